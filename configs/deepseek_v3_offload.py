"""DeepSeek-V3 with activation host offloading (the JAX-Toolbox recipe; at 671b laid out for expert parallelism,
below): configs/deepseek_v3_offload.py:671b | :tiny | :small, each also
with MXFP8 GEMMs and the routed experts' host activations stored in FP8 (:671b_mxfp8, ...: docs/fp8.md), and the
671b layout under full rematerialization with nothing offloaded (:671b_remat, its twin for the offload-vs-remat
comparison). :671b_fsdp is the earlier FSDP16 x EP8 layout (all-gather exchange: the fallback where XLA's ragged
all-to-all fails, docs/parallelism.md); at 32K or 128K tokens a sequence it is the base, split over a context axis
(:671b_32k, :671b_128k: docs/parallelism.md).

In the MoE layers (and the MoE block of multi-token prediction after them, when model.mtp_depth > 0)
the routed experts' input projections (moe_mlpwi_0/1) go to pinned host memory, the query/key/value
projections are recomputed and every other tagged activation stays in HBM. The dense layers (the
first 3) get the same settings without the routed-expert names, which they do not have.

671b mesh (two NVL72 racks, 2 x 16 x 4 GB200): 64 expert ranks inside each rack (mesh.ici.expert=64), the racks
data-parallel (mesh.dcn.data=2). Each GPU owns 4 of every layer's 256 routed experts, whole (mesh.rules.exp_embed=[]:
never gathered); routed tokens travel to them and back by the token all-to-all (mesh.exchange=all_to_all); the
dense ~17B are FSDP-sharded over the rack's 64 GPUs (rules embed/q_lora/kv_lora over the expert axis). Each rack
accumulates its own gradients over the step's 32 micro-batches and the two racks sum them once a step
(train.reduce_gradients=per_step). Parameters and Adam state (12 B a parameter, 119 GiB a GPU) live in Grace memory
(offload.params, offload.optimizer_state); in the MoE layers the dispatched rows (moe_rows), the attention output and
its projection go to the host too, recomputation is the plan's alone (xla.hlo_rematerialization=false) and XLA's
latency hiding scheduler pipelines the collectives (xla.preset=lhs_pipelined). On a CPU machine:
XLA_FLAGS=--xla_force_host_platform_device_count=128 python train.py configs/deepseek_v3_offload.py run.dry_run=true
"""
import os

from MaxOffload.config.defaults import add_layer_group, long_context_variant, reset_remat
from MaxOffload.config.loader import load_file

REMAT = ("query_proj", "key_proj", "value_proj")
DEVICE = ("query_wa_proj", "kv_wa_proj", "mla_q", "mla_kv", "attention_out", "out_proj", "mlpwi_0", "mlpwi_1",
          "mlpwo")


def get_config(size="671b"):
    if size in ("671b_32k", "671b_128k"):  # the long-context variants split sequences over the FSDP x EP8 layout
        size = size.replace("671b", "671b_fsdp")
    # e.g. 671b_32k: 32,768 tokens a sequence, 4,096 of them on each GPU as at the recipe's own length
    # (docs/parallelism.md); at 128K that is 32 GPUs a sequence, so 4 experts' GPUs instead of 8
    long = long_context_variant(get_config, size, tokens_per_gpu=4096)
    if long is not None:
        if long.train.seq_len == 131072:
            long.mesh.ici.expert = 4
        return long
    if size.endswith("_mxfp8"):  # e.g. small_mxfp8: the same recipe with MXFP8 GEMMs (docs/fp8.md)
        cfg = get_config(size[:-len("_mxfp8")])
        cfg.run.output_dir += "_mxfp8"
        cfg.quant.mode = "mxfp8"
        if cfg.train.reduce_gradients == "per_step":  # 671b: jax's MXFP8 matmul cannot be partitioned inside the
            cfg.quant.parts = ["routed_experts"]      # data replicas' shard_map; the routed experts' GEMMs (half the
            #                                           step's) run in the exchange's own (train/step.py)
        # the routed experts' input projections, most of what goes to the host, in FP8 (as DeepSeek-V3 cached
        # activations): half the bytes over the link; their forward goes on with the FP8 values
        cfg.quant.fp8_storage = ["moe_mlpwi_0", "moe_mlpwi_1"]
        return cfg
    if size == "671b_pp":  # pipeline stages: 256 GB200 (docs/parallelism.md, issue 45)
        return pipelined_671b()
    if size == "671b_remat":  # the same layout, full rematerialization, no activation offloaded
        cfg = get_config("671b")
        cfg.run.output_dir += "_remat"
        reset_remat(cfg, "full")
        # its fastest schedule: with nothing to copy, pipelining the collectives buys nothing here (predicted 437.2
        # TFLOP/s per GPU under lhs_pipelined, 445.9 under baseline)
        cfg.xla.preset = "baseline"
        return cfg
    cfg = load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"deepseek_v3.py:{size.split('_')[0]}"))
    cfg.run.output_dir = f"runs/deepseek_v3_{size}_offload"
    cfg.remat.policy = "custom"
    for name in REMAT:
        cfg.remat.tensors[name] = "remat"
    for name in DEVICE:
        cfg.remat.tensors[name] = "device"
    # every layer from the first MoE layer on: the MoE layers and the MTP blocks, if any (a range, so that
    # model.mtp_depth=0 on the command line needs no other change)
    add_layer_group(cfg, "moe", layers=f"{cfg.model.first_k_dense}-", moe_mlpwi_0="offload", moe_mlpwi_1="offload",
                    moe_mlpwo="device")
    if size in ("671b", "671b_fsdp"):
        # Dropless, through tokamax's grouped GEMM on GPUs (model.moe_kernel=auto). A buffer of 1.25x the rows a
        # balanced step gives a device bounds what the exchange holds and offloads: only the choices past a
        # device's 1.25x (its experts together, over the whole batch) are dropped (counted in
        # moe/dropped_fraction), far fewer than a capacity of 1.25 per expert and sequence, at the same memory.
        # The attention output and its projection go to the host too.
        cfg.model.capacity_factor = 0.0
        cfg.model.moe_buffer_factor = 1.25
        for name in ("attention_out", "out_proj"):
            cfg.remat.groups.moe.tensors[name] = "offload"
        cfg.aot.topology = "2x16x4"  # 128 GB200: two NVL72 racks of 64 GPUs (aot and auto dry runs)
        # 4,096 sequences of 4,096 tokens a step (16.8M tokens): on 128 GPUs 32 micro-batches of one sequence per
        # GPU, accumulated in the step
        cfg.train.global_batch_size = 4096
        for axis in ("embed", "q_lora", "kv_lora"):
            cfg.mesh.rules[axis] = ["fsdp", "expert"]
        # the loss from the whole logits (2 GiB a GPU of a 4,096-token micro-batch): the step has the headroom, and
        # vocabulary tiles (model.vocab_tiles=0) cost 1% (394.7 against 399.1 TFLOP/s predicted, no HBM saved)
        cfg.model.vocab_tiles = 1
    if size == "671b":
        # experts at home, tokens by all-to-all, racks data-parallel (the module docstring). The routed experts'
        # output stays in HBM: recomputing its GEMM (K = 2,048) costs less than moving it over the host link both
        # ways. Deviceless on 2x16x4 GB200: benchmarks/results/deepseek_671b_ep64_2026-12-06 (FITS, the predicted
        # step and where it goes)
        cfg.mesh.ici.expert, cfg.mesh.ici.fsdp, cfg.mesh.dcn.data = 64, 1, 2
        cfg.mesh.rules.exp_embed = []
        cfg.mesh.exchange = "all_to_all"
        cfg.train.reduce_gradients = "per_step"
        cfg.offload.params = cfg.offload.optimizer_state = True
        # recomputation is the plan's alone: XLA's own rematerialization, which a compile-only device's HBM
        # estimate (the host-resident state counted in it) drives over its limit, cloned 2.26 PFLOP of GEMMs a
        # step and saved nothing (122.5 GiB either way; predicted 398.5 -> 407.3 TFLOP/s per GPU)
        cfg.xla.hlo_rematerialization = False
        # XLA's latency hiding scheduler with its collectives pipelined across the layers' loop iterations: the
        # offload copies and most of the FSDP gathers hide (baseline: 9.6 s of copies and 24.5 s of collectives
        # exposed a step)
        cfg.xla.preset = "lhs_pipelined"
        # the rows each GPU holds for its experts (587 MB a layer) go to the host with the up-projections: the
        # backward pass does not dispatch them again by the all-to-all (one of the six a layer and micro-batch);
        # in HBM they would not fit beside what the pipelined schedule holds (175.1 GiB of 165.9)
        cfg.remat.groups.moe.tensors.moe_rows = "offload"
    if size == "671b_fsdp":
        # FSDP16 x EP8, the routed experts gathered over fsdp each micro-batch, tokens by all-gather, their output
        # offloaded as well: 144.0 GiB with the float32 gradient accumulator, FITS; compiled work 1.24x the model
        # FLOPs; predicted collective-bound (docs/timeline.md)
        cfg.mesh.ici.expert = 8
        cfg.mesh.ici.fsdp = -1
        cfg.remat.groups.moe.tensors.moe_mlpwo = "offload"
    return cfg


def pipelined_671b():
    """The 671b layout on four NVL72 racks (4 x 16 x 4 GB200) with a pipeline stage a pair of racks
    (mesh.dcn.stage=2, mesh.dcn.data=2, 64 expert ranks a rack): the 58 MoE layers in 2 stages x 29 repeats
    (virtual stages of one layer: the stages x repeats that divide 58), the 3 dense layers, the head and MTP on
    every GPU. 4,096 sequences a step in 16 micro-batches of two sequences a GPU of a stage (bubble 1 / 465); the
    backward pass gets each iteration's input from pinned host memory (mesh.pipeline.remat=stages_offloaded: 465 x
    112 MiB, 50.9 GiB a GPU that HBM does not hold: the recipe fits with it, not without) and runs the MoE layer's
    forward again, keeping all of it for its own backward. Megatron-Bridge's published layout is PP4 x VP4 (16 virtual stages,
    uneven: not built here)."""
    cfg = get_config("671b")
    cfg.run.output_dir = "runs/deepseek_v3_671b_pp"
    cfg.aot.topology = "4x16x4"
    cfg.mesh.dcn.stage, cfg.mesh.dcn.data = 2, 2
    cfg.mesh.pipeline.repeats, cfg.mesh.pipeline.remat = 29, "stages_offloaded"
    cfg.train.reduce_gradients = "per_micro_batch"  # the pipeline runs the step's micro-batches in one pass
    # outside the stages the dense layers and the MTP block run on the whole step's batch at once (16 sequences a
    # GPU): they keep their inputs only; the pipelined MoE layers keep all of one virtual stage's forward
    reset_remat(cfg, "full")
    add_layer_group(cfg, "moe", layers="moe", policy="save_all")
    cfg.model.vocab_tiles = 0  # the loss over the step's 16 sequences a GPU by vocabulary tiles, not whole logits
    return cfg


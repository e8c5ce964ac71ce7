"""DeepSeek-V3 with activation host offloading (the JAX-Toolbox recipe; at 671b extended to fit, below):
configs/deepseek_v3_offload.py:671b | :tiny | :small, each also
with MXFP8 GEMMs and the routed experts' host activations stored in FP8 (:671b_mxfp8, ...: docs/fp8.md) and at 32K
or 128K tokens a sequence, split over a context axis (:671b_32k, :671b_128k: docs/parallelism.md).

In the MoE layers (and the MoE block of multi-token prediction after them, when model.mtp_depth > 0)
the routed experts' input projections (moe_mlpwi_0/1) go to pinned host memory, the query/key/value
projections are recomputed and every other tagged activation stays in HBM. The dense layers (the
first 3) get the same settings without the routed-expert names, which they do not have.

671b mesh: FSDP16 x EP8 on 128 GPUs: mesh.ici.expert=8 and mesh.ici.fsdp=-1 (the remaining 16). The
batch is sharded over data x fsdp x expert = all 128 devices; the 256 routed experts are split 8 ways
(32 per device) over `expert` and their `embed` dimension 16 ways over `fsdp`; every other weight is
split 128 ways over fsdp x expert (the expert axis is data parallel outside the routed experts), so
parameters + Adam state are 12 B x 682.6B (with the MTP block) / 128 = 64 GB per GPU. For 128 GPUs in two NVLink domains keep
the expert exchange inside a domain: mesh.dcn.fsdp=2 mesh.ici.fsdp=8. On a CPU machine:
XLA_FLAGS=--xla_force_host_platform_device_count=128 python train.py configs/deepseek_v3_offload.py run.dry_run=true
"""
import os

from MaxOffload.config.defaults import add_layer_group, long_context_variant
from MaxOffload.config.loader import load_file

REMAT = ("query_proj", "key_proj", "value_proj")
DEVICE = ("query_wa_proj", "kv_wa_proj", "mla_q", "mla_kv", "attention_out", "out_proj", "mlpwi_0", "mlpwi_1",
          "mlpwo")


def get_config(size="671b"):
    # e.g. 671b_32k: 32,768 tokens a sequence, 4,096 of them on each GPU as at the recipe's own length
    # (docs/parallelism.md); at 128K that is 32 GPUs a sequence, so 4 experts' GPUs instead of 8
    long = long_context_variant(get_config, size, tokens_per_gpu=4096)
    if long is not None:
        if long.train.seq_len == 131072:
            long.mesh.ici.expert = 4
        return long
    if size.endswith("_mxfp8"):  # e.g. small_mxfp8: the same recipe with MXFP8 GEMMs (docs/fp8.md; 671b_mxfp8 fits
        #                           2x16x4 GB200 but is predicted slower than BF16 there: collective-bound)
        cfg = get_config(size[:-len("_mxfp8")])
        cfg.run.output_dir += "_mxfp8"
        cfg.quant.mode = "mxfp8"
        # the routed experts' input projections, most of what goes to the host, in FP8 (as DeepSeek-V3 cached
        # activations): half the bytes over the link; their forward goes on with the FP8 values
        cfg.quant.fp8_storage = ["moe_mlpwi_0", "moe_mlpwi_1"]
        return cfg
    cfg = load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"deepseek_v3.py:{size}"))
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
    if size == "671b":
        # Fit on 128 GB200s (python -m MaxOffload.aot ... --topology 2x16x4, with the MTP block and the flash
        # attention: 123.5 GiB HBM of 165.9 usable for one micro-batch a step, 60.3 GiB host, 1.24x the model FLOPs
        # compiled). Dropless, through tokamax's grouped GEMM on GPUs
        # (model.moe_kernel=auto). The all-gather dispatch would size its rows buffer for the worst case (8x a
        # balanced step at EP8: 130.1 GiB HBM, but 329.4 GiB of offloaded expert activations per GPU, more
        # than the host has); a buffer of 1.25x the balanced rows of each device bounds it. Only the choices
        # past a device's 1.25x — its 32 experts together, over the whole batch — are dropped (counted in
        # moe/dropped_fraction): far fewer than a capacity of 1.25 per expert and sequence, at the same memory.
        # Then the routed experts' output and the attention output/projection go to the host too.
        cfg.model.capacity_factor = 0.0
        cfg.model.moe_buffer_factor = 1.25
        for name in ("moe_mlpwo", "attention_out", "out_proj"):
            cfg.remat.groups.moe.tensors[name] = "offload"
        cfg.mesh.ici.expert = 8
        cfg.mesh.ici.fsdp = -1
        cfg.aot.topology = "2x16x4"  # 128 GB200: two NVL72 racks of 64 GPUs (aot and auto dry runs)
        # 4,096 sequences of 4,096 tokens a step (16.8M tokens): on 128 GPUs 32 micro-batches of one sequence per
        # GPU, accumulated in the step (aot: 144.0 GiB HBM with the float32 gradient accumulator, FITS; compiled
        # work 1.24x the model FLOPs, as for one micro-batch: benchmarks/results/grad_accum_2026-12-03)
        cfg.train.global_batch_size = 4096
        for axis in ("embed", "q_lora", "kv_lora"):
            cfg.mesh.rules[axis] = ["fsdp", "expert"]
    return cfg

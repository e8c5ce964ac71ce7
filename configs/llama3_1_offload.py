"""Llama 3.1 with activation host offloading: configs/llama3_1_offload.py:8b | :70b | :405b | :tiny | :small, each also
with per-tensor FP8 GEMMs (:405b_fp8, ...: docs/fp8.md) and at 32K or 128K tokens a sequence, split over a
context axis (:405b_32k, :405b_128k, ...: docs/parallelism.md).

Every layer offloads its attention projections (q, k, v and the output projection) to pinned
host memory and recomputes the MLP, whose inputs are the largest activations (2 x 53248 wide
at 405B: offloading them too would need ~236 GiB of host memory per GPU at batch 1 x 8192,
more than a GB200 tray's 224 GiB per GPU — `python -m MaxOffload.aot` says so). The last two
layers keep everything in HBM instead (`minimal`): the backward pass starts with them, so there
is no forward compute left to hide their copies behind.
"""
import os

from MaxOffload.config.defaults import add_layer_group, long_context_variant
from MaxOffload.config.loader import load_file


def get_config(size="8b"):
    # e.g. 405b_128k: 131,072 tokens a sequence, 16,384 of them on each GPU (docs/parallelism.md)
    long = long_context_variant(get_config, size, tokens_per_gpu=16384)
    if long is not None:
        if long.train.seq_len == 131072:
            # XLA's own rematerialization back on: without it the step needs 167.0 GiB of 165.9 usable; with it
            # 135.0 GiB, 1.43x the model FLOPs (benchmarks/results/context_2026-12-04)
            long.xla.hlo_rematerialization = True
        return long
    if size == "405b_pp":  # pipeline stages across the two racks (docs/parallelism.md, issue 45)
        return pipelined_405b()
    if size.endswith("_fp8"):  # e.g. 405b_fp8: the same recipe with per-tensor FP8 GEMMs (docs/fp8.md)
        cfg = get_config(size[:-len("_fp8")])
        cfg.run.output_dir += "_fp8"
        cfg.quant.mode = "fp8"
        return cfg
    cfg = load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"llama3_1.py:{size}"))
    cfg.run.output_dir = f"runs/llama3_1_{size}_offload"
    cfg.remat.policy = "custom"
    for name in ("query_proj", "key_proj", "value_proj", "out_proj"):
        cfg.remat.tensors[name] = "offload"
    cfg.xla.preset = "lhs_pipelined_offload"
    add_layer_group(cfg, "last_two", layers="-2-", policy="minimal")  # counted from the end: any depth
    if size == "405b":
        # 2,048 sequences of 8,192 tokens a step (16.8M tokens, Llama 3.1's pre-training batch): on 128 GPUs 16
        # micro-batches of one sequence per GPU, accumulated in the step. The float32 gradient accumulator (11.8 GiB
        # per GPU) is paid for by offloading each layer's input too (the residual stream every recomputation
        # starts from: 126 x 256 MiB), and XLA's own rematerialization is off: under its default memory limit it
        # recomputed most of an MLP forward per layer (1.46x the model FLOPs instead of 1.19x). aot on 2x16x4
        # GB200: 133.5 GiB HBM, 96.9 GiB host, FITS, 1.19x (benchmarks/results/grad_accum_2026-12-04)
        cfg.train.global_batch_size = 2048
        cfg.remat.tensors["decoder_layer_input"] = "offload"
        cfg.xla.hlo_rematerialization = False
        # the loss from the whole logits (4.2 GB a GPU of an 8,192-token micro-batch), as the recipe was measured:
        # it fits, and vocabulary tiles (model.vocab_tiles=0) make the logits again in the backward pass
        cfg.model.vocab_tiles = 1
    return cfg


def pipelined_405b():
    """Llama 3.1 405B on 2 x NVL72 with a pipeline stage a rack (mesh.dcn.stage=2, FSDP over each rack's 64 GPUs):
    the 126 layers in 2 stages x 7 repeats (virtual stages of 9 layers), 2,048 sequences a step in 16 micro-batches
    of two sequences a GPU of a stage (bubble 1 / 113). Each iteration's input is all the backward pass gets of it
    (mesh.pipeline.remat=stages_offloaded: the 113 inputs, 512 MiB each, in pinned host memory: 56.5 GiB of it per
    GPU, which HBM then does not hold); the backward pass runs each virtual stage's forward
    again and keeps its dots but the MLP's for its own backward. The loss over the step's 16 sequences a GPU by
    vocabulary tiles."""
    from MaxOffload.config.defaults import reset_remat

    cfg = load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama3_1.py:405b"))
    cfg.run.output_dir = "runs/llama3_1_405b_pp"
    cfg.aot.topology = "2x16x4"
    cfg.mesh.dcn.stage, cfg.mesh.ici.fsdp = 2, -1
    cfg.mesh.pipeline.repeats, cfg.mesh.pipeline.remat = 7, "stages_offloaded"
    cfg.train.global_batch_size = 2048
    reset_remat(cfg, "save_dot_except_mlp")
    cfg.xla.hlo_rematerialization = False
    cfg.model.vocab_tiles = 0
    return cfg


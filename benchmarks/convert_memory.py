"""Peak memory of the checkpoint conversion against its bound, on a synthetic multi-shard checkpoint:
python benchmarks/convert_memory.py [--layers 12] [--shard_size 500MB] [--output_dir DIR]

Writes a DeepSeek-V3-shaped Hugging Face checkpoint of random bfloat16 weights (emb 1024, 64 routed experts of
512 + 1 shared, MLA; --layers layers, the first dense; 2.3 GiB in 5 shards at the defaults) with the exporter's
own layer-by-layer path, then runs, each in a fresh process measured by os.wait4 (its own peak RSS):

    baseline   what every conversion does before its first tensor: imports, the shard headers, the config,
               the abstract model (python -m MaxOffload.convert's setup, nothing converted)
    from-hf    the whole import: HF shards -> this project's float32 weights (an Orbax checkpoint)
    to-hf      the whole export of those weights back to bfloat16 shards

and reports each one's growth over the baseline against the bound the conversion promises, one shard plus
one layer's parameters (the largest layer, in the parameters' float32), and against the whole model. Writes
DIR/convert_memory.json and .md (default DIR: benchmarks/results/convert_memory).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from MaxOffload.cli import parse, tool  # noqa: E402  (after the path, like a tool run from a checkout)
from benchmarks.common import write  # noqa: E402

CONFIG = "configs/deepseek_v3.py:tiny"
SHAPE = ["model.vocab_size=32768", "model.emb_dim=1024", "model.first_k_dense=1", "model.mlp_dim=2816",
         "model.num_heads=8", "model.q_lora_rank=384", "model.kv_lora_rank=256", "model.qk_nope_head_dim=64",
         "model.qk_rope_head_dim=32", "model.v_head_dim=64", "model.num_experts=64", "model.num_experts_per_tok=6",
         "model.moe_mlp_dim=512", "model.n_groups=8", "model.topk_groups=4"]

BASELINE = """
import sys
from MaxOffload import models
from MaxOffload.convert import exporter, importer
from MaxOffload.convert.hf_files import HFCheckpoint
hf = HFCheckpoint(sys.argv[1])
cfg, family, _ = importer.resolve_config(hf, sys.argv[2], sys.argv[3:])
models.weight_leaves(models.model_config(cfg))
"""


def measured(args):
    """(peak RSS in bytes, seconds) of `python ARGS` in a fresh process (os.wait4: that process's own)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    _, status, usage = os.wait4(proc.pid, 0)
    output = proc.stdout.read()
    if status != 0:
        raise SystemExit(f"python {' '.join(args)} failed:\n{output}")
    return usage.ru_maxrss * 1024, time.perf_counter() - start


def synthesize(cfg, directory, shard_bytes):
    """A Hugging Face checkpoint of random weights for cfg's model, written layer by layer."""
    import ml_dtypes
    import numpy as np

    from MaxOffload import models
    from MaxOffload.convert.exporter import hf_tensors
    from MaxOffload.convert.hf_files import CONFIG as HF_CONFIG, ShardWriter

    c = models.model_config(cfg)
    family, leaves = models.family_of(c), models.weight_leaves(c)
    rng = np.random.default_rng(0)

    def read(path, layer):
        shape = leaves[path].shape if layer is None else leaves[path].shape[1:]
        return rng.standard_normal(shape, np.float32) * 0.02

    writer = ShardWriter(directory, shard_bytes)
    for name, value in hf_tensors(family.hf.groups(c), read):
        writer.add(name, value.astype(ml_dtypes.bfloat16))
    shards = writer.close()
    with open(os.path.join(directory, HF_CONFIG), "w") as f:
        json.dump({**family.hf.config_json(c), "dtype": "bfloat16"}, f)
    return shards, writer.total


def layer_bytes(cfg):
    """The bytes of the largest layer's weights (a stack's leaves / its layers; the top level counts as one)."""
    import math

    from MaxOffload import models

    c = models.model_config(cfg)
    leaves, per_group = models.weight_leaves(c), {}
    for group in models.family_of(c).hf.groups(c):
        for rule in group.rules:
            for path in rule.ours:
                leaf = leaves[group.path(path)]
                size = math.prod(leaf.shape) * leaf.dtype.itemsize
                per_group[group.stack] = per_group.get(group.stack, 0) + (size // len(group.layers) if group.stack else size)
    total = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in leaves.values())
    return max(per_group.values()), total


@tool
def main(argv):
    from MaxOffload.config import load
    from MaxOffload.convert.__main__ import parse_size
    from MaxOffload.platform import use_cpu_runtime
    from MaxOffload.reports import gib

    argv, options, _ = parse(argv, __doc__, options={"--layers": "12", "--shard_size": "500MB"})
    use_cpu_runtime()
    out = next((a.split("=", 1)[1] for a in argv if a.startswith("run.output_dir=")),
               os.path.join(ROOT, "benchmarks", "results", "convert_memory"))
    overrides = [*SHAPE, f"model.num_layers={int(options['--layers'])}"]
    cfg = load([CONFIG, *overrides])
    work = tempfile.mkdtemp(prefix="convert_memory.")
    try:
        hf_dir, weights, exported = (os.path.join(work, n) for n in ("hf", "weights", "exported"))
        shards, hf_bytes = synthesize(cfg, hf_dir, parse_size(options["--shard_size"]))
        largest_shard = max(os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir)
                            if f.endswith(".safetensors"))
        layer, model = layer_bytes(cfg)
        bound = largest_shard + layer
        runs = {"baseline": ["-c", BASELINE, hf_dir, CONFIG, *overrides],
                "from-hf": ["-m", "MaxOffload.convert", "from-hf", hf_dir, "--config", CONFIG, *overrides,
                            "--out", weights],
                "to-hf": ["-m", "MaxOffload.convert", "to-hf", weights, "--out", exported]}
        results = {name: measured(args) for name, args in runs.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = results["baseline"][0]
    lines = ["# Checkpoint conversion: peak memory against its bound", "",
             f"Synthetic DeepSeek-V3-shaped checkpoint: {options['--layers']} layers, {gib(hf_bytes)} of bfloat16 in "
             f"{shards} shards (largest {gib(largest_shard)}); this project's float32 weights: {gib(model)}, the "
             f"largest layer {gib(layer)}. Bound = largest shard + largest layer = {gib(bound)}.", "",
             "| process | peak RSS | over baseline | / bound | / whole model (float32) | seconds |",
             "|---|---|---|---|---|---|"]
    record = {"hf_bytes": hf_bytes, "shards": shards, "largest_shard": largest_shard, "layer_bytes": layer,
              "model_bytes": model, "bound": bound, "runs": {}}
    for name, (peak, seconds) in results.items():
        growth = peak - base
        record["runs"][name] = {"peak_rss": peak, "growth": growth, "seconds": round(seconds, 1)}
        lines.append(f"| {name} | {gib(peak)} | {gib(growth)} | {growth / bound:.2f}x | {growth / model:.2f}x | "
                     f"{seconds:.1f} |")
    held = all(record["runs"][n]["growth"] <= bound for n in ("from-hf", "to-hf"))
    lines += ["", f"bound held: {'yes' if held else 'NO'}"]
    write(out, "convert_memory", lines, record)
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

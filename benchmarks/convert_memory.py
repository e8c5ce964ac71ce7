"""Peak memory of the checkpoint conversion against its bound, on a synthetic multi-shard checkpoint:
python benchmarks/convert_memory.py [--layers 12] [--shard_size 500MB] [--output_dir DIR]

Writes a DeepSeek-V3-shaped Hugging Face checkpoint of random bfloat16 weights (emb 1024, 64 routed experts of
512 + 1 shared, MLA; --layers layers, the first dense; 2.3 GiB in 5 shards at the defaults) with the exporter's
own layer-by-layer path, then, each in a fresh process:

    from-hf    the import: HF shards -> this project's float32 weights (an Orbax checkpoint)
    to-hf      the export of those weights back to bfloat16 shards

Each process first does what precedes the conversion (imports, the shard headers, the config, the abstract
model), then resets its peak-RSS mark (Linux: /proc/self/clear_refs 5) and converts; the growth is the peak
(VmHWM) over the resident memory at the start of the conversion. It is reported against the bound the
conversion promises, one shard plus one layer's parameters (the largest layer, in the parameters' float32),
and against the whole model. Writes DIR/convert_memory.json and .md (default DIR: benchmarks/results/convert_memory).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from MaxOffload.cli import parse, tool  # noqa: E402  (after the path, like a tool run from a checkout)
from benchmarks.common import write  # noqa: E402

CONFIG = "configs/deepseek_v3.py:tiny"
SHAPE = ["model.vocab_size=32768", "model.emb_dim=1024", "model.first_k_dense=1", "model.mlp_dim=2816",
         "model.num_heads=8", "model.q_lora_rank=384", "model.kv_lora_rank=256", "model.qk_nope_head_dim=64",
         "model.qk_rope_head_dim=32", "model.v_head_dim=64", "model.num_experts=64", "model.num_experts_per_tok=6",
         "model.moe_mlp_dim=512", "model.n_groups=8", "model.topk_groups=4"]

MEASURE = r"""
import gc, json, re, sys, time
from MaxOffload import models
from MaxOffload.convert import exporter, importer
from MaxOffload.convert.hf_files import HFCheckpoint
from MaxOffload.train import rundir

def status():
    return {k: int(v) * 1024 for k, v in re.findall(r"(VmHWM|VmRSS):\s+(\d+)", open("/proc/self/status").read())}

kind, source, out, *rest = sys.argv[1:]
if kind == "from-hf":
    hf = HFCheckpoint(source)
    cfg, family, _ = importer.merged_config(hf, rest[0], rest[1:])
    def convert():
        importer.convert(hf, cfg, family, out)
        rundir.write_config(out, cfg.to_dict(), lambda _: None)  # the model's config, for to-hf
else:
    models.weight_leaves(exporter.model_config(exporter.locate(source)[0])[1])
    convert = lambda: exporter.to_hf(source, out, say=lambda _: None)
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak mark := now
start, began = status()["VmRSS"], time.perf_counter()
convert()
print(json.dumps({"start": start, "peak": status()["VmHWM"], "seconds": time.perf_counter() - began}))
"""


def measured(args):
    """{start, peak, seconds} of one conversion in a fresh process (MEASURE)."""
    result = subprocess.run([sys.executable, "-c", MEASURE, *args], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    if result.returncode != 0:
        raise SystemExit(f"{args[0]} failed:\n{result.stdout}{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def synthesize(cfg, directory, shard_bytes):
    """A Hugging Face checkpoint of random weights for cfg's model, written layer by layer."""
    import ml_dtypes
    import numpy as np

    from MaxOffload import models
    from MaxOffload.convert.exporter import hf_tensors
    from MaxOffload.convert.hf_files import CONFIG as HF_CONFIG, ShardWriter

    c = models.model_config(cfg.model)
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

    c = models.model_config(cfg.model)
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
    from MaxOffload.convert.__main__ import parse_size

    argv, options, _ = parse(argv, __doc__, options={"--layers": 12, "--shard_size": "500MB"})  # before JAX
    shard_size = parse_size(options["--shard_size"], "--shard_size")
    from MaxOffload.config import load
    from MaxOffload.platform import use_cpu_runtime
    from MaxOffload.reports import gib

    use_cpu_runtime()
    out = next((a.split("=", 1)[1] for a in argv if a.startswith("run.output_dir=")),
               os.path.join(ROOT, "benchmarks", "results", "convert_memory"))
    overrides = [*SHAPE, f"model.num_layers={options['--layers']}"]
    cfg = load([CONFIG, *overrides])
    work = tempfile.mkdtemp(prefix="convert_memory.")
    try:
        hf_dir, weights, exported = (os.path.join(work, n) for n in ("hf", "weights", "exported"))
        shards, hf_bytes = synthesize(cfg, hf_dir, shard_size)
        largest_shard = max(os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir)
                            if f.endswith(".safetensors"))
        layer, model = layer_bytes(cfg)
        bound = largest_shard + layer
        results = {"from-hf": measured(["from-hf", hf_dir, weights, CONFIG, *overrides]),
                   "to-hf": measured(["to-hf", weights, exported])}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = ["# Checkpoint conversion: peak memory against its bound", "",
             f"Synthetic DeepSeek-V3-shaped checkpoint: {options['--layers']} layers, {gib(hf_bytes)} of bfloat16 in "
             f"{shards} shards (largest {gib(largest_shard)}); this project's float32 weights: {gib(model)}, the "
             f"largest layer {gib(layer)}. Bound = largest shard + largest layer = {gib(bound)}.", "",
             "| conversion | RSS at its start | peak RSS | growth | growth / bound | growth / whole model | seconds |",
             "|---|---|---|---|---|---|---|"]
    record = {"hf_bytes": hf_bytes, "shards": shards, "largest_shard": largest_shard, "layer_bytes": layer,
              "model_bytes": model, "bound": bound, "runs": results}
    for name, r in results.items():
        r["growth"] = growth = r["peak"] - r["start"]
        lines.append(f"| {name} | {gib(r['start'])} | {gib(r['peak'])} | {gib(growth)} | {growth / bound:.2f}x | "
                     f"{growth / model:.2f}x | {r['seconds']:.1f} |")
    held = all(r["growth"] <= bound for r in results.values())
    lines += ["", f"bound held: {'yes' if held else 'NO'}"]
    write(out, "convert_memory", lines, record)
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

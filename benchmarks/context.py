"""Context-parallel attention, strategy by strategy, side by side in one run:
python benchmarks/context.py [--target gb200] [--tokens 32768,131072] [--ways 8] [--output_dir DIR]

One attention forward + backward (the value and the gradients of q, k, v) of one sequence split --ways ways over
a context axis of that many GPUs, deviceless for --target, at the head shapes of Llama 3.1 405B (128 query heads,
8 kv heads, head dim 128) and DeepSeek-V3 (MLA: 128 heads, q/k head dim 192, v 128; its keys and values come
from a latent of 512 + a 64-wide RoPE key per token):

    kv_gather       models/layers.context_flash_attention (mesh.context_attention=all_gather, model.attention=
                    flash): every GPU all-gathers the keys and values and runs tokamax's flash kernels on its
                    chunks of queries (to its own positions causally, to the earlier keys under a one-row bound)
    tokamax_sharded tokamax's own answer to a split sequence (dot_product_attention with a q_sharding): it
                    all-gathers the keys and values and masks by index, a dense [queries, keys] mask in its VJP
    latent_gather   (DeepSeek-V3 only, counted, not built) gather the 576-wide latent instead and expand it to
                    per-head keys and values on every GPU: the same kernels and temporaries as kv_gather (the
                    expanded keys and values of the whole sequence), a fraction of the bytes, and every GPU
                    repeats the up-projection of the whole sequence

Per strategy: bytes each GPU receives per layer (forward and backward: the compiled all-gathers and
reduce-scatters; for latent_gather the same collectives on the latent's bytes) and temporaries per GPU (XLA's
memory analysis). Writes DIR/context.json, .md and .png.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from MaxOffload.cli import tool  # noqa: E402  (after the path, like a tool run from a checkout)
from benchmarks.common import bar_pair, write  # noqa: E402

SHAPES = {"llama3_1_405b": dict(heads=128, kv_heads=8, qk_dim=128, v_dim=128),
          "deepseek_v3": dict(heads=128, kv_heads=128, qk_dim=192, v_dim=128, latent=512 + 64)}
COLLECTIVES = ("all-gather", "all-gather-start", "reduce-scatter", "reduce-scatter-start", "all-reduce", "all-reduce-start",
               "collective-permute", "collective-permute-start", "all-to-all")


def collective_bytes(text, ways):
    """Bytes the collectives of a compiled module move per GPU, its own share included: an all-gather's output
    (its operand x ways), any other collective's input, summed over the module."""
    from MaxOffload import hlo

    module, total = hlo.parse(text), 0
    for name, instructions in module.computations.items():
        shapes = module.shapes(name)
        for ins in instructions:
            if ins.opcode in COLLECTIVES:
                operand = sum(hlo.nbytes(shapes[o]) for o in ins.operands if o in shapes)
                total += operand * ways if "all-gather" in ins.opcode else operand
    return total


def strategy_step(strategy, mesh):
    """The value and the q, k, v gradients of sum(attention . w) over a sequence split over mesh axis 'context'."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from MaxOffload.models import kernels, layers
    from MaxOffload.parallel.layout import ParallelLayout

    rules = {"activation_length": ["context"]}
    layout = ParallelLayout.of(mesh, rules)
    kernel = kernels.attention_for("flash", kernels.platform(mesh.devices.flat[0]))
    q_sharding = NamedSharding(mesh, PartitionSpec(None, "context", None, None))

    def attend(q, k, v):
        scale = q.shape[-1] ** -0.5
        if strategy == "kv_gather":
            return layers.context_flash_attention(q, k, v, scale, kernel, layout)
        return kernels.flash_attention(q, k, v, scale, kernel, q_sharding)

    def loss(q, k, v, w):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * w)

    return jax.value_and_grad(loss, argnums=(0, 1, 2)), q_sharding


def compiled(strategy, shape, length, devices):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from MaxOffload.models import kernels

    mesh = Mesh(devices, ("context",))
    fn, sharding = strategy_step(strategy, mesh)
    spec = lambda *d: jax.ShapeDtypeStruct(d, jnp.bfloat16, sharding=sharding)  # noqa: E731
    w = jax.ShapeDtypeStruct((shape["v_dim"],), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    args = (spec(1, length, shape["heads"], shape["qk_dim"]), spec(1, length, shape["kv_heads"], shape["qk_dim"]),
            spec(1, length, shape["kv_heads"], shape["v_dim"]), w)
    with kernels.lowering(devices[0]):
        c = jax.jit(fn).lower(*args).compile()
    text = c.as_text()
    return {"received_bytes": collective_bytes(text, len(devices)), "temp_bytes": c.memory_analysis().temp_size_in_bytes}


def latent_row(kv_row, shape):
    """latent_gather, counted from kv_gather's compile: the same collectives on the latent's bytes per token
    instead of the per-head keys' and values', the same temporaries."""
    per_token_kv = shape["kv_heads"] * (shape["qk_dim"] + shape["v_dim"])
    return {"received_bytes": kv_row["received_bytes"] * shape["latent"] / per_token_kv,
            "temp_bytes": kv_row["temp_bytes"], "counted": True}


@tool
def main(argv):
    from MaxOffload import cli

    argv, options, _ = cli.parse(argv, __doc__, keys=cli.TARGET_KEYS,
                                 options={"--tokens": "32768,131072", "--ways": "8"})
    from MaxOffload.platform import use_cpu_runtime

    use_cpu_runtime()
    from MaxOffload.config import load
    from MaxOffload.deviceless import compile_only_devices, require_plugin

    lengths = [cli.whole_number("--tokens", t) for t in options["--tokens"].split(",")]
    ways = cli.whole_number("--ways", options["--ways"])
    cfg = load(["configs/llama3_1.py:tiny", *argv])
    require_plugin()
    devices = compile_only_devices(cfg.aot.target, f"1x1x{ways}" if ways <= 4 else f"1x{ways // 4}x4")
    rows = []
    for model, shape in SHAPES.items():
        for length in lengths:
            for strategy in ("kv_gather", "tokamax_sharded"):
                print(f"compiling {strategy} for {model}'s heads at {length} tokens over {ways} "
                      f"{cfg.aot.target} (deviceless) ...", flush=True)
                row = {"model": model, "tokens": length, "strategy": strategy,
                       **compiled(strategy, shape, length, devices)}
                rows.append(row)
                if strategy == "kv_gather" and "latent" in shape:
                    rows.append({"model": model, "tokens": length, "strategy": "latent_gather",
                                 **latent_row(row, shape)})
    gib = 2 ** 30
    lines = [f"Causal attention forward + backward, one sequence over {ways} {cfg.aot.target}s split over a context "
             "axis (deviceless): what each GPU receives per layer and its temporaries", "",
             "| heads of | tokens | strategy | received per GPU per layer | temporaries per GPU |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['tokens']:,} | {r['strategy']}{' (counted)' if r.get('counted') else ''} | "
              f"{r['received_bytes'] / gib:.3f} GiB | {r['temp_bytes'] / gib:.2f} GiB |" for r in rows]
    out = options.get("--output_dir") or os.path.join(ROOT, "benchmarks", "results", "context_2026-12-04")
    path = write(out, "context", lines, {"target": cfg.aot.target, "ways": ways, "rows": rows})
    labels = [f"{r['model'].split('_')[0]} {r['tokens'] // 1024}K\n{r['strategy']}" for r in rows]
    bar_pair(os.path.join(out, "context.png"), labels,
             [([r["received_bytes"] / gib for r in rows], "GiB received per GPU per layer", "tab:blue",
               {"log": True, "rotation": 90}),
              ([r["temp_bytes"] / gib for r in rows], "temporaries per GPU (GiB)", "tab:orange",
               {"log": True, "rotation": 90})],
             f"Context-parallel attention over {ways} {cfg.aot.target}s")
    print(f"wrote {path} and context.png")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

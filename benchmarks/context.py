"""Context-parallel attention, strategy by strategy, side by side in one run:
python benchmarks/context.py [--target gb200] [--tokens 32768,131072] [--ways 8] [--output_dir DIR]

One attention forward + backward (the value and the gradients of q and of what is gathered) of one sequence split
--ways ways over a context axis of that many GPUs in the load-balanced layout (mesh.context_load_balance),
deviceless for --target, at the head shapes of Llama 3.1 405B (128 query heads, 8 kv heads, head dim 128) and
DeepSeek-V3 (MLA: 128 heads, q/k head dim 192, v 128; its keys and values come from a latent of 512 + a 64-wide
RoPE key per token):

    kv_gather       models/attention/all_gather.py (mesh.context_attention=all_gather, model.attention=
                    flash; DeepSeek-V3: model.mla_context_gather=kv): every GPU all-gathers the keys and values and
                    runs tokamax's flash kernels on its chunks of queries, to their own keys causally and to each
                    earlier block of keys whole
    latent_gather   (DeepSeek-V3; model.mla_context_gather=latent) the same pieces, every GPU gathering the 576-wide
                    latent instead and making each block's keys and values from it (the up-projections wk_b, wv_b:
                    per block, again in the backward pass)
    tokamax_sharded tokamax's own answer to a split sequence (dot_product_attention with a q_sharding): it
                    all-gathers the keys and values and masks by index, a dense [queries, keys] mask in its VJP

Per strategy: bytes each GPU receives per layer (forward and backward: the compiled all-gathers and
reduce-scatters), temporaries per GPU (XLA's memory analysis), and the predicted time of the forward + backward
(MaxOffload/timeline/ on the compiled program: compute, and the collectives' time not hidden behind it). The
weights' gradient (latent_gather's up-projections) is left out: it reduces over the data-parallel devices with
every other weight's. Writes DIR/context.json, .md and .png.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from MaxOffload.cli import tool  # noqa: E402  (after the path, like a tool run from a checkout)
from benchmarks.common import bar_pair, write  # noqa: E402

SHAPES = {"llama3_1_405b": dict(heads=128, kv_heads=8, qk_dim=128, v_dim=128),
          "deepseek_v3": dict(heads=128, kv_heads=128, qk_dim=192, v_dim=128, latent=(512, 64))}
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


def strategy_step(strategy, shape, mesh):
    """(the value and the gradients of q and the gathered inputs of sum(attention . w), the input shapes) of a
    sequence split over mesh axis 'context', load-balanced (kv_gather, latent_gather)."""

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from MaxOffload.models import deepseek, kernels
    from MaxOffload.models.model_context import ModelContext
    from MaxOffload.models.attention.all_gather import context_flash_attention
    from MaxOffload.models.attention.flash import flash_attention
    from MaxOffload.models.attention.key_source import KeySource
    from MaxOffload.parallel.layout import ParallelLayout

    layout = ParallelLayout.of(mesh, {"activation_length": ["context"]}, load_balance=True)
    kernel = kernels.attention_for("flash", kernels.platform(mesh.devices.flat[0]))
    q_sharding = NamedSharding(mesh, PartitionSpec(None, "context", None, None))
    heads, kv_heads, qk, dv = shape["heads"], shape["kv_heads"], shape["qk_dim"], shape["v_dim"]
    scale = qk ** -0.5
    if strategy == "latent_gather":
        rank, rope = shape["latent"]
        inputs = [(heads, qk), (rank,), (1, rope)]
        weights = [(rank, heads, qk - rope), (rank, heads, dv)]

        def attend(q, latent, k_rope, wk_b, wv_b):
            source = deepseek.latent_key_source(ModelContext(layout), latent, k_rope, (wk_b, wv_b),
                                                (("kv_lora", "heads", "head_dim"),) * 2)
            return context_flash_attention(q, source, scale, kernel, layout)
    else:
        inputs, weights = [(heads, qk), (kv_heads, qk), (kv_heads, dv)], []

        def attend(q, k, v):
            if strategy == "kv_gather":
                return context_flash_attention(q, KeySource.of_keys(q, k, v), scale, kernel, layout)
            return flash_attention(q, k, v, scale, kernel, q_sharding)

    def loss(w, *args):
        return jnp.sum(attend(*args).astype(jnp.float32) * w)

    return jax.value_and_grad(loss, argnums=tuple(range(1, 1 + len(inputs)))), inputs, weights


def compiled(strategy, shape, length, devices, rates):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from MaxOffload import deviceless
    from MaxOffload.timeline import simulate

    mesh = Mesh(devices, ("context",))
    fn, inputs, weights = strategy_step(strategy, shape, mesh)
    whole = NamedSharding(mesh, PartitionSpec())
    args = [jax.ShapeDtypeStruct((shape["v_dim"],), jnp.float32, sharding=whole)]
    split = NamedSharding(mesh, PartitionSpec(None, "context"))  # the tokens' axis
    args += [jax.ShapeDtypeStruct((1, length, *dims), jnp.bfloat16, sharding=split) for dims in inputs]
    args += [jax.ShapeDtypeStruct(dims, jnp.bfloat16, sharding=whole) for dims in weights]
    with deviceless.lowering(devices[0]):
        c = jax.jit(fn).lower(*args).compile()
    text = c.as_text()
    predicted, _ = simulate.simulate(text, rates, len(devices))
    return {"received_bytes": collective_bytes(text, len(devices)), "temp_bytes": c.memory_analysis().temp_size_in_bytes,
            "step_s": predicted["step_s"], "compute_s": predicted["compute_s"],
            "exposed_collective_s": predicted["exposed_collective_s"]}


@tool
def main(argv):
    from MaxOffload import cli

    argv, options, _ = cli.parse(argv, __doc__, keys=("--target",), options={
        "--tokens": "32768,131072", "--ways": "8",
        "--output_dir": os.path.join(ROOT, "benchmarks", "results", "context_2026-12-04")})
    from MaxOffload.platform import use_cpu_runtime

    use_cpu_runtime()
    from MaxOffload import hardware
    from MaxOffload.config import load
    from MaxOffload.deviceless import compile_only_devices, require_plugin
    from MaxOffload.timeline import engines

    lengths = [cli.whole_number("--tokens", t) for t in options["--tokens"].split(",")]
    ways = cli.whole_number("--ways", options["--ways"])
    cfg = load(["configs/llama3_1.py:tiny", *argv])
    require_plugin()
    topology = f"1x1x{ways}" if ways <= 4 else f"1x{ways // 4}x4"
    devices = compile_only_devices(cfg.aot.target, topology)
    rates = engines.Rates.of(hardware.ACCELERATORS[cfg.aot.target], topology)
    rows = []
    for model, shape in SHAPES.items():
        for length in lengths:
            for strategy in ("kv_gather", "latent_gather", "tokamax_sharded"):
                if strategy == "latent_gather" and "latent" not in shape:
                    continue
                print(f"compiling {strategy} for {model}'s heads at {length} tokens over {ways} "
                      f"{cfg.aot.target} (deviceless) ...", flush=True)
                rows.append({"model": model, "tokens": length, "strategy": strategy,
                             **compiled(strategy, shape, length, devices, rates)})
    gib, ms = 2 ** 30, 1e3
    lines = [f"Causal attention forward + backward, one sequence over {ways} {cfg.aot.target}s split over a context "
             "axis, load-balanced (deviceless): what each GPU receives per layer, its temporaries and the predicted "
             "time (timeline: compute, and collective time not hidden behind it)", "",
             "| heads of | tokens | strategy | received per GPU per layer | temporaries per GPU | predicted time | "
             "compute | exposed collectives |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['tokens']:,} | {r['strategy']} | {r['received_bytes'] / gib:.3f} GiB | "
              f"{r['temp_bytes'] / gib:.2f} GiB | {r['step_s'] * ms:.1f} ms | {r['compute_s'] * ms:.1f} ms | "
              f"{r['exposed_collective_s'] * ms:.1f} ms |" for r in rows]
    out = options["--output_dir"]
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

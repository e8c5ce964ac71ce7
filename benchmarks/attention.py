"""Causal attention, implementation by implementation, side by side in one run:
python benchmarks/attention.py [--target gb200] [--tokens 8192] [--output_dir DIR]

One attention forward + backward (the value and the gradients of q, k, v) at the head shapes of Llama 3.1 405B
(128 query heads, 8 kv heads, head dim 128) and DeepSeek-V3 (MLA: 128 heads, q/k head dim 192, v 128), batch 1:

    square   the whole [L, L] causal score matrix in one einsum (k/v repeated per query head; what this
             project's attention fell back to when seq_len was no multiple of its chunk)
    xla      models/attention/plain.causal_attention: query blocks of 512 attending only to the keys they can see
             (model.attention=xla)
    flash    tokamax's flash attention (model.attention=flash; auto on GPUs): its Pallas-Triton kernel on GPUs

For each: compiled matmul FLOPs (the audit's count; the flash kernels' from their shapes), as a multiple of the
causal half's (2 (d + dv) L (L + 1) / 2 heads forward, 2x that backward), and temporaries per device, from the
deviceless compile for --target. Then CPU time of each on a small shape (1,024 tokens, 8 heads, 2 kv heads,
head dim 64, float32; median of 5 after a warm-up, all in this one process; flash = tokamax's chunked XLA
implementation on CPU). Writes DIR/attention.json and .md.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from MaxOffload.cli import tool  # noqa: E402  (after the path, like a tool run from a checkout)
from benchmarks.common import cpu_table, median_seconds, start, write  # noqa: E402

SHAPES = {"llama3_1_405b": dict(heads=128, kv_heads=8, qk_dim=128, v_dim=128),
          "deepseek_v3": dict(heads=128, kv_heads=128, qk_dim=192, v_dim=128)}
IMPLEMENTATIONS = ("square", "xla", "flash")
SMALL = dict(length=1024, heads=8, kv_heads=2, qk_dim=64, v_dim=64)


def square(q, k, v):
    import jax
    import jax.numpy as jnp

    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("blhd,bshd->bhls", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    scores = jnp.where(jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool)), scores, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhls,bshd->blhd", jax.nn.softmax(scores, axis=-1).astype(v.dtype), v)


def attention_fn(impl, on):
    """(q, k, v) -> causal attention [b, l, heads, dv] through `impl` for devices of platform `on`."""
    from MaxOffload.models import kernels
    from MaxOffload.models.attention.flash import flash_attention
    from MaxOffload.models.attention.plain import causal_attention

    scale = None
    if impl == "square":
        return square
    if impl == "xla":
        return lambda q, k, v: causal_attention(q, k, v, scale)
    kernel = kernels.attention_for("flash", on)
    return lambda q, k, v: flash_attention(q, k, v, q.shape[-1] ** -0.5, kernel)


def step(impl, on):
    """The value and the q, k, v gradients of sum(attention . w): forward + backward, every product live."""
    import jax
    import jax.numpy as jnp

    attend = attention_fn(impl, on)

    def loss(q, k, v, w):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * w)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def causal_flops(length, heads, qk_dim, v_dim):
    """Forward + backward matmul FLOPs of the causal half: 3 x 2 (d + dv) per visible pair and head."""
    return 3 * 2 * (qk_dim + v_dim) * length * (length + 1) // 2 * heads


def compiled(impl, shape, length, device):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from MaxOffload import audit, deviceless
    from MaxOffload.models import kernels

    s = NamedSharding(jax.sharding.Mesh([device], ("x",)), PartitionSpec())
    spec = lambda *d, dt=jnp.bfloat16: jax.ShapeDtypeStruct(d, dt, sharding=s)  # noqa: E731
    args = (spec(1, length, shape["heads"], shape["qk_dim"]), spec(1, length, shape["kv_heads"], shape["qk_dim"]),
            spec(1, length, shape["kv_heads"], shape["v_dim"]), spec(shape["v_dim"], dt=jnp.float32))
    with deviceless.lowering(device):
        c = jax.jit(step(impl, kernels.platform(device))).lower(*args).compile()
    flops = audit.count(c.as_text()).total
    return {"compiled_flops": flops, "causal_flops": causal_flops(length, **{k: shape[k] for k in
                                                                             ("heads", "qk_dim", "v_dim")}),
            "temp_bytes": c.memory_analysis().temp_size_in_bytes}


def cpu_time(impl):
    import jax
    import jax.numpy as jnp
    import numpy as np

    n, h, kv, d, dv = (SMALL[k] for k in ("length", "heads", "kv_heads", "qk_dim", "v_dim"))
    rng = np.random.default_rng(0)
    arrays = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((1, n, h, d), (1, n, kv, d), (1, n, kv, dv),
                                                                          (dv,))]
    return median_seconds(jax.jit(step(impl, "cpu")), *arrays)


@tool
def main(argv):
    cfg, lengths, devices = start(argv, __doc__, "configs/llama3_1.py:tiny", "8192")
    device = devices[0]
    rows = []
    for model, shape in SHAPES.items():
        for length in lengths:
            for impl in IMPLEMENTATIONS:
                print(f"compiling {impl} for {model}'s heads at {length} tokens ({cfg.aot.target}, deviceless) ...",
                      flush=True)
                rows.append({"model": model, "tokens": length, "impl": impl, **compiled(impl, shape, length, device)})
    cpu = {impl: cpu_time(impl) for impl in IMPLEMENTATIONS}
    lines = [f"Causal attention forward + backward, batch 1, one {cfg.aot.target} (deviceless); FLOPs against the "
             "causal half's", "", "| heads of | tokens | implementation | compiled TFLOP | / causal half | "
             "temporaries |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['tokens']} | {r['impl']} | {r['compiled_flops'] / 1e12:.2f} | "
                     f"{r['compiled_flops'] / r['causal_flops']:.2f}x | {r['temp_bytes'] / 2**20:,.0f} MiB |")
    lines += cpu_table(f"CPU time, {SMALL['length']} tokens, {SMALL['heads']} heads / {SMALL['kv_heads']} kv heads, "
                       f"head dim {SMALL['qk_dim']}, float32, fwd + bwd (median of 5, one process; flash = tokamax's "
                       "chunked XLA implementation on CPU):", cpu, "xla")
    path = write(cfg.run.output_dir, "attention", lines,
                 {"target": cfg.aot.target, "rows": rows, "cpu_seconds": cpu, "small": SMALL})
    print(f"wrote {path} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

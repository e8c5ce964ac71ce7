"""FP8 weight GEMMs, mode by mode, side by side in one run: python benchmarks/fp8.py [--target gb200]
[--tokens 4096] [--output_dir DIR]

DeepSeek-V3's shapes on one device (deviceless compile for --target), forward + backward, each block's weight
GEMMs through models/matmul under quant.mode = bf16 | fp8 | mxfp8 (mxfp8 needs jax >= 0.11):

    experts dropless   one MoE layer's routed experts at EP8 (benchmarks/moe_kernels.py's block: 32 local experts,
                       emb 7168, moe_mlp 2048, 1.25 x the balanced rows), tokamax's grouped GEMM
    experts capacity   the same block as capacity mode's batched GEMM
    MLA projections    one layer's six projections over the device's tokens: q_a 7168->1536, q_b 1536->128x192,
                       kv_a 7168->576, kv_b 512->128x256, o 128x128->7168

For each: the GEMM kernels the compiled program runs (kind x executions, from the audit), the FP8 share of its
matmul FLOPs, its temporaries and argument bytes per device. Writes DIR/fp8.json, .md and .png.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from MaxOffload.cli import tool  # noqa: E402  (after the path, like a tool run from a checkout)
from benchmarks.common import bar_pair, start, write  # noqa: E402
from benchmarks.moe_kernels import EMB, expert_arguments, expert_block  # noqa: E402

# DeepSeek-V3's MLA: q_lora_rank, kv_lora_rank + qk_rope_head_dim, heads x (qk_nope + qk_rope), heads x (nope + v)
Q_LORA, KV_LATENT, KV_LORA, HEADS, QK_HEAD, V_HEAD = 1536, 576, 512, 128, 192, 128
BLOCKS = ("experts dropless", "experts capacity", "MLA projections")


def modes():
    from MaxOffload.platform import jax_at_least

    return ("bf16", "fp8", "mxfp8") if jax_at_least(0, 11) else ("bf16", "fp8")


def mla_projections(numerics):
    """loss(x, attention output, q_a, q_b, kv_a, kv_b, o) of one MLA layer's projections under `numerics`."""
    import jax
    import jax.numpy as jnp

    from MaxOffload.models import components, matmul

    def loss(x, attended, q_a, q_b, kv_a, kv_b, o):
        mm = lambda a, w: matmul.dense(a, w, None, components.PROJECTIONS, numerics)  # noqa: E731
        q = mm(mm(x, q_a), q_b)
        kv = mm(mm(x, kv_a)[:, :KV_LORA], kv_b)
        return sum(jnp.sum(jnp.square(t.astype(jnp.float32))) / 2 for t in (q, kv, mm(attended, o)))  # (moe_kernels)

    return jax.value_and_grad(loss, argnums=tuple(range(7)))


def mla_arguments(tokens, device):
    import jax
    import jax.numpy as jnp

    s = jax.sharding.SingleDeviceSharding(device)
    shape = lambda *d: jax.ShapeDtypeStruct(d, jnp.bfloat16, sharding=s)  # noqa: E731
    return (shape(tokens, EMB), shape(tokens, HEADS * V_HEAD), shape(EMB, Q_LORA), shape(Q_LORA, HEADS * QK_HEAD),
            shape(EMB, KV_LATENT), shape(KV_LORA, HEADS * (QK_HEAD - 64 + V_HEAD)), shape(HEADS * V_HEAD, EMB))


def compiled(block, mode, tokens, device):
    """The audit of one block's compiled forward + backward under `mode`: GEMM kernels, FP8 share, memory."""
    import jax

    from MaxOffload import audit, deviceless, xla
    from MaxOffload.models import kernels, matmul

    numerics = matmul.Numerics(mode=mode)
    if block == "MLA projections":
        fn, args = mla_projections(numerics), mla_arguments(tokens, device)
    else:
        impl = "capacity" if block == "experts capacity" else "tokamax"
        fn, args = expert_block(impl, kernels.platform(device), numerics), expert_arguments(tokens, device)
    with deviceless.lowering(device):
        c = jax.jit(fn).lower(*args).compile(compiler_options=xla.compiler_options("baseline", mode))
    matmuls = audit.count(c.as_text()).matmuls
    found = {}
    for m in matmuls:
        kind = f"{m.kind} (FP8)" if m.fp8 and m.kind not in audit.FP8_KINDS else m.kind
        found[kind] = found.get(kind, 0) + m.times
    total = sum(m.flops for m in matmuls)
    memory = c.memory_analysis()
    return {"kernels": found, "flops": total, "fp8_share": sum(m.flops for m in matmuls if m.fp8) / total,
            "temp_bytes": memory.temp_size_in_bytes, "argument_bytes": memory.argument_size_in_bytes}


def chart(rows, path):
    labels = [f"{r['block'].split()[-1]}\n{r['mode']}" for r in rows]  # dropless / capacity / projections
    bar_pair(path, labels, [([100 * r["fp8_share"] for r in rows], "FP8 share of compiled matmul FLOPs (%)",
                             "tab:blue", {"ylim": (0, 100), "rotation": 90}),
                            ([r["temp_bytes"] / 2**20 for r in rows], "temporaries per device (MiB)", "tab:orange",
                             {"rotation": 90})],
             "DeepSeek-V3 expert and MLA GEMMs per quant.mode, fwd+bwd (deviceless)")


@tool
def main(argv):
    cfg, tokens, devices = start(argv, __doc__, "configs/deepseek_v3.py:small", "4096")
    rows = []
    for n in tokens:
        for block in BLOCKS:
            for mode in modes():
                print(f"compiling {block} in {mode} at {n} tokens for {cfg.aot.target} (deviceless) ...", flush=True)
                rows.append({"block": block, "mode": mode, "tokens": n, **compiled(block, mode, n, devices[0])})
    lines = [f"DeepSeek-V3 expert (EP8) and MLA GEMMs, forward + backward on one {cfg.aot.target} (deviceless), "
             "per quant.mode", "", "| block | mode | tokens/device | GEMM kernels (x executions) | FP8 share of "
             "FLOPs | temporaries | arguments |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        kinds = ", ".join(f"{k} x{v}" for k, v in sorted(r["kernels"].items()))
        lines.append(f"| {r['block']} | {r['mode']} | {r['tokens']} | {kinds} | {100 * r['fp8_share']:.0f}% | "
                     f"{r['temp_bytes'] / 2**20:,.0f} MiB | {r['argument_bytes'] / 2**20:,.0f} MiB |")
    path = write(cfg.run.output_dir, "fp8", lines, {"target": cfg.aot.target, "rows": rows})
    chart(rows, os.path.join(cfg.run.output_dir, "fp8.png"))
    print(f"wrote {path}, .json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

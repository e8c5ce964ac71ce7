"""The routed experts' grouped matmuls, implementation by implementation, side by side in one run:
python benchmarks/moe_kernels.py [--target gb200] [--tokens 4096,8192] [--output_dir DIR]

DeepSeek-V3's expert shapes at EP8: 32 local experts, emb 7168, moe_mlp 2048; a device's rows for one MoE layer
are the balanced share of the gathered choices (batch 1 x tokens x top-8 per device, all-gathered over 8 expert
ranks, 1/8 of them on this device's experts) times 1.25: the capacity factor of capacity mode, the dispatch
buffer (model.moe_buffer_factor) of dropless mode. One MoE layer's expert block, forward + backward: gate and up
[rows, 7168] x [32, 7168, 2048], down [rows, 2048] x [32, 2048, 7168], each through models/matmul.grouped:

    capacity    batched GEMM over [experts, capacity rows, emb] (capacity mode)
    xla         jax.lax.ragged_dot (dropless; XLA's GPU compiler makes it a dense dot over every expert)
    tokamax     tokamax's ragged_dot: its Pallas-Triton grouped GEMM on GPUs (dropless, model.moe_kernel=auto)

For each: compiled matmul FLOPs (the audit's count; the kernel's from its shapes), temporaries and argument
bytes per device, from the deviceless compile for --target; the ideal is 2 x balanced rows x emb x moe_mlp x 3
matmuls x 3 (forward, two gradients). Then CPU time of each on a small shape (rows 2048, 8 experts, emb 256,
moe_mlp 128; median of 5 after a warm-up, all in this one process): on CPU tokamax runs its XLA implementation
behind the same call, as the Triton kernel cannot run here. Writes DIR/moe_kernels.json, .md and .png.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from MaxOffload.cli import tool  # noqa: E402  (after the path, like a tool run from a checkout)
from benchmarks.common import bar_pair, cpu_table, median_seconds, start, write  # noqa: E402

LOCAL_EXPERTS, EMB, MOE_MLP, TOP_K, EP = 32, 7168, 2048, 8, 8
FACTOR = 1.25
IMPLEMENTATIONS = ("capacity", "xla", "tokamax")
SMALL = dict(rows=2048, experts=8, emb=256, mlp=128)


def expert_block(impl, on, numerics=None):
    """loss(rows, wi_0, wi_1, wo, sizes) of one expert SwiGLU block through `impl`, for devices of platform `on`,
    under `numerics` (a models/matmul.Numerics; default BF16)."""
    import jax
    import jax.numpy as jnp

    from MaxOffload.models import kernels, matmul

    kernel = "xla" if impl == "capacity" else kernels.grouped_gemm_for("xla" if impl == "xla" else "tokamax", on)

    def loss(rows, wi_0, wi_1, wo, sizes):
        capacity = rows.shape[0] // wi_0.shape[0] if impl == "capacity" else 0
        mm = lambda a, w: matmul.grouped(a, w, sizes, capacity, kernel, numerics or matmul.Numerics())  # noqa: E731
        h = jax.nn.silu(mm(rows, wi_0)) * mm(rows, wi_1)
        # half the sum of squares, not the sum: its gradient is the output, not a constant XLA could fold into
        # the backward (an FP8 backward would quantize a constant)
        return jnp.sum(jnp.square(mm(h, wo).astype(jnp.float32))) / 2

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))  # the value too: every forward matmul is live


def expert_rows(tokens):
    """(rows in a device's expert buffer, its balanced share) for `tokens` tokens per device."""
    balanced = tokens * TOP_K * EP // EP  # gathered choices over the 8 ranks, 1/8 of them local
    return int(FACTOR * balanced) // LOCAL_EXPERTS * LOCAL_EXPERTS, balanced


def expert_arguments(tokens, device):
    """ShapeDtypeStructs (rows, wi_0, wi_1, wo, sizes) of one expert block on `device`."""
    import jax
    import jax.numpy as jnp

    s = jax.sharding.SingleDeviceSharding(device)
    shape = lambda *d, dt=jnp.bfloat16: jax.ShapeDtypeStruct(d, dt, sharding=s)  # noqa: E731
    return (shape(expert_rows(tokens)[0], EMB), shape(LOCAL_EXPERTS, EMB, MOE_MLP),
            shape(LOCAL_EXPERTS, EMB, MOE_MLP), shape(LOCAL_EXPERTS, MOE_MLP, EMB), shape(LOCAL_EXPERTS, dt=jnp.int32))


def compiled(impl, tokens, devices):
    """(compiled matmul FLOPs, ideal FLOPs, temp bytes, argument bytes) of one expert block on one device."""
    import jax

    from MaxOffload import audit, deviceless
    from MaxOffload.models import kernels

    rows, balanced = expert_rows(tokens)
    with deviceless.lowering(devices[0]):
        step = jax.jit(expert_block(impl, kernels.platform(devices[0])))
        c = step.lower(*expert_arguments(tokens, devices[0])).compile()
    m = c.memory_analysis()
    ideal = 2 * balanced * EMB * MOE_MLP * 3 * 3
    return {"rows": rows, "balanced_rows": balanced, "compiled_flops": audit.count(c.as_text()).total,
            "ideal_flops": ideal, "temp_bytes": m.temp_size_in_bytes, "argument_bytes": m.argument_size_in_bytes}


def cpu_time(impl):
    import jax
    import jax.numpy as jnp
    import numpy as np

    r, e, d, n = SMALL["rows"], SMALL["experts"], SMALL["emb"], SMALL["mlp"]
    rng = np.random.default_rng(0)
    arrays = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((r, d), (e, d, n), (e, d, n), (e, n, d))]
    sizes = jnp.full((e,), r // e, jnp.int32)
    return median_seconds(jax.jit(expert_block(impl, "cpu")), *arrays, sizes)


def chart(rows, path):
    labels = [f"{r['impl']}\n{r['tokens']} tok" for r in rows]
    bar_pair(path, labels, [([r["compiled_flops"] / r["ideal_flops"] for r in rows], "compiled / ideal matmul FLOPs",
                             "tab:blue", {"log": True, "line": FACTOR}),
                            ([r["temp_bytes"] / 2**30 for r in rows], "temporaries per device (GiB)", "tab:orange",
                             {"log": True})],
             "DeepSeek-V3 routed experts at EP8, one MoE layer fwd+bwd (deviceless)")


@tool
def main(argv):
    cfg, tokens, devices = start(argv, __doc__, "configs/deepseek_v3.py:small", "4096,8192")
    rows = []
    for n in tokens:
        for impl in IMPLEMENTATIONS:
            print(f"compiling {impl} at {n} tokens for {cfg.aot.target} (deviceless) ...", flush=True)
            rows.append({"impl": impl, "tokens": n, **compiled(impl, n, devices)})
    cpu = {impl: cpu_time(impl) for impl in IMPLEMENTATIONS}
    lines = [f"DeepSeek-V3 routed experts, EP8 ({LOCAL_EXPERTS} local experts, emb {EMB}, moe_mlp {MOE_MLP}), "
             f"one MoE layer forward + backward on one {cfg.aot.target} (deviceless); rows = {FACTOR} x balanced",
             "", "| implementation | tokens/device | rows | compiled TFLOP | / ideal | temporaries | arguments |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['impl']} | {r['tokens']} | {r['rows']} | {r['compiled_flops'] / 1e12:.2f} | "
                     f"{r['compiled_flops'] / r['ideal_flops']:.2f}x | {r['temp_bytes'] / 2**20:,.0f} MiB | "
                     f"{r['argument_bytes'] / 2**20:,.0f} MiB |")
    lines += cpu_table(f"CPU time, rows {SMALL['rows']}, {SMALL['experts']} experts, emb {SMALL['emb']}, moe_mlp "
                       f"{SMALL['mlp']}, float32, fwd + bwd (median of 5, one process; tokamax = its XLA "
                       "implementation on CPU):", cpu, "capacity")
    path = write(cfg.run.output_dir, "moe_kernels", lines, {"target": cfg.aot.target, "factor": FACTOR, "rows": rows,
                                                              "cpu_seconds": cpu, "small": SMALL})
    chart(rows, os.path.join(cfg.run.output_dir, "moe_kernels.png"))
    print(f"wrote {path}, .json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

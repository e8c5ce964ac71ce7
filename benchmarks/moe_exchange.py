"""How routed tokens reach their experts, exchange by exchange, side by side in one run, deviceless:
python benchmarks/moe_exchange.py [--target gb200] [--topology 1x16x4] [--eps 8,16,32,64] [--tokens 4096]
                                  [--output_dir DIR]

One DeepSeek-V3 MoE layer's routed experts at their real width (256 experts, emb 7168, moe_mlp 2048, top-8), forward
+ backward (the value of half the output's sum of squares and the gradients of the tokens and the three expert
weights), on every device of the topology (64 GB200 of one NVL72 rack by default), `--tokens` tokens a device,
dropless with the 671B recipe's dispatch buffer (model.moe_buffer_factor=1.25), the experts at home (their weights
sharded over the expert axis only, mesh.rules.exp_embed=[]: no weight is gathered), the tokens' batch over
fsdp x expert, for each expert degree EP of --eps (fsdp = devices / EP) and each exchange (models/exchange.py):

    all_gather   tokens all-gathered over the expert axis, outputs reduce-scattered back
    all_to_all   each choice to its expert's owner and back: XLA's ragged all-to-all on GPUs and TPUs

For each: the bytes its collectives move per device (the compiled program's, as the timeline costs them), temporaries
per device (XLA's memory analysis) and the predicted time of the layer on the target (MaxOffload/timeline/: its
compute, and its collectives as exposed after overlap). The routing is a compile-time shape only: the byte counts
are the buffers' (for the ragged all-to-all, a rank's whole send buffer: its choices, about (EP - 1) / EP of which
leave the device when the routing is balanced). Writes DIR/moe_exchange.json, .md and .png.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from MaxOffload.cli import tool  # noqa: E402  (after the path, like a tool run from a checkout)
from benchmarks.common import bar_pair, write  # noqa: E402

EXPERTS, EMB, MOE_MLP, TOP_K, BUFFER = 256, 7168, 2048, 8, 1.25
EXCHANGES = ("all_gather", "all_to_all")


def layer(exchange, mesh, kernel):
    """value_and_grad of one MoE layer's routed experts (models/moe.routed_experts) through `exchange` on `mesh`."""
    import jax
    import jax.numpy as jnp

    from MaxOffload.models import moe
    from MaxOffload.models.model_context import ModelContext
    from MaxOffload.parallel import logical
    from MaxOffload.parallel.layout import ParallelLayout

    rules = {**logical.DEFAULT_RULES, "exp_embed": ()}
    layout = ParallelLayout.of(mesh, rules, exchange)

    def loss(x, experts, gates, wi_0, wi_1, wo):
        out, _ = moe.routed_experts(x, experts, gates, None, wi_0, wi_1, wo, 0, ModelContext(layout), kernel, BUFFER)
        return jnp.sum(jnp.square(out)) / 2

    return jax.value_and_grad(loss, argnums=(0, 3, 4, 5)), layout


def compile_layer(exchange, ep, devices, tokens, target, topology):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from MaxOffload import audit, deviceless, hardware
    from MaxOffload.models import kernels
    from MaxOffload.timeline import engines, simulate

    mesh = Mesh(np.array(devices).reshape(len(devices) // ep, ep), ("fsdp", "expert"))
    kernel = kernels.grouped_gemm_for("auto", kernels.platform(devices[0]))
    fn, _ = layer(exchange, mesh, kernel)
    batch = NamedSharding(mesh, P(("fsdp", "expert")))
    experts_at_home = NamedSharding(mesh, P("expert"))
    shape = lambda dims, dtype, s: jax.ShapeDtypeStruct(dims, dtype, sharding=s)  # noqa: E731
    n = len(devices)
    args = (shape((n, tokens, EMB), jnp.bfloat16, batch), shape((n, tokens, TOP_K), jnp.int32, batch),
            shape((n, tokens, TOP_K), jnp.float32, batch), shape((EXPERTS, EMB, MOE_MLP), jnp.bfloat16, experts_at_home),
            shape((EXPERTS, EMB, MOE_MLP), jnp.bfloat16, experts_at_home),
            shape((EXPERTS, MOE_MLP, EMB), jnp.bfloat16, experts_at_home))
    with deviceless.lowering(devices[0]):
        compiled = jax.jit(fn).lower(*args).compile()
    text = compiled.as_text()
    accelerator = hardware.ACCELERATORS[target]
    rates = engines.Rates.of(accelerator, topology)
    domains = [d.id // rates.domain for d in mesh.devices.flat]
    report, _ = simulate.simulate(text, rates, n, domains=domains)
    ideal = 2 * 3 * 3 * tokens * TOP_K * EMB * MOE_MLP  # three matmuls, forward and two gradients, each row once
    return {"exchange": exchange, "ep": ep, "fsdp": n // ep, "tokens_per_device": tokens,
            "collective_bytes": report["collective_bytes"], "collective_s": report["collective_s"],
            "exposed_collective_s": report["exposed_collective_s"], "compute_s": report["compute_s"],
            "layer_s": report["step_s"], "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "compiled_matmul_flops": audit.count(text).total, "ideal_matmul_flops": ideal}


@tool
def main(argv):
    from MaxOffload import cli

    argv, options, _ = cli.parse(argv, __doc__, keys=(), options={
        "--target": "gb200", "--topology": "1x16x4", "--eps": "8,16,32,64", "--tokens": "4096",
        "--output_dir": os.path.join(ROOT, "benchmarks", "results", "moe_exchange")})
    from MaxOffload.platform import use_cpu_runtime

    use_cpu_runtime()
    from MaxOffload.deviceless import compile_only_devices, require_plugin

    target, topology = options["--target"], options["--topology"]
    require_plugin(target=target)
    devices = compile_only_devices(target, topology)
    eps = [cli.whole_number("--eps", e) for e in options["--eps"].split(",")]
    bad = [ep for ep in eps if len(devices) % ep or EXPERTS % ep]
    if bad:
        raise cli.ConfigError(f"--eps {bad[0]}: an expert degree divides the {len(devices)} devices and the "
                              f"{EXPERTS} experts")
    tokens = cli.whole_number("--tokens", options["--tokens"])
    rows = []
    for ep in eps:
        for exchange in EXCHANGES:
            print(f"compiling one MoE layer, {exchange}, EP{ep} x fsdp{len(devices) // ep} on {len(devices)} x "
                  f"{target} (deviceless) ...", flush=True)
            rows.append(compile_layer(exchange, ep, devices, tokens, target, topology))
    gb, ms = (lambda b: f"{b / 1e9:.2f}"), (lambda s: f"{s * 1e3:.2f}")
    lines = [f"One DeepSeek-V3 MoE layer's routed experts (256 x 7168 x 2048, top-8), forward + backward, "
             f"{tokens:,} tokens a device, dropless (buffer {BUFFER}), experts at home, on {len(devices)} x {target} "
             f"({topology}), deviceless; per device", "",
             "| EP x fsdp | exchange | collective GB | collective ms (exposed) | compute ms | layer ms | "
             "temporaries GB | compiled / ideal matmul FLOPs |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['ep']} x {r['fsdp']} | {r['exchange']} | {gb(r['collective_bytes'])} | "
                     f"{ms(r['collective_s'])} ({ms(r['exposed_collective_s'])}) | {ms(r['compute_s'])} | "
                     f"{ms(r['layer_s'])} | {gb(r['temp_bytes'])} | "
                     f"{r['compiled_matmul_flops'] / r['ideal_matmul_flops']:.2f} |")
    by = {(r["ep"], r["exchange"]): r for r in rows}
    lines += ["", "all_gather / all_to_all, layer time: " + ", ".join(
        f"EP{ep} {by[ep, 'all_gather']['layer_s'] / by[ep, 'all_to_all']['layer_s']:.2f}x" for ep in eps)]
    out = options["--output_dir"]
    write(out, "moe_exchange", lines, {"target": target, "topology": topology, "rows": rows})
    labels = [f"EP{r['ep']} {r['exchange']}" for r in rows]
    bar_pair(os.path.join(out, "moe_exchange.png"), labels,
             [([r["collective_bytes"] / 1e9 for r in rows], "collective GB / device", "tab:orange", {}),
              ([r["layer_s"] * 1e3 for r in rows], "predicted layer ms", "tab:blue", {})],
             f"one DeepSeek-V3 MoE layer, {len(devices)} x {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

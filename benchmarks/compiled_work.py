"""Compiled work side by side: python benchmarks/compiled_work.py [CONFIG [overrides]] [--target gb200]
                                         [--topology 1x2x4] [--output_dir DIR]

For each variant (a set of overrides on CONFIG, default `configs/deepseek_v3.py:small remat.policy=save_all`):
the deviceless compile of the training step for aot.target/aot.topology (default 8 GB200s), and the
compiled-work audit of its optimized HLO (MaxOffload/audit.py): matmul FLOPs per device per step against the
model FLOPs, in total and for the routed experts, how many ragged_dots XLA lowered to dense dots, and HBM per
device. The default variants are the MoE issue's: all 16 experts local (fsdp=8) and EP8, each with a capacity
of 1.25 and dropless — dropless through the grouped-GEMM kernel (model.moe_kernel=auto: tokamax's Triton
ragged_dot on GPUs), at EP8 also with a dispatch buffer of 1.25x the balanced rows, and through XLA's own
ragged_dot (moe_kernel=xla) for comparison. Writes DIR/compiled_work.csv and .json; needs only the aot extra.
"""
import csv
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from MaxOffload.cli import tool  # noqa: E402  (after the path, like a tool run from a checkout)

DEFAULT = ["configs/deepseek_v3.py:small", "remat.policy=save_all"]
FSDP8, EP8, DROPLESS = ["mesh.ici.fsdp=8", "mesh.ici.expert=1"], ["mesh.ici.fsdp=1", "mesh.ici.expert=8"], \
    ["model.capacity_factor=0"]
VARIANTS = {
    "fsdp8 capacity 1.25": FSDP8 + ["model.capacity_factor=1.25"],
    "fsdp8 dropless": FSDP8 + DROPLESS,
    "fsdp8 dropless xla": FSDP8 + DROPLESS + ["model.moe_kernel=xla"],
    "ep8 capacity 1.25": EP8 + ["model.capacity_factor=1.25"],
    "ep8 dropless": EP8 + DROPLESS,
    "ep8 dropless buf 1.25": EP8 + DROPLESS + ["model.moe_buffer_factor=1.25"],
    "ep8 dropless xla": EP8 + DROPLESS + ["model.moe_kernel=xla"],
}
FIELDS = ["variant", "ratio", "experts_ratio", "recompute_share", "dense_ragged_dots", "kernel_calls",
          "compiled_tflop", "model_tflop", "hbm_gib", "warnings"]


@tool
def main(argv):
    from MaxOffload import cli

    argv, _, _ = cli.parse(argv, __doc__, keys=cli.TARGET_KEYS)
    from MaxOffload.platform import use_cpu_runtime

    use_cpu_runtime()
    from MaxOffload import audit, from_config, xla
    from MaxOffload.config import load
    from MaxOffload.deviceless import compile_only_devices, require_plugin
    from MaxOffload.memory import compiled_bytes
    from MaxOffload.models import components

    base = argv if argv and ".py" in argv[0] else DEFAULT + argv  # a config given, or the default one
    if not any(a.startswith("aot.topology=") for a in base):
        base = base[:1] + ["aot.topology=1x2x4"] + base[1:]  # 8 GPUs unless told otherwise
    require_plugin()
    xla.apply(load(base))  # one XLA preset for every variant: XLA_FLAGS are read once, when the backend starts
    rows = []
    for name, overrides in VARIANTS.items():
        cfg = load(base + overrides)
        setup = from_config.train_setup(cfg, compile_only_devices(cfg.aot.target, cfg.aot.topology))
        print(f"compiling {name} for {cfg.aot.topology} x {cfg.aot.target} (deviceless) ...", flush=True)
        compiled = setup.compile_train_step()
        report = audit.of_compiled(compiled, setup)
        experts = report["components"].get(components.EXPERTS, {})
        rows.append({"variant": name, "ratio": report["ratio"], "experts_ratio": experts.get("ratio"),
                     "recompute_share": report["recompute_flops"] / report["compiled_matmul_flops"],
                     "dense_ragged_dots": report["dense_ragged_dots"],
                     "kernel_calls": sum(report["counted_kernels"].values()),
                     "compiled_tflop": report["compiled_matmul_flops"] / 1e12,
                     "model_tflop": report["model_flops"] / 1e12,
                     "hbm_gib": compiled_bytes(compiled.memory_analysis())[0] / 2**30,
                     "warnings": " | ".join(report["warnings"])})
    print(f"{'variant':<22} {'compiled/model':>14} {'experts':>9} {'dense ragged_dots':>18} {'kernel calls':>13} "
          f"{'HBM':>10}")
    for r in rows:
        experts = f"{r['experts_ratio']:.2f}x" if r["experts_ratio"] else "-"
        print(f"{r['variant']:<22} {r['ratio']:>13.2f}x {experts:>9} {r['dense_ragged_dots']:>18} "
              f"{r['kernel_calls']:>13} {r['hbm_gib']:>7.2f} GiB")
    out = cfg.run.output_dir
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "compiled_work.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(out, "compiled_work.json"), "w") as f:
        json.dump({"config": base, "variants": VARIANTS, "rows": rows}, f, indent=1)
    print(f"wrote {os.path.join(out, 'compiled_work.csv')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

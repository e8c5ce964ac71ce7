"""What the vocabulary-tiled cross-entropy (model.vocab_tiles, MaxOffload/models/cross_entropy.py) saves, from the
deviceless compile of the training step (no accelerator needed): Llama-3.1-8B width with its 128,256-token
vocabulary, 2 layers, bf16 parameters, full remat, rows of 2,048 tokens (4 and 8 a device) on one TPU v5e (or another
--target/--topology), whole logits (model.vocab_tiles=1) against tiles (default 0: auto, 167 tiles of 768 columns),
each compiled by its own `python -m MaxOffload.aot` process as a user runs it. Prints the temporaries, the HBM needed
and the predicted step of each, side by side, and writes OUT/cross_entropy.{md,json}.

    python benchmarks/cross_entropy.py OUT_DIR [--target v5e] [--topology 1x1] [--tiles 0] [--batches 4,8]
                                       [overrides ...]
"""
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
SHAPE = ["configs/llama3_1.py:8b", "model.num_layers=2", "train.per_device_batch_size=4", "train.seq_len=2048",
         "model.param_dtype=bfloat16", "remat.policy=full"]


def compile_report(run_dir, args, label):
    """The aot report's memory and predicted step for one compile (`python -m MaxOffload.aot ARGS`)."""
    from MaxOffload.errors import ConfigError

    command = [sys.executable, "-m", "MaxOffload.aot", *args, "--output_dir", run_dir]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode not in (0, 1):  # 1: compiled, does not fit (still measured)
        raise ConfigError(f"the aot compile for {label} failed (exit {done.returncode}): "
                          f"{(done.stderr or done.stdout).strip().splitlines()[-1]}")
    with open(os.path.join(run_dir, "aot_report.json")) as f:
        report = json.load(f)
    return {"command": " ".join(["python", *command[1:]]), "fits": report["fits"],
            "temp_bytes_per_device": report.get("temp_bytes_per_device"),  # none when refused
            "refused": report.get("refused"), "hbm_bytes_per_device": report["hbm_bytes_per_device"],
            "predicted_step_s": (report.get("timeline") or {}).get("step_s")}


def main(argv):
    """Exit status; a mistake in the input prints one line (MaxOffload/cli.py)."""
    from MaxOffload.cli import run

    return run(_main, argv)


def _main(argv):
    from benchmarks.common import write
    from MaxOffload import cli
    from MaxOffload.errors import ConfigError

    rest, options, _ = cli.parse(argv, __doc__, keys=(),
                                 options={"--target": "v5e", "--topology": "1x1", "--tiles": "0", "--batches": "4,8"})
    if not rest:
        raise ConfigError("give OUT_DIR (and config overrides on top of the Llama-8B-width shape); see --help")
    out, overrides = rest[0], rest[1:]
    batches = [cli.whole_number("--batches", b) for b in options["--batches"].split(",")]
    runs = {}
    for batch in batches:
        for label, tiles in (("whole logits", "1"), (f"vocab_tiles={options['--tiles']}", options["--tiles"])):
            args = [*SHAPE, f"train.per_device_batch_size={batch}", *overrides, f"model.vocab_tiles={tiles}",
                    "--target", options["--target"], "--topology", options["--topology"]]
            run_dir = os.path.join(out, f"b{batch}_vocab_tiles_{tiles}")
            runs[f"{batch} x 2,048 tokens, {label}"] = compile_report(run_dir, args, label)
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    lines = [f"# Vocabulary-tiled cross-entropy, deviceless {options['--target']} {options['--topology']}", "",
             "| step | temporaries | HBM needed | fits | predicted step |", "|---|---|---|---|---|"]
    for label, r in runs.items():
        temp = gib(r["temp_bytes_per_device"]) if r["temp_bytes_per_device"] is not None else "refused"
        step = f"{r['predicted_step_s']:.3f} s" if r["predicted_step_s"] else "-"
        lines.append(f"| {label} | {temp} | {gib(r['hbm_bytes_per_device'])} | {r['fits']} | {step} |")
    lines += ["", "HBM needed: the compile's arguments + temporaries + output, or what libtpu says a refused one needs"]
    lines += [f"{label}: {r['refused']}" for label, r in runs.items() if r["refused"]]
    labels = list(runs)
    for whole, tiled in zip(labels[::2], labels[1::2]):
        a, b = runs[whole], runs[tiled]
        ratio = f", predicted step {b['predicted_step_s'] / a['predicted_step_s']:.3f}x" \
            if a["predicted_step_s"] and b["predicted_step_s"] else ""
        lines.append(f"{tiled}: {gib(a['hbm_bytes_per_device'] - b['hbm_bytes_per_device'])} less HBM than the whole "
                     f"logits ({b['hbm_bytes_per_device'] / a['hbm_bytes_per_device']:.3f}x){ratio}")
    write(out, "cross_entropy", lines, {"shape": SHAPE + overrides, "target": options["--target"],
                                        "topology": options["--topology"], "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Does the planner rank policies the way this machine does? Predicted vs measured step times, side by side.

    python benchmarks/planner_order.py [CONFIG overrides...] [--rounds 5] [--policies full,minimal,save_all,auto]

For each policy (remat.policy=auto resolved by the planner for this process's devices): the cost model's
predicted step time (planner.predict) and the measured median of --rounds steps, the policies interleaved
round by round so a noisy machine slows them alike. Prints both orders and exits 1 when they differ.
Default model: a 3-layer float32 llama (emb 256, mlp 1024, 8 x 512 tokens) - the out-of-sample check of
the CPU calibration (CPU_SAVE_S_PER_BYTE was fitted on a wider 2-layer model, docs/planner.md).
"""
import statistics
import sys
import time

DEFAULT = ["configs/llama3_1.py:tiny", "model.emb_dim=256", "model.mlp_dim=1024", "model.num_heads=4",
           "model.num_kv_heads=2", "model.head_dim=64", "model.num_layers=3", "model.vocab_size=512",
           "train.seq_len=512", "train.per_device_batch_size=8", "model.compute_dtype=float32",
           "run.output_dir=runs/planner_order"]


def main(argv):
    """Exit status; a mistake in the input prints one line (MaxOffload/cli.py)."""
    from MaxOffload.cli import run

    return run(_main, argv)


def _main(argv):
    from MaxOffload import cli

    argv, options, _ = cli.parse(argv, __doc__, options={"--rounds": 5, "--policies": "full,minimal,save_all,auto"})
    rounds, policies = options["--rounds"], options["--policies"]
    from MaxOffload.platform import pick_platform

    pick_platform()
    import jax

    from MaxOffload.config import load
    from MaxOffload.offload import planner
    from MaxOffload import from_config

    argv = argv if argv and "=" not in argv[0] else DEFAULT + argv  # no config given: the default model
    runs = {}
    for name in policies.split(","):
        cfg = load(argv + [f"remat.policy={name}"])
        plan = planner.plan_for(cfg, log=lambda *a: None)
        setup = from_config.train_setup(cfg, plan=plan)
        state = setup.init_state()
        batch = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), setup.abstract_batch())
        step = setup.compile_train_step()
        state, metrics = step(state, batch)  # warm up
        jax.block_until_ready(metrics)
        runs[name] = {"setup": setup, "step": step, "state": state, "batch": batch, "times": [],
                      "predicted": planner.predict(cfg, offload_plan=plan).step_time()}
        print(f"{name}: compiled", flush=True)
    for _ in range(rounds):
        for run in runs.values():
            started = time.perf_counter()
            run["state"], metrics = run["step"](run["state"], run["batch"])
            jax.block_until_ready(metrics)
            run["times"].append(time.perf_counter() - started)
    print(f"{'policy':<10} {'predicted':>10} {'measured':>10}  (median of {rounds}, interleaved)")
    for name, run in runs.items():
        run["measured"] = statistics.median(run["times"])
        print(f"{name:<10} {run['predicted'] * 1e3:>8.1f}ms {run['measured'] * 1e3:>8.1f}ms")
    predicted = sorted(runs, key=lambda n: runs[n]["predicted"])
    measured = sorted(runs, key=lambda n: runs[n]["measured"])
    print(f"predicted order: {' < '.join(predicted)}\nmeasured order:  {' < '.join(measured)}")
    print("orders agree" if predicted == measured else "orders DIFFER")
    return 0 if predicted == measured else 1


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
    sys.exit(main(sys.argv[1:]))

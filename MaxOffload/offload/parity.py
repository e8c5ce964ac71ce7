"""Numerical parity gate: offloading or saving must not change the loss or the gradients.

    python -m MaxOffload.offload.parity CONFIG.py[:ARG] [overrides...] [--all_presets]

Computes the loss and gradients of one real training batch under full rematerialisation
(the reference) and under the config's own policy (per-layer groups included) — with
--all_presets also under every preset — on whatever backend runs it. On a GPU this
exercises XLA's real host-offload passes, which have had wrong-offset bugs; on a CPU an
offloaded tensor is simply saved. Exit status 0 when all agree within tolerance, 1 when
one does not, 2 on a configuration error.
"""
import contextlib
import sys

from MaxOffload.cli import tool


# Relative tolerances on the loss and on ||g - g_ref|| / ||g_ref||. Recomputing instead of saving reruns
# the same ops, but XLA fuses them differently, so bits differ. Measured on an H200 (jax 0.11.2, 4 Llama-8B
# layers, 8k tokens): bfloat16 gradients 1.18e-2 from full remat both when the tensors were saved in HBM and
# when they were offloaded (the offload itself changed nothing); float32 8.1e-4 under the GPU's default TF32
# matmuls, hence float32 runs at "highest" matmul precision here. A wrong-offset offload bug gives O(1).
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}


def _loss_and_grads(setup, params, batch, model_state=None):
    import jax

    model_state = {} if model_state is None else model_state
    fn = jax.jit(lambda p, m, b: jax.value_and_grad(lambda q: setup.loss(q, m, b)[0])(p),
                 in_shardings=(setup.state_shardings["params"], setup.state_shardings["model_state"],
                               setup.batch_shardings(step=False)))  # one batch, as the first micro-batch
    return setup.compile(fn, params, model_state, batch)(params, model_state, batch)


def first_batch(cfg):
    """The run's first training batch (this process's rows): what the gate compares on."""
    import jax

    from MaxOffload import data as data_lib

    return data_lib.build(cfg, jax.process_index(), jax.process_count()).train_batch(0)


def compare(setup, batch, presets=()):
    """(reference loss, tolerance, [(label, loss, loss rel. diff, grad rel. diff, ok)]) against full remat on
    `batch` (first_batch), for the TrainSetup's own plan and `presets` on every layer."""
    import jax

    precision = jax.default_matmul_precision("highest") if setup.model_config.compute_dtype == "float32" else \
        contextlib.nullcontext()  # float32: no TF32 rounding (a GPU's default) to hide a real difference
    with precision:
        return _compare(setup, batch, presets)


def _compare(setup, host_batch, presets):
    import jax
    import jax.numpy as jnp
    import optax

    reference = setup.with_plan(setup.plan.uniform("full"))
    state = reference.init_state()
    params, model_state = state["params"], state["model_state"]
    batch = reference.put_batch(host_batch)
    ref_loss, ref_grads = _loss_and_grads(reference, params, batch, model_state)
    ref_norm = float(optax.tree.norm(ref_grads))
    tolerance = TOLERANCE[setup.model_config.compute_dtype]
    rows = []
    variants = [("this config", setup)] + [(preset, setup.with_plan(setup.plan.uniform(preset))) for preset in presets]
    for label, variant in variants:
        loss, grads = _loss_and_grads(variant, params, batch, model_state)
        loss_diff = abs(float(loss) - float(ref_loss)) / max(abs(float(ref_loss)), 1e-12)
        diff = jax.tree.map(lambda a, b: a.astype(jnp.float32) - b.astype(jnp.float32), grads, ref_grads)
        grad_diff = float(optax.tree.norm(diff)) / max(ref_norm, 1e-12)
        rows.append((label, float(loss), loss_diff, grad_diff, loss_diff <= tolerance and grad_diff <= tolerance))
    return float(ref_loss), tolerance, rows


def format_rows(ref_loss, tolerance, rows):
    lines = [f"reference (full remat): loss {ref_loss:.6f}; tolerance {tolerance:g} (relative)",
             f"  {'policy':<34} {'loss':>10} {'loss rel diff':>14} {'grad rel diff':>14}"]
    for label, loss, loss_diff, grad_diff, ok in rows:
        lines.append(f"  {label:<34} {loss:>10.6f} {loss_diff:>14.2e} {grad_diff:>14.2e}  {'ok' if ok else 'MISMATCH'}")
    return "\n".join(lines)


@tool
def main(argv):
    """Exit status; a mistake in the input prints one line (MaxOffload/cli.py)."""
    from MaxOffload import cli
    from MaxOffload.platform import pick_platform

    argv, _, flags = cli.parse(argv, __doc__, keys=(), flags=("--all_presets",))
    pick_platform()
    from MaxOffload import from_config
    from MaxOffload.config import load
    from MaxOffload.offload import planner
    from MaxOffload.offload.policy import PRESETS

    cfg = load(argv)
    setup = from_config.train_setup(cfg, plan=planner.plan_for(cfg))  # remat.policy=auto: planned for these devices
    presets = [p for p in PRESETS if p not in ("full", "custom")] if flags["--all_presets"] else []
    ref_loss, tolerance, rows = compare(setup, first_batch(cfg), presets)
    print(format_rows(ref_loss, tolerance, rows))
    bad = [r[0] for r in rows if not r[4]]
    print(f"parity FAILED for: {', '.join(bad)}" if bad else "parity holds: same loss and gradients as full remat")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

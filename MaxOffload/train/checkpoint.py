"""Orbax checkpoints of the whole train state, restored straight into the current sharding.

Layout: <run.output_dir>/checkpoints/<step>/{state, meta}. `state` is the train-state pytree
(step, params, opt_state, model_state); `meta` is JSON with what exact resume needs beyond
it (the data position: batches are a pure function of (run.seed, step)). Orbax writes each
checkpoint to a temporary directory and renames it when complete, so a process killed during
an asynchronous save leaves the previous checkpoint intact; the leftover is skipped.
"""
import os
import sys

import jax
import orbax.checkpoint as ocp

from MaxOffload.errors import ConfigError


def _warn(text):
    if jax.process_index() == 0:
        print(f"warning: {text}", file=sys.stderr, flush=True)


def _quiet_closed_loop(kind, value, tb, _default=sys.excepthook):
    """sys.excepthook while restoring: when Orbax gives up on a damaged checkpoint, reads still in flight
    complete on tensorstore's threads and call back into the asyncio loop Orbax has already closed; Python
    prints that RuntimeError through sys.excepthook. It says nothing about the checkpoint (the restore's own
    exception does, in one line), so it is dropped; everything else goes to the default hook."""
    if kind is RuntimeError and str(value) == "Event loop is closed":
        return
    _default(kind, value, tb)


def _restore_args(setup):
    """The state's shapes with the CURRENT shardings: Orbax reshards whatever mesh saved it."""
    target = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                          setup.abstract_state, setup.state_shardings)
    return ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())


class Checkpointer:
    def __init__(self, cfg, setup):
        self.cfg, self.setup = cfg, setup
        self.directory = os.path.abspath(os.path.join(cfg.run.output_dir, "checkpoints"))
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.checkpoint.keep, enable_async_checkpointing=True,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step, state, meta):
        """Starts an asynchronous save of `state` at `step` (returns before the bytes are written)."""
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

    def wait(self):
        self.manager.wait_until_finished()

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()

    def restore_latest(self):
        """(state, meta) of the newest readable checkpoint, or None when there is none."""
        for name in sorted(os.listdir(self.directory)) if os.path.isdir(self.directory) else ():
            if "tmp" in name:
                _warn(f"skipping incomplete checkpoint {os.path.join(self.directory, name)} (a save was interrupted)")
        steps = sorted(self.manager.all_steps(), reverse=True)
        sys.excepthook = _quiet_closed_loop  # kept for the process: the stray callbacks can come at any time
        for i, step in enumerate(steps):
            try:
                restored = self.manager.restore(step, args=_restore_args(self.setup))
                return restored.state, dict(restored.meta)
            except Exception as e:  # unreadable: say which, and what to do
                path = os.path.join(self.directory, str(step))
                reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
                older = steps[i + 1] if i + 1 < len(steps) else None
                if not self.cfg.checkpoint.fallback_to_previous or older is None:
                    hint = (f"; set checkpoint.fallback_to_previous=true to resume from step {older}" if older is not None
                            else "; delete it or choose another run.output_dir")
                    raise ConfigError(f"checkpoint {path} is corrupted or unreadable ({reason}){hint}") from None
                _warn(f"checkpoint {path} is unreadable ({reason}); falling back to step {older}")
        return None


def load_params(path, setup):
    """Parameters from another run's checkpoint: a run directory, its checkpoints/ or one step directory."""
    candidates = [path, os.path.join(path, "checkpoints")]
    for directory in candidates:
        if os.path.isdir(os.path.join(directory, "state")):  # a step directory
            directory, step = os.path.dirname(os.path.abspath(directory)), int(os.path.basename(directory))
        elif os.path.isdir(directory) and any(n.isdigit() for n in os.listdir(directory)):
            step = None
        else:
            continue
        manager = ocp.CheckpointManager(os.path.abspath(directory))
        step = step if step is not None else manager.latest_step()
        try:
            restored = manager.restore(step, args=_restore_args(setup))
        except Exception as e:
            raise ConfigError(f"checkpoint.load_params_from={path}: cannot restore step {step} "
                              f"({type(e).__name__}); it must come from the same model and optimizer") from None
        finally:
            manager.close()  # its threads must not outlive the run (or the one-line error)
        return restored.state["params"], step
    raise ConfigError(f"checkpoint.load_params_from={path}: no checkpoint there; give a run directory, its "
                      "checkpoints/ directory or one step directory")

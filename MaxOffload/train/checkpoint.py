"""Orbax checkpoints of the whole train state, restored straight into the current sharding.

Layout: <run.output_dir>/checkpoints/<step>/{state, meta, integrity.process_<i>.json}. `state` is the
train-state pytree (step, params, opt_state, model_state); `meta` is JSON with what exact resume needs beyond
it (the data position: batches are a pure function of (run.seed, step)); the integrity manifests (see
integrity.py) let a restore find damage or another model before Orbax reads the arrays. Orbax writes each
checkpoint to a temporary directory and renames it when complete, so a process killed during an asynchronous
save leaves the previous checkpoint intact; the leftover is skipped.
"""
import errno
import json
import logging
import math
import os
import shutil
import sys

import jax
import orbax.checkpoint as ocp

from MaxOffload.errors import ConfigError
from MaxOffload.reports import gib
from MaxOffload.train import integrity


LAYER_ORDER = "layer_order"  # meta: the pipelined stack's stored order (train/step.TrainSetup.layer_order), if not the model's


def _warn(text):
    if jax.process_index() == 0:
        print(f"warning: {text}", file=sys.stderr, flush=True)


def _targets(setup):
    """The state's shapes with the CURRENT shardings: Orbax reshards whatever mesh saved it."""
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                        setup.abstract_state, setup.state_shardings)


def _restore_args(setup):
    return ocp.args.Composite(state=ocp.args.StandardRestore(_targets(setup)), meta=ocp.args.JsonRestore())


def _weights_item(tree):
    """The model's weights in a train-state-shaped tree: its parameters and model state (router biases; left
    out when the model has none)."""
    return {key: tree[key] for key in ("params", "model_state") if jax.tree.leaves(tree[key])}


def _weights_restore_args(setup):
    """The weights alone: the rest of the saved state (another optimizer's, say) is not read."""
    item = _weights_item(_targets(setup))
    return ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))


def _verify(step_dir, structure, partial=False):
    """integrity.verify on this process (raises Renamed / Damaged / Mismatch); an unverifiable checkpoint is a
    warning."""
    unverified = integrity.verify(step_dir, structure, jax.process_index(), jax.process_count(), partial)
    if unverified:
        _warn(f"checkpoint {step_dir} is restored unverified: {unverified}")


def _mismatch(path, error, output_dir):
    """The one line for a sound checkpoint of another model or optimizer: what differs and the ways on."""
    resume = "resume it with the config it was saved with (the run's config.json)"
    if error.params_match:
        return (f"checkpoint {path} holds this model's parameters but another optimizer state ({error}); {resume}, "
                f"or start a new run from its weights: a new run.output_dir with checkpoint.load_params_from={output_dir}")
    kind = "another model" if error.params_match is False else "another model or optimizer"
    return f"checkpoint {path} was saved for {kind}: {error}; {resume}, or choose a new run.output_dir"


def _first_line(error, limit):
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else ""


def _tree_bytes(path):
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def _out_of_space(error):
    text = str(error)
    return (getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in text
            or f"os_error_code='{errno.ENOSPC}'" in text)


class _OrbaxErrors(logging.Filter):
    """Holds back the ERROR records (with tracebacks) Orbax's threads log for a failed save, which
    wait_until_finished raises again: Checkpointer.wait turns that into one line. Records held back when no
    error is raised are shown after all (`release`)."""

    def __init__(self):
        super().__init__()
        self.held = []

    def filter(self, record):
        if record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname:
            self.held.append(record)
            return False
        return True

    def release(self, logger):
        held, self.held = self.held, []
        for record in held:
            logger.handle(record)


class _FailedSaveTasks(logging.Filter):
    """After a failed save: asyncio's "Task exception was never retrieved" for the save's own write tasks (it
    logs them when they are garbage-collected, as the process ends after the one-line error)."""

    def __init__(self, directory):
        super().__init__()
        self.directory = directory

    def filter(self, record):
        return not ("never retrieved" in record.getMessage() and self.directory in record.getMessage())


def _quiet_closed_loop_callbacks():
    """Installs, once per process, a sys.unraisablehook without the 'Event loop is closed' of tensorstore
    callbacks that outlive a failed save. It must be in place before any save: the save thread's event loop
    closes, and those callbacks fire, before the main thread learns that the save failed."""
    hook = sys.unraisablehook
    if getattr(hook, "quiets_closed_loops", False):
        return

    def quiet(unraisable):
        if not (isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value)):
            hook(unraisable)
    quiet.quiets_closed_loops = True
    sys.unraisablehook = quiet


class Checkpointer:
    def __init__(self, cfg, setup):
        self.cfg, self.setup = cfg, setup
        self.directory = os.path.abspath(os.path.join(cfg.run.output_dir, "checkpoints"))
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.checkpoint.keep, enable_async_checkpointing=True,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self.structure = integrity.structure(setup.abstract_state)
        self.unsealed = None  # the step whose save may still be in flight, its manifest not yet written
        self.damaged = set()  # steps found damaged by restore_latest: the run replaces them when it gets there
        self.failed = False  # a save failed: its error was raised once, close() only releases the threads
        self.orbax_errors = _OrbaxErrors()
        logging.getLogger("absl").addFilter(self.orbax_errors)
        _quiet_closed_loop_callbacks()

    def has(self, step):
        """Whether a sound checkpoint of `step` exists (a damaged one is to be replaced)."""
        return step in self.manager.all_steps() and step not in self.damaged

    def save(self, step, state, meta):
        """Starts an asynchronous save of `state` at `step` (returns before the bytes are written)."""
        self.wait()  # Orbax would wait for the previous save here anyway; its manifest is written first
        if step in self.damaged:
            self.manager.delete(step)  # re-trained from an older checkpoint: the sound state replaces it
            self.damaged.discard(step)
        order = self.setup.layer_order()  # a pipeline's stored layer order: another schedule's resume reorders
        meta = meta if order is None else {**meta, LAYER_ORDER: [int(i) for i in order]}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)
        self.unsealed = step

    def seal_finished(self):
        """Writes the manifest of the save in flight once it has finished (a check a step, no waiting): a run killed
        before its next save then resumes from a verified checkpoint, not an unverified one."""
        if self.unsealed is not None and not self.manager.is_saving_in_progress():
            self.wait()  # finished: returns at once, after the manifest (or raising the save's error)

    def wait(self):
        """Waits for the save in flight, then writes its integrity manifest; a failed save is a ConfigError (one
        line: the directory, and for a full disk the space needed); the checkpoints before it stay as they are."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            step, self.unsealed, self.failed = self.unsealed, None, True
            self.orbax_errors.held.clear()  # they are about this error
            logging.getLogger("asyncio").addFilter(_FailedSaveTasks(self.directory))
            raise self._save_failed(step, e) from None
        self.orbax_errors.release(logging.getLogger("absl"))
        if self.unsealed is not None:
            step_dir = os.path.join(self.directory, str(self.unsealed))
            if os.path.isdir(step_dir):  # absent if Orbax's garbage collection already removed it
                integrity.seal(step_dir, jax.process_index(), jax.process_count(), self.structure)
            self.unsealed = None

    def _save_failed(self, step, error):
        if jax.process_index() == 0:  # the partial write is of no use; removing it gives its space back
            for name in os.listdir(self.directory):
                if name.startswith(f"{step}.") and "tmp" in name:
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        sound = sorted(s for s in self.manager.all_steps() if s != step)
        resume = f"a rerun resumes from step {sound[-1]}" if sound else "a rerun starts from step 0"
        if _out_of_space(error):
            need = (_tree_bytes(os.path.join(self.directory, str(sound[-1]))) if sound else
                    sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(self.setup.abstract_state)))
            free = shutil.disk_usage(self.directory).free
            keep = self.cfg.checkpoint.keep
            return ConfigError(f"checkpoint of step {step} not saved: {self.directory} is out of space "
                               f"({gib(free)} free, a checkpoint needs about {gib(need)}; checkpoint.keep={keep} "
                               f"holds up to {keep} plus the one being written); free at least "
                               f"{gib(max(need - free, 0))} there, then rerun: {resume}")
        return ConfigError(f"checkpoint of step {step} not saved in {self.directory} ({type(error).__name__}: "
                           f"{_first_line(error, 300)}); {resume}")

    def close(self):
        try:
            if not self.failed:
                self.wait()
        finally:
            try:
                self.manager.close()
            except Exception:
                if not self.failed:  # after a failed save Orbax re-raises it here: it was reported once
                    raise
            logging.getLogger("absl").removeFilter(self.orbax_errors)

    def restore_latest(self):
        """(state, meta) of the newest readable checkpoint, or None when there is none."""
        for name in sorted(os.listdir(self.directory)) if os.path.isdir(self.directory) else ():
            if "tmp" in name:
                _warn(f"skipping incomplete checkpoint {os.path.join(self.directory, name)} (a save was interrupted)")
        steps = sorted(self.manager.all_steps(), reverse=True)
        for i, step in enumerate(steps):
            path = os.path.join(self.directory, str(step))
            try:
                _verify(path, self.structure)
                restored = self.manager.restore(step, args=_restore_args(self.setup))
                meta = dict(restored.meta)
                return self.setup.reorder(restored.state, meta.get(LAYER_ORDER)), meta
            except integrity.Mismatch as e:  # intact, but another model or optimizer: not a reason to fall back
                raise ConfigError(_mismatch(path, e, self.cfg.run.output_dir)) from None
            except integrity.Renamed as e:  # another step's state: resuming it would mislabel the run
                raise ConfigError(e.line(path)) from None
            except Exception as e:  # damaged or unreadable: say which, and what to do
                text = _first_line(e, 200)
                reason = text if isinstance(e, integrity.Damaged) else f"{type(e).__name__}: {text}"
                older = steps[i + 1] if i + 1 < len(steps) else None
                if not self.cfg.checkpoint.fallback_to_previous or older is None:
                    hint = (f"; set checkpoint.fallback_to_previous=true to resume from step {older}" if older is not None
                            else "; move it out of checkpoints/ to start afresh, or choose another run.output_dir")
                    raise ConfigError(f"checkpoint {path} is corrupted or unreadable ({reason}){hint}") from None
                _warn(f"checkpoint {path} is unreadable ({reason}); falling back to step {older} "
                      f"(step {step} is replaced when the run saves it again)")
                self.damaged.add(step)
        return None


def load_params(path, setup):
    """({"params": ..., "model_state": ...}, step): the weights of another run's checkpoint, or of one
    `python -m MaxOffload.convert from-hf` wrote: a run directory, its checkpoints/ or one step directory."""
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
        step_dir = os.path.join(os.path.abspath(directory), str(step))
        try:
            _verify(step_dir, integrity.structure(_weights_item(setup.abstract_state)), partial=True)
            restored = manager.restore(step, args=_weights_restore_args(setup))
            saved_order = _saved_meta(step_dir).get(LAYER_ORDER)
        except integrity.Mismatch as e:
            raise ConfigError(f"checkpoint.load_params_from={path}: the parameters of step {step} are not this "
                              f"model's ({e}); it must come from a run of the same model") from None
        except integrity.Damaged as e:
            raise ConfigError(f"checkpoint.load_params_from={path}: step {step} is corrupted ({e})") from None
        except integrity.Renamed as e:
            raise ConfigError(f"checkpoint.load_params_from={path}: {e.line(step_dir)}") from None
        except Exception as e:
            raise ConfigError(f"checkpoint.load_params_from={path}: cannot restore the parameters of step {step} "
                              f"({type(e).__name__}); it must come from a run of the same model") from None
        finally:
            manager.close()  # its threads must not outlive the run (or the one-line error)
        return setup.reorder({"model_state": {}, **restored.state}, saved_order), step
    raise ConfigError(f"checkpoint.load_params_from={path}: no checkpoint there; give a run directory, its "
                      "checkpoints/ directory or one step directory")


def _saved_meta(step_dir):
    """A step directory's meta JSON ({} where there is none: a converted checkpoint has no training position)."""
    path = os.path.join(step_dir, "meta", "metadata")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


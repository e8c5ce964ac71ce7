"""The errors a run or a tool stops on, and the exit status each one means.

A leaf module: it imports nothing from the package and no JAX, so every layer (config, mesh, checkpoint,
data, planner, the command-line tools) can raise these without import cycles.

  exit 2  the input is wrong (ConfigError and its kinds): one line naming the problem and the fix;
          nothing was changed.
  exit 130/143  a tool was interrupted (Ctrl-C / SIGTERM: Interrupted); one line says what it left.
  exit 1  the run stopped on what it found (ParityError, NonFiniteError; parallel/rollcall.py's one line when a
          multi-process job never assembles).
"""


class ConfigError(Exception):
    """Bad input — a key, file, option or environment setting: one line naming it and the fix (exit 2)."""


class PlanError(ConfigError):
    """remat.policy=auto found no plan within the budget; the message says what the least-HBM plan needs."""


class ParityError(Exception):
    """The configured remat/offload policy changes the loss or gradients beyond tolerance (exit 1)."""


class NonFiniteError(Exception):
    """Training stopped on a non-finite loss or gradient (train.on_nonfinite=stop; exit 1)."""


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM stopped a tool: exit 128 + the signal's number, `note` saying what was kept."""

    def __init__(self, signum=2, note=""):
        super().__init__(signum, note)
        self.signum, self.note = signum, note


def suggest(word, choices):
    """' (did you mean X?)' for the closest of `choices`, or ''."""
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def require(ok, message):
    """Raises ConfigError(message) unless `ok`: the validators' one-line check."""
    if not ok:
        raise ConfigError(message)


def require_choice(key, value, choices):
    require(value in choices, f"{key}={value!r} is not one of {', '.join(choices)}{suggest(value, choices)}")


EXIT_CODES = ((ConfigError, 2), (ParityError, 1), (NonFiniteError, 1))


def exit_code(error):
    """The exit status for `error`, or None when it is not one of ours (a bug: let its traceback show)."""
    for kind, code in EXIT_CODES:
        if isinstance(error, kind):
            return code
    return None

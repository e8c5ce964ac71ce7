"""The command line every tool shares: `CONFIG.py[:ARG] [key=value ...] [--option VALUE | --flag ...]`.

- `--help` / `-h` prints the tool's own documentation (its module docstring) and exits 0.
- Options that set a config key are that key, spelled the same in every tool: `--target X` is
  `aot.target=X`, `--topology T` is `aot.topology=T` and `--output_dir D` is `run.output_dir=D`. Each is
  rewritten in place into its override, so when a key is given twice the last one on the command line wins,
  as for any repeated `key=value`.
- A tool's own options (`--rounds 3`, `--no_confirm`) are declared by the tool; any other `--name` is an
  error naming the options the tool takes. An option whose default is an int takes a whole number >= 1.
- `@tool` on a tool's main (or `run(main)`) turns the errors of MaxOffload.errors into one line on stderr and their exit status.
- A tool that keeps argparse builds `ArgumentParser`: its mistakes are ConfigErrors too (one line, exit 2).
"""
import argparse
import functools
import math
import signal
import sys

from MaxOffload.errors import ConfigError, exit_code

KEY_OPTIONS = {"--target": "aot.target", "--topology": "aot.topology", "--output_dir": "run.output_dir"}
TARGET_KEYS = tuple(KEY_OPTIONS)  # the tools that compile for a GPU target take all three


def parse(argv, doc, keys=("--output_dir",), options=None, flags=()):
    """-> (argv for config.load, {option: value}, {flag: bool}).

    keys: the KEY_OPTIONS this tool takes; options: {name: default} of its own valued options (an int default:
    the value is a whole number >= 1, returned as int); flags: its own boolean flags. Raises ConfigError for an
    unknown option, one without its value or a bad whole number."""
    options = dict(options or {})
    if any(a in ("-h", "--help") for a in argv):
        print(doc.strip())
        raise SystemExit(0)
    known = sorted([*keys, *options, *flags])
    rest, values, seen = [], dict(options), set()
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if arg in flags:
            seen.add(arg)
        elif name in keys or name in options:
            if not eq:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ConfigError(f"{name} needs a value: {name} VALUE or {name}=VALUE")
                i, value = i + 1, argv[i + 1]
            if not value:
                raise ConfigError(f"{name} needs a non-empty value")
            if name in keys:
                rest.append(f"{KEY_OPTIONS[name]}={value}")
            else:
                values[name] = value
        elif arg.startswith("--") and not arg.startswith("--config."):
            takes = f"this tool takes {', '.join(known)}" if known else "this tool takes no options"
            raise ConfigError(f"unknown option {name}: {takes} (and key=value overrides); see --help")
        else:
            rest.append(arg)
        i += 1
    for name, default in options.items():
        if isinstance(default, int) and not isinstance(default, bool):
            values[name] = whole_number(name, values[name])
    return rest, values, {f: f in seen for f in flags}


MAX_WHOLE = 2**31 - 1  # beyond any count a tool takes (as config/validate.py bounds the config's integers)


def whole_number(name, text, minimum=1):
    """`text` (an option's value) as an int in [minimum, MAX_WHOLE]; ConfigError naming `name` otherwise."""
    try:
        value = int(str(text).replace("_", ""))
    except ValueError:
        value = None
    if value is None or not minimum <= value <= MAX_WHOLE:
        raise ConfigError(f"{name} takes a whole number from {minimum} to {MAX_WHOLE:,}, got {text!r}")
    return value


def number(text):
    """argparse `type=` for a finite number: nan and inf are mistakes."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the tools that keep it: a mistake is a ConfigError (one line naming `prog --help`, exit 2
    through `tool`/`run`), never the usage block."""

    def error(self, message):
        raise ConfigError(f"{message} ({self.prog} --help)")


def tool(main):
    """Decorates a tool's `main(argv)`: its errors of MaxOffload.errors become one line and their status."""
    @functools.wraps(main)
    def wrapped(argv):
        return run(main, argv)

    return wrapped


def run(main, argv=None):
    """main(argv) -> exit status; our errors become `error: <one line>` on stderr and their status."""
    try:
        return main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt as e:
        signum, note = getattr(e, "signum", 2), getattr(e, "note", "")
        print(f"interrupted by {signal.Signals(signum).name}{'; ' + note if note else ''}", file=sys.stderr)
        return 128 + signum
    except Exception as e:  # noqa: BLE001 - only our own kinds are mapped; anything else is re-raised
        code = exit_code(e)
        if code is None:
            raise
        print(f"error: {e}", file=sys.stderr)
        return code

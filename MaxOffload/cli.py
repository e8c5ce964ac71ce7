"""The command line every tool shares: `CONFIG.py[:ARG] [key=value ...] [--option VALUE | --flag ...]`.

- `--help` / `-h` prints the tool's own documentation (its module docstring) and exits 0.
- Options that set a config key are that key, spelled the same in every tool: `--target X` is
  `aot.target=X`, `--topology T` is `aot.topology=T` and `--output_dir D` is `run.output_dir=D`. Each is
  rewritten in place into its override, so when a key is given twice the last one on the command line wins,
  as for any repeated `key=value`.
- A tool's own options (`--rounds 3`, `--no_confirm`) are declared by the tool; any other `--name` is an
  error naming the options the tool takes.
- `@tool` on a tool's main (or `run(main)`) turns the errors of MaxOffload.errors into one line on stderr and their exit status.
"""
import functools
import signal
import sys

from MaxOffload.errors import ConfigError, exit_code

KEY_OPTIONS = {"--target": "aot.target", "--topology": "aot.topology", "--output_dir": "run.output_dir"}
TARGET_KEYS = tuple(KEY_OPTIONS)  # the tools that compile for a GPU target take all three


def parse(argv, doc, keys=("--output_dir",), options=None, flags=()):
    """-> (argv for config.load, {option: value}, {flag: bool}).

    keys: the KEY_OPTIONS this tool takes; options: {name: default} of its own valued options; flags: its own
    boolean flags. Raises ConfigError for an unknown option or one without its value."""
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
    return rest, values, {f: f in seen for f in flags}


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

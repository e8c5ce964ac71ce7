"""Reading a JSON file back: whatever is wrong with it is one line.

The project reads back the JSON it wrote (a run's config.json, a checkpoint's manifests and metadata, the aot
report, from-hf's hf_config.json, its caches) and JSON a user hands it (a Hugging Face config.json). A crash or a
full disk cuts such a file short, a hand edit changes a type, a copy goes wrong: `read_json` turns every such
file (unreadable, not UTF-8, not JSON, a key the caller relies on missing or of another type) into
`Unreadable`, a ConfigError of one line "PATH: what is wrong; how to put it right" (exit 2), before the
caller uses a byte of it.

A shape says what the caller relies on:
  a JSON type: dict, list, str, int, float, bool, or a union (`int | float` any number; `X | None` also null,
      and as an object's key: the key may be absent);
  {key: shape}: an object holding those keys (others may be there too);
  (test, "what it should be"): any other check, test(value) -> bool (test(None) true: the key may be absent);
      `COUNT`, `optional(shape)` and `every(kind, item, want)` make the common ones.
"""
import json

from MaxOffload.errors import ConfigError

_NAMES = {dict: "an object", list: "an array", str: "a string", int: "an integer", float: "a number",
          bool: "true or false", type(None): "null"}


class Unreadable(ConfigError):
    """A JSON file that is not what its reader relies on: `path` and `problem` (a phrase), for a caller that
    words its own line (a damaged checkpoint, a cache it recomputes)."""

    def __init__(self, path, problem, fix=""):
        super().__init__(f"{path}: {problem}" + (f"; {fix}" if fix else ""))
        self.path, self.problem = path, problem


def is_a(value, kind):
    """`value` is of the JSON type `kind` (a type or a union); true and false are numbers only where `kind`
    names bool."""
    return isinstance(value, kind) and not (isinstance(value, bool) and bool not in getattr(kind, "__args__", (kind,)))


def is_count(value):
    """A whole number >= 0 (a size, an offset, a step; true and false are not)."""
    return is_a(value, int) and value >= 0


COUNT = is_count, "a whole number >= 0"


def optional(shape):
    """`shape` or null; as an object's key, one that may be absent."""
    test, want = _check(shape)
    return (lambda value: value is None or test(value)), want


def every(kind, item, want=""):
    """(test, `want`) for a `kind` (dict or list) whose every value is of the shape `item` (not an object's)."""
    test = _check(item)[0]
    return (lambda value: isinstance(value, kind) and all(map(test, value.values() if kind is dict else value))), want


def _check(shape):
    """(test, what it should be) of a shape that is not an object's."""
    if isinstance(shape, tuple):
        return shape
    kinds = getattr(shape, "__args__", (shape,))
    names = [_NAMES[k] for k in kinds if k is not type(None) and not (k is int and float in kinds)]
    return (lambda value: is_a(value, shape)), " or ".join(names)


def _got(value):
    if isinstance(value, (dict, list)):
        return _NAMES[type(value)]
    text = json.dumps(value)[:40]
    return text if value is None or isinstance(value, bool) else f"{_NAMES[type(value)]} ({text})"


def problem(value, shape, where=""):
    """What is wrong with `value` as `shape` (one phrase naming the key), or None."""
    subject = f"'{where}'" if where else "the file"
    if not isinstance(shape, dict):
        test, want = _check(shape)
        return None if test(value) else f"{subject} should be {want}, got {_got(value)}"
    if not isinstance(value, dict):
        return f"{subject} should be an object, got {_got(value)}"
    for key, inner in shape.items():
        name = f"{where}.{key}" if where else key
        if key in value:
            found = problem(value[key], inner, name)
            if found:
                return found
        elif isinstance(inner, dict) or not _check(inner)[0](None):
            return f"missing key '{name}'"
    return None


def read_json(path, fix, shape=None, missing_ok=False):
    """The parsed JSON of `path`, checked against `shape` (see the module docstring; None: any JSON); raises
    Unreadable ("PATH: what is wrong; `fix`") when it cannot be. missing_ok: a file that is not there is None."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise Unreadable(path, "missing", fix) from None
    except OSError as e:
        raise Unreadable(path, f"cannot be read ({e.strerror or e})", fix) from None
    except UnicodeDecodeError:
        raise Unreadable(path, "not UTF-8 text, so not JSON", fix) from None
    except ValueError as e:  # json.JSONDecodeError: cut short, or not JSON at all
        raise Unreadable(path, f"not valid JSON ({str(e).splitlines()[0][:120]})", fix) from None
    except RecursionError:
        raise Unreadable(path, "not JSON this reader can take (nested too deeply)", fix) from None
    found = problem(value, shape) if shape is not None else None
    if found:
        raise Unreadable(path, found, fix)
    return value

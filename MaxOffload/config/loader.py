"""Command line -> validated ConfigDict: `CONFIG.py[:ARG] [a.b=value | --config.a.b=value ...]`.

Every problem raises ConfigError with one line that names the key or file and the fix;
the entry points turn it into a message on stderr and exit status 2.
"""
import ast
import difflib
import importlib.util
import os
import re

import ml_collections

from MaxOffload.config.defaults import flat_keys, get_path
from MaxOffload.errors import ConfigError, suggest


def load_file(spec):
    """Runs get_config([ARG]) of `path[:ARG]`."""
    path, _, arg = spec.partition(":")
    if not path.endswith(".py"):
        raise ConfigError(f"config {path!r} is not a Python file; pass a file such as configs/quickstart.py")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} not found; check the path (configs/ lists the recipes)")
    module_spec = importlib.util.spec_from_file_location("maxoffload_user_config", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file: report, don't dump our stack
        raise ConfigError(f"config file {path} failed to load: {type(e).__name__}: {e}") from None
    if not callable(getattr(module, "get_config", None)):
        raise ConfigError(f"config file {path} defines no get_config(); add one that returns a ConfigDict")
    call = f"get_config({arg!r})" if arg else "get_config()"
    try:
        cfg = module.get_config(arg) if arg else module.get_config()
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{path}: {_explain(e)}" if _locked_key(e) else
                          f"{path}: {call} failed: {type(e).__name__}: {_first_line(e)}") from None
    if not isinstance(cfg, ml_collections.ConfigDict):
        raise ConfigError(f"{path}: get_config() returned {type(cfg).__name__}; return a ConfigDict "
                          "(start from MaxOffload.config.defaults.get_config())")
    return cfg


def _root_cause(e):
    while e.args and isinstance(e.args[0], BaseException):  # ml_collections wraps KeyError in AttributeError
        e = e.args[0]
    return e


def _first_line(e):
    text = str(_root_cause(e).args[0] if _root_cause(e).args else e).strip()
    return text.splitlines()[0] if text else ""


def _locked_key(e):
    """The key a config file tried to add to the locked defaults, or None."""
    match = re.match(r'Key "([^"]+)" does not exist and cannot be added', _first_line(e))
    return match.group(1) if match else None


def _explain(e):
    from MaxOffload.config.defaults import get_config

    leaf = _locked_key(e)
    known = flat_keys(get_config())
    close = difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in known], n=1, cutoff=0.6)
    hint = f" (did you mean {[k for k in known if k.endswith('.' + close[0])][0]}?)" if close else ""
    return f"sets unknown config key {leaf!r}{hint}; `python train.py --help` lists all keys"


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def parse_value(key, text, current, field_type):
    """Parses `text` to the type of the field `key` (whose value is `current`)."""
    if text.lower() in ("none", "null") and current is None:
        return None  # a placeholder field
    if text.lower() in ("none", "null") and field_type is not str:
        raise ConfigError(f"{key} cannot be None; give a {field_type.__name__} value")
    if field_type is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(f"{key} expects true or false, got {text!r}")
    if field_type is int:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            raise ConfigError(f"{key} expects an integer, got {text!r}") from None
    if field_type is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{key} expects a number, got {text!r}") from None
    if field_type in (list, tuple):
        body = text
        if text.startswith(("[", "(")):
            try:
                return field_type(ast.literal_eval(text))
            except (ValueError, SyntaxError):  # unquoted items: [a.txt,b.txt]
                if not text.endswith(("]", ")")):
                    raise ConfigError(f"{key} expects a list such as [a,b] or a,b; could not parse {text!r}") from None
                body = text[1:-1]
        return field_type(item.strip() for item in body.split(",") if item.strip())
    return text


def _ensure_group(cfg, key):
    """`remat.groups.NAME.*` creates the group NAME on first use."""
    from MaxOffload.config.defaults import layer_group

    parts = key.split(".")
    if len(parts) >= 4 and parts[:2] == ["remat", "groups"] and parts[2] not in cfg.remat.groups:
        if not parts[2].isidentifier():
            raise ConfigError(f"{key}: group name {parts[2]!r} must be an identifier (letters, digits, _)")
        with cfg.remat.groups.unlocked():
            cfg.remat.groups[parts[2]] = layer_group("")


def apply_override(cfg, key, text):
    _ensure_group(cfg, key)
    known = flat_keys(cfg)
    if key not in known:
        raise ConfigError(f"unknown config key {key!r}{suggest(key, known)}; `python train.py --help` lists all keys")
    *parents, leaf = key.split(".")
    node = cfg
    for part in parents:
        node = node[part]
    field_type = node.get_type(leaf)
    value = parse_value(key, text, node[leaf], field_type)
    try:
        node[leaf] = value
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}: cannot set {text!r}: {e}") from None


def split_overrides(args):
    """['a.b=1', '--config.c=2', '--config.d', '3'] -> [('a.b', '1'), ('c', '2'), ('d', '3')]."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--config."):
            body = arg[len("--config."):]
            if "=" not in body:
                if i + 1 >= len(args):
                    raise ConfigError(f"{arg} has no value; write {arg}=VALUE")
                body = f"{body}={args[i + 1]}"
                i += 1
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r}; overrides look like model.num_layers=8 "
                              "or --config.model.num_layers=8")
        else:
            body = arg
        key, eq, value = body.partition("=")
        if not eq or not key:
            raise ConfigError(f"override {arg!r} is not KEY=VALUE; write e.g. train.steps=100")
        pairs.append((key.strip(), value.strip()))
        i += 1
    return pairs


def load(argv):
    """argv (without the program name) -> validated, locked ConfigDict."""
    from MaxOffload.config.defaults import reset_remat
    from MaxOffload.config.validate import validate

    if not argv:
        raise ConfigError("no config given; run e.g. `python train.py configs/quickstart.py`")
    if argv[0].startswith("-") and not argv[0].startswith("--config="):
        raise ConfigError(f"the first argument must be a config file, got {argv[0]!r}")
    spec = argv[0][len("--config="):] if argv[0].startswith("--config=") else argv[0]
    cfg = load_file(spec)
    overrides = split_overrides(argv[1:])
    if ("remat.policy", "auto") in overrides:
        # auto on the command line replaces the file's hand-tuned remat recipe (its per-tensor settings and
        # layer groups); remat.tensors.NAME given on the command line are pins the planner keeps
        reset_remat(cfg, "auto")
    for key, value in overrides:
        apply_override(cfg, key, value)
    validate(cfg)
    cfg.lock()
    return cfg


def describe(cfg):
    """The resolved config, one line per section (empty per-tensor settings left out)."""
    lines = []
    for section, values in cfg.items():
        items = []
        for key in flat_keys(values):
            value = get_path(values, key)
            if ".tensors." in f".{key}" and value == "":
                continue
            items.append(f"{key}={','.join(map(str, value)) if isinstance(value, (list, tuple)) else value}")
        lines.append(f"  {section}: " + " ".join(items))
    return "\n".join(lines)

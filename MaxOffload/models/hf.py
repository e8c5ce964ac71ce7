"""The Hugging Face layout of a family's weights: the vocabulary each family's mapping is written in
(models/llama_hf.py, models/deepseek_hf.py; the registry carries it as Family.hf), read by
MaxOffload/convert in both directions.

A family's `HFFormat` says
  - which `architectures` of a config.json it reads;
  - `model_keys(hf_config)`: the `model` section keys a config.json sets (a field this project cannot honour is a
    ConfigError: one line naming it);
  - `config_json(model_config)`: the config.json of an export;
  - `groups(model_config)`: the weights as Groups of Rules.

The weights are the train state's "params" and "model_state" (non-Param variables such as DeepSeek's router
bias). A Group is one of the model's stacks (its parameters stacked on a leading layers axis) or the top level;
each of its Rules turns a few Hugging Face tensors of one layer into a few of the group's arrays (one layer's
slice of them) and back. Rules work on numpy float32 arrays, one layer at a time: conversion never holds more
than one layer's tensors.
"""
import dataclasses
import math
from typing import Callable

import numpy as np

from MaxOffload.errors import ConfigError

PARAMS, STATE = "params", "model_state"


def P(path):
    """A parameter's path below its group: P("attention.wq")."""
    return (PARAMS, *path.split("."))


def S(path):
    """A model-state variable's path below its group: S("mlp.router_bias")."""
    return (STATE, *path.split("."))


@dataclasses.dataclass(frozen=True)
class Rule:
    """ours: paths below the group (P/S); theirs: Hugging Face names below the layer's prefix;
    load(*their arrays, shapes=(our slices' shapes)) -> our slices; save(*our slices) -> their arrays."""
    ours: tuple
    theirs: tuple
    load: Callable
    save: Callable


@dataclasses.dataclass(frozen=True)
class Group:
    """stack: the stack's key in the weights (None: the top level); layers: the Hugging Face layer index of
    each of the stack's layers, in order (the top level: ()); prefix: the Hugging Face name prefix of a layer,
    formatted with its index; copies: Rules whose paths are absolute (top-level weights) that an export writes
    again per layer and an import skips (DeepSeek's MTP layer stores the shared embedding and head); hint: what
    to do when the checkpoint lacks this group's tensors."""
    stack: str | None
    layers: tuple
    prefix: str
    rules: tuple
    copies: tuple = ()
    hint: str = ""

    def path(self, rule_path):
        """The absolute path in the weights of one of this group's rule paths."""
        collection, *rest = rule_path
        return (collection, self.stack, *rest) if self.stack else (collection, *rest)

    def names(self, rule, layer):
        """The Hugging Face names of `rule`'s tensors at Hugging Face layer `layer` (None: the top level)."""
        prefix = self.prefix.format(layer) if layer is not None else self.prefix
        return [prefix + name for name in rule.theirs]


class HFFormat:
    """A family's Hugging Face layout (see the module docstring); subclassed per family."""
    architectures = ()

    def model_keys(self, hf):
        raise NotImplementedError

    def config_json(self, c):
        raise NotImplementedError

    def groups(self, c):
        raise NotImplementedError

    def mtp_layers(self, hf):
        """The multi-token-prediction layers a config.json says its checkpoint has (0: the family has none)."""
        return 0

    def skipped_note(self, c, unused):
        """What to add to the note on tensors an import left unused ('' : nothing)."""
        return ""


# --------------------------------------------------------------------------------------------
# reading a config.json


class HFConfig:
    """A config.json's fields, read with one-line errors: `get`, `expect`, `unsupported`, `rope`. Every number the
    model is built from is checked for its type and range here (a string, a list, zero heads, an infinite
    epsilon: one line naming the field), so that nothing downstream divides by it or builds from it first."""

    def __init__(self, fields, source):
        self.fields, self.source = fields, source

    def get(self, name, default=None, kind=int, minimum=1):
        """The field as `kind` (int, float or bool), at least `minimum` (numbers; None: any finite value); absent
        or null: `default` (none: a ConfigError)."""
        value = self.fields.get(name)
        if value is None:
            if default is None:
                raise ConfigError(f"{self.source}: config.json has no {name}, which this project needs to build "
                                  "the model")
            return default
        return checked(f"{self.source}: config.json's {name}", value, kind, minimum)

    def unsupported(self, name, value, supported):
        raise ConfigError(f"{self.source}: config.json has {name}={value!r}, which this project cannot train "
                          f"({supported}); convert a checkpoint of a supported variant")

    def expect(self, name, supported, default):
        """The field's value, which must be one of `supported` (absent: `default`)."""
        value = self.fields.get(name, default)
        if value not in supported:
            self.unsupported(name, value, "it supports " + " or ".join(repr(s) for s in supported))
        return value

    def rope(self):
        """(rope type, param(name, default=None, kind=float, minimum=0) reading its parameters, theta):
        transformers 5 writes `rope_parameters` (with rope_theta in it), older files `rope_scaling` +
        `rope_theta`; type "default" (or none) is plain RoPE."""
        key = "rope_parameters" if self.fields.get("rope_parameters") else "rope_scaling"
        params = self.fields.get(key) or {}
        if not isinstance(params, dict):
            raise ConfigError(f"{self.source}: config.json's {key} is a {type(params).__name__}, not an object")
        kind = params.get("rope_type", params.get("type", "default")) or "default"

        def param(name, default=None, kind=float, minimum=0):
            value = params.get(name)
            if value is None:
                if default is None:
                    raise ConfigError(f"{self.source}: config.json's {key} has no {name}, which its rope type "
                                      f"{params.get('rope_type', params.get('type'))!r} needs")
                return default
            return checked(f"{self.source}: config.json's {key}.{name}", value, kind, minimum)

        theta = param("rope_theta", minimum=1) if "rope_theta" in params else self.get("rope_theta", kind=float)
        return kind, param, theta


def checked(label, value, kind, minimum):
    """`value` as `kind` when it is one (an int is a float; a bool is neither), finite and >= `minimum`."""
    if kind is bool:
        ok = isinstance(value, bool)
    else:
        ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool) and \
            math.isfinite(value) and (minimum is None or value >= minimum)
    if not ok:
        want = {bool: "true or false", int: "an integer", float: "a finite number"}[kind]
        bound = f" >= {minimum}" if minimum is not None and kind is not bool else ""
        raise ConfigError(f"{label} is {value!r}; it must be {want}{bound}: the file is damaged or not a "
                          "model's config.json")
    return kind(value)


# --------------------------------------------------------------------------------------------
# transforms: Hugging Face linear weights are [out, in]; ours are [in..., out...]


def linear(inputs=1):
    """(load, save) of a linear layer whose first `inputs` axes of ours are its input."""
    def load(w, shapes):
        return (w.T.reshape(shapes[0]),)

    def save(x):
        return (x.reshape(int(np.prod(x.shape[:inputs])), -1).T,)

    return load, save


def same():
    """(load, save) of a tensor stored alike (norm scales, the embedding, a bias)."""
    return (lambda w, shapes: (w.reshape(shapes[0]),)), (lambda x: (x,))


def rule(ours, theirs, transform):
    """A one-to-one Rule from a path, a Hugging Face name and a (load, save) pair."""
    load, save = transform
    return Rule((ours,), (theirs,), load, save)


def stacked(ours, names, inner):
    """A Rule stacking one tensor per name (e.g. the experts of a layer) on a leading axis, each by `inner`."""
    load_one, save_one = inner

    def load(*ws, shapes):
        one = shapes[0][1:]
        return (np.stack([load_one(w, (one,))[0] for w in ws]),)

    def save(x):
        return tuple(save_one(x[i])[0] for i in range(x.shape[0]))

    return Rule((ours,), tuple(names), load, save)


def interleaved_to_halves(n):
    """The permutation taking RoPE's interleaved pairs (x0, y0, x1, y1, ...) to rotate-half order
    (x0, x1, ..., y0, y1, ...): [0, 2, 4, ..., 1, 3, 5, ...]."""
    return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])


def permute_last(x, start, perm):
    """x with its last axis's entries start.. reordered by `perm` (a copy)."""
    out = np.array(x, copy=True)
    out[..., start:] = x[..., start + perm]
    return out

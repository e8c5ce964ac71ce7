"""Hugging Face checkpoint -> this project's weights (`python -m MaxOffload.convert from-hf`).

The model's dimensions come from the checkpoint's config.json (its family's HFFormat.model_keys, applied over
the given config file and overrides); its weights are read tensor by tensor and written layer by layer
(convert/orbax_files.WeightsWriter) into <out>/checkpoints/0, with the resolved config in <out>/config.json.
`python train.py CONFIG ... checkpoint.load_params_from=<out>` starts a run from them.
"""
import math
import os
import re
import time


from MaxOffload import models
from MaxOffload.convert import staging
from MaxOffload.convert.hf_files import HF_SOURCE, SCALE_SUFFIX, HFCheckpoint
from MaxOffload.convert.orbax_files import WeightsWriter, nested
from MaxOffload.errors import ConfigError
from MaxOffload.models.hf import HFConfig
from MaxOffload.reports import gib, peak_rss, write_json
from MaxOffload.train import integrity


def _value_text(value):
    return str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, float) else str(value)


def _agrees(text, value):
    """Whether an override's text means `value` (1e-5 and 0.00001 alike)."""
    if isinstance(value, bool):
        return text.lower() == str(value).lower()
    try:
        return type(value)(text) == value
    except ValueError:
        return text == str(value)


def hf_family(hf):
    """(Family, HFConfig) of a checkpoint, by its config.json's architectures."""
    fields = HFConfig(hf.config, hf.directory)
    architectures = hf.config.get("architectures") or [hf.config.get("model_type", "(none)")]
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ConfigError(f"{hf.directory}/config.json's architectures is {architectures!r}, not a list of class "
                          "names; download or copy it again")
    family = models.by_architecture(architectures[0])
    if family is None:
        known = ", ".join(a for f in models.FAMILIES.values() if f.hf for a in f.hf.architectures)
        raise ConfigError(f"{hf.directory} holds a {architectures[0]}, an architecture this project does not "
                          f"import; it imports {known}")
    return family, fields


def merged_config(hf, config_spec, overrides):
    """(cfg, model keys from config.json): the config file + overrides, with config.json's model keys applied
    last. An override that contradicts config.json, or a config file of another family, is a ConfigError."""
    from MaxOffload.config.loader import load, load_file, split_overrides

    family, fields = hf_family(hf)
    keys = family.hf.model_keys(fields)
    base = load_file(config_spec)
    if base.model.family != keys["family"]:
        raise ConfigError(f"{config_spec} is a {base.model.family} config and {hf.directory} holds a "
                          f"{fields.fields['architectures'][0]}: give a {keys['family']} config file")
    given = dict(split_overrides(overrides))
    for key, value in keys.items():
        text = given.get(f"model.{key}")
        if text is not None and not _agrees(text, value):
            raise ConfigError(f"model.{key}={text} contradicts {hf.directory}/config.json, which makes it {value}; "
                              "leave it out (the checkpoint's dimensions come from its config.json)")
    cfg = load([config_spec, *overrides, *(f"model.{k}={_value_text(v)}" for k, v in keys.items())])
    depth, available = getattr(models.model_config(cfg.model), "mtp_depth", 0), family.hf.mtp_layers(fields)
    if depth > available:
        raise ConfigError(f"model.mtp_depth={depth}, but {hf.directory} has {available} multi-token-prediction "
                          f"layer(s) (config.json num_nextn_predict_layers); set model.mtp_depth={available}")
    differs = [f"model.{k}={_value_text(v)}" for k, v in keys.items() if base.model[k] != v]
    return cfg, family, differs


def _shape_error(hf, name, path, expected, got=None):
    where = os.path.basename(hf.tensors[name][0])
    got = f"gives {tuple(got)}" if got is not None else "does not reshape"
    return ConfigError(f"{hf.directory}: tensor {name} (shape {tuple(hf.shape(name))}, in {where}) {got} where "
                       f"{'.'.join(path)} needs {tuple(expected)}; the checkpoint does not match its config.json")


def convert(hf, cfg, family, out):
    """Writes the weights of `hf` for the model of `cfg` into out/checkpoints/0; returns (tensors read, the
    names left unused, parameters written)."""
    c = models.model_config(cfg.model)
    leaves = models.weight_leaves(c)
    groups = family.hf.groups(c)
    stacked = {group.path(p) for group in groups if group.stack for r in group.rules for p in r.ours}
    shapes = {path: (leaf.shape, leaf.dtype, path in stacked) for path, leaf in leaves.items()}
    mapped = {group.path(p) for group in groups for r in group.rules for p in r.ours}
    assert mapped == set(shapes), f"the Hugging Face layout misses {sorted(set(shapes) - mapped)[:3]}"
    # every tensor is looked up before any is converted: a missing one costs a second, not a conversion
    for group in groups:
        for layer in group.layers or (None,):
            for r in group.rules:
                for name in group.names(r, layer):
                    if name not in hf.tensors:
                        hint = f" ({group.hint})" if group.hint else ""
                        raise ConfigError(f"{hf.directory} has no tensor {name}, which {'.'.join(group.path(r.ours[0]))} "
                                          f"is made from{hint}; the checkpoint is incomplete or of another model")
    final = os.path.join(out, "checkpoints", "0")
    writer, used = WeightsWriter(final, shapes), set()
    for group in groups:
        for index, layer in enumerate(group.layers or (None,)):
            for r in group.rules:
                names = group.names(r, layer)
                paths = [group.path(p) for p in r.ours]
                expected = [shapes[p][0][1:] if shapes[p][2] else shapes[p][0] for p in paths]
                try:
                    values = r.load(*(hf.read(n) for n in names), shapes=expected)
                except ValueError:
                    raise _shape_error(hf, names[0], paths[0], expected[0]) from None
                for path, value, shape in zip(paths, values, expected):
                    if tuple(value.shape) != tuple(shape):
                        raise _shape_error(hf, names[0], path, shape, value.shape)
                    writer.write(path, value, index if shapes[path][2] else None)
                used.update(names)
            for copy in group.copies if layer is not None else ():
                used.update(group.names(copy, layer))
    writer.finish()
    integrity.seal(final, 0, 1, integrity.structure(nested(leaves)))
    used |= {n + SCALE_SUFFIX for n in used}
    params = sum(math.prod(leaf.shape) for path, leaf in leaves.items() if path[0] == "params")
    return len(used & set(hf.tensors)), sorted(set(hf.tensors) - used), params


def unused_note(names):
    """One line on the tensors a conversion left unused, by layer ('model.layers.61.*' for a whole layer)."""
    layers = sorted({int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))})
    other = [n for n in names if not re.match(r"model\.layers\.\d+\.", n)]
    parts = [f"model.layers.{i}.* " for i in layers] + other[:3] + ([f"... {len(other) - 3} more"] if len(other) > 3 else [])
    return f"{len(names)} tensor(s) not used by this model: " + ", ".join(p.strip() for p in parts)


def from_hf(hf_dir, config_spec, overrides, out, say=print):
    """The command: checks, converts, and says how to train from the result."""
    from MaxOffload.train import rundir

    started = time.time()
    hf = HFCheckpoint(hf_dir)
    cfg, family, differs = merged_config(hf, config_spec, overrides)
    c = models.model_config(cfg.model)
    with staging.staged(out, [hf_dir], say) as partial:  # renamed to `out` when complete
        say(f"from-hf: {hf_dir} ({hf.config['architectures'][0]}, {len(hf.files)} shard(s), {gib(hf.nbytes())}) -> "
            f"{out}/checkpoints/0 ({cfg.model.family}, {c.param_dtype} parameters)")
        count, unused, params = convert(hf, cfg, family, partial)
        rundir.write_config(partial, cfg.to_dict(), lambda _: None)
        write_json(os.path.join(partial, HF_SOURCE), hf.config)  # what an export carries over (exporter.py)
    say(f"  read {count} tensors, wrote {params:,} parameters in {time.time() - started:.1f} s; peak memory "
        f"{gib(peak_rss())}")
    if unused:
        say(f"  note: {unused_note(unused)}{family.hf.skipped_note(c, unused)}")
    train = " ".join(["python train.py", config_spec, *overrides, *differs, f"checkpoint.load_params_from={out}"])
    say(f"train from these weights:\n  {train}")
    return 0


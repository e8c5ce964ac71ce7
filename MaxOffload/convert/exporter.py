"""This project's checkpoint -> a Hugging Face checkpoint (`python -m MaxOffload.convert to-hf`).

The source is a run directory (its newest checkpoint), one of its step directories, or a from-hf output; the
model comes from the run's config.json. Each layer's arrays are read (convert/orbax_files.WeightsReader), turned
into the Hugging Face tensors by the family's Rules in reverse, cast (bfloat16 by default) and appended to the
safetensors shards: one layer in memory at a time.
"""
import dataclasses
import json
import os
import time

import ml_dtypes
import numpy as np

from MaxOffload import models
from MaxOffload.convert import staging
from MaxOffload.convert.hf_files import CONFIG, HF_SOURCE, ShardWriter
from MaxOffload.convert.orbax_files import WeightsReader, nested
from MaxOffload.errors import ConfigError
from MaxOffload.jsonfile import Unreadable, problem, read_json
from MaxOffload.reports import gib, peak_rss
from MaxOffload.train import rundir

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}


def locate(source):
    """(run directory, step directory) of a run directory, its checkpoints/ or one step directory."""
    source = os.path.normpath(source)
    if os.path.isdir(os.path.join(source, "state")):
        return os.path.dirname(os.path.dirname(source)), source
    run_dir = os.path.dirname(source) if os.path.basename(source) == "checkpoints" else source
    steps = rundir.checkpoint_steps(run_dir)
    if not steps:
        raise ConfigError(f"{source}: no checkpoint there; give a run directory, its checkpoints/ or one step "
                          "directory")
    return run_dir, os.path.join(run_dir, "checkpoints", str(steps[-1]))


def model_config(run_dir):
    """The model configuration of the run whose config.json is in run_dir."""
    path = os.path.join(run_dir, "config.json")
    fix = "to-hf reads the model from the config.json train.py or from-hf wrote beside checkpoints/: put a copy back"
    names = (lambda name: isinstance(name, str) and name in models.FAMILIES), f"one of {', '.join(models.FAMILIES)}"
    model = read_json(path, fix, {"model": {"family": names}})["model"]
    family = models.FAMILIES[model["family"]]
    fields = {f.name: int | float if f.type is float else f.type for f in dataclasses.fields(family.config_class)}
    wrong = problem(model, fields, "model")
    if wrong:
        raise Unreadable(path, wrong, fix)
    return family, family.config_class.from_config(model)


def source_config(run_dir, seen=()):
    """The config.json of the Hugging Face checkpoint the run's weights came from ({} if none): from-hf keeps it
    as hf_config.json; a run started with checkpoint.load_params_from leads to the run or weights it loaded."""
    source = read_json(os.path.join(run_dir, HF_SOURCE), f"from-hf copied it from the Hugging Face checkpoint's "
                       f"{CONFIG}: copy that file over it (the export takes token ids and the context length from it)",
                       dict, missing_ok=True)
    if source is not None:
        return source
    try:
        saved = read_json(os.path.join(run_dir, "config.json"), "", {"checkpoint": {"load_params_from": str | None}})
        loaded_from = saved["checkpoint"].get("load_params_from")
        origin = locate(loaded_from)[0] if loaded_from else None
    except ConfigError:  # its config.json unreadable, or the run it loaded gone: nothing to carry over
        return {}
    return {} if origin is None or origin in seen else source_config(origin, (*seen, run_dir))


# What an export keeps of its source's config.json besides what the model defines: the tokens' ids, the context
# length it was trained for (Llama 3.1: 131072, not the rope scaling's original x factor), and the like.
# A quantization_config is dropped: the export is not quantised.
def exported_config(ours, source, dtype):
    carried = {k: v for k, v in source.items()
               if (k not in ours or k == "max_position_embeddings") and k not in ("quantization_config", "dtype",
                                                                                  "torch_dtype")}
    return {**ours, **carried, "dtype": dtype, "torch_dtype": dtype}


def to_hf(source, out, dtype="bfloat16", max_shard_bytes=5 * 10**9, say=print):
    from MaxOffload.train import integrity

    started = time.time()
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    run_dir, step_dir = locate(source)
    family, c = model_config(run_dir)
    source = source_config(run_dir)  # before a byte is written: a damaged one is found first
    with staging.staged(out, [run_dir, step_dir], say) as partial:  # renamed to `out` when complete
        # the saved structure must be this model's, and its files whole, before a byte is converted
        try:
            unverified = integrity.verify(step_dir, integrity.structure(nested(models.weight_leaves(c))), 0, 1,
                                          partial=True)
        except integrity.Damaged as e:
            raise removed_by_its_run(step_dir) or ConfigError(f"checkpoint {step_dir} is damaged ({e}); export "
                                                             "another step") from None
        except integrity.Renamed as e:
            raise ConfigError(e.line(step_dir)) from None
        except integrity.Mismatch as e:
            raise ConfigError(f"checkpoint {step_dir} does not hold the model its run's config.json describes "
                              f"({e})") from None
        if unverified:
            say(f"warning: checkpoint {step_dir} is exported unverified: {unverified}")
        reader, target = WeightsReader(step_dir), DTYPES[dtype]
        say(f"to-hf: {step_dir} ({family.hf.architectures[0]}) -> {out} ({dtype})")
        writer = ShardWriter(partial, max_shard_bytes)
        try:
            for name, value in hf_tensors(family.hf.groups(c), reader.read):
                writer.add(name, value.astype(target))
        except Exception as e:
            raise removed_by_its_run(step_dir) or e
        shards = writer.close()
        config = exported_config(family.hf.config_json(c), source, dtype)
        with open(os.path.join(partial, CONFIG), "w") as f:
            json.dump(config, f, indent=2)
    say(f"  wrote {len(writer.weight_map)} tensors ({gib(writer.total)}) in {shards} shard(s) in "
        f"{time.time() - started:.1f} s; peak memory {gib(peak_rss())}")
    return 0


def removed_by_its_run(step_dir):
    """The one line for a checkpoint that vanished while it was read (its run, still training, keeps only its
    newest checkpoint.keep ones), or None when it is still there."""
    if os.path.isdir(step_dir):
        return None
    return ConfigError(f"checkpoint {step_dir} was removed by its run while it was exported (a training run keeps "
                       "its newest checkpoint.keep checkpoints); nothing was written: export the run's newest "
                       "checkpoint again")


def hf_tensors(groups, read):
    """(Hugging Face name, float32 array) of every tensor, layer by layer; read(path, layer) gives a weight
    (layer None) or one layer of a stacked one."""
    for group in groups:
        for index, layer in enumerate(group.layers or (None,)):
            for r in (*group.rules, *(group.copies if layer is not None else ())):
                copy = r in group.copies
                slices = [read(p if copy else group.path(p), None if copy or not group.stack else index) for p in r.ours]
                values = r.save(*(np.asarray(s, np.float32) for s in slices))
                yield from zip(group.names(r, layer), values)

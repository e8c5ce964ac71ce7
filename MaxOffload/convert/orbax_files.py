"""The weights of a train state in Orbax's checkpoint layout, written and read one layer at a time.

Written: a step directory `<dir>/checkpoints/<step>/` whose `state` item holds {"params": ..., "model_state":
...} in Orbax's zarr layout (one zarr array per leaf, named by its key path joined with dots, and the tree
metadata `_METADATA`), plus the integrity manifest (train/integrity.py). train.py's
`checkpoint.load_params_from` restores it like any run's checkpoint: Orbax reads it into the run's sharding.
Each leaf of a stacked layer group is chunked by layer (and further, to chunks of at most CHUNK_BYTES), and
written one layer at a time: the whole model is never in memory. Orbax's own `save` takes whole arrays, which
for DeepSeek-V3's expert weights would be 436 GB in bfloat16 per leaf.

Read: any Orbax checkpoint's `state` item (a training run's, OCDBT or not), leaf by leaf and layer by layer
through tensorstore.
"""
import json
import math
import os
import time

import numpy as np
import tensorstore as ts

from MaxOffload.errors import ConfigError
from MaxOffload.jsonfile import read_json

CHUNK_BYTES = 64 * 2**20
METADATA = "_METADATA"


def leaf_name(path):
    return ".".join(path)


def nested(leaves):
    """{path: leaf} -> the nested dict of the leaves (the tree integrity.structure records)."""
    tree = {}
    for path, leaf in leaves.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return tree


def _zarr_dtype(dtype):
    dtype = np.dtype(dtype)
    return "bfloat16" if dtype.name == "bfloat16" else dtype.str


def chunk_shape(shape, itemsize, stacked):
    """One layer per chunk along a stacked leaf's first axis; the largest axes halved until a chunk holds at
    most CHUNK_BYTES."""
    chunk = [1, *shape[1:]] if stacked and shape else list(shape)
    while math.prod(chunk) * itemsize > CHUNK_BYTES:
        axis = max(range(len(chunk)), key=lambda a: chunk[a])
        chunk[axis] = math.ceil(chunk[axis] / 2)
    return chunk


class WeightsWriter:
    """shapes: {path (tuple of keys): (shape, dtype, stacked)} of every leaf to write."""

    def __init__(self, step_dir, shapes):
        self.step_dir, self.state_dir = step_dir, os.path.join(step_dir, "state")
        os.makedirs(self.state_dir)
        self.shapes, self.arrays, self.written = shapes, {}, {}

    def _array(self, path):
        if path not in self.arrays:
            shape, dtype, stacked = self.shapes[path]
            metadata = {"shape": list(shape), "chunks": chunk_shape(shape, np.dtype(dtype).itemsize, stacked),
                        "dtype": _zarr_dtype(dtype), "compressor": None}  # weights barely compress: 2.4x faster
            spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": os.path.join(self.state_dir, leaf_name(path))},
                    "metadata": metadata, "create": True}
            self.arrays[path] = ts.open(spec).result()
        return self.arrays[path]

    def write(self, path, value, layer=None):
        """Writes `value` as the leaf (layer None) or its slice `layer` of a stacked leaf."""
        value = np.asarray(value, self.shapes[path][1])
        target = self._array(path) if layer is None else self._array(path)[layer]
        target.write(value).result()
        self.written.setdefault(path, set()).add(layer)

    def finish(self):
        """Writes the tree metadata and the step's checkpoint metadata (the arrays are complete by then)."""
        missing = [p for p, (shape, _, stacked) in self.shapes.items()
                   if len(self.written.get(p, ())) != (shape[0] if stacked else 1)]
        assert not missing, f"not written: {leaf_name(missing[0])}"
        tree = {str(path): {"key_metadata": [{"key": k, "key_type": 2} for k in path],
                            "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False,
                                               "write_shape": list(self.shapes[path][0])}}
                for path in sorted(self.shapes)}
        with open(os.path.join(self.state_dir, METADATA), "w") as f:
            json.dump({"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
                       "store_array_data_equal_to_fill_value": True, "custom_metadata": None}, f)
        now = time.time_ns()
        with open(os.path.join(self.step_dir, "_CHECKPOINT_METADATA"), "w") as f:
            json.dump({"item_handlers": {"state": "orbax.checkpoint._src.handlers.standard_checkpoint_handler."
                                                  "StandardCheckpointHandler"},
                       "metrics": {}, "performance_metrics": {}, "init_timestamp_nsecs": now,
                       "commit_timestamp_nsecs": now, "custom_metadata": {}}, f)


class WeightsReader:
    """The leaves of an Orbax checkpoint's `state` item, read whole or one layer at a time."""

    def __init__(self, step_dir):
        self.state_dir = os.path.join(step_dir, "state")
        metadata = read_json(os.path.join(self.state_dir, METADATA), f"checkpoint {step_dir} is damaged or not "
                             "an Orbax checkpoint: export another step, or a sound copy of this one",
                             {"use_ocdbt": bool | None, "use_zarr3": bool | None})
        self.ocdbt, self.zarr3 = metadata.get("use_ocdbt", True), metadata.get("use_zarr3", False)
        self.arrays = {}

    def _array(self, path):
        if path not in self.arrays:
            driver = "zarr3" if self.zarr3 else "zarr"
            base = os.path.abspath(self.state_dir)
            kvstore = ({"driver": "ocdbt", "base": f"file://{base}", "path": leaf_name(path)} if self.ocdbt
                       else {"driver": "file", "path": os.path.join(base, leaf_name(path))})
            self.arrays[path] = ts.open({"driver": driver, "kvstore": kvstore}, open=True).result()
        return self.arrays[path]

    def read(self, path, layer=None):
        try:
            array = self._array(path)
            return (array if layer is None else array[layer]).read().result()
        except ValueError as e:  # tensorstore: absent or unreadable
            raise ConfigError(f"{self.state_dir}: cannot read {leaf_name(path)} ({str(e).splitlines()[0][:160]}); "
                              "the checkpoint is damaged or not of this model") from None

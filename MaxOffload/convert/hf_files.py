"""Hugging Face checkpoint files: safetensors shards (+ model.safetensors.index.json) and config.json.

The safetensors format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}} and the raw little-endian tensors. It is read and written here, tensor by tensor, rather than
through the `safetensors` package, whose numpy interface has no bfloat16 or float8 (ml_dtypes, which JAX
ships, gives numpy both): a tensor is read with one seek and one read (never a whole shard), and a shard is
written tensor by tensor. Float8 weights with a `<name>_scale_inv` beside them (DeepSeek-V3's released
checkpoint: e4m3, one scale per 128 x 128 block) are dequantised as they are read.
"""
import json
import math
import os
import shutil

import ml_dtypes
import numpy as np

from MaxOffload.errors import ConfigError
from MaxOffload.jsonfile import is_count, read_json

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
FLOATS = {np.dtype(DTYPES[k]) for k in ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")}  # what a weight may be
INDEX, SINGLE, CONFIG = "model.safetensors.index.json", "model.safetensors", "config.json"
HF_SOURCE = "hf_config.json"  # from-hf keeps the source's config.json beside the weights, for the export
SCALE_SUFFIX = "_scale_inv"


def read_header(path):
    """{name: (numpy dtype, shape, absolute byte offset)} of one safetensors file, checked as a format reader
    should: the header a JSON object of {dtype, shape, data_offsets} entries, each tensor's offsets integers
    within the data, exactly dtype x shape bytes long, no two tensors sharing a byte and no byte unaccounted
    for. A damaged or hostile header is a ConfigError naming the tensor."""
    def corrupt(why):
        return ConfigError(f"{path} is not a readable safetensors shard ({why}); download or copy it again")

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise corrupt("shorter than its header")
        n = int.from_bytes(head, "little")
        if n > size - 8 or n > 100 * 2**20:
            raise corrupt(f"header length {n} beyond the file's {size} bytes")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested beyond the parser
            raise corrupt("its header is not JSON") from None
    if not isinstance(header, dict):
        raise corrupt(f"its header is a JSON {type(header).__name__}, not an object of tensors")
    entries, spans, data = {}, [], size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise corrupt(f"tensor {name}'s entry is not {{dtype, shape, data_offsets}}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise corrupt(f"tensor {name} has the unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(is_count(d) for d in shape):
            raise corrupt(f"tensor {name}'s shape {shape!r} is not a list of sizes")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_count(o) for o in offsets):
            raise corrupt(f"tensor {name}'s data_offsets {offsets!r} are not two byte offsets")
        begin, end = offsets
        dtype, shape = np.dtype(DTYPES[dtype]), tuple(shape)
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise corrupt(f"tensor {name}'s bytes {begin}..{end} are not the {math.prod(shape) * dtype.itemsize} "
                          f"its {entry['dtype']} shape {list(shape)} needs")
        if end > data:
            raise corrupt(f"tensor {name}'s bytes {begin}..{end} run past the file's {data} bytes of data (truncated?)")
        entries[name] = (dtype, shape, 8 + n + begin)
        spans.append((begin, end, name))
    spans.sort()
    for (_, end, first), (begin, after, name) in zip(spans, spans[1:]):  # sorted: an overlap shows between neighbours
        if begin < end and after > begin:
            raise corrupt(f"tensor {name}'s bytes {begin}..{after} overlap tensor {first}'s")
    for (_, end, _), (begin, *_) in zip([(0, 0, None), *spans], [*spans, (data,)]):
        if begin != end:
            raise corrupt(f"bytes {end}..{begin} of its data belong to no tensor")
    return entries


class HFCheckpoint:
    """A Hugging Face checkpoint directory: config.json and its safetensors (sharded with an index, or one file).
    Every shard's header is read up front (so a damaged shard is found before any conversion work)."""

    def __init__(self, directory):
        self.directory = directory
        if not os.path.isdir(directory):
            raise ConfigError(f"{directory}: no such directory; give the directory of a Hugging Face checkpoint")
        if not os.path.isfile(os.path.join(directory, CONFIG)):
            raise ConfigError(f"{directory} has no {CONFIG}; give the directory save_pretrained (or a download) wrote")
        again = "download or copy it again"
        self.config = read_json(os.path.join(directory, CONFIG), again, dict)
        index = os.path.join(directory, INDEX)
        if os.path.isfile(index):
            weight_map = read_json(index, again, {"weight_map": dict})["weight_map"]
            for tensor, file in weight_map.items():
                if not isinstance(file, str) or not file.endswith(".safetensors") or os.path.basename(file) != file:
                    raise ConfigError(f"{index} places {tensor} in {file!r}, not a safetensors file beside it; "
                                      "download or copy the index again")
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(directory, SINGLE)):
            files, weight_map = [SINGLE], None
        else:
            raise ConfigError(f"{directory} has no {INDEX} or {SINGLE}: only safetensors checkpoints are read")
        self.files = files
        self.tensors = {}  # name -> (file, dtype, shape, offset)
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                raise ConfigError(f"{path} is listed in {INDEX} but missing; download or copy it again")
            for tensor, (dtype, shape, offset) in read_header(path).items():
                self.tensors[tensor] = (path, dtype, shape, offset)
        for tensor, name in (weight_map or {}).items():
            if tensor not in self.tensors:
                raise ConfigError(f"{os.path.join(directory, name)} lacks {tensor}, which {INDEX} places there; "
                                  "download or copy it again")
        quantization = self.config.get("quantization_config") or {}
        self.block = tuple(quantization.get("weight_block_size") or (128, 128))

    def nbytes(self):
        return sum(os.path.getsize(os.path.join(self.directory, f)) for f in self.files)

    def shape(self, name):
        return self.tensors[name][2]

    def scale_of(self, name):
        """The name of `name`'s block scales, if it is stored quantised."""
        scale = name + SCALE_SUFFIX
        return scale if scale in self.tensors else None

    def raw(self, name):
        path, dtype, shape, offset = self.tensors[name]
        count = math.prod(shape) * dtype.itemsize
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(count)
        if len(data) != count:
            raise ConfigError(f"{path}: tensor {name} is cut short; download or copy the shard again")
        return np.frombuffer(data, dtype).reshape(shape)

    def read(self, name):
        """The tensor as float32 (dequantised by its block scales when it has them); a weight stored as anything
        but a floating-point type (a relabelled integer tensor) is a ConfigError."""
        for part in (name, self.scale_of(name)):
            if part is not None and self.tensors[part][1] not in FLOATS:
                path, dtype = self.tensors[part][:2]
                raise ConfigError(f"{path}: tensor {part} is stored as {NAMES[dtype]}, not a floating-point type, so "
                                  "its bytes are not weights; download or copy the shard again")
        value = self.raw(name)
        scale = self.scale_of(name)
        if scale is None:
            return value.astype(np.float32)
        return dequantize(value, self.raw(scale), self.block)


def dequantize(weight, scale_inv, block=(128, 128)):
    """weight [rows, cols] (float8) x scale_inv [ceil(rows / b0), ceil(cols / b1)], one scale per block."""
    rows, cols = weight.shape
    b0, b1 = block
    if scale_inv.shape != (math.ceil(rows / b0), math.ceil(cols / b1)):
        raise ConfigError(f"block scales of shape {scale_inv.shape} do not fit a {rows}x{cols} weight in {b0}x{b1} "
                          "blocks; the checkpoint's quantization_config.weight_block_size is not its layout")
    scales = np.repeat(np.repeat(scale_inv.astype(np.float32), b0, axis=0), b1, axis=1)[:rows, :cols]
    return weight.astype(np.float32) * scales


class ShardWriter:
    """Writes tensors into safetensors shards of at most `max_shard_bytes` (a tensor larger than that gets a
    shard of its own), then the index: model-0000i-of-0000N.safetensors + model.safetensors.index.json. Each
    shard's tensors go to a data file first and are copied behind the header when the shard is full, so only
    one tensor is in memory at a time."""

    def __init__(self, directory, max_shard_bytes):
        self.directory, self.max = directory, max_shard_bytes
        os.makedirs(directory, exist_ok=True)
        self.shards, self.weight_map, self.total = [], {}, 0
        self._data = None

    def add(self, name, array):
        array = np.ascontiguousarray(array)
        if self._data is not None and self._size + array.nbytes > self.max and self._entries:
            self._finish_shard()
        if self._data is None:
            self._entries, self._size = {}, 0
            self._data = open(os.path.join(self.directory, f".shard{len(self.shards)}.part"), "wb")
        self._entries[name] = {"dtype": NAMES[array.dtype], "shape": list(array.shape),
                               "data_offsets": [self._size, self._size + array.nbytes]}
        self._data.write(array.tobytes())
        self._size += array.nbytes
        self.total += array.nbytes

    def _finish_shard(self):
        self._data.close()
        part = self._data.name
        header = json.dumps({"__metadata__": {"format": "pt"}, **self._entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        shard = os.path.join(self.directory, f".shard{len(self.shards)}.safetensors")
        with open(shard, "wb") as out, open(part, "rb") as data:
            out.write(len(header).to_bytes(8, "little"))
            out.write(header)
            shutil.copyfileobj(data, out, 64 * 2**20)
        os.remove(part)
        self.shards.append((shard, list(self._entries)))
        self._data = None

    def close(self):
        """Names the shards model-0000i-of-0000N.safetensors and writes the index; returns the shard count."""
        if self._data is not None:
            self._finish_shard()
        n = len(self.shards)
        for i, (path, names) in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(path, os.path.join(self.directory, final))
            self.weight_map.update({name: final for name in names})
        with open(os.path.join(self.directory, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": self.weight_map}, f, indent=2)
        return n

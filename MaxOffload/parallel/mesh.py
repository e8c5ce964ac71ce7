"""The device mesh: ici (within a slice, e.g. one NVL72 NVLink domain) x dcn (across slices).

Each mesh axis has size ici[axis] * dcn[axis]. Devices of one slice form a contiguous block
along the dcn part of every axis, so collectives over ici-only axes stay on NVLink.
"""
import collections
import math

import jax
import numpy as np
from jax.sharding import Mesh

from MaxOffload.errors import ConfigError
from MaxOffload.parallel.logical import MESH_AXES


def sequences(per_device_batch, devices):
    """Sequences a (micro-)batch holds on `devices` devices at `per_device_batch` sequences per device: a whole
    number. A fraction per device is how context parallelism keeps a device's tokens down (0.125 on 8 devices
    split 8 ways over context: one sequence, 1/8 of it on each)."""
    total = per_device_batch * devices
    if total <= 0 or abs(total - round(total)) > 1e-9:
        raise ConfigError(f"train.per_device_batch_size={per_device_batch:g} x {devices} devices = {total:g} "
                          f"sequences, not a whole number; give a per-device batch that makes one (e.g. "
                          f"{max(1, round(total)) / devices:g})")
    return int(round(total))


def _sizes(kind, sizes, total):
    """Fills a single -1 so that the product is `total`; ConfigError if impossible."""
    sizes = dict(sizes)
    described = " ".join(f"{a}={sizes[a]}" for a in MESH_AXES)
    free = [a for a in MESH_AXES if sizes[a] == -1]
    if len(free) > 1 or any(sizes[a] == 0 or sizes[a] < -1 for a in MESH_AXES):
        raise ConfigError(f"mesh.{kind} {described}: sizes must be >= 1, with at most one -1")
    known = math.prod(sizes[a] for a in MESH_AXES if a not in free)
    if free:
        if total % known:
            raise ConfigError(f"mesh.{kind} {described}: the fixed sizes multiply to {known}, which does not divide "
                              f"the {total} {'devices per slice' if kind == 'ici' else 'slices'}")
        sizes[free[0]] = total // known
    elif known != total:
        raise ConfigError(f"mesh.{kind} {described}: product {known} != {total} "
                          f"{'devices per slice' if kind == 'ici' else 'slices'}; make the product {total} or "
                          "set one axis to -1")
    return sizes


def _granules(devices, num_slices):
    """Devices grouped by slice: by slice_index where the runtime reports slices, else by process,
    else (one process simulating several slices) in equal consecutive blocks."""
    if num_slices == 1:
        return [list(devices)]
    for key in ("slice_index", "process_index"):
        groups = collections.defaultdict(list)
        for d in devices:
            groups[getattr(d, key, 0)].append(d)
        if len(groups) == num_slices:
            return [groups[k] for k in sorted(groups)]
    if len(devices) % num_slices:
        raise ConfigError(f"mesh.dcn asks for {num_slices} slices, which does not divide {len(devices)} devices")
    per = len(devices) // num_slices
    return [list(devices[i * per:(i + 1) * per]) for i in range(num_slices)]


def count_slices(devices):
    slices = {getattr(d, "slice_index", 0) for d in devices}
    return len(slices) if len(slices) > 1 else len({d.process_index for d in devices})


def shape(mesh_cfg, devices):
    """({axis: ici size}, {axis: dcn size}) with -1 resolved for these devices."""
    dcn = dict(mesh_cfg.dcn)
    dcn = _sizes("dcn", dcn, count_slices(devices) if -1 in dcn.values() else math.prod(dcn.values()))
    num_slices = math.prod(dcn.values())
    if len(devices) % num_slices:
        raise ConfigError(f"mesh.dcn product {num_slices} does not divide the {len(devices)} devices")
    return _sizes("ici", mesh_cfg.ici, len(devices) // num_slices), dcn


def make(mesh_cfg=None, devices=None):
    """The mesh over `devices` (default: all) with axes MESH_AXES; mesh_cfg=None puts every device on data."""
    devices = list(devices if devices is not None else jax.devices())
    devices.sort(key=lambda d: (getattr(d, "slice_index", 0), d.process_index, d.id))
    if mesh_cfg is None:
        ici, dcn = {a: len(devices) if a == "data" else 1 for a in MESH_AXES}, {a: 1 for a in MESH_AXES}
    else:
        ici, dcn = shape(mesh_cfg, devices)
    ici_shape, dcn_shape = [ici[a] for a in MESH_AXES], [dcn[a] for a in MESH_AXES]
    blocks = [np.array(g, dtype=object).reshape(ici_shape) for g in _granules(devices, math.prod(dcn_shape))]
    grid = np.array(blocks, dtype=object).reshape(dcn_shape + ici_shape)
    n = len(MESH_AXES)
    grid = grid.transpose([j for i in range(n) for j in (i, n + i)])  # (dcn_0, ici_0, dcn_1, ici_1, ...)
    return Mesh(grid.reshape([d * i for d, i in zip(dcn_shape, ici_shape)]), MESH_AXES)


def describe(mesh):
    return " x ".join(f"{a}={mesh.shape[a]}" for a in MESH_AXES if mesh.shape[a] > 1) or "1 device"

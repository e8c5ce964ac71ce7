"""The device mesh. For now every device is on the data axis; the other axes have size 1
(the parallelism issue adds ici x dcn shapes from the config)."""
import jax
import numpy as np
from jax.sharding import Mesh

from MaxOffload.parallel.logical import MESH_AXES


def make(devices=None):
    devices = np.array(devices if devices is not None else jax.devices())
    shape = (devices.size,) + (1,) * (len(MESH_AXES) - 1)
    return Mesh(devices.reshape(shape), MESH_AXES)

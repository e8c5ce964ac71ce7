"""Splash attention (models/attention/splash.splash_attention, interpreted on this CPU) against the XLA path
(models/attention/plain.causal_attention), per shard of a mesh of fake CPU devices: prints one JSON line of the largest
output and gradient differences per case. python tests/helpers/splash_check.py (sets 8 host devices itself)."""
import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from MaxOffload.models.attention.plain import causal_attention  # noqa: E402
from MaxOffload.models.attention.splash import splash_attention  # noqa: E402

# (name, mesh shape {data, tensor}, heads, kv heads, q/k dim, v dim)
CASES = [("gqa_data2_tensor2", {"data": 2, "tensor": 2}, 4, 2, 64, 64),
         ("gqa_tensor4_wider_than_kv", {"data": 1, "tensor": 4}, 4, 2, 64, 64),
         ("mla_data2_tensor2", {"data": 2, "tensor": 2}, 4, 4, 64, 32)]


def main():
    out = {}
    for name, shape, heads, kv_heads, d, dv in CASES:
        devices = np.array(jax.devices()[:shape["data"] * shape["tensor"]]).reshape(shape["data"], shape["tensor"])
        mesh = jax.sharding.Mesh(devices, ("data", "tensor"))
        sharding = NamedSharding(mesh, P("data", None, "tensor", None))
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, dout = (jax.random.normal(key, (2, 256, h, dim), jnp.float32) for key, h, dim in
                         zip(keys, (heads, kv_heads, kv_heads, heads), (d, d, dv, dv)))

        def loss(fn, q, k, v):
            return jnp.sum(fn(q, k, v) * dout)

        splash = lambda q, k, v: splash_attention(q, k, v, None, sharding, interpret=True)  # noqa: E731
        xla = lambda q, k, v: causal_attention(q, k, v)  # noqa: E731
        got = jax.jit(jax.value_and_grad(lambda *a: loss(splash, *a), argnums=(0, 1, 2)))(q, k, v)
        want = jax.jit(jax.value_and_grad(lambda *a: loss(xla, *a), argnums=(0, 1, 2)))(q, k, v)
        outputs = float(jnp.max(jnp.abs(splash(q, k, v) - xla(q, k, v))))
        grads = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(got[1], want[1]))
        out[name] = {"output": outputs, "gradients": grads, "loss": [float(got[0]), float(want[0])]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

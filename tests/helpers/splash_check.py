"""Splash attention (models/attention/splash.splash_attention, interpreted on this CPU) against the XLA path
(models/attention/plain.causal_attention), per shard of a mesh of fake CPU devices, and over a sequence split by
context axes (splash.context_splash_attention: each shard's queries against the gathered keys, in sequence order and
load-balanced), with rows of packed documents (the kernel's segment ids): prints one JSON line of the largest output and gradient differences per case.
python tests/helpers/splash_check.py (sets 8 host devices itself)."""
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
from MaxOffload.models.attention.key_source import KeySource  # noqa: E402
from MaxOffload.models.attention.splash import context_splash_attention, splash_attention  # noqa: E402
from MaxOffload.parallel.layout import ParallelLayout  # noqa: E402

# (name, mesh shape {data, tensor}, heads, kv heads, q/k dim, v dim, packed documents)
CASES = [("gqa_data2_tensor2", {"data": 2, "tensor": 2}, 4, 2, 64, 64, False),
         ("gqa_tensor4_wider_than_kv", {"data": 1, "tensor": 4}, 4, 2, 64, 64, False),
         ("mla_data2_tensor2", {"data": 2, "tensor": 2}, 4, 4, 64, 32, False),
         ("packed_gqa_data2_tensor2", {"data": 2, "tensor": 2}, 4, 2, 64, 64, True),
         ("packed_mla_data2_tensor2", {"data": 2, "tensor": 2}, 4, 4, 64, 32, True)]
# over context axes: (name, mesh shape {data, context, tensor}, load balanced, tokens, heads, kv heads, q/k dim, v
# dim, packed documents); a shard's chunk of the sequence (its rows, half of them load-balanced) is one block of 128
# tokens
CONTEXT_CASES = [("context4_gqa", {"data": 1, "context": 4, "tensor": 2}, False, 512, 4, 2, 64, 64, False),
                 ("context2_balanced_gqa_data2", {"data": 2, "context": 2, "tensor": 2}, True, 512, 4, 2, 64, 64,
                  False),
                 ("context4_balanced_mla", {"data": 1, "context": 4, "tensor": 2}, True, 1024, 4, 4, 64, 32, False),
                 ("packed_context2_balanced_gqa", {"data": 2, "context": 2, "tensor": 2}, True, 512, 4, 2, 64, 64,
                  True)]
RULES = {"activation_batch": ("data",), "activation_length": ("context",), "activation_heads": ("tensor",),
         "activation_kv_heads": ("tensor",)}


def documents_of(length, packed):
    """Which document each token of the two rows belongs to: row 0 three documents (cut inside the kernel's blocks),
    row 1 two; None unpacked."""
    if not packed:
        return None
    cuts = [(length // 3 + 5, length // 2 + 17), (length - 40,)]
    return jnp.asarray(np.stack([np.searchsorted(np.asarray(c), np.arange(length), side="right") for c in cuts]),
                       jnp.int32)


def compare(fn, q, k, v, dout, documents=None):
    """{output, gradients, loss} of fn against causal_attention (of those documents): the largest differences."""
    def loss(f, q, k, v):
        return jnp.sum(f(q, k, v) * dout)

    xla = lambda q, k, v: causal_attention(q, k, v, documents=documents)  # noqa: E731
    got = jax.jit(jax.value_and_grad(lambda *a: loss(fn, *a), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.value_and_grad(lambda *a: loss(xla, *a), argnums=(0, 1, 2)))(q, k, v)
    outputs = float(jnp.max(jnp.abs(jax.jit(fn)(q, k, v) - xla(q, k, v))))
    grads = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(got[1], want[1]))
    return {"output": outputs, "gradients": grads, "loss": [float(got[0]), float(want[0])]}


def inputs(length, heads, kv_heads, d, dv):
    keys = jax.random.split(jax.random.key(0), 4)
    return [jax.random.normal(key, (2, length, h, dim), jnp.float32) for key, h, dim in
            zip(keys, (heads, kv_heads, kv_heads, heads), (d, d, dv, dv))]


def context_case(shape, balanced, length, heads, kv_heads, d, dv, packed):
    """The context path on a (data, context, tensor) mesh, its tokens in the layout's order (load balancing's
    chunks), against causal_attention of the whole sequence in sequence order."""
    devices = np.array(jax.devices()[:shape["data"] * shape["context"] * shape["tensor"]])
    mesh = jax.sharding.Mesh(devices.reshape(shape["data"], shape["context"], shape["tensor"]),
                             ("data", "context", "tensor"))
    layout = ParallelLayout.of(mesh, RULES, load_balance=balanced)
    q, k, v, dout = inputs(length, heads, kv_heads, d, dv)
    order = layout.token_order(length)
    order = np.arange(length) if order is None else order
    back = np.argsort(order)
    documents = documents_of(length, packed)

    def split(q, k, v):  # the layout's token order in, sequence order out
        q, k, v = (a[:, order] for a in (q, k, v))
        out = context_splash_attention(q, KeySource.of_keys(q, k, v), None, "splash", layout, interpret=True,
                                       documents=None if documents is None else documents[:, order])
        return out[:, back]

    return compare(split, q, k, v, dout, documents)


def main():
    out = {}
    for name, shape, heads, kv_heads, d, dv, packed in CASES:
        devices = np.array(jax.devices()[:shape["data"] * shape["tensor"]]).reshape(shape["data"], shape["tensor"])
        mesh = jax.sharding.Mesh(devices, ("data", "tensor"))
        sharding = NamedSharding(mesh, P("data", None, "tensor", None))
        documents = documents_of(256, packed)
        splash = lambda q, k, v: splash_attention(q, k, v, None, sharding, interpret=True,  # noqa: E731
                                                  documents=documents)
        q, k, v, dout = inputs(256, heads, kv_heads, d, dv)
        out[name] = compare(splash, q, k, v, dout, documents)
    for name, *case in CONTEXT_CASES:
        out[name] = context_case(*case)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

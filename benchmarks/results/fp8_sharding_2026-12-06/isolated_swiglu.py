import os
os.environ["XLA_FLAGS"]="--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P, NamedSharding
from MaxOffload.models.fp8 import einsum_fp8
mesh = jax.make_mesh((2,4), ("data","tensor"), axis_types=(jax.sharding.AxisType.Auto,)*2)
ks = jax.random.split(jax.random.key(0),5)
x = jax.random.normal(ks[0], (8,16,64)); w0 = jax.random.normal(ks[1], (64,128))*0.1; w1 = jax.random.normal(ks[2], (64,128))*0.1
wo = jax.random.normal(ks[3], (128,64))*0.1; g = jax.random.normal(ks[4], (8,16,64))
S="abk,kn->abn"
def mlp(x, w0, w1, wo, constrain=False):
    a = einsum_fp8(S, x, w0); b = einsum_fp8(S, x, w1)
    h = jax.nn.silu(a) * b
    if constrain: h = jax.lax.with_sharding_constraint(h, P("data", None, "tensor"))
    return einsum_fp8(S, h, wo)
f = lambda *a: jnp.sum(mlp(*a) * g)
gr = jax.jit(jax.grad(f, argnums=(0,1,2,3)))(x, w0, w1, wo)
args = [jax.device_put(a, NamedSharding(mesh, p)) for a,p in zip((x,w0,w1,wo),(P("data"),P(None,"tensor"),P(None,"tensor"),P("tensor")))]
gs = jax.jit(jax.grad(f, argnums=(0,1,2,3)))(*args)
print([float(jnp.linalg.norm(a-b)/jnp.linalg.norm(a)) for a,b in zip(gr,gs)])

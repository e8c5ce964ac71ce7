from MaxOffload.platform import pick_platform
pick_platform()
import jax, jax.numpy as jnp, numpy as np, optax
from MaxOffload import data, from_config
from MaxOffload.config import load
def rel(a,b):
    a,b=jax.device_get((a,b)); d=jax.tree.map(lambda x,y:x.astype(np.float64)-y.astype(np.float64),a,b)
    return float(optax.tree.norm(d))/float(optax.tree.norm(b))
base=["configs/llama3_1.py:tiny","model.num_layers=4","model.compute_dtype=float32","train.seq_len=16","checkpoint.enabled=false","data.source=synthetic","model.num_kv_heads=4","train.per_device_batch_size=8"]
for q in (["quant.mode=fp8"], []):
    cfg=load([*base,*q]); s=from_config.train_setup(cfg, jax.devices()[:1]); st=s.init_state()
    b=s.put_batch(data.build(cfg).train_batch(0))
    f=jax.jit(s.gradients)
    _,_,g1=f(st["params"], st["model_state"], b)
    keys=iter(jax.random.split(jax.random.key(1), 1000))
    p2=jax.tree.map(lambda p: p*(1+1e-7*jax.random.normal(next(keys), p.shape)), st["params"])
    _,_,g2=f(p2, st["model_state"], b)
    print(q, "grads rel diff from a 1e-7 relative perturbation of the params:", rel(g2,g1))

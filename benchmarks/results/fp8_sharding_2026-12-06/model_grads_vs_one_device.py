import json, sys
from MaxOffload.platform import pick_platform
pick_platform()
import jax, numpy as np, optax
from MaxOffload import data, from_config
from MaxOffload.config import load
def rel(a,b):
    a,b=jax.device_get((a,b)); d=jax.tree.map(lambda x,y:x.astype(np.float64)-y.astype(np.float64),a,b)
    return float(optax.tree.norm(d))/float(optax.tree.norm(b))
def grads(cfg, devices):
    s=from_config.train_setup(cfg, devices); st=s.init_state()
    return lambda b: jax.jit(s.gradients)(st["params"], st["model_state"], s.put_batch(b))
base=["configs/llama3_1.py:tiny","model.num_layers=4","model.compute_dtype=float32","train.seq_len=16","checkpoint.enabled=false","data.source=synthetic"]
for q in (["quant.mode=fp8","quant.parts=[mlp]"], ["quant.mode=fp8","quant.parts=[projections]"]):
    for mesh in (["mesh.ici.fsdp=2","mesh.ici.tensor=4","model.num_kv_heads=4"], ["mesh.ici.fsdp=8"]):
        split=load([*base,*q,*mesh,"train.per_device_batch_size=1"])
        b=data.build(split).train_batch(0)
        one=load([*base,*q,*( ["model.num_kv_heads=4"] if "model.num_kv_heads=4" in mesh else []),"train.per_device_batch_size=8"])
        l1,_,g1=grads(one, jax.devices()[:1])(b); ls,_,gs=grads(split,None)(b)
        print(q, mesh, abs(float(ls)-float(l1))/float(l1), rel(gs,g1), flush=True)

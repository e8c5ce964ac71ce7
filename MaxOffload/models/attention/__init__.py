"""Causal attention, one module per concern:
  dispatch.py    attention(): the chosen kernel (models/kernels.attention_for), or the layout's context strategy
  gqa.py         Attention: grouped-query self-attention with RoPE (Llama's layer)
  plain.py       the XLA path: query blocks that attend only to the keys they can see; masked by position
  flash.py       tokamax's flash kernel, whole and on pieces of the keys (GPUs; its XLA implementation on CPU)
  tokamax_adapter.py  the one module that reads tokamax's private ops (the pieces' residuals and VJP)
  splash.py      jax's Pallas splash kernel (TPUs)
  context.py     the context strategies' registry (mesh.context_attention): a sequence split over context axes
  key_source.py  KeySource: what a context shard gathers to make the keys and values
  all_gather.py  the all_gather strategy: each shard gathers the key source, the XLA and the flash paths
A new context strategy is a module here and one entry of context.STRATEGIES.
"""

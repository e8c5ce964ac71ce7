"""The one door into tokamax's private modules: its attention ops by implementation.

Attention in pieces (models/attention/flash.flash_attention_piece: a context shard's queries against blocks of
keys, combined by their log-sum-exp) needs what tokamax's public `dot_product_attention` hides: the forward's
residuals (the softmax's row max and sum) and the op's VJP given them. tokamax keeps its ops by implementation in
`tokamax._src.ops.attention.api.IMPLEMENTATIONS`; this module alone reads it, written for the tokamax versions
requirements.txt pins (SUPPORTED). Where an installed tokamax has moved it, the lookup is one line
(errors.ConfigError) naming the installed and the supported versions.
"""
import jax.numpy as jnp

from MaxOffload.errors import ConfigError
from MaxOffload.models import kernels

# requirements.txt: tokamax 0.0.12 on Python 3.11 (jax 0.10), >= 0.0.13, < 0.0.15 on Python 3.12
SUPPORTED = ("0.0.12", "0.0.13", "0.0.14")


def attention_op(implementation):
    """tokamax's attention op (a tokamax.Op) of an implementation name: 'triton' (GPUs), 'xla'."""
    tokamax = kernels.import_tokamax()
    try:
        from tokamax._src.ops.attention import api

        return api.IMPLEMENTATIONS[implementation]
    except (ImportError, AttributeError, KeyError) as error:
        raise ConfigError(f"tokamax {getattr(tokamax, '__version__', '?')} has no attention op {implementation!r} "
                          "in tokamax._src.ops.attention.api.IMPLEMENTATIONS, where MaxOffload's context attention "
                          f"reads it (written for tokamax {', '.join(SUPPORTED)}): install one of those "
                          "(requirements.txt)") from error


def forward(implementation, q, k, v, scale, causal):
    """(the output of q's attention to k, v, its log-sum-exp [b, heads, l] in float32) by tokamax's op."""
    out, (m, l) = attention_op(implementation)(q, k, v, logits_scale=scale, is_causal=causal, return_residuals=True)
    return out, (0.0 if m is None else m) + jnp.log(l)


def vjp(implementation, q, k, v, scale, causal, lse, out, dout):
    """(dq, dk, dv) by tokamax's VJP of the op, given an attention's output, its cotangent and its log-sum-exp (the
    op's residuals are (max, sum): (lse, 1) says the same); None when the implementation has no VJP of its own."""
    op = attention_op(implementation)
    if op.vjp is None:
        return None
    bound = op.bind(q, k, v, logits_scale=scale, is_causal=causal)
    kwargs = {name: value for name, value in bound.kwargs.items() if name != "return_residuals"}
    grads = op.vjp((lse, jnp.ones_like(lse)), out, dout, *bound.args, **kwargs)
    return (grads["q"], grads["k"], grads["v"]) if isinstance(grads, dict) else tuple(grads[:3])

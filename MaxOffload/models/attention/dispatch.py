"""Causal attention by the chosen kernel (`model.attention`, chosen for a platform by models/kernels.attention_for):
XLA's query blocks (plain.py), tokamax's flash kernel (flash.py) or the TPU's splash kernel (splash.py), and over
a sequence split by the layout's context axes its context strategy (context.py)."""
import jax

from MaxOffload.models import components, kernels
from MaxOffload.models.attention import context
from MaxOffload.models.attention.flash import flash_attention
from MaxOffload.models.attention.key_source import KeySource
from MaxOffload.models.attention.plain import Q_AXES, causal_attention
from MaxOffload.models.attention.splash import splash_attention
from MaxOffload.parallel.layout import NONE


def chosen(kernel):
    """`kernel` when it is a kernel chosen for a platform ('xla', 'flash:<implementation>', 'splash[:<block>]');
    ValueError for a choice not yet made for one ('auto', 'flash')."""
    if kernel == "xla" or kernel.startswith("flash:") or kernels.is_splash(kernel):
        return kernel
    raise ValueError(f"attention kernel {kernel!r} is not chosen for a platform: choose it with "
                     "models/kernels.for_platform(config, platform) (or kernels.attention_for), as TrainSetup does")


def attention(q, k, v, scale, kernel, layout=NONE, positions=None, source=None):
    """Causal attention by `kernel`, chosen for the devices the step runs on (models/kernels.attention_for of
    `model.attention`: TrainSetup applies kernels.for_platform; an unchosen one is a ValueError). The flash kernel
    runs per shard of the layout's query sharding. Over a sequence split by the layout's context axes, the layout's context
    strategy (context.STRATEGIES, `mesh.context_attention`) attends with `source` (KeySource; by default k and v,
    which are then not needed); else XLA's partitioning of the whole-sequence attention. `positions`: the tokens'
    models/positions.Positions (their global positions, needed when the layout reorders them; where rows hold
    packed documents, which one each token belongs to: it attends only within it)."""
    kernel = chosen(kernel)
    documents = None if positions is None else positions.document
    over_context = context.strategy(layout)
    if over_context is not None:
        return over_context(q, source or KeySource.of_keys(q, k, v), positions, scale, kernel, layout)
    if kernel == "xla" or (kernels.is_splash(kernel) and kernels.splash_block(q.shape[1], kernel) is None):
        return causal_attention(q, k, v, scale, documents=documents)  # (splash: a length no block divides, only in
        #                                          shape-only traces: TrainSetup refuses such a train.seq_len)
    with jax.named_scope(components.ATTENTION_SCORES):
        if kernels.is_splash(kernel):
            return splash_attention(q, k, v, scale, layout.sharding(Q_AXES), kernel=kernel, documents=documents)
        return flash_attention(q, k, v, scale, kernel, layout.sharding(Q_AXES), documents=documents)

"""Model families and the one place a ConfigDict becomes a model."""
import collections

from flax import nnx

from MaxOffload.models import llama
from MaxOffload.offload import policy

Family = collections.namedtuple("Family", "config_class model_class TAGGED_NAMES PRESETS")

FAMILIES = {
    "llama": Family(llama.LlamaConfig, llama.Llama, llama.TAGGED_NAMES, llama.PRESETS),
}


def model_config(cfg):
    """The family's explicit (frozen dataclass) model configuration from cfg.model."""
    return FAMILIES[cfg.model.family].config_class.from_config(cfg.model)


def remat_segments(cfg):
    """((start, stop, jax.checkpoint policy), ...) over the decoder layers."""
    return ((0, cfg.model.num_layers, policy.checkpoint_policy(cfg.remat.policy, dict(cfg.remat.tensors))),)


def build(cfg, rngs=None):
    """The model with freshly initialised parameters (call under jax.eval_shape for shapes only)."""
    rngs = rngs if rngs is not None else nnx.Rngs(params=cfg.run.seed)
    return FAMILIES[cfg.model.family].model_class(model_config(cfg), remat_segments=remat_segments(cfg), rngs=rngs)

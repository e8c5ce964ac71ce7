"""Model families and the one place a ConfigDict becomes a model."""
import collections

from flax import nnx

from MaxOffload.models import deepseek, llama
from MaxOffload.offload import segments

# layer_groups(model_config) -> {name: (start, stop)}: the model's separately scanned stacks.
Family = collections.namedtuple("Family", "config_class model_class TAGGED_NAMES PRESETS layer_groups")

FAMILIES = {
    "llama": Family(llama.LlamaConfig, llama.Llama, llama.TAGGED_NAMES, llama.PRESETS,
                    lambda c: {"decoder": (0, c.num_layers)}),
    "deepseek": Family(deepseek.DeepSeekConfig, deepseek.DeepSeek, deepseek.TAGGED_NAMES, deepseek.PRESETS,
                       deepseek.layer_groups),
}


def model_config(cfg):
    """The family's explicit (frozen dataclass) model configuration from cfg.model."""
    return FAMILIES[cfg.model.family].config_class.from_config(cfg.model)


def layer_groups(cfg):
    return FAMILIES[cfg.model.family].layer_groups(model_config(cfg))


def remat_segments(cfg):
    """[Segment] over all layers: which policy each run of layers is compiled with."""
    return segments.layer_segments(cfg.remat, layer_groups(cfg))


def offloads_activations(cfg):
    """Whether any layer segment moves a tagged activation to pinned host memory."""
    return any(d == "offload" for seg in remat_segments(cfg) for _, d in seg.decisions)


def _segments_by_stack(cfg):
    """{model group: ((start, stop, policy, label), ...)} with start/stop relative to that stack."""
    groups, out = layer_groups(cfg), {}
    for seg in remat_segments(cfg):
        offset = groups[seg.model_group][0]
        out.setdefault(seg.model_group, []).append((seg.start - offset, seg.stop - offset, seg.policy(), seg.label))
    return {k: tuple(v) for k, v in out.items()}


def build(cfg, rngs=None):
    """The model with freshly initialised parameters (call under jax.eval_shape for shapes only)."""
    rngs = rngs if rngs is not None else nnx.Rngs(params=cfg.run.seed)
    return FAMILIES[cfg.model.family].model_class(model_config(cfg), remat_segments=_segments_by_stack(cfg),
                                                  params_on_host=cfg.offload.params, rngs=rngs)

"""Model families and the one place a model configuration + an OffloadPlan become a model."""
import collections

from MaxOffload.models import deepseek, llama

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


def family_of(config):
    """The Family whose configuration class `config` (a model configuration) is."""
    return next(f for f in FAMILIES.values() if isinstance(config, f.config_class))


def build(config, plan, rngs, experts=None):
    """The model for a model configuration under an OffloadPlan (MaxOffload/resolve.py makes both); `experts`:
    the parallel/expert.ExpertLayout its MoE layers exchange tokens over (None: every expert local)."""
    return family_of(config).model_class(config, remat_segments=plan.by_stack(), params_on_host=plan.params_on_host,
                                         rngs=rngs, experts=experts)

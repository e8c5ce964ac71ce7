"""Model families: the registry, and the one place a model configuration + an OffloadPlan become a model.

A family is
  - a frozen config dataclass (deriving from models/base.ModelConfig, which declares the fields every family
    shares, or at least from models/base.FromConfig): its own fields, `validate()` (the family's own checks,
    one ConfigError line each), `layer_groups()` (its separately scanned stacks) and the planner's cost
    table (`contractions`, `matmul_params_per_token`, `attention_dims`);
  - an nnx model class, built as model_class(config, remat_segments=, params_on_host=, rngs=, ctx=): ctx, the
    models/model_context.ModelContext, hands it the parallel layout (parallel/layout.py: mesh, rules, expert
    exchange) and the weight matmuls' numerics (models/matmul.Numerics) as one value, which it hands to each of
    its layers; neither is read from anywhere else;
  - `fields`: its own `model` section keys {key: (default, meaning)}: by default its dataclass's own fields
    (models/base.field carries each one's default and meaning), joined to the config schema by `register`;
  - `hf`: its weights in the Hugging Face layout (models/hf.HFFormat), which MaxOffload/convert reads and
    writes.
The names a family tags are read from its traced forward pass (`Family.tagged_names`), never kept by hand.
Adding a family is one `register` call: nothing else under MaxOffload/ changes (tests/test_family.py).
"""
import dataclasses
import functools

from MaxOffload.models import deepseek, deepseek_hf, llama, llama_hf


@dataclasses.dataclass(frozen=True)
class Family:
    config_class: type
    model_class: type
    fields: dict = None  # {key: (default, meaning)}; None: the config class's own fields (models/base.keys)
    hf: object = None

    def layer_groups(self, config):
        """{name: (start, stop)}: the model's separately scanned stacks, global layer ranges."""
        return config.layer_groups()

    def tagged_names(self, config):
        """The vocabulary names this family's model tags under `config`, in the order the forward pass tags them."""
        return tagged_names(config)


FAMILIES = {}


def register(name, family):
    """Adds a family under model.family=`name`; its own config keys join the `model` section (config/defaults.py
    full_schema: a key another family or the shared section has must keep its default)."""
    if family.fields is None:  # a models/base.ModelConfig's own fields declare its keys
        from MaxOffload.models import base

        family = dataclasses.replace(family, fields=base.keys(family.config_class))
    FAMILIES[name] = family


register("llama", Family(llama.LlamaConfig, llama.Llama, hf=llama_hf.LlamaHF()))
register("deepseek", Family(deepseek.DeepSeekConfig, deepseek.DeepSeek, hf=deepseek_hf.DeepSeekHF()))


def model_config(section):
    """The family's explicit (frozen dataclass) model configuration from a config's `model` section."""
    return FAMILIES[section.family].config_class.from_config(section)


def layer_groups(section):
    """{name: (start, stop)}: the separately scanned stacks of the model a `model` section describes."""
    return model_config(section).layer_groups()


def family_of(config):
    """The Family whose configuration class `config` (a model configuration) is."""
    return next(f for f in FAMILIES.values() if isinstance(config, f.config_class))


def weights(model):
    """{"params": the model's nnx.Params, "model_state": its other variables (e.g. router biases)}, as pure
    dicts: what a train state holds of the model, and what a converted checkpoint holds."""
    from flax import nnx

    _, params, model_state = nnx.split(model, nnx.Param, ...)
    return {"params": nnx.to_pure_dict(params), "model_state": nnx.to_pure_dict(model_state)}


def abstract_model(config):
    """The model of a model configuration, abstract (shapes and dtypes only: nothing is allocated; its kernels
    are the CPU's choices, which have the same parameters and tag the same names as any other's)."""
    from flax import nnx

    from MaxOffload.models import kernels
    from MaxOffload.offload import segments
    from MaxOffload.offload.plan import OffloadPlan

    plan = OffloadPlan(tuple(segments.uniform("full", config.layer_groups())))
    return nnx.eval_shape(lambda: build(kernels.for_platform(config, "cpu"), plan, nnx.Rngs(0)))


def weight_leaves(config):
    """{key path (tuple): ShapeDtypeStruct} of the model's weights (models.weights), empty collections left out."""
    import jax

    tree = weights(abstract_model(config))
    return {tuple(k.key for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def by_architecture(architecture):
    """The family whose Hugging Face layout reads config.json's `architecture`, or None."""
    return next((f for f in FAMILIES.values() if f.hf and architecture in f.hf.architectures), None)


def build(config, plan, rngs, layout=None, numerics=None):
    """The model for a model configuration under an OffloadPlan (MaxOffload/from_config.py makes both), built for a
    parallel layout (parallel/layout.ParallelLayout; None: no mesh, every placement a no-op) and a numerics
    policy (models/matmul.Numerics; None: bf16 in the configured compute dtype): its ModelContext."""
    from MaxOffload.models.model_context import ModelContext

    return family_of(config).model_class(config, remat_segments=plan.by_stack(), params_on_host=plan.params_on_host,
                                         rngs=rngs, ctx=ModelContext.of(config, layout, numerics))


@functools.lru_cache(maxsize=None)
def tagged_names(config):
    """The vocabulary names the model of `config` tags, read off the jaxpr of its forward pass (traced with
    abstract parameters under full remat: nothing is allocated, compiled or run, and no backend starts); a
    sequence of one splash block where the model runs splash attention (whose residuals it names)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from MaxOffload.models import kernels
    from MaxOffload.offload import names

    graphdef, state = nnx.split(abstract_model(config))
    kernel = getattr(config, "attention", "")
    length = (config.attention_block or kernels.SPLASH_LANES) if kernels.is_splash(kernel) else 8
    tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)
    return tuple(n for n in names.traced(jaxpr.jaxpr) if n in names.VOCABULARY)

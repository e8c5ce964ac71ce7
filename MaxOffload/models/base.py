"""What every model family's frozen config dataclass shares."""
import dataclasses

from MaxOffload.errors import require


class FromConfig:
    """Mixin for a family's frozen dataclass: built from a config's `model` section (config read at the edge)."""

    @classmethod
    def from_config(cls, model_cfg):
        return cls(**{f.name: model_cfg[f.name] for f in dataclasses.fields(cls)})

    def validate(self):
        """The family's own checks of its fields: raise errors.ConfigError (one line naming model.KEY and the
        fix) on the first problem. The shared keys (sizes > 0, dtypes) are checked by config/validate.py."""

    def layer_groups(self):
        """{name: (start, stop)}: the separately scanned stacks (remat.groups can name them); one by default."""
        return {"decoder": (0, self.num_layers)}

    def pipelined_group(self):
        """The layer group (of layer_groups) that pipeline stages split (parallel/pipeline.py): a stack of identical
        layers; the others run before or after it on every device, the batch split over the stages too."""
        return "decoder"

    def matmul_params_by_component(self):
        """{models/components part: weights each token multiplies by} (embedding lookup excluded): each part's
        model FLOPs (train/flops.by_component)."""
        raise NotImplementedError(f"{type(self).__name__} does not split its matmul parameters by component")

    def params_stored_twice(self):
        """Parameters this model shares that the family's released checkpoints store a second copy of (counted
        in their published totals); 0 by default."""
        return 0

    def matmul_params_per_token(self):
        """Weights each token multiplies by: the FLOP-bearing parameters (embedding lookup excluded)."""
        return sum(self.matmul_params_by_component().values())

    def active_params(self):
        """Parameters one token's pass uses, as model cards count "activated" parameters: its matmul weights (for
        MoE the router, the top-k routed and the shared experts) and the embedding table (the output head
        already, when tied); norms left out."""
        return self.matmul_params_per_token() + (0 if self.tie_embeddings else self.vocab_size * self.emb_dim)

    def require_positive(self, *fields):
        for f in fields:
            require(getattr(self, f) > 0, f"model.{f} must be > 0, got {getattr(self, f)}")

    def require_non_negative(self, *fields):
        for f in fields:
            require(getattr(self, f) >= 0, f"model.{f} must be >= 0, got {getattr(self, f)}")


def field(default, meaning):
    """A model configuration field: its default and meaning are its `model` section key's (config/defaults.py
    reads them from the dataclass: a key is declared once)."""
    return dataclasses.field(default=default, metadata={"meaning": meaning})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(FromConfig):
    """The fields every family shares, declared once: the `model` section's shared keys are these
    (config/defaults.py reads them from here). A family's dataclass derives from it (kw_only) and adds its own."""
    vocab_size: int = field(512, "vocabulary size (embedding rows); must cover the tokenizer")
    emb_dim: int = field(256, "model width d_model")
    num_layers: int = field(4, "number of decoder layers")
    num_heads: int = field(8, "query heads")
    mlp_dim: int = field(704, "hidden size of the SwiGLU MLP (deepseek: of the dense layers)")
    norm_eps: float = field(1e-5, "RMSNorm epsilon")
    rope_theta: float = field(10000.0, "RoPE base frequency")
    rope_scaling: str = field("none", "RoPE frequency scaling: none | llama3 (Llama 3.1) | yarn (DeepSeek-V3)")
    rope_factor: float = field(8.0, "llama3 scaling: factor for low frequencies; yarn: context extension factor")
    rope_original_max_len: int = field(8192, "llama3 / yarn scaling: original context length")
    tie_embeddings: bool = field(False, "share the token embedding with the output projection")
    param_dtype: str = field("float32", "parameter (and optimizer state) dtype: float32 | bfloat16")
    compute_dtype: str = field("bfloat16", "matmul/activation dtype: float32 | bfloat16")
    attention: str = field("auto", "causal attention: auto (flash on GPUs, splash on TPUs, xla on CPU) | xla "
                                   "(query blocks that skip the keys they cannot see) | flash (tokamax's fused "
                                   "kernel; splash on TPUs; models/kernels.py)")
    attention_block: int = field(0, "splash attention's block on TPUs (models/kernels.py): 0 = the largest of "
                                    "1024/512/256/128 dividing train.seq_len (the fastest on the v5e); else that "
                                    "many tokens, a multiple of 128 dividing train.seq_len")
    vocab_tiles: int = field(0, "the loss's cross-entropy over the vocabulary in this many tiles (models/"
                                "cross_entropy.py): the float32 logits are never whole; 1 = whole logits; 0 = "
                                "auto: tiles of at most 8,192 columns (1 tile for a vocabulary that small)")
    scan_layers: bool = field(True, "scan over layers (compile time flat in depth); false = Python loop")
    init_std: float = field(0.02, "standard deviation of the normal weight initialiser")


def keys(config_class, shared=False):
    """{key: (default, meaning)} of a model configuration class's fields: ModelConfig's (shared=True), or the
    family's own (those ModelConfig does not have)."""
    base = {f.name for f in dataclasses.fields(ModelConfig)}
    return {f.name: (f.default, f.metadata["meaning"]) for f in dataclasses.fields(config_class)
            if (f.name in base) == shared}

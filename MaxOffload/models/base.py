"""What every model family's frozen config dataclass shares."""
import dataclasses

from MaxOffload.errors import require


class FromConfig:
    """Mixin for a family's frozen dataclass: built from a config's `model` section (config read at the edge)."""

    # Multi-token prediction: a family that has it makes these dataclass fields (models/deepseek.py); its model
    # then returns aux["mtp_logits"], which the train step weighs in (train/step.py).
    mtp_depth = 0
    mtp_loss_weight = 0.0

    @classmethod
    def from_config(cls, model_cfg):
        return cls(**{f.name: model_cfg[f.name] for f in dataclasses.fields(cls)})

    def validate(self):
        """The family's own checks of its fields: raise errors.ConfigError (one line naming model.KEY and the
        fix) on the first problem. The shared keys (sizes > 0, dtypes) are checked by config/validate.py."""

    def layer_groups(self):
        """{name: (start, stop)}: the separately scanned stacks (remat.groups can name them); one by default."""
        return {"decoder": (0, self.num_layers)}

    def matmul_params_by_component(self):
        """{models/components part: weights each token multiplies by} (embedding lookup excluded): the model
        FLOPs the compiled-work audit (MaxOffload/audit.py) holds each part of the compiled step to."""
        raise NotImplementedError(f"{type(self).__name__} does not split its matmul parameters by component")

    def compiled_work_multiples(self):
        """{models/components part: x}: the multiple of its model FLOPs a part computes by construction under
        this configuration (the audit's expectation; 1 when absent), e.g. padding rows."""
        return {}

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

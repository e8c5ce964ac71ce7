"""What every model family's frozen config dataclass shares."""
import dataclasses


class FromConfig:
    """Mixin for a family's frozen dataclass: built from the cfg.model section (config read at the edge)."""

    @classmethod
    def from_config(cls, model_cfg):
        return cls(**{f.name: model_cfg[f.name] for f in dataclasses.fields(cls)})

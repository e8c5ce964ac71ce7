"""Configuration: defaults (defaults.py), loading + overrides (loader.py), validation (validate.py)."""
from MaxOffload.config.defaults import get_config
from MaxOffload.config.loader import ConfigError, load

__all__ = ["ConfigError", "get_config", "load"]

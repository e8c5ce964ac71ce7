"""Configuration: defaults (defaults.py), loading + overrides (loader.py), validation (validate.py)."""
from MaxOffload.config.defaults import get_config
from MaxOffload.config.loader import load
from MaxOffload.errors import ConfigError

__all__ = ["ConfigError", "get_config", "load"]

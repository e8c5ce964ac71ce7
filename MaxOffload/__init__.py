"""MaxOffload: JAX training for very large LLMs with activation host offloading."""
__version__ = "0.1.0"

"""Keep CPU-only machines quiet when the CUDA plugin is installed (for the deviceless compile):
without an NVIDIA driver, JAX would try the plugin and print a traceback before falling back."""
import os
import sys


def prefer_cpu_without_gpu():
    """Selects the CPU platform when none is chosen and this machine has no NVIDIA driver.
    Call before JAX's backend starts (JAX may already be imported: its config is updated too)."""
    if "JAX_PLATFORMS" in os.environ or os.path.exists("/proc/driver/nvidia"):
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_platforms", "cpu")


def use_cpu_runtime():
    """The deviceless tools compile for GPUs they never run on: the runtime is always the CPU."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_platforms", "cpu")


def jax_at_least(major, minor):
    """Whether the installed jax is at least major.minor (jax 0.11 changed the deviceless target's cuDNN field and
    gave MXFP8 its CPU and differentiable lowering)."""
    import jax

    return tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (major, minor)

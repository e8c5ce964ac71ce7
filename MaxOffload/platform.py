"""Keep CPU-only machines quiet when the CUDA plugin is installed (for the deviceless compile):
without an NVIDIA driver, JAX would try the plugin and print a traceback before falling back."""
import os


def prefer_cpu_without_gpu():
    """Sets JAX_PLATFORMS=cpu when unset and this machine has no NVIDIA driver. Call before JAX starts."""
    if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/proc/driver/nvidia"):
        os.environ["JAX_PLATFORMS"] = "cpu"

"""Which platform JAX starts on, decided before its backend starts.

The CUDA plugin is installed for the deviceless GPU compile and libtpu for the deviceless TPU compile, so a
machine may hold both without the hardware of either: left alone, JAX would try each and print their
tracebacks before falling back to the CPU. `pick_platform` names the platform the machine really has: an NVIDIA
GPU (JAX finds it itself), a TPU ("tpu,cpu"), else the CPU. JAX_PLATFORMS set by the user always wins
(`JAX_PLATFORMS=cpu` forces the CPU on any machine).
"""
import glob
import importlib.util
import os
import sys

GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips are PCI devices of Google's vendor id (what jax's own check reads)


def _set(platforms):
    os.environ["JAX_PLATFORMS"] = platforms
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_platforms", platforms)


def nvidia_gpu_present():
    return os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidiactl")


def tpu_present():
    """Whether a TPU chip is attached and libtpu is installed to drive it: a PCI device of Google's, or the device
    files of a TPU VM (/dev/accel*, /dev/vfio/N)."""
    if importlib.util.find_spec("libtpu") is None:
        return False
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() == GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def pick_platform():
    """Sets JAX_PLATFORMS to the machine's accelerator (see the module's docstring) unless it is set already.
    Call before JAX's backend starts (JAX may already be imported: its config is updated too)."""
    if "JAX_PLATFORMS" in os.environ or nvidia_gpu_present():
        return
    _set("tpu,cpu" if tpu_present() else "cpu")


def chosen_platform():
    """"tpu" | "gpu" | "cpu": the platform JAX starts on after pick_platform (from JAX_PLATFORMS; unset on a machine
    with an NVIDIA GPU)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms.startswith("tpu"):
        return "tpu"
    if platforms.startswith(("cuda", "gpu", "rocm")) or (not platforms and nvidia_gpu_present()):
        return "gpu"
    return "cpu"


def use_cpu_runtime():
    """The deviceless tools compile for accelerators they never run on: the runtime is always the CPU."""
    _set("cpu")


def jax_at_least(major, minor):
    """Whether the installed jax is at least major.minor (jax 0.11 changed the deviceless target's cuDNN field and
    gave MXFP8 its CPU and differentiable lowering)."""
    import jax

    return tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (major, minor)

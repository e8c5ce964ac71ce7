"""Known XLA miscompiles of activation offload, by jaxlib version — why the parity gate exists.

openxla/xla#46231: on GPUs, scan residuals offloaded by name were read back at wrong offsets, giving silently
wrong gradients (a regression from openxla/xla#41348, 2026-04-22; fixed by openxla/xla#46308, 2026-07-27).
jaxlib 0.10.1 to 0.11.0 carry it; 0.11.1 and later are fixed. On CPU an offloaded tensor is simply saved, so
only GPU runs (and programs compiled for GPUs) are affected.
"""
import re

SCAN_RESIDUAL_OFFSETS = {"bug": "openxla/xla#46231 (offloaded scan residuals read back at wrong offsets: "
                                "silently wrong gradients)",
                         "first": (0, 10, 1), "last": (0, 11, 0), "fixed": "jax/jaxlib >= 0.11.1"}


def _version(text):
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def offload_miscompile(jaxlib_version=None):
    """One line naming the bug and the fixed versions when `jaxlib_version` (default: the installed
    jaxlib) has it, else None."""
    if jaxlib_version is None:
        import jaxlib

        jaxlib_version = jaxlib.__version__
    bug = SCAN_RESIDUAL_OFFSETS
    if bug["first"] <= _version(jaxlib_version) <= bug["last"]:
        return (f"jaxlib {jaxlib_version} has XLA bug {bug['bug']} when activations are offloaded on GPUs; "
                f"fixed in {bug['fixed']} (pip install -U jax jaxlib on Python 3.12)")
    return None


def affects(plan, platform):
    """The bug line when an OffloadPlan offloads activations on `platform` "gpu" with an affected jaxlib, else
    None."""
    if platform != "gpu" or not plan.offloads_activations:
        return None
    return offload_miscompile()

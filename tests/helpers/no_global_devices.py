"""python tests/helpers/no_global_devices.py MODULE [ARGS ...]: `python -m MODULE ARGS` with jax's global device
reads (jax.devices, jax.local_devices, jax.device_count, jax.local_device_count) by the project's code turned into
errors, for tests/test_aot.py and tests/test_tpu.py: what a deviceless compile selects for its target (kernels, peak, memory)
must come from the target's devices, never from this process's. (jax.default_backend stays: deviceless.lowering
asks it whether this process itself has GPUs, a question about the process, not the target.)"""
import os
import runpy
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
READS = ("devices", "local_devices", "device_count", "local_device_count")


def refused(name, original):
    """jax.NAME refused to the project's code (jax's own code still reads it, e.g. Pallas' Triton lowering)."""
    def read(*args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller == "MaxOffload" or caller.startswith("MaxOffload."):
            raise AssertionError(f"a global device read in {caller}: jax.{name}() (the target's devices are passed in)")
        return original(*args, **kwargs)
    return read


for name in READS:
    setattr(jax, name, refused(name, getattr(jax, name)))
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)

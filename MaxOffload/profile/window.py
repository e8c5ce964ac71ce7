"""Start/stop a profiler around a window of training steps.

xprof: jax.profiler.start_trace/stop_trace into <run.output_dir>/profile (TensorBoard's profile plugin,
       XProf or Perfetto open it; python -m MaxOffload.profile.overlap reads it).
nsys:  cudaProfilerStart/Stop from libcudart, so `nsys profile --capture-range=cudaProfilerApi` records only
       these steps; without a GPU (or libcudart) a no-op with a message.
"""
import ctypes
import ctypes.util
import glob
import os

import jax


def _cudart():
    """libcudart via ctypes, or None."""
    names = [ctypes.util.find_library("cudart"), "libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    try:  # the pip wheel JAX's CUDA plugin uses
        import nvidia.cuda_runtime

        for root in nvidia.cuda_runtime.__path__:
            names += sorted(glob.glob(os.path.join(root, "lib", "libcudart.so*")))
    except ImportError:
        pass
    for name in filter(None, names):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


class Window:
    """Steps first..last (1-based, as in metrics.jsonl) under the profiler of `mode`."""

    def __init__(self, mode, start_step, num_steps, directory, say=print):
        self.mode, self.first, self.last = mode, start_step, start_step + num_steps - 1
        self.directory, self.say, self.active, self._cudart = directory, say, False, None

    def starts_at(self, step):
        return self.mode != "off" and step == self.first

    def ends_at(self, step):
        return self.active and step == self.last

    def start(self):
        if self.mode == "xprof":
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory)
        elif self.mode == "nsys":
            if jax.default_backend() != "gpu" or (lib := _cudart()) is None:
                self.say(f"profile.mode=nsys: no CUDA GPU/libcudart here (backend {jax.default_backend()}); "
                         "steps not bracketed")
                return
            rc = lib.cudaProfilerStart()
            if rc != 0:
                self.say(f"profile.mode=nsys: cudaProfilerStart returned {rc}; steps not bracketed")
                return
            self._cudart = lib
        self.active = True
        self.say(f"profile: {self.mode} capturing steps {self.first}-{self.last}")

    def stop(self):
        """Stops the capture; returns the trace directory (xprof) or None."""
        if not self.active:
            return None
        self.active = False
        if self.mode == "xprof":
            jax.profiler.stop_trace()
            self.say(f"profile: trace of steps {self.first}-{self.last} in {self.directory} "
                     f"(python -m MaxOffload.profile.overlap {self.directory})")
            return self.directory
        self._cudart.cudaProfilerStop()
        self.say(f"profile: nsys capture range closed after step {self.last}")
        return None

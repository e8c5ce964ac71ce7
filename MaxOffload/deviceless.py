"""Compile-only GPU and TPU devices on a CPU machine, for the targets of MaxOffload/hardware.py: XLA's GPU
compiler through the JAX CUDA plugin, the TPU compiler through libtpu (the wheel jax's `[tpu]` extra pins). A
library for the aot tool, the planner's confirming compile and dry runs.
"""

from MaxOffload.errors import ConfigError

HOST_USABLE = 0.9  # share of the host RAM per GPU that pinned buffers may take (the OS and the job need the rest)


def plugin_missing(target=None):
    """One line saying what to install, or None when the compiler of `target` (a key of hardware.ACCELERATORS;
    None: a GPU) is present: the JAX CUDA plugin for GPUs, libtpu for TPUs."""
    import importlib.util

    import jaxlib

    from MaxOffload import hardware

    if target is not None and hardware.ACCELERATORS[target].platform == "tpu":
        if importlib.util.find_spec("libtpu"):
            return None
        return (f"the deviceless TPU compile needs libtpu, the TPU compiler jax {jaxlib.__version__} pins: "
                f"pip install 'jax[tpu]=={jaxlib.__version__}' (or pip install -e '.[tpu]')")

    for name in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
        try:
            if importlib.util.find_spec(name):
                return None
        except ModuleNotFoundError:  # no jax_plugins package at all
            pass
    v = jaxlib.__version__
    return (f"the deviceless GPU compile needs the JAX CUDA plugin matching jaxlib {v}: "
            f"pip install 'jax-cuda13-plugin=={v}' 'jax-cuda13-pjrt=={v}' (or pip install -e '.[aot]')")


def require_plugin(context="", target=None):
    """ConfigError (one line, exit 2) saying what to install when `target`'s compiler is missing (plugin_missing);
    `context` says what needed it."""
    missing = plugin_missing(target)
    if missing:
        raise ConfigError(f"{context}: {missing}" if context else missing)


def require_target(cfg):
    """ConfigError (one line) unless aot.target's compiler is installed (require_plugin) and xla.preset is one that
    target takes (xla.require_preset_for): the aot tool's and the planner's checks before they compile."""
    from MaxOffload import hardware, xla

    require_plugin(target=cfg.aot.target)
    xla.require_preset_for(cfg.xla.preset, hardware.ACCELERATORS[cfg.aot.target].platform,
                           f"aot.target={cfg.aot.target}")


def lowering(device):
    """Context for lowering a step for the devices of `device`'s kind: for GPUs this process does not have (the
    deviceless compile), Pallas-Triton reads the target GPU's kind from the default device (jax >= 0.12). It asks
    this process's backend whether it has GPUs, which is why it lives here and not with the models."""
    import contextlib

    import jax

    if device.platform in ("gpu", "cuda", "rocm") and jax.default_backend() != "gpu":
        return jax.default_device(device)
    return contextlib.nullcontext()


def compile_only_devices(target, topology, num_slices=1):
    """The compile-only devices of `target` (a key of hardware.ACCELERATORS) in `topology` (GPUs: SxHxG; TPUs: a
    slice's chip grid, `num_slices` of them). Turns JAX's persistent compilation cache off for this process: it
    cannot load an executable compiled for these devices (each hit would be a warning, "PjRtCompiler must be
    constructed with a Client"), so its entries are waste."""
    import jax
    from jax.experimental import topologies

    jax.config.update("jax_enable_compilation_cache", False)
    from MaxOffload import hardware

    if hardware.ACCELERATORS[target].platform == "tpu":
        return tpu_devices(target, topology, num_slices)
    description = topologies.get_topology_desc(platform="cuda", topology_name=f"{target}:{topology}",
                                               target_config=hardware.xla_target_config(
                                                   hardware.ACCELERATORS[target]),
                                               topology=topology)
    return description.devices


def tpu_devices(target, topology, num_slices=1):
    """Compile-only TPU chips: `num_slices` slices of the chip grid `topology`, hosts of up to 2x2 chips (how
    libtpu lays out v5e, v5p and v6e hosts of multi-host slices; a host's size changes no compiled program of one
    process per host). libtpu says on stderr that it found no TPU on this machine; that is expected."""
    import os

    from jax.experimental import topologies

    # libtpu takes a machine-wide lock file (/tmp/libtpu_lockfile) so that one process drives the chips; compiling
    # for compile-only chips drives none, and two such compiles (the planner's and a test's, two tools) may run at once
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    dims = [int(d) for d in topology.split("x")] + [1] * (3 - len(topology.split("x")))
    per_host = (min(dims[0], 2), min(dims[1], 2), 1)
    return topologies.get_topology_desc(platform="tpu", topology_name=f"{target}:{topology}",
                                        chip_config_name="default", chips_per_host_bounds=per_host,
                                        num_slices=num_slices).devices

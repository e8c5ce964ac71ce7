"""Compile-only GPU devices on a CPU machine: XLA's GPU compiler through the JAX CUDA plugin, for the targets
of MaxOffload/hardware.py. A library for the aot tool, the planner's confirming compile and dry runs.
"""

from MaxOffload.errors import ConfigError

HOST_USABLE = 0.9  # share of the host RAM per GPU that pinned buffers may take (the OS and the job need the rest)


def plugin_missing():
    """One line saying what to install, or None when the JAX CUDA plugin is present."""
    import importlib.util

    import jaxlib

    for name in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
        try:
            if importlib.util.find_spec(name):
                return None
        except ModuleNotFoundError:  # no jax_plugins package at all
            pass
    v = jaxlib.__version__
    return (f"the deviceless GPU compile needs the JAX CUDA plugin matching jaxlib {v}: "
            f"pip install 'jax-cuda13-plugin=={v}' 'jax-cuda13-pjrt=={v}' (or pip install -e '.[aot]')")


def require_plugin(context=""):
    """ConfigError (one line, exit 2) saying what to install when the JAX CUDA plugin is missing; `context`
    says what needed it."""
    missing = plugin_missing()
    if missing:
        raise ConfigError(f"{context}: {missing}" if context else missing)


def compile_only_devices(target, topology):
    """The compile-only devices of `target` (a key of hardware.ACCELERATORS) in `topology` (SxHxG). Turns JAX's
    persistent compilation cache off for this process: it cannot load an executable compiled for these devices
    (each hit would be a warning, "PjRtCompiler must be constructed with a Client"), so its entries are waste."""
    import jax
    from jax.experimental import topologies

    jax.config.update("jax_enable_compilation_cache", False)
    from MaxOffload import hardware

    description = topologies.get_topology_desc(platform="cuda", topology_name=f"{target}:{topology}",
                                               target_config=hardware.xla_target_config(
                                                   hardware.ACCELERATORS[target]),
                                               topology=topology)
    return description.devices

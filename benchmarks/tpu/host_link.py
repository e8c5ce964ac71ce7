"""The host link of this machine's first accelerator, both ways, as the step's offload copies use it: a jitted copy
of a device array into pinned host memory and back (what XLA emits for an offloaded activation), and jax.device_put
between the memory kinds (the runtime's own transfer), for each size; median of 5 after a warm-up.

    python benchmarks/tpu/host_link.py [--sizes_mib 256,1024] [--json PATH]
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from benchmarks.common import median_seconds  # noqa: E402  (after the path, like a tool run from a checkout)


def measure(size_mib):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    device, host = (NamedSharding(mesh, P(), memory_kind=kind) for kind in ("device", "pinned_host"))
    x = jax.device_put(jnp.ones((size_mib * 2**20 // 4,), jnp.float32), device)
    to_host = jax.jit(lambda a: a, out_shardings=host)
    on_host = to_host(x)
    to_device = jax.jit(lambda a: a, out_shardings=device)
    nbytes = x.size * 4
    rows = {}
    for label, fn, arg in (("jit d2h", to_host, x), ("jit h2d", to_device, on_host),
                           ("device_put d2h", lambda a: jax.device_put(a, host), x),
                           ("device_put h2d", lambda a: jax.device_put(a, device), on_host)):
        seconds = median_seconds(fn, arg)
        rows[label] = {"bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9}
    return rows


def main(argv):
    """Exit status; a mistake in the input prints one line (MaxOffload/cli.py)."""
    from MaxOffload.cli import run

    return run(_main, argv)


def _main(argv):
    from MaxOffload import cli
    from MaxOffload.errors import ConfigError

    rest, options, _ = cli.parse(argv, __doc__, keys=(), options={"--sizes_mib": "256,1024", "--json": ""})
    if rest:
        raise ConfigError(f"unexpected argument {rest[0]!r}; see --help")
    try:
        sizes = [int(s) for s in options["--sizes_mib"].split(",")]
    except ValueError:
        raise ConfigError(f"--sizes_mib={options['--sizes_mib']}: give sizes in MiB, e.g. 256,1024") from None
    out = options["--json"] or None
    from MaxOffload.platform import pick_platform

    pick_platform()
    import jax

    device = jax.devices()[0]
    results = {"device_kind": device.device_kind, "platform": device.platform, "sizes": {}}
    for size in sizes:
        results["sizes"][size] = measure(size)
        for label, r in results["sizes"][size].items():
            print(f"{size:6d} MiB {label:15s} {r['seconds'] * 1e3:9.2f} ms {r['gb_per_s']:7.2f} GB/s", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

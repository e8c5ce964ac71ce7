"""Environment for a GPU job, from the config: `eval "$(python -m MaxOffload.parallel.launch_env CONFIG.py[:ARG] ...)"`.

Prints `export NAME=VALUE` lines (shell-quoted) that must be set before JAX starts its backend:
  XLA_PYTHON_CLIENT_MEM_FRACTION      launch.mem_fraction: share of HBM JAX preallocates (0.88-0.9 in recipes).
  XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB   launch.host_memory_limit_gb: pinned host pool per process; the default
                                      (64 GB) is too small for activation/parameter offload recipes.
  XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE=false  reserve that pool lazily, so a large limit costs nothing unused.
  NCCL_CUMEM_ENABLE=1                 cuMem allocations; must stay enabled for multi-node NVLink (MNNVL).
  NCCL_NVLS_ENABLE=1                  NVLink SHARP (in-switch reductions) on NVSwitch systems.
  NCCL_MNNVL_ENABLE=1                 NCCL over the multi-node NVLink domain (an NVL72 rack; needs IMEX).
  XLA_FLAGS                           launch.xla_flags, appended to any XLA_FLAGS already in the environment.
  MAXOFFLOAD_NODES_PER_SLICE          launch.nodes_per_slice: nodes per NVLink domain (slice for mesh.dcn).
  MAXOFFLOAD_GPUS_PER_NODE            launch.gpus_per_node: GPUs (= tasks) per node.
A config mistake prints "error: ..." on stderr and exits 2, like train.py.
"""
import os
import shlex
import sys


def exports(cfg, environ=None):
    """[(name, value)] for a GPU job of this config."""
    environ = os.environ if environ is None else environ
    launch = cfg.launch
    xla_flags = " ".join([environ.get("XLA_FLAGS", "").strip(), *map(str, launch.xla_flags)]).strip()
    return [
        ("XLA_PYTHON_CLIENT_MEM_FRACTION", str(launch.mem_fraction)),
        ("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(launch.host_memory_limit_gb)),
        ("XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE", "false"),
        ("NCCL_CUMEM_ENABLE", "1"),
        ("NCCL_NVLS_ENABLE", "1"),
        ("NCCL_MNNVL_ENABLE", "1"),
        ("XLA_FLAGS", xla_flags),
        ("MAXOFFLOAD_NODES_PER_SLICE", str(launch.nodes_per_slice)),
        ("MAXOFFLOAD_GPUS_PER_NODE", str(launch.gpus_per_node)),
    ]


def main(argv):
    from MaxOffload.config import ConfigError, load

    try:
        cfg = load(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, value in exports(cfg):
        print(f"export {name}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

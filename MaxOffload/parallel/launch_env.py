"""Environment for a job, from the config: `eval "$(python -m MaxOffload.parallel.launch_env [--cpu] CONFIG.py[:ARG] ...)"`.

Prints `export NAME=VALUE` lines (shell-quoted) for the Slurm launcher (launchers/slurm/nvl72.sbatch):
  MAXOFFLOAD_RESTARTS                 launch.restarts: how often the launcher starts a failed job step again.
and, for a GPU job (not with --cpu), what must be set before JAX starts its backend:
  XLA_PYTHON_CLIENT_MEM_FRACTION      launch.mem_fraction: share of HBM JAX preallocates (0.88-0.9 in recipes).
  XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB   pinned host pool per process (XLA's default, 64 GB, is too small for offload
                                      recipes): launch.host_memory_limit_gb, or when 0 derived from the plan —
                                      <run.output_dir>/aot_report.json's host bytes per device + 25% + 4 GB —
                                      capped at 90% of the host RAM per GPU of aot.target.
  XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE=false  reserve that pool lazily, so a large limit costs nothing unused.
  NCCL_CUMEM_ENABLE=1                 cuMem allocations; must stay enabled for multi-node NVLink (MNNVL).
  NCCL_NVLS_ENABLE=1                  NVLink SHARP (in-switch reductions) on NVSwitch systems.
  NCCL_MNNVL_ENABLE=1                 NCCL over the multi-node NVLink domain (an NVL72 rack; needs IMEX).
  XLA_FLAGS                           xla.preset + xla.extra_flags (MaxOffload/xla.py, checked against the
                                      installed jaxlib), appended to any XLA_FLAGS already in the environment.
  MAXOFFLOAD_NODES_PER_SLICE          launch.nodes_per_slice: nodes per NVLink domain (slice for mesh.dcn).
  MAXOFFLOAD_GPUS_PER_NODE            launch.gpus_per_node: GPUs (= tasks) per node.
A config mistake prints "error: ..." on stderr and exits 2, like train.py.
"""
import math
import os
import shlex
import sys

from MaxOffload.cli import tool
from MaxOffload.jsonfile import is_a, read_json


def host_memory_limit_gb(cfg):
    """launch.host_memory_limit_gb, or (0) the plan's host need with headroom, capped by host RAM per GPU."""
    from MaxOffload import hardware

    if cfg.launch.host_memory_limit_gb > 0:
        return cfg.launch.host_memory_limit_gb
    cap = int(hardware.ACCELERATORS[cfg.aot.target].host_ram_per_gpu * 0.9 / 1e9)
    size = (lambda n: is_a(n, int | float) and 0 <= n < math.inf), "a number of bytes >= 0"
    report = read_json(os.path.join(cfg.run.output_dir, "aot_report.json"), "the aot tool writes it: run `python -m "
                       "MaxOffload.aot` with this config again, or set launch.host_memory_limit_gb",
                       {"host_bytes_per_device": size}, missing_ok=True)
    if report is None:  # no plan yet: a generous share of the host
        return min(cap, 180)
    return min(cap, math.ceil(report["host_bytes_per_device"] * 1.25 / 1e9) + 4)


def exports(cfg, environ=None, gpu=True):
    """[(name, value)] for a job of this config (a GPU job's environment too when `gpu`)."""
    from MaxOffload import xla

    environ = os.environ if environ is None else environ
    launch = cfg.launch
    job = [("MAXOFFLOAD_RESTARTS", str(launch.restarts))]
    if not gpu:
        return job
    xla_flags = " ".join([environ.get("XLA_FLAGS", "").strip(), *xla.extra_flags(cfg.xla)]).strip()  # the preset: per compile
    return job + [
        ("XLA_PYTHON_CLIENT_MEM_FRACTION", str(launch.mem_fraction)),
        ("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(host_memory_limit_gb(cfg))),
        ("XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE", "false"),
        ("NCCL_CUMEM_ENABLE", "1"),
        ("NCCL_NVLS_ENABLE", "1"),
        ("NCCL_MNNVL_ENABLE", "1"),
        ("XLA_FLAGS", xla_flags),
        ("MAXOFFLOAD_NODES_PER_SLICE", str(launch.nodes_per_slice)),
        ("MAXOFFLOAD_GPUS_PER_NODE", str(launch.gpus_per_node)),
    ]


@tool
def main(argv):
    """Exit status; a mistake in the input prints one line (MaxOffload/cli.py)."""
    from MaxOffload import cli
    from MaxOffload.config import load

    argv, _, flags = cli.parse(argv, __doc__, keys=(), flags=("--cpu",))
    lines = exports(load(argv), gpu=not flags["--cpu"])
    for name, value in lines:
        print(f"export {name}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

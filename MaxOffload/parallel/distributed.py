"""Multi-process start-up: single process by default, Slurm auto-detected, or explicit settings.

Call `initialize(cfg)` before anything else touches JAX's backend. One process per GPU is the
norm (srun --ntasks-per-node=4 on a GB200 tray); with one task per node the process drives every
GPU it sees (JAX's own Slurm detection would use GPU 0 only).
"""
import contextlib
import os

from MaxOffload.errors import ConfigError
from MaxOffload.parallel import consensus


def _slurm():
    needed = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    return all(k in os.environ for k in needed) and int(os.environ["SLURM_NTASKS"]) > 1


def _tasks_on_this_node():
    counts = os.environ.get("SLURM_TASKS_PER_NODE", "")  # e.g. "4(x2)" or "1,1"
    node = int(os.environ.get("SLURM_NODEID", "0"))
    per_node = []
    for part in counts.split(","):
        if not part:
            continue
        count, _, repeat = part.partition("(x")
        per_node += [int(count)] * int(repeat.rstrip(")") or 1)
    return per_node[node] if node < len(per_node) else None


def _visible_gpus():
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return len(os.environ["CUDA_VISIBLE_DEVICES"].split(","))
    return int(os.environ.get("SLURM_GPUS_ON_NODE", "0") or 0)


def process_args(cfg):
    """The jax.distributed.initialize arguments for this process, or None for a single process."""
    d = cfg.distributed
    explicit = bool(d.coordinator_address) or d.num_processes > 1
    if not explicit and not _slurm():
        return None
    args = {"initialization_timeout": d.initialization_timeout_s, "heartbeat_timeout_seconds": d.heartbeat_timeout_s}
    if explicit:
        if not d.coordinator_address or d.num_processes < 1 or not 0 <= d.process_id < d.num_processes:
            raise ConfigError("distributed: give coordinator_address=host:port, num_processes >= 1 and "
                              f"0 <= process_id < num_processes (got {d.coordinator_address!r}, {d.num_processes}, "
                              f"{d.process_id})")
        args.update(coordinator_address=d.coordinator_address, num_processes=d.num_processes,
                    process_id=d.process_id)
    else:
        args["cluster_detection_method"] = "slurm"
    on_gpu = not os.environ.get("JAX_PLATFORMS", "").startswith(("cpu", "tpu"))  # platform.pick_platform's choice
    if d.local_device_ids:
        args["local_device_ids"] = list(d.local_device_ids)
    elif not explicit and on_gpu and _tasks_on_this_node() == 1:
        # one task drives the whole node (JAX alone would take GPU SLURM_LOCALID = 0 only)
        args["local_device_ids"] = list(range(_visible_gpus() or cfg.launch.gpus_per_node))
    elif not explicit and on_gpu and _visible_gpus() == 1:
        args["local_device_ids"] = [0]  # per-task GPU binding: the one visible GPU is ordinal 0
    if not explicit and "SLURM_NODEID" in os.environ:
        # NVLink domain of this node, so that mesh.dcn splits across racks (e.g. 18 trays per NVL72)
        args["slice_index"] = int(os.environ["SLURM_NODEID"]) // cfg.launch.nodes_per_slice
    return args


def _identity(args):
    """(coordinator address, this rank, process count) of a start-up plan, or None when JAX has to find them."""
    if "coordinator_address" in args:
        return args["coordinator_address"], args["process_id"], args["num_processes"]
    try:  # Slurm: the address JAX's own Slurm detection will use (the first node, a port from the job id)
        from jax._src.clusters.slurm_cluster import SlurmCluster

        return (SlurmCluster.get_coordinator_address(None, None), int(os.environ["SLURM_PROCID"]),
                int(os.environ["SLURM_NTASKS"]))
    except Exception:  # another JAX: the start-up goes on without the roll call's names
        return None


def initialize(cfg):
    """Joins the multi-process job if there is one; returns (process_index, process_count)."""
    import jax

    from MaxOffload.parallel import rollcall

    args = process_args(cfg)
    if args is None:
        return 0, 1
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeout = cfg.distributed.initialization_timeout_s
    identity = _identity(args)
    watch = rollcall.watch(*identity, timeout) if identity else contextlib.nullcontext()
    if identity:  # JAX's fatal timeout comes after the roll call's one line
        args["initialization_timeout"] = timeout + rollcall.GRACE_S
    try:
        with watch:
            jax.distributed.initialize(**args)
    except Exception as e:  # a runtime failure, reported in one line
        raise ConfigError(f"distributed start-up failed ({type(e).__name__}: {str(e).splitlines()[0][:300]}); check "
                          f"that all processes started and reach the coordinator within {timeout} s") from None
    consensus.agree(consensus.fingerprint(cfg.to_dict()), jax.process_index(), jax.process_count(), timeout)
    return jax.process_index(), jax.process_count()

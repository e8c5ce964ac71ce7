"""XLA scheduling presets -> compile options of the training step; xla.extra_flags and the environment's
XLA_FLAGS, checked against the installed jaxlib before the backend starts.

A preset is applied per compile (`compiler_options`: jax's `.compile(compiler_options=...)`), not through the
process's XLA_FLAGS: so one process can compile a step under several presets (the planner chooses one by the
compiled timelines) and a deviceless compile gets exactly its preset. XLA_FLAGS changed inside a running process
did not reliably reach the GPU compiler (seen here: a preset set by the aot tool's process before any compile left
the deviceless program unchanged, the same flags in the shell's environment changed it).

An unknown flag in XLA_FLAGS aborts the process when JAX's backend starts, and XLA renames flags
between releases (collective pipelining moved from --xla_gpu_enable_pipelined_all_gather=true to
--xla_gpu_pipeline_all_gather=on). So each preset names features; each feature lists its spellings,
newest first, and the first one the installed jaxlib accepts is used. Acceptance is tested in a
subprocess (the only exact test) and cached per jaxlib version.

TPUs take libtpu's flags, the same way (compile options; LIBTPU_INIT_ARGS is libtpu's start-up equivalent). XLA:TPU
accepts an XLA:GPU flag and ignores it, so the GPU presets are refused on TPUs in one line (and the TPU presets
elsewhere); a libtpu flag is tested by compiling a trivial program for a compile-only v5e with it (libtpu answers
"No such compile option" for one it does not know), cached per jaxlib and libtpu version.
"""
import os
import re
import subprocess
import sys

from MaxOffload.errors import ConfigError
from MaxOffload.jsonfile import every, read_json
from MaxOffload.reports import write_json

# feature -> spellings, newest first
FEATURES = {
    "latency_hiding_scheduler": ["--xla_gpu_enable_latency_hiding_scheduler=true"],
    "pipeline_all_gather": ["--xla_gpu_pipeline_all_gather=on", "--xla_gpu_enable_pipelined_all_gather=true"],
    "pipeline_reduce_scatter": ["--xla_gpu_pipeline_reduce_scatter=on",
                                "--xla_gpu_enable_pipelined_reduce_scatter=true"],
    "pipeline_all_reduce": ["--xla_gpu_pipeline_all_reduce=on", "--xla_gpu_enable_pipelined_all_reduce=true"],
    "while_loop_double_buffering": ["--xla_gpu_enable_while_loop_double_buffering=true"],
    "pipelined_host_offloading": ["--xla_gpu_enable_pipelined_host_offloading=true"],
    # libtpu's: the collective flags MaxText's TPU recipes set (fuse async collectives with compute, overlap them
    # on the TensorCore, async all-gathers) and its host-offload test's flag (passes that know host memory)
    "tpu_async_collective_fusion": ["--xla_tpu_enable_async_collective_fusion=true"],
    "tpu_fuse_all_gather": ["--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"],
    "tpu_fusion_multiple_steps": ["--xla_tpu_enable_async_collective_fusion_multiple_steps=true"],
    "tpu_overlap_compute_collective": ["--xla_tpu_overlap_compute_collective_tc=true"],
    "async_all_gather": ["--xla_enable_async_all_gather=true"],
    "tpu_host_aware_passes": ["--xla_tpu_enable_host_aware_passes=true"],
}

_PIPELINED = ["latency_hiding_scheduler", "pipeline_all_gather", "pipeline_reduce_scatter", "pipeline_all_reduce",
              "while_loop_double_buffering"]
_TPU_OVERLAP = ["tpu_async_collective_fusion", "tpu_fuse_all_gather", "tpu_fusion_multiple_steps",
                "tpu_overlap_compute_collective", "async_all_gather"]
PRESETS = {
    "baseline": [],
    "lhs": ["latency_hiding_scheduler"],  # overlap async collectives and host<->device copies with compute
    "lhs_pipelined": _PIPELINED,  # + move collectives of the next layer into this one's loop iteration
    "lhs_pipelined_offload": _PIPELINED + ["pipelined_host_offloading"],  # + the same for offload copies
    "tpu_overlap": _TPU_OVERLAP,  # TPUs: collectives fused with and overlapped under compute
    "tpu_overlap_offload": _TPU_OVERLAP + ["tpu_host_aware_passes"],  # + host-memory-aware passes for offload
}

# the features that only schedule copies to and from host memory: a program with nothing in host memory compiles
# the same with or without them
HOST_COPY_FEATURES = {"pipelined_host_offloading", "tpu_host_aware_passes"}


def platform_of(preset):
    """"tpu" for a preset of libtpu flags, "gpu" for one of XLA:GPU flags, None for baseline (every platform)."""
    features = PRESETS[preset]
    if not features:
        return None
    return "tpu" if all(_is_tpu_flag(FEATURES[f][0]) for f in features) else "gpu"


def presets_for(platform):
    """The presets that mean something on `platform` ("gpu" | "tpu" | "cpu"): baseline and the platform's own (the
    CPU compiles the GPU ones: its tests run them; it knows no libtpu flag)."""
    own = "tpu" if platform == "tpu" else "gpu"
    return [p for p in PRESETS if platform_of(p) in (None, own)]


def require_preset_for(preset, platform, where):
    """ConfigError (one line) when `preset` holds flags `platform` ignores or refuses: never silently ignored."""
    if preset not in presets_for(platform):
        kind = "XLA:TPU (libtpu)" if platform_of(preset) == "tpu" else "XLA:GPU"
        fits = ", ".join(p for p in presets_for(platform))
        raise ConfigError(f"xla.preset={preset} sets {kind} flags only, which {where} does not take; use one of "
                          f"{fits}")


def same_without_host_copies(preset, other):
    """`preset` and `other` differ at most in features that only schedule host copies."""
    return [f for f in PRESETS[preset] if f not in HOST_COPY_FEATURES] == \
        [f for f in PRESETS[other] if f not in HOST_COPY_FEATURES]


_UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (\S+)")


def _cache_path():
    import importlib.metadata

    import jaxlib

    try:  # libtpu's flags are libtpu's: a new libtpu is probed afresh
        libtpu = "-libtpu-" + importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        libtpu = ""
    root = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    return os.path.join(root, "maxoffload", f"xla_flags-jaxlib-{jaxlib.__version__}{libtpu}.json")


def _load_cache():
    """{flag: accepted}; a cache is derived data: a damaged one counts as empty (its flags are probed again and the
    cache written whole)."""
    try:
        return read_json(_cache_path(), "", every(dict, bool), missing_ok=True) or {}
    except ConfigError:
        return {}


def _save_cache(cache):
    try:
        os.makedirs(os.path.dirname(_cache_path()), exist_ok=True)
        write_json(_cache_path(), cache)  # whole or not at all
    except OSError:
        pass  # a cache only


def rejected_flag(flags):
    """The first flag of `flags` the installed jaxlib rejects, or None (starts a CPU backend in a subprocess)."""
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                           text=True, timeout=300)
    if probe.returncode == 0:
        return None
    match = _UNKNOWN.search(probe.stderr)
    return match.group(1) if match else (flags[0] if flags else "?")


_TPU_PROBE = """
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
import jax, numpy as np
from jax.experimental import topologies
devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:1x1", chip_config_name="default",
                                       chips_per_host_bounds=(1, 1, 1), num_slices=1).devices
sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices), ("x",)), jax.sharding.PartitionSpec())
options = dict(f[2:].split("=", 1) for f in sys.argv[1:])
jax.jit(lambda a: a * 2).lower(jax.ShapeDtypeStruct((8, 128), np.float32, sharding=sharding)).compile(
    compiler_options=options)
"""
_NO_OPTION = re.compile(r"No such compile option: '(\w+)'")


def rejected_tpu_flag(flags):
    """The first libtpu flag of `flags` the installed libtpu rejects, or None: a compile for a compile-only v5e with
    them as compile options (libtpu answers "No such compile option" for one it does not know), in a subprocess."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    probe = subprocess.run([sys.executable, "-c", _TPU_PROBE, *flags], env=env, capture_output=True, text=True,
                           timeout=300)
    if probe.returncode == 0:
        return None
    match = _NO_OPTION.search(probe.stderr)
    if match:
        return next((f for f in flags if f[2:].split("=")[0] == match.group(1)), flags[0])
    if "libtpu" in probe.stderr and "No module named" in probe.stderr:
        raise ConfigError("the TPU presets' flags are checked against libtpu, which is not installed: "
                          "pip install -e '.[tpu]'")
    return flags[0] if flags else "?"


# libtpu's flags without the xla_tpu_ prefix that the TPU presets use
_TPU_UNPREFIXED = {"--xla_enable_async_all_gather"}


def _is_tpu_flag(flag):
    return flag.startswith("--xla_tpu_") or flag.split("=")[0] in _TPU_UNPREFIXED


def _probe(todo, rejected, cache):
    """Records in `cache` whether each flag of `todo` is known, `rejected(flags)` naming the first unknown one."""
    while todo:
        bad = rejected(todo)
        if bad is None:
            cache.update({f: True for f in todo})
            return
        cache[bad] = False
        todo = [f for f in todo if f != bad]


def accepted(flags):
    """{flag: bool} — whether the installed jaxlib (libtpu, for a TPU flag) knows each flag (cached per version)."""
    cache = _load_cache()
    todo = [f for f in dict.fromkeys(flags) if f not in cache]
    _probe([f for f in todo if _is_tpu_flag(f)], rejected_tpu_flag, cache)
    _probe([f for f in todo if not _is_tpu_flag(f)], rejected_flag, cache)
    _save_cache(cache)
    return {f: cache[f] for f in flags}


def preset_flags(preset):
    """The flags of a preset's features in the installed jaxlib's spellings."""
    spellings = [s for feature in PRESETS[preset] for s in FEATURES[feature]]
    known = accepted(spellings)
    flags = []
    for feature in PRESETS[preset]:
        usable = [s for s in FEATURES[feature] if known[s]]
        if not usable:
            raise ConfigError(f"xla.preset={preset}: this jaxlib knows no spelling of {feature} "
                              f"({' or '.join(FEATURES[feature])}); choose another preset or upgrade jaxlib")
        flags.append(usable[0])
    return flags


# the enum values of the collective-pipelining options, as compile options spell them
_ENUMS = {"default": "COLLECTIVE_PIPELINING_MODE_DEFAULT", "off": "COLLECTIVE_PIPELINING_MODE_OFF",
          "on": "COLLECTIVE_PIPELINING_MODE_ON", "explicit": "COLLECTIVE_PIPELINING_MODE_EXPLICIT"}


# what a weight-GEMM mode (quant.mode) needs of the compiler: per-tensor FP8 dots become cuBLASLt FP8 matmuls
# only when Triton GEMMs are off (with them on, XLA dequantizes and runs BF16 Triton GEMMs, silently), and only
# unmerged: XLA's dot merger joins GEMMs that share an operand (the query/key/value projections, the MLP's two
# input projections) by concatenating their dequantized weights, each with its own scale, which no FP8 GEMM takes
_FP8_GEMMS = ("--xla_gpu_enable_triton_gemm=false", "--xla_gpu_dot_merger_threshold_mb=0")
QUANT_FLAGS = {"bf16": (), "fp8": _FP8_GEMMS, "mxfp8": _FP8_GEMMS}  # mxfp8's capacity-mode experts: per tensor


# XLA's GPU compiler rematerializes (HloRematerialization, after scheduling) while its estimate of the step's peak
# memory exceeds a limit: 80% of the device's memory less the outputs, x this factor / 100 (default 95). Its
# estimate can be far off the buffer assignment's: the 405B recipe at 16 micro-batches, estimated 284.7 GiB and
# assigned 138.9 GiB, got 1,201 instructions recomputed (0.27x the step's FLOPs, most of an MLP forward per
# layer). A limit this many times higher never binds (and leaves the scheduler's overlap unconstrained by it):
# recomputation is then the plan's alone, and the aot verdict checks what the buffer assignment needs.
NO_HLO_REMAT_SLOP_FACTOR = 10000


# XLA:TPU takes no slop factor; its rematerialization pass is turned off by name (a DebugOptions flag libtpu
# accepts as a compile option): a program over HBM is then refused at compile with the bytes it needs.
NO_HLO_REMAT_TPU = {"xla_disable_hlo_passes": "rematerialization"}


# XLA:GPU's decomposition of ragged-all-to-all into dense collectives (xla.ragged_decomposer)
RAGGED_DECOMPOSER = {"xla_gpu_unsupported_enable_ragged_all_to_all_decomposer": True}


def compiler_options(preset, quant_mode="bf16", hlo_rematerialization=True, platform="gpu"):
    """{option: value} for jax's `.compile(compiler_options=...)` on devices of `platform`: the preset's features
    (baseline: none, XLA's defaults), what `quant_mode` needs (QUANT_FLAGS: XLA:GPU's GEMM rewrites; none on TPUs),
    and XLA's own rematerialization off when asked."""
    tpu = platform == "tpu"
    options = {} if hlo_rematerialization else dict(NO_HLO_REMAT_TPU) if tpu else \
        {"xla_gpu_memory_limit_slop_factor": NO_HLO_REMAT_SLOP_FACTOR}
    for flag in [*preset_flags(preset), *(() if tpu else QUANT_FLAGS[quant_mode])]:
        name, _, value = flag[2:].partition("=")
        options[name] = {"true": True, "false": False}.get(value, _ENUMS.get(value, value))
    return options


def extra_flags(xla_cfg):
    """xla.extra_flags, each checked against the installed jaxlib (one ConfigError line for an unknown one)."""
    known = accepted(list(xla_cfg.extra_flags))
    for flag in xla_cfg.extra_flags:
        if not known[flag]:
            raise ConfigError(f"xla.extra_flags: {flag} is not a flag of the installed jaxlib; check its spelling "
                              "(XLA renames flags between releases)")
    return list(xla_cfg.extra_flags)


def check_environment():
    """The flags already in the environment's XLA_FLAGS, checked like xla.extra_flags: XLA aborts the process
    on an unknown one when the backend starts (a fatal log, exit 1); this is one line, exit 2, before that."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not flags:
        return
    known = accepted(flags)
    for flag in flags:
        if not known[flag]:
            import jaxlib

            raise ConfigError(f"XLA_FLAGS (from the environment) holds {flag}, which the installed jaxlib "
                              f"{jaxlib.__version__} does not know; fix its spelling or remove it (XLA renames "
                              "flags between releases)")


def apply(cfg):
    """Checks the environment's XLA_FLAGS and the preset's spellings, and adds xla.extra_flags to XLA_FLAGS; call
    before JAX's backend starts. The preset itself reaches each compile as compile options (TrainSetup). Returns
    the added flags."""
    check_environment()
    preset_flags(cfg.xla.preset)
    flags = extra_flags(cfg.xla)
    if not flags:
        return []
    existing = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join(existing + [f for f in flags if f not in existing])
    return flags

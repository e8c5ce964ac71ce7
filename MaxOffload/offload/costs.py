"""The planner's cost model, pure arithmetic (no tracing, no compiling): per tagged tensor of a model group,
per layer and device, its bytes, the FLOPs and seconds to recompute it and the seconds to copy it over the
host link (`Candidate`); per group the forward compute copies can hide under (`GroupCost`); the machine
(`Machine`: usable HBM, achievable FLOP/s, link, host budget); and what a set of decisions costs in HBM and
host memory (`usage`). The calibration constants and where they were measured are below (docs/planner.md).
MaxOffload/offload/planner.py traces and compiles to feed it; offload/search.py chooses with it.
"""
import dataclasses
import math
import os

from MaxOffload.errors import PlanError
from MaxOffload.models import components
from MaxOffload.offload import names
from MaxOffload.offload.policy import DEVICE, OFFLOAD, REMAT

# Speed: the achievable shares of the target's peaks are the timeline's calibration (hardware.calibration_for), so
# the search and the compiled timelines that make the final choice (offload/planner.py) price work alike.
# How much of a layer's compute the analytic search assumes copies hide under, per host link: a prior for the
# search, not a measurement. The planner confirms its candidates by their compiled timelines, which simulate the
# copies where the schedule puts them. PCIe: the H200 run hid ~20% (benchmarks/results/h200_2026-11-29);
# NVLink-C2C: the published +57% for offloading on GB200 needs most copies hidden.
ASSUMED_OVERLAP = {"PCIe": 0.2, "NVLink-C2C": 0.8}
# HBM an offloaded tensor still takes, in layers of it. Measured with the deviceless GB200 compile (docs/planner.md):
# XLA's figure for offloading policies matched base + kept tensors with no staging term (2 layers over-predicted
# minimal_offloaded by 9.7%), so 0; raise it if a real GPU's figures say otherwise.
OFFLOAD_STAGING_LAYERS = 0
# XLA:CPU: step time a stored byte costs. Recomputing was FASTER than saving on the 2-core machine (a 2-layer
# llama, emb 512, mlp 2048, 8 x 256 tokens, float32: full remat 1.09 s, save_all 1.23 s; docs/planner.md), far
# beyond memory bandwidth (stored activations change XLA:CPU's fusions and layouts): fitted to that run.
CPU_SAVE_S_PER_BYTE = 3.8e-9  # 0.38 s over the 100 MB save_all stores, beyond its predicted recompute saving



@dataclasses.dataclass(frozen=True)
class Candidate:
    """One tagged tensor of one model group, per layer and per device."""
    group: str
    name: str
    layers: int
    bytes: int  # per layer per device
    recompute_flops: float  # per layer per device, the matmul that regenerates it
    recompute_s: float  # per layer
    transfer_s: float  # per layer, one direction over the host link
    options: tuple  # decisions allowed (the scan carry cannot be recomputed)
    pinned: str = ""  # remat.tensors.NAME given by the user
    remat_bytes: float = 0.0  # per layer: its share of the backward's recompute working set (see with_recompute_hbm)
    save_s: float = 0.0  # per layer: what storing it costs the step (bytes x Machine.save_s_per_byte)
    kept_scale: float = 1.0  # HBM a kept tensor takes per byte of it (see with_recompute_hbm)

    @property
    def density(self):
        """Net seconds saved per byte kept: the greedy order."""
        return (self.recompute_s - self.save_s) / max(self.bytes, 1)


@dataclasses.dataclass(frozen=True)
class GroupCost:
    group: str
    layers: int
    forward_flops: float  # per layer per device
    forward_s: float  # per layer


@dataclasses.dataclass(frozen=True)
class Machine:
    name: str
    hbm_usable: float
    peak_flops: float  # achievable
    hbm_bandwidth: float  # achievable
    host_link_bandwidth: float  # achievable, per direction; inf = copies are free (CPU)
    host_budget: float
    gpu: bool
    overlap: float = 1.0  # share of a layer's compute the search assumes copies hide under (ASSUMED_OVERLAP)
    save_s_per_byte: float = 0.0  # step time a stored byte costs (written in the forward, read in the backward)
    fp8_peak_flops: float = None  # achievable in FP8 GEMMs (quant.mode); None: peak_flops
    platform: str = "gpu"  # "gpu" | "tpu" | "cpu": which XLA presets mean something (xla.presets_for)

    def rate(self, fp8):
        """Achievable FLOP/s of a GEMM, in FP8 or not."""
        return (self.fp8_peak_flops or self.peak_flops) if fp8 else self.peak_flops


def machine(accelerator, mem_fraction, host_state_bytes=0):
    from MaxOffload.deviceless import HOST_USABLE
    from MaxOffload.hardware import calibration_for, usable_hbm

    shares = calibration_for(accelerator)
    hbm = accelerator.hbm_bandwidth * shares["hbm_efficiency"]
    return Machine(accelerator.name, usable_hbm(accelerator, mem_fraction),
                   accelerator.bf16_peak_flops * shares["matmul_efficiency"], hbm,
                   accelerator.host_link_bandwidth * shares["link_efficiency"],
                   accelerator.host_ram_per_gpu * HOST_USABLE - host_state_bytes, True,
                   ASSUMED_OVERLAP[accelerator.host_link.split()[0]], 2 / hbm,
                   accelerator.fp8_peak_flops * shares["matmul_efficiency"], accelerator.platform)


def cpu_machine():
    """XLA:CPU: an offloaded tensor is kept in RAM, so copies cost nothing and 'HBM' is half the RAM."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 8 * 2**30
    return Machine("CPU", ram / 2, 5e10 * (os.cpu_count() or 1), 2e10, math.inf, ram / 2, False,
                   save_s_per_byte=CPU_SAVE_S_PER_BYTE, platform="cpu")


def contraction(model_config, model_group, name, seq_len):
    """K of the matmul that produces `name` (FLOPs = 2 x output elements x K; 0 for non-matmuls), from the
    family's own table (its config's `contractions`). A tagged name the table lacks is an error, never 0 FLOPs."""
    table = model_config.contractions(model_group, seq_len)
    if name not in table:
        raise PlanError(f"the {type(model_config).__name__} family tags {name!r} but its recompute-cost table "
                        f"(contractions) has no entry for it; add one to its config class")
    return table[name]


def _score_ratio(model_config):
    """Q.K^T FLOPs / P.V FLOPs (qk_dim / v_dim)."""
    _, _, qk, v = model_config.attention_dims()
    return qk / v


def cost_model(mc, groups, m, seq_len, pinned=None, numerics=None):
    """(candidates, {group: GroupCost}) for the model configuration `mc` from placement.activation_groups'
    entries (traced under full remat); `pinned` {name: decision}: what the user fixed (MaxOffload.from_config.pins);
    `numerics` (models/matmul.Numerics): a GEMM of a part it runs in FP8 is timed at the machine's FP8 rate."""
    pinned = pinned or {}
    candidates, costs = [], {}
    for entry in groups.values():
        group, layers = entry["model_group"], entry["layers"][1] - entry["layers"][0] + 1
        forward, forward_fp8 = 0.0, 0.0  # FLOPs; of them in FP8 GEMMs
        for name, t in entry["tensors"].items():
            per_layer = t["bytes_per_device_per_step"] // layers
            elements = per_layer / _itemsize(t["dtype"])
            flops = 2 * elements * contraction(mc, group, name, seq_len)
            part = components.MADE_BY.get(name)
            fp8 = numerics is not None and part is not None and numerics.quantized(part)
            forward += flops * (1 + _score_ratio(mc)) if name in (names.ATTENTION_OUT, names.CONTEXT) else flops
            forward_fp8 += flops if fp8 else 0.0
            if t["result"] in ("unused",):
                continue  # the backward pass never reads it: nothing to decide
            recompute_s = max(flops / m.rate(fp8), 3 * per_layer / m.hbm_bandwidth)
            options = (DEVICE, OFFLOAD) if name in names.ALWAYS_KEPT else (REMAT, DEVICE, OFFLOAD)
            candidates.append(Candidate(group, name, layers, int(per_layer), flops, recompute_s,
                                        per_layer / m.host_link_bandwidth, options, pinned.get(name, ""),
                                        save_s=per_layer * m.save_s_per_byte))
        costs[group] = GroupCost(group, layers, forward,
                                 (forward - forward_fp8) / m.peak_flops + forward_fp8 / m.rate(True))
    return candidates, costs


def _itemsize(dtype):
    import jax.numpy as jnp

    return jnp.dtype(dtype).itemsize


def usage(candidates, decisions):
    """(extra HBM over the base, host bytes, {group: copy seconds per layer}) of decisions. The base holds
    the state, the scan carry and XLA's workspace; a recomputed tensor costs its share of the backward's
    recompute working set, a kept one its bytes x layers, an offloaded one staging only."""
    hbm, host, copy = 0, 0, {}
    for c in candidates:
        d = decisions.get((c.group, c.name), REMAT)
        if d == REMAT:
            hbm += c.remat_bytes * c.layers
        elif d == OFFLOAD:
            host += c.bytes * c.layers
            copy[c.group] = copy.get(c.group, 0.0) + c.transfer_s
            hbm += c.bytes * min(OFFLOAD_STAGING_LAYERS, c.layers)
            if c.name in names.ALWAYS_KEPT:  # the carry is in the full-remat base already
                hbm -= c.bytes * c.layers
        elif d == DEVICE and c.name not in names.ALWAYS_KEPT:
            hbm += c.bytes * c.layers * c.kept_scale
    return hbm, host, copy


def with_recompute_hbm(candidates, full_hbm, saved_hbm):
    """(candidates with remat_bytes set, base) from two compiles of the same step: full remat (`full_hbm`) and
    every candidate kept in HBM (`saved_hbm`). Recomputation is not free in HBM: the backward rebuilds each
    layer's chain with its untagged intermediates (MoE dispatch buffers above all) next to the gradients.
    On DeepSeek small (GB200 deviceless) keeping every tagged tensor took 1,170 MiB, recomputing them 1,224:
    the 235 MiB working set is what the additive model missed (+22%). base = saved_hbm - the kept bytes;
    working set = full_hbm - base, shared among the recomputable tensors by their recompute FLOPs x layers."""
    everything = {(c.group, c.name): DEVICE for c in candidates}
    kept = usage(candidates, everything)[0]
    base = saved_hbm - kept
    if base > full_hbm and kept > 0:
        # keeping the tensors took more HBM than their bytes: the base cannot exceed what full remat holds, so the
        # difference is the kept tensors' (XLA:TPU, Llama-8B width on a v5e: 1.4-1.9x their bytes, its layouts and
        # the copies its fusions keep beside them; benchmarks/results/tpu_v5e_2026-12-05)
        candidates = [dataclasses.replace(c, kept_scale=(saved_hbm - full_hbm) / kept) for c in candidates]
        base = full_hbm
    working = max(0.0, full_hbm - base)
    weights = {id(c): c.recompute_flops * c.layers for c in candidates if REMAT in c.options}
    total = sum(weights.values())
    out = [dataclasses.replace(c, remat_bytes=working * weights[id(c)] / total / c.layers)
           if total and id(c) in weights else c for c in candidates]
    return out, base


def gib(n):
    """n bytes as GiB (or MiB below one GiB), for the planner's lines."""
    return f"{n / 2**30:,.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:,.2f} MiB"

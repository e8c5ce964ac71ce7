"""Automatic offload planner: `remat.policy=auto` -> remat / device / offload per tensor and layer group.

    python -m MaxOffload.offload.planner CONFIG.py[:ARG] [overrides...] [--target gb200] [--topology 2x16x4]
                                         [--no_confirm] [--output_dir DIR]

--target/--topology are aot.target/aot.topology (MaxOffload/cli.py): the last one given wins.

1. Cost model (explicit and small, see `Candidate` and `GroupCost`). The step is traced once under full
   remat (MaxOffload.offload.placement.activation_groups): per model group (llama: decoder; deepseek: dense,
   moe) every tagged tensor's bytes per device (shape x the sharding rules) and whether the backward pass
   needs it at all. Per tensor and layer:
     - recompute FLOPs = 2 x elements per device x K, K = the contraction length of the matmul that
       produced it (`contraction`: e.g. mlpwi_0: emb_dim, out_proj: heads x v_dim, attention_out: seq/2 —
       the causal P.V; norms (mla_q, mla_kv): 0, costed as memory traffic 3 x bytes / HBM bandwidth);
       recompute time = max(FLOPs / achievable peak, 3 x bytes / HBM bandwidth);
     - transfer time = bytes / (host-link bandwidth per direction (hardware.py: NVLink-C2C vs PCIe) x the
       link's measured efficiency, LINK_CALIBRATION);
     - compute available to hide copies = the layer's forward FLOPs / achievable peak (the sum of its
       tagged matmuls plus the Q.K^T scores) for the copy to host, 2x that (+ recomputation) for the copy back;
     - achievable peak = MATMUL_EFFICIENCY x the table's bf16 peak.
     - storing a tensor (kept or offloaded) costs bytes x Machine.save_s_per_byte of step time: 2 / HBM
       bandwidth on a GPU, CPU_SAVE_S_PER_BYTE (measured) on XLA:CPU.
   HBM budget = capacity x launch.mem_fraction - base. With a GPU target the base and the backward's
   recompute working set come from two compiles, full remat and keep-everything (`with_recompute_hbm`):
   base = keep-everything - the kept bytes (parameters, optimizer state, gradients, the scan carry, logits,
   XLA's workspace); working set = full remat - base, shared among the recomputable tensors by recompute
   FLOPs. With --no_confirm / no GPU target: an analytic base (`analytic_base`) and no working set. A
   recomputed tensor costs its working-set share, a kept one its bytes x layers, an offloaded one host bytes
   x layers plus OFFLOAD_STAGING_LAYERS layers of HBM staging. Host budget = host RAM per GPU x
   deviceless.HOST_USABLE - host-resident state.
2. Search (`search`): if recomputing everything does not fit, offload what frees the most HBM first
   (`_fit_first`); if even the least-HBM plan does not fit, PlanError says what it would need. Then greedy
   by net seconds saved per byte: keep in HBM while it fits; otherwise offload while the host budget holds
   and the group's copies still hide under the link's overlap share of compute (LINK_CALIBRATION);
   otherwise recompute. Tensors the user pinned with remat.tensors.NAME stay as given. Then (confirm)
   the plan is compiled deviceless; while XLA's HBM figure is over the usable HBM, the planner charges the
   overshoot to the budget and searches again (at most CONFIRM_ROUNDS compiles, then PlanError).
3. Output: a table (tensor, group, bytes, decision, reason), predicted step time and TFLOP/s per device,
   and the exact override lines (`remat.policy=custom remat.tensors.X=...`, or per model group
   `remat.groups.auto_moe.layers=moe remat.groups.auto_moe.tensors.X=...`).
Plans are cached per config (JSON in ~/.cache/maxoffload/plans, keyed by a hash of everything that
changes the plan). On CPU (no GPU target), offloaded tensors are simply kept (XLA:CPU drops the host
placement), so the planner uses `CPU` below: memory = half the machine's RAM, copies free, storing costly.
"""
import dataclasses
import hashlib
import json
import math
import os
import sys

from MaxOffload.cli import tool
from MaxOffload.errors import PlanError
from MaxOffload.offload import names
from MaxOffload.offload.policy import DEVICE, OFFLOAD, REMAT

PLANNER_VERSION = 3
# Calibration, from measurements (docs/planner.md, "Calibration"):
# achievable share of the bf16 peak: 0.34 measured on an H200 (Llama-8B layers, full remat, XLA's chunked
# attention: 1.38 s/step where 0.6 predicted 0.79 s); the published DeepSeek-V3 GB200 runs imply ~0.31 (578
# TFLOP/s of model FLOPs under remat = 4/3 x that in hardware FLOPs, of a 2.5 PFLOP/s peak) and ~0.36 (908).
MATMUL_EFFICIENCY = 0.35
# Per host link: (share of the nominal bandwidth a copy gets, share of a layer's compute copies hide under).
# PCIe: measured on an H200 (jax 0.11.2): 18.3 GB each way per step cost 0.80 s more than its saved recompute
# with xla.preset=baseline (~46 GB/s, nothing hidden) and 0.61 s with lhs_pipelined_offload (~20% hidden).
# NVLink-C2C: not measured here; the published +57% for offloading on GB200 needs most copies hidden.
LINK_CALIBRATION = {"PCIe": (0.72, 0.2), "NVLink-C2C": (0.8, 0.8)}
# HBM an offloaded tensor still takes, in layers of it. Measured with the deviceless GB200 compile (docs/planner.md):
# XLA's figure for offloading policies matched base + kept tensors with no staging term (2 layers over-predicted
# minimal_offloaded by 9.7%), so 0; raise it if a real GPU's figures say otherwise.
OFFLOAD_STAGING_LAYERS = 0
# XLA:CPU: step time a stored byte costs. Recomputing was FASTER than saving on the 2-core machine (a 2-layer
# llama, emb 512, mlp 2048, 8 x 256 tokens, float32: full remat 1.09 s, save_all 1.23 s; docs/planner.md), far
# beyond memory bandwidth (stored activations change XLA:CPU's fusions and layouts): fitted to that run.
CPU_SAVE_S_PER_BYTE = 3.8e-9  # 0.38 s over the 100 MB save_all stores, beyond its predicted recompute saving
HBM_MARGIN = 0.03  # keep this share of usable HBM free: the model's error bar
CONFIRM_ROUNDS = 3


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
    hbm_bandwidth: float
    host_link_bandwidth: float  # effective, per direction; inf = copies are free (CPU)
    host_budget: float
    gpu: bool
    overlap: float = 1.0  # share of a layer's compute that copies hide under
    save_s_per_byte: float = 0.0  # step time a stored byte costs (written in the forward, read in the backward)


def machine(accelerator, mem_fraction, host_state_bytes=0):
    from MaxOffload.deviceless import HOST_USABLE

    link_efficiency, overlap = LINK_CALIBRATION[accelerator.host_link.split()[0]]
    return Machine(accelerator.name, accelerator.hbm_bytes * mem_fraction,
                   accelerator.bf16_peak_flops * MATMUL_EFFICIENCY, accelerator.hbm_bandwidth,
                   accelerator.host_link_bandwidth * link_efficiency,
                   accelerator.host_ram_per_gpu * HOST_USABLE - host_state_bytes, True, overlap,
                   2 / accelerator.hbm_bandwidth)


def cpu_machine():
    """XLA:CPU: an offloaded tensor is kept in RAM, so copies cost nothing and 'HBM' is half the RAM."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 8 * 2**30
    return Machine("CPU", ram / 2, 5e10 * (os.cpu_count() or 1), 2e10, math.inf, ram / 2, False,
                   save_s_per_byte=CPU_SAVE_S_PER_BYTE)


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


def cost_model(cfg, groups, m, seq_len=None, pinned=None):
    """(candidates, {group: GroupCost}) from placement.activation_groups' entries (traced under full remat);
    `pinned` {name: decision}: what the user fixed (MaxOffload.resolve.pins)."""
    from MaxOffload import models

    mc = models.model_config(cfg)
    seq_len = seq_len or cfg.train.seq_len
    pinned = pinned or {}
    candidates, costs = [], {}
    for entry in groups.values():
        group, layers = entry["model_group"], entry["layers"][1] - entry["layers"][0] + 1
        forward = 0.0
        for name, t in entry["tensors"].items():
            per_layer = t["bytes_per_device_per_step"] // layers
            elements = per_layer / _itemsize(t["dtype"])
            flops = 2 * elements * contraction(mc, group, name, seq_len)
            forward += flops * (1 + _score_ratio(mc)) if name == names.ATTENTION_OUT else flops
            if t["result"] in ("unused",):
                continue  # the backward pass never reads it: nothing to decide
            recompute_s = max(flops / m.peak_flops, 3 * per_layer / m.hbm_bandwidth)
            options = (DEVICE, OFFLOAD) if name in names.ALWAYS_KEPT else (REMAT, DEVICE, OFFLOAD)
            candidates.append(Candidate(group, name, layers, int(per_layer), flops, recompute_s,
                                        per_layer / m.host_link_bandwidth, options, pinned.get(name, ""),
                                        save_s=per_layer * m.save_s_per_byte))
        costs[group] = GroupCost(group, layers, forward, forward / m.peak_flops)
    return candidates, costs


def _itemsize(dtype):
    import jax.numpy as jnp

    return jnp.dtype(dtype).itemsize


@dataclasses.dataclass
class Plan:
    decisions: dict  # (group, name) -> decision
    reasons: dict  # (group, name) -> why
    candidates: list
    costs: dict
    machine: Machine
    base_hbm: float  # full-remat HBM per device (compiled or analytic)
    base_source: str
    hbm_penalty: float = 0.0  # overshoot charged after a confirm round
    compiled_hbm: float = None
    compiled_host: float = None
    model_flops_per_device: float = 0.0
    other_s: float = 0.0  # embedding/unembedding etc.: outside the layers

    def hbm_bytes(self):
        """Predicted HBM per device of this plan."""
        return self.base_hbm + usage(self.candidates, self.decisions)[0]

    def host_bytes(self):
        return usage(self.candidates, self.decisions)[1]

    def step_time(self):
        """Predicted seconds per step: forward + backward (2x) + recomputation + exposed copies."""
        total = self.other_s
        for group, g in self.costs.items():
            members = [c for c in self.candidates if c.group == group]
            recompute = sum(c.recompute_s for c in members if self.decisions[(group, c.name)] == REMAT)
            stored = sum(c.save_s for c in members if self.decisions[(group, c.name)] != REMAT)
            total += g.layers * (3 * g.forward_s + recompute + stored + self.exposed_s(group, recompute))
        return total

    def exposed_s(self, group, recompute=0.0):
        """Per layer: copy time that does not hide under the layer's compute (to host in the forward,
        back in the backward)."""
        g = self.costs[group]
        copy = sum(c.transfer_s for c in self.candidates
                   if c.group == group and self.decisions[(group, c.name)] == OFFLOAD)
        overlap = self.machine.overlap
        return max(0.0, copy - overlap * g.forward_s) + max(0.0, copy - overlap * (2 * g.forward_s + recompute))

    def tflops_per_device(self):
        return self.model_flops_per_device / self.step_time() / 1e12


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
            hbm += c.bytes * c.layers
    return hbm, host, copy


def feasible(candidates, costs, m, budget, decisions, exposed_ok=False):
    """Fits HBM and host, and (unless exposed_ok: fitting needed exposed copies) every group's copies hide."""
    hbm, host, copy = usage(candidates, decisions)
    return hbm <= budget and host <= m.host_budget and (exposed_ok or all(
        t <= m.overlap * costs[g].forward_s * (1 + 1e-9) for g, t in copy.items()))


def _fit_first(candidates, m, budget, decisions, free):
    """When recomputing everything does not fit (the recompute working set, or the carry): offload what frees
    the most HBM, largest first, until it fits. Returns {key: reason} of what it offloaded."""
    forced = {}

    def gain(c):
        return (c.bytes if c.name in names.ALWAYS_KEPT else c.remat_bytes) * c.layers

    movable = [c for c in candidates if not c.pinned and OFFLOAD in c.options and gain(c) > 0]
    for c in sorted(movable, key=lambda c: (-gain(c), c.group, c.name)):
        if usage(candidates, decisions)[0] <= budget:
            break
        trial = {**decisions, (c.group, c.name): OFFLOAD}
        if usage(candidates, trial)[1] <= m.host_budget:
            decisions.clear()
            decisions.update(trial)
            forced[(c.group, c.name)] = (f"offloaded to fit HBM: keeping it needs {_gib(c.bytes * c.layers)}, "
                                         f"recomputing it {_gib(c.remat_bytes * c.layers)} of working memory")
    return forced


def least_hbm(candidates, base_hbm, penalty=0.0):
    """(HBM, host) of the least-HBM plan: every offloadable tensor on the host (pins kept)."""
    decisions = {(c.group, c.name): c.pinned or (OFFLOAD if OFFLOAD in c.options else REMAT) for c in candidates}
    hbm, host, _ = usage(candidates, decisions)
    return base_hbm + penalty + hbm, host


def plan_error(m, hbm, host, what="even the least-HBM plan (every tensor offloaded)"):
    return PlanError(f"no plan fits {m.name}: {what} needs {_gib(hbm)} of HBM per device "
                     f"({_gib(m.hbm_usable)} usable at launch.mem_fraction) and {_gib(host)} of host memory "
                     f"({_gib(m.host_budget)} available); use more devices (mesh), a smaller "
                     "train.per_device_batch_size or train.seq_len, or offload.params / offload.optimizer_state")


def _saved_s(candidates, decisions):
    return sum((c.recompute_s - c.save_s) * c.layers for c in candidates
               if decisions.get((c.group, c.name), REMAT) != REMAT)


def search(candidates, costs, m, base_hbm, penalty=0.0):
    """(decisions, reasons): greedy by recompute seconds saved per byte, then an exchange pass.

    Greedy: in order of density, keep a tensor in HBM if it fits, else offload it if the host memory and
    the group's copy time (which must hide under the machine's overlap share of the layer's forward) allow, else recompute.
    Exchange: for each recomputed tensor, most recompute time first, try saving it (offloaded, else kept)
    after moving kept tensors to the host, largest first, until the plan fits; accepted if it saves time.
    """
    budget = m.hbm_usable * (1 - HBM_MARGIN) - base_hbm - penalty
    decisions, reasons = {}, {}
    for c in candidates:
        key = (c.group, c.name)
        if c.pinned:
            decisions[key], reasons[key] = c.pinned, "pinned by remat.tensors"
        elif c.name in names.ALWAYS_KEPT:
            decisions[key], reasons[key] = DEVICE, "scan carry: kept (in the base)"
    free = sorted((c for c in candidates if (c.group, c.name) not in decisions),
                  key=lambda c: (-c.density, c.bytes, c.group, c.name))
    forced = _fit_first(candidates, m, budget, decisions, free)
    reasons.update(forced)
    exposed_ok = bool(forced)  # fitting took offloads whose copies may not hide: time is charged, not refused
    if not feasible(candidates, costs, m, budget, decisions, exposed_ok=True):
        hbm, host = least_hbm(candidates, base_hbm, penalty)
        raise plan_error(m, hbm, host)
    ok = lambda d: feasible(candidates, costs, m, budget, d, exposed_ok)  # noqa: E731
    for c in free:
        key = (c.group, c.name)
        if key in forced:
            continue
        decisions[key] = REMAT
        if c.recompute_s <= 0:
            reasons[key] = "free to recompute"
            continue
        if c.recompute_s <= c.save_s:
            reasons[key] = (f"recomputing ({c.recompute_s * 1e3:.3g} ms/layer) costs less than storing it "
                            f"({c.save_s * 1e3:.3g} ms)")
            continue
        for choice, why in ((DEVICE, f"fits HBM (saves {c.recompute_s * 1e3:.3g} ms/layer of recompute)"),
                            (OFFLOAD, f"HBM full; its copy ({c.transfer_s * 1e3:.3g} ms) hides under the layer's "
                                      f"{costs[c.group].forward_s * 1e3:.3g} ms forward")):
            trial = {**decisions, key: choice}
            if ok(trial):
                decisions, reasons[key] = trial, why
                break
        else:
            hbm, host, copy = usage(candidates, {**decisions, key: OFFLOAD})
            why = ("host memory full" if host > m.host_budget else "HBM full (even for the staging buffers)"
                   if hbm > budget else "its copy would not hide under the layer's compute")
            reasons[key] = f"{why}: recompute {c.recompute_s * 1e3:.3g} ms/layer"
    def remat_reason(c, decisions):
        hbm, host, copy = usage(candidates, {**decisions, (c.group, c.name): OFFLOAD})
        why = ("host memory full" if host > m.host_budget else "HBM full (even for the staging buffers)"
               if hbm > budget else "its copy would not hide under the layer's compute")
        return f"{why}: recompute {c.recompute_s * 1e3:.3g} ms/layer"

    # exchange pass
    for c in sorted((c for c in free if decisions[(c.group, c.name)] == REMAT and c.recompute_s > c.save_s),
                    key=lambda c: -c.recompute_s * c.layers):
        key = (c.group, c.name)
        for choice in (OFFLOAD, DEVICE):
            trial = {**decisions, key: choice}
            movable = sorted((k for k in free if decisions[(k.group, k.name)] == DEVICE),
                             key=lambda k: -k.bytes * k.layers)
            moved = []
            while not ok(trial) and movable:
                k = movable.pop(0)
                trial[(k.group, k.name)] = OFFLOAD
                moved.append(k)
            if ok(trial) and _saved_s(candidates, trial) > _saved_s(candidates, decisions):
                decisions = trial
                reasons[key] = (f"saved ({choice}) after moving {', '.join(k.name for k in moved)} to the host: "
                                f"saves {c.recompute_s * 1e3:.3g} ms/layer of recompute")
                for k in moved:
                    reasons[(k.group, k.name)] = (f"offloaded to make room in HBM for {c.name}; copy "
                                                  f"{k.transfer_s * 1e3:.3g} ms hides under compute")
                break
    for c in free:
        if decisions[(c.group, c.name)] == REMAT and c.recompute_s > c.save_s:
            reasons[(c.group, c.name)] = remat_reason(c, decisions)
    return decisions, reasons


# ---------------------------------------------------------------------------------------------------
# from a config to a plan


def _target_devices(target, topology):
    if target:
        from MaxOffload import deviceless

        return deviceless.compile_only_devices(target, topology)
    return None


def _accelerator(target, devices):
    from MaxOffload import hardware

    if target:
        return hardware.ACCELERATORS[target]
    import jax

    dev = (devices or jax.devices())[0]
    return hardware.lookup(dev.device_kind) if dev.platform == "gpu" else None


def analytic_base(setup, groups, logits_vocab):
    """Full-remat HBM without a compile: state on the device + gradients + the stacked scan carry +
    float32 logits and their gradient + twice one layer's tagged tensors (the backward's working set)."""
    from MaxOffload.train.step import DEVICE as DEVICE_KIND

    state = setup.state_bytes_per_device(DEVICE_KIND)
    params = setup.state_bytes_per_device() // 3  # params + 2 Adam moments of the same shape
    tokens = setup.cfg.train.per_device_batch_size * setup.cfg.train.seq_len
    carry = sum(t["bytes_per_device_per_step"] for g in groups.values() for n, t in g["tensors"].items()
                if n in names.ALWAYS_KEPT)
    layer = max(sum(t["bytes_per_device_per_step"] for t in g["tensors"].values()) /
                (g["layers"][1] - g["layers"][0] + 1) for g in groups.values())
    return state + params + carry + 2 * 4 * tokens * logits_vocab + 2 * layer


def with_recompute_hbm(candidates, full_hbm, saved_hbm):
    """(candidates with remat_bytes set, base) from two compiles of the same step: full remat (`full_hbm`) and
    every candidate kept in HBM (`saved_hbm`). Recomputation is not free in HBM: the backward rebuilds each
    layer's chain with its untagged intermediates (MoE dispatch buffers above all) next to the gradients.
    On DeepSeek small (GB200 deviceless) keeping every tagged tensor took 1,170 MiB, recomputing them 1,224:
    the 235 MiB working set is what the additive model missed (+22%). base = saved_hbm - the kept bytes;
    working set = full_hbm - base, shared among the recomputable tensors by their recompute FLOPs x layers."""
    everything = {(c.group, c.name): DEVICE for c in candidates}
    base = saved_hbm - usage(candidates, everything)[0]
    working = max(0.0, full_hbm - base)
    weights = {id(c): c.recompute_flops * c.layers for c in candidates if REMAT in c.options}
    total = sum(weights.values())
    out = [dataclasses.replace(c, remat_bytes=working * weights[id(c)] / total / c.layers)
           if total and id(c) in weights else c for c in candidates]
    return out, base


def saved_plan(base, candidates):
    """`base` (an OffloadPlan) with every candidate kept in HBM (the second anchor of with_recompute_hbm)."""
    everything = {(c.group, c.name): DEVICE for c in candidates}
    return to_offload_plan(base, Plan(everything, {}, candidates, {}, None, 0.0, ""))


def compiled_memory(setup):
    """(HBM, pinned host) bytes per device of a TrainSetup's compiled step, from XLA's memory analysis."""
    m = setup.compile_train_step().memory_analysis()
    hbm = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    host = (m.host_argument_size_in_bytes + m.host_output_size_in_bytes - m.host_alias_size_in_bytes
            + m.host_temp_size_in_bytes)
    return hbm, host


def plan(cfg, target=None, topology=None, confirm=True, log=print):
    """The Plan for cfg (remat.policy may be anything; remat.tensors are honoured as pins)."""
    from MaxOffload import models, resolve
    from MaxOffload.offload.placement import activation_groups
    from MaxOffload.train import flops
    from MaxOffload.train.step import HOST

    devices = _target_devices(target, topology)
    accelerator = _accelerator(target, devices)
    setup = resolve.train_setup(cfg, devices, resolve.template(cfg))  # full remat
    m = machine(accelerator, cfg.launch.mem_fraction, setup.state_bytes_per_device(HOST)) if accelerator \
        else cpu_machine()
    groups, _, _ = activation_groups(cfg, setup)
    candidates, costs = cost_model(cfg, groups, m, pinned=resolve.pins(cfg))
    mc = models.model_config(cfg)
    n = setup.mesh.size
    model_flops = flops.train_flops_per_step(mc, cfg.train.per_device_batch_size * n, cfg.train.seq_len) / n
    tokens = cfg.train.per_device_batch_size * cfg.train.seq_len
    other_s = 6 * tokens * mc.emb_dim * mc.vocab_size / m.peak_flops
    confirm = confirm and m.gpu
    if confirm:
        log(f"planner: compiling full remat and keep-everything for {target or accelerator.name} (the HBM base "
            "and the recompute working set) ...")
        full_hbm, _ = compiled_memory(setup)
        saved_hbm, _ = compiled_memory(setup.with_plan(saved_plan(setup.plan, candidates)))
        candidates, base = with_recompute_hbm(candidates, full_hbm, saved_hbm)
        source = ("deviceless compiles" if target else "compiles") + \
            f" of full remat ({_gib(full_hbm)}) and keep-everything ({_gib(saved_hbm)})"
    else:
        base, source = analytic_base(setup, groups, mc.vocab_size), "analytic estimate (no compile)"
    result = Plan({}, {}, candidates, costs, m, base, source, model_flops_per_device=model_flops, other_s=other_s)
    result.decisions, result.reasons = search(candidates, costs, m, base)
    for round_ in range(CONFIRM_ROUNDS if confirm else 0):
        variant = setup.with_plan(to_offload_plan(setup.plan, result))
        log(f"planner: confirming the plan with a compile (round {round_ + 1}) ...")
        result.compiled_hbm, result.compiled_host = compiled_memory(variant)
        over = result.compiled_hbm - m.hbm_usable * (1 - HBM_MARGIN / 2)
        if over <= 0 and result.compiled_host <= m.host_budget:
            break
        if round_ + 1 == CONFIRM_ROUNDS:
            raise plan_error(m, result.compiled_hbm, result.compiled_host,
                             f"the best plan after {CONFIRM_ROUNDS} confirming compiles")
        result.hbm_penalty += max(over, 0) + max(0.0, result.compiled_hbm - result.hbm_bytes())
        result.decisions, result.reasons = search(candidates, costs, m, base, result.hbm_penalty)
    return result


def predict(cfg, target=None, topology=None, offload_plan=None):
    """The cost model's Plan for an OffloadPlan's decisions (default: cfg's own; no search): its decisions per
    model group, predicted step time, TFLOP/s and HBM (analytic base). remat.policy=auto without a plan is
    planned without confirming compiles."""
    from MaxOffload import resolve

    result = plan(cfg, target, topology, confirm=False, log=lambda *a: None)
    if offload_plan is None and not resolve.planned(cfg):
        offload_plan = resolve.static_plan(cfg)
    if offload_plan is not None:
        chosen = {}
        for seg in offload_plan.segments:
            for name, d in seg.decisions:
                chosen[(seg.model_group, name)] = d
        result.decisions = {(c.group, c.name): chosen.get((c.group, c.name), REMAT) for c in result.candidates}
    return result


def check_prediction(cfg, target, topology):
    """(predicted, compiled) HBM bytes per device for cfg's own policy on compile-only GPUs: the HBM model
    (base and recompute working set from the full-remat and keep-everything compiles, + kept tensors)
    against XLA's figure for the same config. Decisions are read from cfg's traced step, per segment."""
    from MaxOffload import resolve
    from MaxOffload.offload.placement import activation_groups
    from MaxOffload.train.step import HOST

    devices = _target_devices(target, topology)
    own = resolve.train_setup(cfg, devices)
    setup = own.with_plan(own.plan.uniform("full"))
    m = machine(_accelerator(target, devices), cfg.launch.mem_fraction, setup.state_bytes_per_device(HOST))
    model_candidates, _ = cost_model(cfg, activation_groups(cfg, setup)[0], m)
    full_hbm, _ = compiled_memory(setup)
    saved_hbm, _ = compiled_memory(setup.with_plan(saved_plan(setup.plan, model_candidates)))
    model_candidates, base = with_recompute_hbm(model_candidates, full_hbm, saved_hbm)
    share = {(c.group, c.name): c.remat_bytes for c in model_candidates}
    candidates, decisions = [], {}
    for label, entry in activation_groups(cfg, own)[0].items():
        layers = entry["layers"][1] - entry["layers"][0] + 1
        for name, t in entry["tensors"].items():
            kind = {"offload": OFFLOAD, "offload+device": DEVICE, "device": DEVICE}.get(t["result"], REMAT)
            candidates.append(Candidate(label, name, layers, t["bytes_per_device_per_step"] // layers, 0, 0, 0, (),
                                        remat_bytes=share.get((entry["model_group"], name), 0.0)))
            decisions[(label, name)] = kind
    return base + usage(candidates, decisions)[0], compiled_memory(own)[0]


# ---------------------------------------------------------------------------------------------------
# plan -> OffloadPlan / override lines (printed, never parsed back) / table


def group_decisions(result):
    """{model group: {name: decision}} over the tagged names the plan decided."""
    out = {}
    for (group, name), d in result.decisions.items():
        out.setdefault(group, {})[name] = d
    return out


def override_lines(result):
    """The exact command-line overrides that reproduce the plan without the planner."""
    per_group = group_decisions(result)
    lines = ["remat.policy=custom"]
    if len(per_group) == 1:
        (only,) = per_group.values()
        return lines + [f"remat.tensors.{n}={d}" for n, d in only.items()]
    for group, chosen in per_group.items():
        lines.append(f"remat.groups.auto_{group}.layers={group}")
        lines += [f"remat.groups.auto_{group}.tensors.{n}={d}" for n, d in chosen.items()]
    return lines


def to_offload_plan(base, result):
    """`base` (an OffloadPlan: the run's state placement) with the plan's decisions on its layers: what the
    override lines give when typed on the command line."""
    return base.per_group(group_decisions(result))


def _gib(n):
    return f"{n / 2**30:,.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:,.2f} MiB"


def format_plan(result):
    m = result.machine
    lines = [f"plan for {m.name}: achievable {m.peak_flops / 1e12:,.0f} TFLOP/s, host link "
             f"{'free (CPU)' if math.isinf(m.host_link_bandwidth) else f'{m.host_link_bandwidth / 1e9:,.0f} GB/s'}",
             f"  {'tensor':<14} {'group':<8} {'bytes/layer':>12} {'x layers':>12} {'recompute':>10} "
             f"{'copy':>9}  {'decision':<8} reason"]
    for c in sorted(result.candidates, key=lambda c: (c.group, -c.bytes * c.layers)):
        d = result.decisions[(c.group, c.name)]
        copy = "-" if math.isinf(m.host_link_bandwidth) else f"{c.transfer_s * 1e3:.3g}ms"
        lines.append(f"  {c.name:<14} {c.group:<8} {_gib(c.bytes):>12} {_gib(c.bytes * c.layers):>12} "
                     f"{c.recompute_s * 1e3:>8.3g}ms {copy:>9}  {d:<8} {result.reasons[(c.group, c.name)]}")
    for group, g in result.costs.items():
        lines.append(f"  group {group}: {g.layers} layers, forward {g.forward_flops / 1e12:,.3g} TFLOP "
                     f"({g.forward_s * 1e3:.3g} ms) per layer per device; exposed copy "
                     f"{result.exposed_s(group) * 1e3:.3g} ms/layer")
    lines.append(f"predicted HBM per device: {_gib(result.hbm_bytes())} (base {_gib(result.base_hbm)}: "
                 f"{result.base_source}) of {_gib(m.hbm_usable)} usable; host {_gib(result.host_bytes())} of "
                 f"{_gib(m.host_budget)}")
    if result.compiled_hbm is not None:
        err = (result.hbm_bytes() - result.compiled_hbm) / result.compiled_hbm
        lines.append(f"compiled HBM per device: {_gib(result.compiled_hbm)} (prediction {err:+.1%}), host "
                     f"{_gib(result.compiled_host)}")
    lines.append(f"predicted step time {result.step_time() * 1e3:,.1f} ms, "
                 f"{result.tflops_per_device():,.1f} TFLOP/s per device")
    lines.append("overrides: " + " ".join(override_lines(result)))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# remat.policy=auto: resolve at start, cached per config


def _cache_dir():
    root = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    return os.path.join(root, "maxoffload", "plans")


def cache_key(cfg, target, topology, device_count=None):
    import jax

    relevant = {k: cfg[k].to_dict() for k in ("model", "remat", "mesh", "offload", "xla")}
    relevant.update(batch=cfg.train.per_device_batch_size, seq_len=cfg.train.seq_len,
                    mem_fraction=cfg.launch.mem_fraction, target=target, topology=topology,
                    devices=device_count, jax=jax.__version__, planner=PLANNER_VERSION,
                    constants=[MATMUL_EFFICIENCY, LINK_CALIBRATION, OFFLOAD_STAGING_LAYERS, HBM_MARGIN])
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[:20]


def resolve(cfg, target=None, topology=None, confirm=True, use_cache=True, log=print):
    """The run's OffloadPlan: cfg's own (MaxOffload.resolve.static_plan), or for remat.policy=auto the planned
    one, cached per config. target/topology: plan for compile-only GPUs (the aot tool); None: for this
    process's devices."""
    from MaxOffload import resolve as resolve_lib

    if not resolve_lib.planned(cfg):
        return resolve_lib.static_plan(cfg)
    import jax

    key = cache_key(cfg, target, topology, None if target else jax.device_count())
    path = os.path.join(_cache_dir(), key + ".json")
    cached = None
    if use_cache:
        try:
            with open(path) as f:
                cached = json.load(f)
            chosen, lines = cached["decisions"], cached["overrides"]
            log(f"remat.policy=auto: cached plan {path}")
        except (OSError, ValueError, KeyError):
            cached = None
    if cached is None:
        result = plan(cfg, target, topology, confirm=confirm, log=log)
        log(format_plan(result))
        chosen, lines = group_decisions(result), override_lines(result)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump({"decisions": chosen, "overrides": lines, "predicted_step_s": result.step_time(),
                           "predicted_tflops_per_device": result.tflops_per_device(),
                           "predicted_hbm_bytes": result.hbm_bytes(), "compiled_hbm_bytes": result.compiled_hbm},
                          f, indent=1)
        except OSError:
            pass  # a cache only
    log("remat.policy=auto resolved to: " + " ".join(lines))
    return resolve_lib.template(cfg).per_group(chosen)


@tool
def main(argv):
    """Exit status; a mistake in the input prints one line (MaxOffload/cli.py)."""
    from MaxOffload import cli
    from MaxOffload.cli import TARGET_KEYS
    from MaxOffload.deviceless import require_plugin

    argv, _, flags = cli.parse(argv, __doc__, keys=TARGET_KEYS, flags=("--no_confirm",))
    confirm = not flags["--no_confirm"]  # the CLI always plans afresh; resolve() caches for train.py/aot
    from MaxOffload.platform import use_cpu_runtime

    use_cpu_runtime()  # compile-only GPU devices; no GPU runtime needed
    from MaxOffload import xla
    from MaxOffload.config import load

    cfg = load(argv)
    require_plugin()
    xla.apply(cfg)
    result = plan(cfg, cfg.aot.target, cfg.aot.topology, confirm=confirm)
    print(format_plan(result))
    fits = result.hbm_bytes() <= result.machine.hbm_usable and (
        result.compiled_hbm is None or result.compiled_hbm <= result.machine.hbm_usable)
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Automatic offload planner: `remat.policy=auto` -> remat / device / offload per tensor and layer group.

    python -m MaxOffload.offload.planner CONFIG.py[:ARG] [overrides...] [--target gb200] [--topology 2x16x4]
                                         [--no_confirm] [--output_dir DIR]

--target/--topology are aot.target/aot.topology (MaxOffload/cli.py): the last one given wins.

This module is the planner's probe and command line: it traces and compiles the step to feed the pure cost
model (MaxOffload/offload/costs.py) and search (MaxOffload/offload/search.py), then caches and prints.

1. Cost model (offload/costs.py; explicit and small, see `Candidate` and `GroupCost`). The step is traced once under full
   remat (MaxOffload.offload.placement.activation_groups): per model group (llama: decoder; deepseek: dense,
   moe) every tagged tensor's bytes per device (shape x the sharding rules) and whether the backward pass
   needs it at all. Per tensor and layer:
     - recompute FLOPs = 2 x elements per device x K, K = the contraction length of the matmul that
       produced it (`contraction`: e.g. mlpwi_0: emb_dim, out_proj: heads x v_dim, attention_out: seq/2 —
       the causal P.V; norms (mla_q, mla_kv): 0, costed as memory traffic 3 x bytes / HBM bandwidth);
       recompute time = max(FLOPs / achievable peak, 3 x bytes / HBM bandwidth);
     - transfer time = bytes / (host-link bandwidth per direction (hardware.py: NVLink-C2C vs PCIe) x the
       link's achievable share);
     - compute available to hide copies = the layer's forward FLOPs / achievable peak (the sum of its
       tagged matmuls plus the Q.K^T scores) for the copy to host, 2x that (+ recomputation) for the copy back;
     - achievable rates = hardware.CALIBRATION's shares of the table's peaks: the step-time timeline's
       calibration (MaxOffload/timeline/), so the search and the final choice price work alike.
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
2. Search (offload/search.py `search`): if recomputing everything does not fit, offload what frees the most HBM first
   (`_fit_first`); if even the least-HBM plan does not fit, PlanError says what it would need. Then greedy
   by net seconds saved per byte: keep in HBM while it fits; otherwise offload while the host budget holds
   and the group's copies still hide under the share of compute the search assumes (costs.ASSUMED_OVERLAP);
   otherwise recompute. Tensors the user pinned with remat.tensors.NAME stay as given. Then (confirm)
   the plan is compiled deviceless; while XLA's HBM figure is over the usable HBM, the planner charges the
   overshoot to the budget and searches again (at most CONFIRM_ROUNDS compiles, then PlanError).
3. The final choice by compiled timelines (confirm): the search's plan, the plans the search makes when no copy
   hides and when every copy hides, and full remat are each compiled and their schedules simulated
   (MaxOffload/timeline/); the fastest that fits HBM and host memory is then compiled under each other XLA preset
   (xla.PRESETS) and the fastest plan x preset that fits wins (`choose`). Each distinct plan and preset is one
   compile: 4-8 for a model (the full-remat anchor's compile serves as the full-remat candidate).
4. Output: a table (tensor, group, bytes, decision, reason), the candidates with their predicted step times,
   the chosen plan's predicted step time and TFLOP/s per device, and the exact override lines
   (`remat.policy=custom remat.tensors.X=...`, or per model group `remat.groups.auto_moe.layers=moe
   remat.groups.auto_moe.tensors.X=...`, and `xla.preset=...`).
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

from MaxOffload import audit, hardware, hlo, memory, xla
from MaxOffload.cli import tool
from MaxOffload.errors import PlanError
from MaxOffload.jsonfile import Unreadable, every, read_json
from MaxOffload.memory import compiled_bytes
from MaxOffload.models import cross_entropy
from MaxOffload.offload.costs import (ASSUMED_OVERLAP, OFFLOAD_STAGING_LAYERS, Candidate, cost_model, cpu_machine, gib,
                                      machine, usage, with_recompute_hbm)
from MaxOffload.offload import names
from MaxOffload.offload.policy import DEVICE, OFFLOAD, REMAT
from MaxOffload.offload.search import HBM_MARGIN, Choice, plan_error, search
from MaxOffload.reports import write_json
from MaxOffload.timeline import engines, simulate, summary

PLANNER_VERSION = 4
CONFIRM_ROUNDS = 3  # confirming compiles before PlanError


# ---------------------------------------------------------------------------------------------------
# from a config to a plan


def _target_devices(target, topology, num_slices=1):
    if target:
        from MaxOffload import deviceless

        return deviceless.compile_only_devices(target, topology, num_slices)
    return None


def _accelerator(target, devices):
    from MaxOffload import hardware

    if target:
        return hardware.ACCELERATORS[target]
    import jax

    dev = (devices or jax.devices())[0]
    return hardware.lookup(dev.device_kind) if dev.platform != "cpu" else None


def analytic_base(setup, groups, logits_vocab):
    """Full-remat HBM without a compile: state on the device + gradients + the stacked scan carry +
    float32 logits of `logits_vocab` columns (a vocabulary tile's) and their gradient + twice one layer's tagged tensors (the backward's working set)."""
    from MaxOffload.train.step import DEVICE as DEVICE_KIND

    state = setup.state_bytes_per_device(DEVICE_KIND)
    params = setup.state_bytes_per_device() // 3  # params + 2 Adam moments of the same shape
    tokens = setup.per_device_batch * setup.seq_len
    carry = sum(t["bytes_per_device_per_step"] for g in groups.values() for n, t in g["tensors"].items()
                if n in names.ALWAYS_KEPT)
    layer = max(sum(t["bytes_per_device_per_step"] for t in g["tensors"].values()) /
                (g["layers"][1] - g["layers"][0] + 1) for g in groups.values())
    return state + params + carry + 2 * 4 * tokens * logits_vocab + 2 * layer


def saved_plan(base, candidates):
    """`base` (an OffloadPlan) with every candidate kept in HBM (the second anchor of with_recompute_hbm)."""
    everything = {(c.group, c.name): DEVICE for c in candidates}
    return to_offload_plan(base, Choice(everything, {}, candidates, {}, None, 0.0, ""))


def saved_compiled_hbm(setup, candidates, full_compiled):
    """HBM per device of the step with every candidate kept: compiled, or, where the compiler refuses it (libtpu,
    over HBM), what its refusal says it needed."""
    compiled = memory.compile_or_refusal(setup.with_plan(saved_plan(setup.plan, candidates)).compile_train_step)
    if isinstance(compiled, dict):
        needed = memory.refused_hbm(compiled, full_compiled)
        if needed is None:
            raise PlanError(f"the keep-everything compile was refused without a size: {compiled['message']}")
        return needed
    return compiled_bytes(compiled.memory_analysis())[0]


def compiled_memory(setup):
    """(HBM, pinned host) bytes per device of a TrainSetup's compiled step, from XLA's memory analysis."""
    return compiled_bytes(setup.compile_train_step().memory_analysis())


@dataclasses.dataclass
class Trial:
    """One candidate of the final choice: a plan's decisions under an XLA preset, compiled and simulated."""
    label: str
    preset: str
    decisions: dict
    reasons: dict
    hbm: float = None
    host: float = None
    work: dict = None  # the compiled-work audit
    timeline: dict = None  # MaxOffload/timeline/'s report (summary.summarize)
    error: str = ""  # the compile failed (XLA's first line)
    fits: bool = False

    @property
    def step_s(self):
        return self.timeline["step_s"] if self.timeline else math.inf


def measure(trial, setup, m, rates, compiled=None):
    """Fills a Trial from the compile of `setup` (its plan is the trial's): memory, fit, audit and timeline."""
    import jax

    if compiled is None:
        try:
            compiled = setup.compile_train_step()
        except jax.errors.JaxRuntimeError as e:
            trial.error = (str(e).strip().splitlines() or ["?"])[0][:200]
            return trial
    trial.hbm, trial.host = compiled_bytes(compiled.memory_analysis())
    trial.fits = trial.hbm <= m.hbm_usable * (1 - HBM_MARGIN / 2) and trial.host <= m.host_budget
    module = hlo.parse(compiled.as_text())
    trial.work = audit.of_compiled(module, setup)
    trial.timeline = simulate.of_compiled(module, setup, rates)[0]
    return trial


def _search_label(overlap):
    return f"search (copies hide under {overlap:.0%})"


def alternatives(candidates, costs, m, base, penalty):
    """[(label, decisions, reasons)]: what the analytic search plans when no copy hides under compute and when
    every copy hides, and full remat: the other candidates of the final choice."""
    out = []
    for overlap in (0.0, 1.0):
        try:
            decisions, reasons = search(candidates, costs, dataclasses.replace(m, overlap=overlap), base, penalty)
        except PlanError:
            continue
        out.append((_search_label(overlap), decisions, reasons))
    full = {(c.group, c.name): c.pinned or (REMAT if REMAT in c.options else DEVICE) for c in candidates}
    out.append(("full remat", full, {key: "full remat, a candidate of the final choice" for key in full}))
    return out


def choose(result, setup, m, rates, full_compiled, log):
    """The final choice (planner step 3): the candidate plans, then the best one's other XLA presets, each compiled
    and simulated; sets result's decisions, preset and timeline to the fastest trial that fits."""
    base_plan = setup.plan
    primary = result.trials[0]
    seen = {(frozenset(primary.decisions.items()), primary.preset)}

    def trial(label, decisions, reasons, preset, compiled=None):
        key = (frozenset(decisions.items()), preset)
        if key in seen:
            return
        seen.add(key)
        offload_plan = dataclasses.replace(base_plan.per_group(group_decisions(decisions)), xla_preset=preset)
        log(f"planner: compiling '{label}' under xla.preset={preset} for its timeline ...")
        result.trials.append(measure(Trial(label, preset, decisions, reasons), setup.with_plan(offload_plan), m, rates,
                                     compiled))

    for label, decisions, reasons in alternatives(result.candidates, result.costs, m, result.base_hbm,
                                                  result.hbm_penalty):
        reuse = full_compiled if label == "full remat" and base_plan.xla_preset == primary.preset else None
        trial(label, decisions, reasons, primary.preset, reuse)
    best = min((t for t in result.trials if t.fits), key=lambda t: t.step_s)
    for preset in xla.presets_for(m.platform):
        if not best.host and any(t.decisions == best.decisions and xla.same_without_host_copies(t.preset, preset)
                                 for t in result.trials):
            continue  # nothing in host memory: a preset that only schedules host copies compiles the same program
        trial(best.label, best.decisions, best.reasons, preset)
    best = min((t for t in result.trials if t.fits), key=lambda t: t.step_s)
    result.decisions, result.xla_preset, result.timeline = dict(best.decisions), best.preset, best.timeline
    result.compiled_work = best.work  # compiled_hbm/host stay the search plan's: the check of the HBM model
    if best.decisions != primary.decisions:
        result.reasons = {key: f"{why}; the plan '{best.label}', chosen by the compiled timelines"
                          for key, why in best.reasons.items()}


def decide(cfg, target=None, topology=None, confirm=True, log=print):
    """The Choice for cfg (remat.policy may be anything; remat.tensors are honoured as pins)."""
    from MaxOffload import from_config
    from MaxOffload.offload.placement import activation_groups
    from MaxOffload.train.step import DEVICE as DEVICE_KIND, HOST

    devices = _target_devices(target, topology, cfg.aot.num_slices)
    accelerator = _accelerator(target, devices)
    setup = from_config.train_setup(cfg, devices, from_config.template(cfg))  # full remat
    m = machine(accelerator, cfg.launch.mem_fraction, setup.state_bytes_per_device(HOST)) if accelerator \
        else cpu_machine()
    confirm = confirm and m.gpu
    resident = setup.state_bytes_per_device(DEVICE_KIND)  # in HBM whatever the activations' plan
    if confirm and resident > m.hbm_usable:  # no plan fits: said before tracing and compiling (XLA would only
        #                                      confirm it, with log lines about the programs it cannot fit)
        raise plan_error(m, resident, setup.state_bytes_per_device(HOST), "the state kept on the device "
                         "(parameters and optimizer state, before any activation)")
    groups, _, _ = activation_groups(cfg, setup)
    mc = setup.model_config
    candidates, costs = cost_model(mc, groups, m, cfg.train.seq_len, pinned=from_config.pins(cfg),
                                   numerics=setup.numerics)
    model_flops = sum(audit.model_flops_per_device(setup).values())
    tokens = cfg.train.per_device_batch_size * cfg.train.seq_len
    other_s = 6 * tokens * mc.emb_dim * mc.vocab_size / m.peak_flops
    full_compiled = None
    if confirm:
        log(f"planner: compiling full remat and keep-everything for {target or accelerator.name} (the HBM base "
            "and the recompute working set) ...")
        full_compiled = setup.compile_train_step()
        full_hbm, _ = compiled_bytes(full_compiled.memory_analysis())
        saved_hbm = saved_compiled_hbm(setup, candidates, full_compiled)
        candidates, base = with_recompute_hbm(candidates, full_hbm, saved_hbm)
        source = ("deviceless compiles" if target else "compiles") + \
            f" of full remat ({gib(full_hbm)}) and keep-everything ({gib(saved_hbm)})"
    else:
        tile = mc.vocab_size // cross_entropy.tiles_for(mc.vocab_size, mc.vocab_tiles)  # the loss's logits at once
        base, source = analytic_base(setup, groups, tile), "analytic estimate (no compile)"
    result = Choice({}, {}, candidates, costs, m, base, source, model_flops_per_device=model_flops, other_s=other_s,
                    micro_batches=setup.micro_batches, xla_preset=setup.plan.xla_preset)
    result.decisions, result.reasons = search(candidates, costs, m, base)
    if not confirm:
        return result
    import jax

    rates = engines.Rates.of(accelerator, topology or f"1x1x{len(devices or jax.devices())}")
    label = _search_label(m.overlap)
    for round_ in range(CONFIRM_ROUNDS):
        variant = setup.with_plan(to_offload_plan(setup.plan, result))
        log(f"planner: confirming the plan with a compile (round {round_ + 1}) ...")
        confirmed = Trial(label, result.xla_preset, dict(result.decisions), dict(result.reasons))
        compiled = memory.compile_or_refusal(variant.compile_train_step)
        if isinstance(compiled, dict):  # libtpu refuses a program over HBM: not a fit, by the bytes it needed
            confirmed.hbm, confirmed.host = memory.refused_hbm(compiled, full_compiled) or math.inf, 0.0
            confirmed.error = compiled["message"]
        else:
            confirmed = measure(confirmed, variant, m, rates, compiled)
        result.compiled_hbm, result.compiled_host, result.compiled_work = confirmed.hbm, confirmed.host, confirmed.work
        if confirmed.fits:
            result.trials, result.timeline = [confirmed], confirmed.timeline
            break
        if round_ + 1 == CONFIRM_ROUNDS:
            raise plan_error(m, result.compiled_hbm, result.compiled_host,
                             f"the best plan after {CONFIRM_ROUNDS} confirming compiles")
        over = result.compiled_hbm - m.hbm_usable * (1 - HBM_MARGIN / 2)
        result.hbm_penalty += max(over, 0) + max(0.0, result.compiled_hbm - result.hbm_bytes())
        result.decisions, result.reasons = search(candidates, costs, m, base, result.hbm_penalty)
    choose(result, setup, m, rates, full_compiled, log)
    return result


def predict(cfg, target=None, topology=None, offload_plan=None):
    """The cost model's Choice for an OffloadPlan's decisions (default: cfg's own; no search): its decisions per
    model group, predicted step time, TFLOP/s and HBM (analytic base). remat.policy=auto without a plan is
    planned without confirming compiles."""
    from MaxOffload import from_config

    result = decide(cfg, target, topology, confirm=False, log=lambda *a: None)
    if offload_plan is None and not from_config.planned(cfg):
        offload_plan = from_config.static_plan(cfg)
    if offload_plan is not None:
        chosen = {}
        for seg in offload_plan.segments:
            for name, d in seg.decisions:
                chosen[(seg.model_group, name)] = d
        result.decisions = {(c.group, c.name): chosen.get((c.group, c.name), REMAT) for c in result.candidates}
    return result


def fitted_hbm(cfg, target, topology, own=None):
    """The HBM model's anchors for cfg's model and shapes on compile-only devices, from its full-remat and
    keep-everything compiles: (base bytes, {(model group, name): recompute bytes}, {(model group, name): kept
    scale}). They do not depend on cfg's own policy: one fit serves every policy of the same model and shapes
    (check_prediction's `fitted`). `own`: cfg's TrainSetup on those devices, where the caller has it."""
    from MaxOffload import from_config
    from MaxOffload.offload.placement import activation_groups
    from MaxOffload.train.step import HOST

    own = own or from_config.train_setup(cfg, _target_devices(target, topology, cfg.aot.num_slices))
    setup = own.with_plan(own.plan.uniform("full"))
    m = machine(_accelerator(target, None), cfg.launch.mem_fraction, setup.state_bytes_per_device(HOST))
    model_candidates, _ = cost_model(setup.model_config, activation_groups(cfg, setup)[0], m, cfg.train.seq_len,
                                     numerics=setup.numerics)
    full_compiled = setup.compile_train_step()
    full_hbm, _ = compiled_bytes(full_compiled.memory_analysis())
    saved_hbm = saved_compiled_hbm(setup, model_candidates, full_compiled)
    model_candidates, base = with_recompute_hbm(model_candidates, full_hbm, saved_hbm)
    return (base, {(c.group, c.name): c.remat_bytes for c in model_candidates},
            {(c.group, c.name): c.kept_scale for c in model_candidates})


def check_prediction(cfg, target, topology, fitted=None):
    """(predicted, compiled) HBM bytes per device for cfg's own policy on compile-only GPUs: the HBM model
    (base and recompute working set from the full-remat and keep-everything compiles, + kept tensors)
    against XLA's figure for the same config. Decisions are read from cfg's traced step, per segment.
    `fitted`: fitted_hbm's anchors of the same model and shapes, already compiled (else compiled here)."""
    from MaxOffload import from_config
    from MaxOffload.offload.placement import activation_groups

    own = from_config.train_setup(cfg, _target_devices(target, topology, cfg.aot.num_slices))
    base, share, scale = fitted or fitted_hbm(cfg, target, topology, own)
    candidates, decisions = [], {}
    for label, entry in activation_groups(cfg, own)[0].items():
        layers = entry["layers"][1] - entry["layers"][0] + 1
        for name, t in entry["tensors"].items():
            kind = {"offload": OFFLOAD, "offload+device": DEVICE, "device": DEVICE}.get(t["result"], REMAT)
            candidates.append(Candidate(label, name, layers, t["bytes_per_device_per_step"] // layers, 0, 0, 0, (),
                                        remat_bytes=share.get((entry["model_group"], name), 0.0),
                                        kept_scale=scale.get((entry["model_group"], name), 1.0)))
            decisions[(label, name)] = kind
    return base + usage(candidates, decisions)[0], compiled_memory(own)[0]


# ---------------------------------------------------------------------------------------------------
# plan -> OffloadPlan / override lines (printed, never parsed back) / table


def group_decisions(decisions):
    """{model group: {name: decision}} of a plan's {(group, name): decision}."""
    out = {}
    for (group, name), d in decisions.items():
        out.setdefault(group, {})[name] = d
    return out


def override_lines(result):
    """The exact command-line overrides that reproduce the plan without the planner."""
    per_group = group_decisions(result.decisions)
    preset = [f"xla.preset={result.xla_preset}"] if result.timeline else []
    lines = ["remat.policy=custom"]
    if len(per_group) == 1:
        (only,) = per_group.values()
        return lines + [f"remat.tensors.{n}={d}" for n, d in only.items()] + preset
    for group, chosen in per_group.items():
        lines.append(f"remat.groups.auto_{group}.layers={group}")
        lines += [f"remat.groups.auto_{group}.tensors.{n}={d}" for n, d in chosen.items()]
    return lines + preset


def to_offload_plan(base, result):
    """`base` (an OffloadPlan: the run's state placement) with the plan's decisions on its layers: what the
    override lines give when typed on the command line."""
    planned = base.per_group(group_decisions(result.decisions))
    return dataclasses.replace(planned, xla_preset=result.xla_preset) if result.xla_preset else planned


def format_plan(result):
    m = result.machine
    lines = [f"plan for {m.name}: achievable {m.peak_flops / 1e12:,.0f} TFLOP/s, host link "
             f"{'free (CPU)' if math.isinf(m.host_link_bandwidth) else f'{m.host_link_bandwidth / 1e9:,.0f} GB/s'}",
             f"  {'tensor':<14} {'group':<8} {'bytes/layer':>12} {'x layers':>12} {'recompute':>10} "
             f"{'copy':>9}  {'decision':<8} reason"]
    for c in sorted(result.candidates, key=lambda c: (c.group, -c.bytes * c.layers)):
        d = result.decisions[(c.group, c.name)]
        copy = "-" if math.isinf(m.host_link_bandwidth) else f"{c.transfer_s * 1e3:.3g}ms"
        lines.append(f"  {c.name:<14} {c.group:<8} {gib(c.bytes):>12} {gib(c.bytes * c.layers):>12} "
                     f"{c.recompute_s * 1e3:>8.3g}ms {copy:>9}  {d:<8} {result.reasons[(c.group, c.name)]}")
    for group, g in result.costs.items():
        lines.append(f"  group {group}: {g.layers} layers, forward {g.forward_flops / 1e12:,.3g} TFLOP "
                     f"({g.forward_s * 1e3:.3g} ms) per layer per device; exposed copy (analytic) "
                     f"{result.exposed_s(group) * 1e3:.3g} ms/layer")
    lines.append(f"predicted HBM per device: {gib(result.hbm_bytes())} (base {gib(result.base_hbm)}: "
                 f"{result.base_source}) of {gib(m.hbm_usable)} usable; host {gib(result.host_bytes())} of "
                 f"{gib(m.host_budget)}")
    if result.compiled_hbm is not None:
        primary = result.trials[0] if result.trials else None
        predicted = result.hbm_bytes() if primary is None else result.hbm_bytes(primary.decisions)
        err = (predicted - result.compiled_hbm) / result.compiled_hbm
        lines.append(f"compiled HBM per device: {gib(result.compiled_hbm)} (prediction {err:+.1%}), host "
                     f"{gib(result.compiled_host)}" + (" (the search's plan)" if primary else ""))
    if result.compiled_work is not None:
        lines += audit.format_audit(result.compiled_work)
    if result.trials:
        lines.append("candidates by their compiled timelines (one compile each):")
        lines.append(f"  {'plan':<30} {'xla.preset':<22} {'HBM':>11} {'host':>11} {'step':>12}")
        for t in result.trials:
            chosen = "  <- chosen" if t.decisions == result.decisions and t.preset == result.xla_preset else ""
            if t.error:
                lines.append(f"  {t.label:<30} {t.preset:<22} failed to compile: {t.error}")
                continue
            lines.append(f"  {t.label:<30} {t.preset:<22} {gib(t.hbm):>11} {gib(t.host):>11} "
                         f"{t.step_s * 1e3:>9,.4g} ms{'' if t.fits else '  does not fit'}{chosen}")
    if result.timeline:
        lines += summary.format_report(result.timeline)
    else:
        lines.append(f"predicted step time (analytic, no compile) {result.step_time() * 1e3:,.1f} ms, "
                     f"{result.tflops_per_device():,.1f} TFLOP/s per device")
    lines.append("overrides: " + " ".join(override_lines(result)))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# remat.policy=auto: planned at start, cached per config


def _cache_dir():
    root = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    return os.path.join(root, "maxoffload", "plans")


def cache_key(cfg, target, topology, device_count=None):
    import jax

    relevant = {k: cfg[k].to_dict() for k in ("model", "remat", "mesh", "offload", "xla", "quant")}
    relevant.update(batch=cfg.train.per_device_batch_size, micro_batches=cfg.train.grad_accum_steps,
                    global_batch=cfg.train.global_batch_size,
                    seq_len=cfg.train.seq_len,
                    mem_fraction=cfg.launch.mem_fraction, target=target, topology=topology,
                    slices=cfg.aot.num_slices if target else None,
                    kind=None if target else jax.devices()[0].device_kind,  # a CPU plan is no TPU's
                    devices=device_count, jax=jax.__version__, planner=PLANNER_VERSION,
                    constants=[hardware.CALIBRATION, hardware.TPU_CALIBRATION, ASSUMED_OVERLAP, OFFLOAD_STAGING_LAYERS,
                               HBM_MARGIN])
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[:20]


_CACHED = {"decisions": every(dict, every(dict, str), "an object of {name: decision} objects"),
           "overrides": every(list, str, "an array of strings"),
           "xla_preset": ((lambda p: isinstance(p, str) and p in xla.PRESETS), f"one of {', '.join(xla.PRESETS)}")}


def plan_for(cfg, target=None, topology=None, confirm=True, use_cache=True, log=print):
    """The run's OffloadPlan: cfg's own (MaxOffload.from_config.static_plan), or for remat.policy=auto the planned
    one, cached per config. target/topology: plan for compile-only GPUs (the aot tool); None: for this
    process's devices."""
    from MaxOffload import from_config

    if not from_config.planned(cfg):
        return from_config.static_plan(cfg)
    import jax

    key = cache_key(cfg, target, topology, None if target else jax.device_count())
    path = os.path.join(_cache_dir(), key + ".json")
    cached = None
    if use_cache:
        # a cache is derived data: a damaged one (cut short, edited) is said in one line and planned again
        try:
            cached = read_json(path, "", _CACHED, missing_ok=True)
        except Unreadable as e:
            log(f"remat.policy=auto: {path}: {e.problem}; planning again (the plan replaces it)")
    if cached is not None:
        chosen, lines, preset = cached["decisions"], cached["overrides"], cached["xla_preset"]
        log(f"remat.policy=auto: cached plan {path}")
    else:
        result = decide(cfg, target, topology, confirm=confirm, log=log)
        log(format_plan(result))
        chosen, lines = group_decisions(result.decisions), override_lines(result)
        preset = result.xla_preset
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_json(path, {"decisions": chosen, "overrides": lines, "xla_preset": preset,  # whole or not at all
                              "predicted_step_s": result.step_time(),
                              "predicted_tflops_per_device": result.tflops_per_device(),
                              "predicted_hbm_bytes": result.hbm_bytes(), "compiled_hbm_bytes": result.compiled_hbm})
        except OSError:
            pass  # a cache only
    log("remat.policy=auto resolved to: " + " ".join(lines))
    return dataclasses.replace(from_config.template(cfg).per_group(chosen), xla_preset=preset)


@tool
def main(argv):
    """Exit status; a mistake in the input prints one line (MaxOffload/cli.py)."""
    from MaxOffload import cli
    from MaxOffload.cli import TARGET_KEYS
    from MaxOffload.deviceless import require_target

    argv, _, flags = cli.parse(argv, __doc__, keys=TARGET_KEYS, flags=("--no_confirm",))
    confirm = not flags["--no_confirm"]  # the CLI always plans afresh; plan_for() caches for train.py/aot
    # XLA logs its complaints about the candidates the planner compiles to measure (a plan over HBM: "Can't
    # reduce memory use below ..."); the planner reports what fits itself. Silenced before the backend starts,
    # unless TF_CPP_MIN_LOG_LEVEL is set to other than JAX's default 1 (jax/__init__.py): 0 shows them.
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1") == "1":
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    from MaxOffload.platform import use_cpu_runtime

    use_cpu_runtime()  # compile-only GPU devices; no GPU runtime needed
    from MaxOffload import xla
    from MaxOffload.config import load

    cfg = load(argv)
    require_target(cfg)
    xla.apply(cfg)
    result = decide(cfg, cfg.aot.target, cfg.aot.topology, confirm=confirm)
    print(format_plan(result))
    fits = result.hbm_bytes() <= result.machine.hbm_usable and (
        result.compiled_hbm is None or result.compiled_hbm <= result.machine.hbm_usable)
    if result.trials:  # the chosen plan's own compile
        fits = any(t.fits and t.decisions == result.decisions and t.preset == result.xla_preset for t in result.trials)
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

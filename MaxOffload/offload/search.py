"""The planner's search, pure (no tracing, no compiling): over the cost model's candidates
(MaxOffload/offload/costs.py), remat / device / offload per tensor and model group within the HBM and host
budgets (`search`), and the chosen `Choice` with its predicted HBM, host bytes and step time.
"""
import dataclasses

from MaxOffload.errors import PlanError
from MaxOffload.offload import names
from MaxOffload.offload.costs import Machine, gib, usage
from MaxOffload.offload.policy import DEVICE, OFFLOAD, REMAT

HBM_MARGIN = 0.03  # keep this share of usable HBM free: the model's error bar


@dataclasses.dataclass
class Choice:
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
    compiled_work: dict = None  # the confirming compile's audit (MaxOffload/audit.py)
    model_flops_per_device: float = 0.0  # the whole step's (every micro-batch)
    other_s: float = 0.0  # embedding/unembedding etc.: outside the layers, per micro-batch
    micro_batches: int = 1  # per step (train.grad_accum_steps): memory is planned for one, time counts all
    xla_preset: str = None  # the XLA preset it compiles under (None: the run's own)
    timeline: dict = None  # the chosen plan's compiled timeline (MaxOffload/timeline/), once confirmed
    trials: list = dataclasses.field(default_factory=list)  # planner.Trial: the candidates of the final choice

    def hbm_bytes(self, decisions=None):
        """Predicted HBM per device of this plan (or of other `decisions` over the same candidates)."""
        return self.base_hbm + usage(self.candidates, self.decisions if decisions is None else decisions)[0]

    def host_bytes(self):
        return usage(self.candidates, self.decisions)[1]

    def step_time(self):
        """Predicted seconds per step: the compiled timeline's once the plan was compiled (the planner's final
        choice), else the analytic estimate (analytic_step_time)."""
        return self.timeline["step_s"] if self.timeline else self.analytic_step_time()

    def analytic_step_time(self):
        """The cost model's seconds per step: per micro-batch, compute (forward + backward (2x) + recomputation) +
        storing + exposed copies, times the step's micro-batches. Once a confirming compile was audited
        (compiled_work, MaxOffload/audit.py), the compute is the compiled program's (whole step's) matmul FLOPs
        at the achievable peak, not the model's ideal: a plan that compiles into extra work (a dense
        ragged_dot, say) is predicted slower."""
        compute, rest = self.other_s, 0.0
        for group, g in self.costs.items():
            members = [c for c in self.candidates if c.group == group]
            recompute = sum(c.recompute_s for c in members if self.decisions[(group, c.name)] == REMAT)
            stored = sum(c.save_s for c in members if self.decisions[(group, c.name)] != REMAT)
            compute += g.layers * (3 * g.forward_s + recompute)
            rest += g.layers * (stored + self.exposed_s(group, recompute))
        if self.compiled_work is not None:
            return self.compiled_work["compiled_matmul_flops"] / self.machine.peak_flops + self.micro_batches * rest
        return self.micro_batches * (compute + rest)

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
            forced[(c.group, c.name)] = (f"offloaded to fit HBM: keeping it needs {gib(c.bytes * c.layers)}, "
                                         f"recomputing it {gib(c.remat_bytes * c.layers)} of working memory")
    return forced


def least_hbm(candidates, base_hbm, penalty=0.0):
    """(HBM, host) of the least-HBM plan: every offloadable tensor on the host (pins kept)."""
    decisions = {(c.group, c.name): c.pinned or (OFFLOAD if OFFLOAD in c.options else REMAT) for c in candidates}
    hbm, host, _ = usage(candidates, decisions)
    return base_hbm + penalty + hbm, host


def plan_error(m, hbm, host, what="even the least-HBM plan (every tensor offloaded)"):
    return PlanError(f"no plan fits {m.name}: {what} needs {gib(hbm)} of HBM per device "
                     f"({gib(m.hbm_usable)} usable{'' if m.platform == 'tpu' else ' at launch.mem_fraction'}) and "
                     f"{gib(host)} of host memory "
                     f"({gib(m.host_budget)} available); use more devices (mesh), a smaller "
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

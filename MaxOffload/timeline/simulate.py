"""The simulation of one step: the compiled schedule (read by schedule.py) replayed on the target's engines
(engines.py), each its own queue; what it prices and assumes is said in the package's docstring (__init__.py)."""
from MaxOffload import audit, hlo
from MaxOffload.timeline import schedule, summary
from MaxOffload.timeline.engines import COLLECTIVE, COMPUTE, ENGINES, Event


class Simulation:
    """The engines' clocks and queues while the schedule runs, and the events they ran (`events`), each loop
    iteration's span (`windows`) and the loops run once for want of a trip count (`unknown_trip_counts`)."""

    def __init__(self, module, rates, devices=1, work=None, domains=None, pipeline=None):
        """`work`: see schedule.Schedule (shared by simulations of the same module); `domains`: the NVLink domain
        of each device of the program's device assignment (replica-group ids index it; default: consecutive blocks
        of rates.domain); `pipeline`: the step's parallel/pipeline.Pipeline, if it has stages (what its loops'
        iterations run: summary.pipeline_figures, trace)."""
        self.schedule = schedule.Schedule(module, work)
        self.pipeline = pipeline
        self.rates, self.devices = rates, devices
        self.domains = domains
        self.clock = 0.0  # the compute stream
        self.free = {engine: 0.0 for engine in ENGINES[1:]}  # when each queue is next free
        self.pending = {}  # async start name -> its event
        self.events = []
        self.windows = []  # (loop instruction, iteration, start, end)
        self.unknown_trip_counts = []
        self.loops = []  # the op_names of the while loops being run, innermost last

    # -- running computations ------------------------------------------------------------------
    def run(self, computation):
        for ins in self.schedule.module.computations.get(computation, ()):
            self.step(ins, computation)

    def step(self, ins, computation):
        op = ins.opcode
        if schedule.is_free(ins):
            return
        if op == "while":
            trips = self.schedule.module.trip_count(ins)
            if trips is None:
                self.unknown_trip_counts.append(ins.op_name or ins.name)
            self.loops.append(ins.op_name)
            label = schedule.loop_label(ins, self.schedule.module)
            for i in range(trips or 1):
                started = self.clock
                self.run(ins.called("condition"))
                self.run(ins.called("body"))
                self.windows.append((label, i, started, self.clock))
            self.loops.pop()
            return
        if op == "conditional":
            self.dearest(ins.branches())
            return
        if op == "call":
            self.run(ins.called("to_apply") or ins.called("calls"))
            return
        if op.endswith("-done"):
            self.wait(ins)
            return
        if op.endswith("-start"):
            self.start(ins, computation)
            return
        collective = schedule.collective_kind(op)
        if collective:
            self.stall_on(self.collective(ins, computation, collective, ins))
            return
        transfer = self.schedule.host_transfer(ins, computation, ins.shape)
        if transfer:
            self.stall_on(self.transfer(ins, *transfer))
            return
        self.kernel(ins, computation)

    def dearest(self, branches):
        """Runs the branch that ends last (the others are simulated on a copy and dropped)."""
        best = None
        for branch in branches:
            trial = self.fork()
            trial.run(branch)
            if best is None or trial.clock > best.clock:
                best = trial
        if best is not None:
            self.__dict__.update(best.__dict__)

    def fork(self):
        other = Simulation.__new__(Simulation)
        other.__dict__.update(self.__dict__)
        other.free, other.pending = dict(self.free), dict(self.pending)
        other.events, other.windows = list(self.events), list(self.windows)
        other.unknown_trip_counts, other.loops = list(self.unknown_trip_counts), list(self.loops)
        return other

    # -- work --------------------------------------------------------------------------------------
    def kernel(self, ins, computation):
        flops, fp8_flops, moved = self.schedule.kernel_work(ins, computation)
        fp8_rate = self.rates.fp8_matmul_flops or 2 * self.rates.matmul_flops
        seconds = max(flops / self.rates.matmul_flops + fp8_flops / fp8_rate, moved / self.rates.hbm_bytes)
        self.events.append(Event(COMPUTE, self.clock, self.clock + seconds, ins.name, ins.op_name, flops + fp8_flops,
                                 moved, fp8_flops=fp8_flops, loop=self.loop))
        self.clock += seconds

    def start(self, ins, computation):
        done = self.schedule.done_of(ins, computation)
        result = done.shape if done is not None else ins.shape
        wrapped = self.schedule.wrapped(ins)
        collective = schedule.collective_kind(ins.opcode[:-len("-start")]) or \
            schedule.collective_kind(wrapped.opcode if wrapped else "")
        if collective:
            self.pending[ins.name] = self.collective(ins, computation, collective, wrapped or ins, result)
            return
        transfer = self.schedule.host_transfer(ins, computation, result)
        if transfer:
            self.pending[ins.name] = self.transfer(ins, *transfer)
            return
        # an async computation on the device (a small fused update, say): run where it starts
        called = ins.called("calls")
        if called and ins.opcode == "async-start":
            self.run(called)
        else:
            self.kernel(ins, computation)

    def wait(self, ins):
        event = self.pending.pop(ins.operands[0], None) if ins.operands else None
        if event is not None:
            self.stall_on(event)

    def stall_on(self, event):
        """Compute waits until `event` (a transfer or collective) has finished: the wait is its exposed time."""
        if event.end > self.clock:
            event.stall += event.end - self.clock
            self.clock = event.end

    def queue(self, engine, ins, seconds, moved, flops=0.0, kind=""):
        start = max(self.clock, self.free[engine])
        event = Event(engine, start, start + seconds, ins.name, ins.op_name, flops, moved, kind=kind, loop=self.loop)
        self.free[engine] = event.end
        self.events.append(event)
        return event

    def transfer(self, ins, direction, moved):
        return self.queue(direction, ins, moved / self.rates.host_link, moved)

    def collective(self, ins, computation, kind, carrier, result=None):
        """The event of a collective `kind` whose replica groups `carrier` (the instruction or its wrapped op) says."""
        groups = schedule.replica_groups(carrier.attributes, self.devices)
        n = max((len(g) for g in groups), default=1)
        if n < 2:
            return self.queue(COLLECTIVE, ins, 0.0, 0.0, kind=kind)
        # members of the largest group outside the first member's NVLink domain
        group = max(groups, key=len)
        remote = sum(1 for d in group if self.domain_of(d) != self.domain_of(group[0]))
        size = self.schedule.collective_bytes(ins, computation, kind, result)
        if kind == "collective-permute":
            crosses = any(self.domain_of(a) != self.domain_of(b) for a, b in groups) if \
                all(len(g) == 2 for g in groups) else bool(remote)
            seconds = size / (self.rates.network if crosses else self.rates.nvlink)
            return self.queue(COLLECTIVE, ins, seconds, size, kind=kind)
        rounds = 2 if kind == "all-reduce" else 1
        # hierarchically: the share from (or for) other domains over the network, the rest over NVLink, the two
        # at once (a flat ring across domains would be slower still: each of its links carries (n - 1) / n)
        inter, intra = rounds * size * remote / n, rounds * size * (n - remote - 1) / n
        seconds = max(inter / self.rates.network, intra / self.rates.nvlink)
        return self.queue(COLLECTIVE, ins, seconds, inter + intra, kind=kind)

    @property
    def loop(self):
        """The op_name of the innermost while loop being run ("" outside every loop)."""
        return self.loops[-1] if self.loops else ""

    def domain_of(self, device):
        return self.domains[device] if self.domains else device // self.rates.domain

    def finish(self):
        """Waits for everything still in flight: the step ends when the last engine is idle."""
        for event in list(self.pending.values()):
            self.stall_on(event)
        self.pending.clear()
        end = max([self.clock, *self.free.values()])
        return end


def simulate(text, rates, devices=1, model_flops_per_device=None, work=None, domains=None, pipeline=None):
    """The predicted timeline of a compiled step (its optimized HLO text, or a parsed hlo.Module) on `rates`:
    (report dict, Simulation with its events). `work`, `domains`, `pipeline`: see Simulation."""
    module = hlo.parse(text) if isinstance(text, str) else text
    sim = Simulation(module, rates, devices, work, domains, pipeline)
    sim.run(module.entry)
    step = sim.finish()
    return summary.summarize(sim, step, model_flops_per_device), sim


def of_compiled(compiled, setup, rates):
    """(report, Simulation) of a TrainSetup's compiled step (a jax Compiled, or its parsed hlo.Module)."""
    module = compiled if isinstance(compiled, hlo.Module) else hlo.parse(compiled.as_text())
    domains = [d.id // rates.domain for d in setup.mesh.devices.flat]  # the device assignment's order
    return simulate(module, rates, setup.mesh.size, sum(audit.model_flops_per_device(setup).values()),
                    domains=domains, pipeline=setup.pipeline)

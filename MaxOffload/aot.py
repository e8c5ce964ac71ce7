"""Prove it before launch: compile the real training step for a GPU cluster or a TPU slice on a CPU-only machine.

    python -m MaxOffload.aot CONFIG.py[:ARG] [overrides...] [--target gb200] [--topology 2x16x4]
                             [--output_dir DIR]
    python -m MaxOffload.aot CONFIG.py[:ARG] --target v5e --topology 2x2 [aot.num_slices=2]

--target/--topology/--output_dir are aot.target/aot.topology/run.output_dir (MaxOffload/cli.py): the
last one given on the command line wins.

XLA's own compiler for the target (GPUs: the JAX CUDA plugin; TPUs: libtpu; no accelerator or driver needed)
compiles the same step as train.py — same model, policies, mesh and XLA preset — for compile-only devices described
by MaxOffload/hardware.py, and reports per device: argument bytes (parameters + optimizer
state + batch), temporaries, output, the HBM total against the device's capacity (with the
launch.mem_fraction headroom) and a fits / does-not-fit verdict, host bytes (offloaded
activations and host-resident state), the offloaded tensors and the compile time, and the compiled-work
audit (MaxOffload/audit.py): the matmul FLOPs the optimized program executes per part of the model against
its model FLOPs, with a WARNING for a part over its share or a ragged_dot lowered to a dense dot; and the
predicted step time (MaxOffload/timeline/): the compiled schedule simulated on the target's compute, copy and
collective engines — compute time, the copy and collective time left exposed, the share of copy time hidden,
model TFLOP/s per device and MFU. Writes <run.output_dir>/aot_report.json (the prediction under `timeline`),
timeline.json (the predicted step as a Chrome/Perfetto trace: open it in ui.perfetto.dev or chrome://tracing) and
timeline.png (one layer's window; needs matplotlib). Exit status 0 fits, 1 does not fit, 2 bad input.
"""
import os
import sys
import time

from MaxOffload import audit, hlo, memory
from MaxOffload.cli import tool
from MaxOffload.memory import compiled_bytes
from MaxOffload.reports import gib
from MaxOffload.timeline import engines, simulate, summary, trace
from MaxOffload.deviceless import HOST_USABLE, compile_only_devices, require_target


UNSCANNED = ("placement not proved: the layers are a Python loop (model.scan_layers=false) and the proof reads the "
             "scanned layer segments")


def build_report(cfg, plan, target, topology):
    """(the report dict, the timeline's Simulation) of the step compiled for `target` x `topology`."""
    from MaxOffload import hardware
    from MaxOffload.offload import xla_bugs
    from MaxOffload.offload.placement import activation_groups
    from MaxOffload.parallel.mesh import describe as mesh_describe
    from MaxOffload import from_config
    from MaxOffload.train.step import HOST

    accelerator = hardware.ACCELERATORS[target]
    devices = compile_only_devices(target, topology, cfg.aot.num_slices)
    setup = from_config.train_setup(cfg, devices, plan)
    # the placement proof reads the scanned layer segments; a Python loop of layers (model.scan_layers=false) has none
    groups, problems, _ = activation_groups(cfg, setup) if cfg.model.scan_layers else ({}, [], [])
    started = time.perf_counter()
    compiled = memory.compile_or_refusal(setup.compile_train_step)
    compile_time = time.perf_counter() - started
    if isinstance(compiled, dict):  # the TPU compiler refuses a step that does not fit
        return refused_report(cfg, setup, accelerator, topology, compiled, compile_time), None
    m = compiled.memory_analysis()
    hbm, host = compiled_bytes(m)
    # state asked for in host memory that these compile-only devices held in HBM: counted where it will live
    dropped = setup.host_state_dropped()
    hbm, host = hbm - dropped, host + dropped
    module = hlo.parse(compiled.as_text())
    work = audit.of_compiled(module, setup)
    rates = engines.Rates.of(accelerator, topology)
    predicted, simulation = simulate.of_compiled(module, setup, rates)
    usable = int(hardware.usable_hbm(accelerator, cfg.launch.mem_fraction))
    host_usable = int(accelerator.host_ram_per_gpu * HOST_USABLE)
    return {
        "target": target, "accelerator": accelerator.name, "topology": describe_topology(cfg, topology),
        "devices": len(devices),
        "mesh": mesh_describe(setup.mesh), "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "params_total": setup.params_total(),
        "argument_bytes_per_device": m.argument_size_in_bytes, "output_bytes_per_device": m.output_size_in_bytes,
        "alias_bytes_per_device": m.alias_size_in_bytes, "temp_bytes_per_device": m.temp_size_in_bytes,
        "state_bytes_per_device": setup.state_bytes_per_device(), "hbm_bytes_per_device": hbm,
        "hbm_capacity_bytes": accelerator.hbm_bytes, "hbm_usable_bytes": usable,
        "headroom_bytes": usable - hbm, "hbm_fits": hbm <= usable, "host_usable_bytes": host_usable,
        "host_fits": host <= host_usable, "fits": hbm <= usable and host <= host_usable,
        "host_bytes_per_device": host, "host_temp_bytes_per_device": m.host_temp_size_in_bytes,
        "host_state_bytes_per_device": setup.state_bytes_per_device(HOST) + dropped,
        "host_state_counted_from_shardings_bytes": dropped,
        "host_ram_per_gpu_bytes": accelerator.host_ram_per_gpu,
        "offloaded": {label: g["offloaded"] for label, g in groups.items()},
        "group_notes": {label: g["note"] for label, g in groups.items() if g.get("note")},
        "offload_bytes_per_device_rules": sum(g["offload_bytes_per_device"] for g in groups.values()),
        "problems": problems, "compile_time_s": compile_time,
        "compiled_work": work, "timeline": predicted, "xla_preset": plan.xla_preset,
        "weight_gathers": {**weight_gathers(module, setup.micro_batches), "asked": setup.gather_weights},
        "gradient_reductions": {**gradient_reductions(module, setup.micro_batches), "data_replicas": setup.replicas},
        "host_state_traffic": host_state_traffic(setup, rates, predicted),
        "expert_weight_gathers": len(expert_weight_gathers(module, setup.model_config))
        if getattr(setup.model_config, "num_experts", 0) else None,
        "warnings": [w for w in [xla_bugs.affects(plan, accelerator.platform), ragged_exchange_warning(setup),
                                 UNSCANNED if not cfg.model.scan_layers else None] if w]
        + [f"compiled work: {w}" for w in work["warnings"]],
    }, simulation


def expert_weight_gathers(module, model_config):
    """The all-gathers of a compiled program with a floating-point array of routed experts' weights: its last three
    dims emb, moe_mlp and a divisor of the experts, in any order (a shared expert's weight, [emb, moe_mlp] alone, is
    not one): the FSDP gathers of expert weights, which experts at home (mesh.rules.exp_embed=[]) never make. [] for
    a model without routed experts."""
    emb, mlp = getattr(model_config, "emb_dim", 0), getattr(model_config, "moe_mlp_dim", 0)
    experts = getattr(model_config, "num_experts", 0)
    if not experts:
        return []

    def routed(a):  # the last three dims, in any order (XLA may gather a transposed layout): emb, moe_mlp, experts
        rest = list(a.dims[-3:])
        for dim in (emb, mlp):
            if dim not in rest:
                return False
            rest.remove(dim)
        return a.dtype[0] in "fb" and len(a.dims) >= 3 and rest[0] > 1 and experts % rest[0] == 0

    return [i.name for instructions in module.computations.values() for i in instructions
            if i.opcode in ("all-gather", "all-gather-start") and any(routed(a) for a in i.arrays)]


RAGGED_RANKS_KNOWN_TO_CRASH = 32  # past this, XLA:GPU's one-shot ragged all-to-all crashed (openxla/xla#47283)


def ragged_exchange_warning(setup):
    """The line for a GPU step whose token exchange runs XLA's ragged all-to-all (not decomposed) over more ranks
    than its one-shot lowering is known to survive, else None."""
    from MaxOffload.parallel import logical

    ranks = logical.ways(setup.mesh, setup.layout.expert)
    if not setup.exchanges_ragged() or setup.ragged_decomposed or ranks <= RAGGED_RANKS_KNOWN_TO_CRASH:
        return None
    return (f"the token all-to-all runs XLA's ragged all-to-all over {ranks} GPUs: its one-shot lowering crashed past "
            f"{RAGGED_RANKS_KNOWN_TO_CRASH} ranks (openxla/xla#47283) and gave wrong gradients on some builds "
            "(marin-community/marin#8077); xla.ragged_decomposer=true avoids both, at the cost its own aot timeline "
            "shows (dense all-to-alls of whole buffers; docs/parallelism.md)")


def host_state_traffic(setup, rates, predicted):
    """What the compiled step leaves out where compile-only devices dropped the host memory kind of state asked for
    in host memory (TrainSetup.host_state_dropped): the bytes that state moves a step on the real devices and, at
    the host link, the time they take if nothing hides them. Host-resident parameters are read by every
    micro-batch's forward and backward passes (models/stack.to_device, per layer); the update reads the
    parameters and the optimizer state and writes them back. None where nothing was dropped."""
    params, opt = setup.host_state_dropped(("params",)), setup.host_state_dropped(("opt_state",))
    if not params + opt:
        return None
    h2d = 2 * setup.micro_batches * params + params + opt
    d2h = params + opt
    seconds = max(h2d, d2h) / rates.host_link
    return {"h2d_bytes": h2d, "d2h_bytes": d2h, "seconds": seconds,
            "step_s_if_exposed": predicted["step_s"] + seconds if predicted else None}


def describe_topology(cfg, topology):
    return topology if cfg.aot.num_slices == 1 else f"{cfg.aot.num_slices} x {topology}"


def refused_report(cfg, setup, accelerator, topology, refusal, compile_time):
    """The report of a step the target's compiler refused for memory: DOES NOT FIT, with the needed and available
    bytes it named."""
    from MaxOffload.parallel.mesh import describe as mesh_describe

    return {"target": cfg.aot.target, "accelerator": accelerator.name, "topology": describe_topology(cfg, topology),
            "devices": setup.mesh.size, "mesh": mesh_describe(setup.mesh), "params_total": setup.params_total(),
            "state_bytes_per_device": setup.state_bytes_per_device(), "compile_time_s": compile_time,
            "hbm_capacity_bytes": accelerator.hbm_bytes, "hbm_bytes_per_device": refusal["needed"],
            "hbm_available_bytes": refusal["available"], "hbm_fits": False, "fits": False,
            "refused": refusal["message"], "refused_of": refusal["of"], "xla_preset": cfg.xla.preset,
            "problems": [], "warnings": []}


def weight_gathers(module, micro_batches):
    """Where the step all-gathers (FSDP weights, mostly): {"micro_batches", "per_step_bytes",
    "in_micro_batch_loop_bytes": what the gradient-accumulation loop gathers over all its trips, "where":
    "per micro-batch" when it gathers inside that loop, else "per step"}; the loop is the entry's while loop
    that runs micro_batches (or, pipelined, micro_batches - 1) times."""
    return _in_accumulation(module, micro_batches, module.gathered_bytes)


def gradient_reductions(module, micro_batches):
    """Where the step reduces (gradients over the data-parallel axes, mostly): the bytes all-reduces and
    reduce-scatters deliver (hlo.Module.reduced_bytes), per step and inside the accumulation loop, as
    weight_gathers says for gathers."""
    return _in_accumulation(module, micro_batches, module.reduced_bytes)


def _in_accumulation(module, micro_batches, count):
    total = count(module.entry)
    inside = 0
    if micro_batches > 1:
        for ins in module.computations.get(module.entry, ()):
            trips = module.trip_count(ins) if ins.opcode == "while" else None
            if trips in (micro_batches, micro_batches - 1):
                inside += count(ins.called("body"), trips)
    return {"micro_batches": micro_batches, "per_step_bytes": total, "in_micro_batch_loop_bytes": inside,
            "where": "per micro-batch" if inside else "per step"}


def format_report(r):
    if r.get("refused"):
        return "\n".join([
            f"{r['params_total'] / 1e9:,.4g}B parameters on {r['devices']} x {r['accelerator']} (topology "
            f"{r['topology']}, mesh {r['mesh']}): the compiler refused the step after {r['compile_time_s']:.1f} s",
            (f"HBM per device: needs {gib(r['hbm_bytes_per_device'])} ({r['refused_of']}) of "
             f"{gib(r['hbm_available_bytes'])} " if r["hbm_bytes_per_device"] else "HBM per device: ") +
            f"({r['refused']})",
            f"verdict: DOES NOT FIT ({memory.FIT_ADVICE})"])
    verdict = "FITS" if r["hbm_fits"] else "DOES NOT FIT"
    lines = [f"{r['params_total'] / 1e9:,.4g}B parameters on {r['devices']} x {r['accelerator']} "
             f"(topology {r['topology']}, mesh {r['mesh']}); compiled in {r['compile_time_s']:.1f} s",
             f"HBM per device: arguments {gib(r['argument_bytes_per_device'])} (params + optimizer state "
             f"{gib(r['state_bytes_per_device'] - r['host_state_bytes_per_device'])} on the device) + temporaries "
             f"{gib(r['temp_bytes_per_device'])} + outputs {gib(r['output_bytes_per_device'])} - donated "
             f"{gib(r['alias_bytes_per_device'])}"
             + (f" - host-resident state {gib(r['host_state_counted_from_shardings_bytes'])}"
                if r.get("host_state_counted_from_shardings_bytes") else "") + f" = {gib(r['hbm_bytes_per_device'])}",
             f"  of {gib(r['hbm_capacity_bytes'])}, {gib(r['hbm_usable_bytes'])} usable"
             f"{' at launch.mem_fraction' if r['hbm_usable_bytes'] < r['hbm_capacity_bytes'] else ''}: "
             f"{verdict} (headroom {gib(r['headroom_bytes'])})",
             f"pinned host memory per device: {gib(r['host_bytes_per_device'])} (offloaded activations "
             f"{gib(r['host_temp_bytes_per_device'])}, host-resident state {gib(r['host_state_bytes_per_device'])}) "
             f"of {gib(r['host_ram_per_gpu_bytes'])} host RAM per device ({gib(r['host_usable_bytes'])} usable): "
             f"{'FITS' if r['host_fits'] else 'DOES NOT FIT'}"]
    if r.get("host_state_counted_from_shardings_bytes"):
        moved = gib(r["host_state_counted_from_shardings_bytes"])
        lines.append(f"  (offload.params / offload.optimizer_state: {moved} "
                     "of state these compile-only devices held in HBM, counted in host memory where the run puts "
                     "it; its host<->device traffic is not in the compiled step)")
        traffic = r.get("host_state_traffic")
        if traffic:
            lines.append(f"  that state's traffic a step, not in the compiled step: "
                         f"{traffic['h2d_bytes'] / 1e9:,.4g} GB to the device, {traffic['d2h_bytes'] / 1e9:,.4g} GB "
                         f"back, {traffic['seconds']:.3g} s at the host link if none of it hides"
                         + (f" (predicted step then {traffic['step_s_if_exposed']:.4g} s)"
                            if traffic["step_s_if_exposed"] else ""))
    lines.append(f"verdict: {'FITS' if r['fits'] else 'DOES NOT FIT'}")
    for label, names in r["offloaded"].items():
        lines.append(f"  {label}: offloaded {', '.join(names) or '-'}")
        if r.get("group_notes", {}).get(label):
            lines.append(f"    ({r['group_notes'][label]})")
    if r.get("compiled_work"):
        lines += [line for line in audit.format_audit(r["compiled_work"]) if not line.startswith("WARNING")]
    if r.get("timeline"):
        lines += summary.format_report(r["timeline"]) + [f"  (xla.preset={r['xla_preset']})"]
    gathers = r.get("weight_gathers")
    if gathers and gathers["micro_batches"] > 1:
        lines.append(f"all-gathers (FSDP weights): {gathers['per_step_bytes'] / 1e9:,.4g} GB per device per step, "
                     f"gathered {gathers['where']} (train.gather_weights={gathers['asked']}, "
                     f"{gathers['micro_batches']} micro-batches; "
                     f"{gathers['in_micro_batch_loop_bytes'] / 1e9:,.4g} GB of it inside the accumulation loop)")
    if r.get("expert_weight_gathers") is not None:
        lines.append(f"all-gathers of routed-expert weights: {r['expert_weight_gathers']}"
                     + (" (experts at home)" if r["expert_weight_gathers"] == 0 else
                        " (their FSDP shards gathered for the grouped GEMMs: mesh.rules.exp_embed)"))
    reductions = r.get("gradient_reductions")
    if reductions and reductions["micro_batches"] > 1:
        lines.append(f"reductions (gradients): {reductions['per_step_bytes'] / 1e9:,.4g} GB per device per step, "
                     f"{reductions['in_micro_batch_loop_bytes'] / 1e9:,.4g} GB of it inside the accumulation loop"
                     + (f" ({reductions['data_replicas']} data replicas accumulate their own and are summed once a "
                        "step, train.reduce_gradients=per_step: inside the loop, the reductions within a replica, "
                        "e.g. FSDP's reduce-scatters)" if reductions["data_replicas"] > 1 else ""))
    if r["problems"]:
        lines.append("PROBLEMS:\n  " + "\n  ".join(r["problems"]))
    lines += [f"WARNING: {w}" for w in r.get("warnings", [])]
    return "\n".join(lines)


@tool
def main(argv):
    """Exit status; a mistake in the input prints one line (MaxOffload/cli.py)."""
    from MaxOffload import cli

    argv, _, _ = cli.parse(argv, __doc__, keys=cli.TARGET_KEYS)
    from MaxOffload.platform import use_cpu_runtime

    use_cpu_runtime()  # compile-only devices; no accelerator runtime needed
    from MaxOffload import xla
    from MaxOffload.config import ConfigError, load
    from MaxOffload.reports import publish

    cfg = load(argv)
    require_target(cfg)
    xla.apply(cfg)
    from MaxOffload.offload.planner import plan_for

    plan = plan_for(cfg, cfg.aot.target, cfg.aot.topology)  # remat.policy=auto: planned for this target
    try:
        os.makedirs(cfg.run.output_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run.output_dir={cfg.run.output_dir}: {e.strerror}; choose a writable directory") from None
    print(f"compiling the training step of {argv[0]} for {describe_topology(cfg, cfg.aot.topology)} x "
          f"{cfg.aot.target} (deviceless) ...", flush=True)
    report, simulation = build_report(cfg, plan, cfg.aot.target, cfg.aot.topology)
    publish(cfg, "aot_report.json", report, format_report(report))
    if simulation is not None:
        print(trace.write_pictures(simulation, cfg.run.output_dir))
    return 0 if report["fits"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

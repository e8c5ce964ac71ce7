"""The report of a simulated step: its figures (summarize: the dict the aot report holds under `timeline` and the
planner ranks by) and their lines for people (format_report)."""
import collections

from MaxOffload import hardware
from MaxOffload.timeline.engines import COLLECTIVE, COMPUTE, D2H, H2D, pipeline_pass
from MaxOffload.timeline.schedule import PIPELINE


def summarize(sim, step, model_flops_per_device=None):
    """The figures of a finished Simulation whose step took `step` seconds: the engines' busy and exposed time, the
    bytes they moved, the same split per layer segment (`groups`), compute per model part, collectives per kind,
    and with the model's FLOPs per device its TFLOP/s and MFU."""
    busy = collections.Counter()
    stalls = collections.Counter()
    moved = collections.Counter()
    groups = {}
    parts, kinds = collections.Counter(), {}  # compute per model part; collectives per kind
    for e in sim.events:
        busy[e.engine] += e.end - e.start
        if e.engine == COMPUTE:
            parts[e.component] += e.end - e.start
        elif e.engine == COLLECTIVE:
            kinds.setdefault(e.kind, collections.Counter()).update(s=e.end - e.start, exposed_s=e.stall, bytes=e.bytes)
        moved[e.engine] += e.bytes
        kind = "copy" if e.engine in (D2H, H2D) else e.engine
        stalls[kind] += e.stall
        g = groups.setdefault(e.segment, collections.Counter())
        g[f"{e.engine}_s"] += e.end - e.start
        if e.engine != COMPUTE:
            g[f"exposed_{kind}_s"] += e.stall
    copy_s = busy[D2H] + busy[H2D]
    report = {
        "target": sim.rates.name, "step_s": step, "compute_s": busy[COMPUTE],
        "exposed_copy_s": stalls["copy"], "exposed_collective_s": stalls[COLLECTIVE],
        "d2h_s": busy[D2H], "h2d_s": busy[H2D], "copy_s": copy_s, "collective_s": busy[COLLECTIVE],
        "d2h_bytes": moved[D2H], "h2d_bytes": moved[H2D], "collective_bytes": moved[COLLECTIVE],
        "copy_hidden_fraction": 1 - stalls["copy"] / copy_s if copy_s else None,
        "collective_hidden_fraction": 1 - stalls[COLLECTIVE] / busy[COLLECTIVE] if busy[COLLECTIVE] else None,
        "compiled_matmul_flops": sum(e.flops for e in sim.events),
        "fp8_matmul_flops": sum(e.fp8_flops for e in sim.events),
        "kernels": sum(1 for e in sim.events if e.engine == COMPUTE),
        "unknown_trip_counts": sim.unknown_trip_counts,
        "calibration": {"matmul_flops": sim.rates.matmul_flops, "hbm_bytes_per_s": sim.rates.hbm_bytes,
                        "host_link_bytes_per_s": sim.rates.host_link, "nvlink_bytes_per_s": sim.rates.nvlink,
                        "network_bytes_per_s": sim.rates.network},
        "groups": {name: {k: v for k, v in sorted(g.items())} for name, g in sorted(groups.items())},
        "compute_by_part_s": dict(parts.most_common()),
        "collectives_by_kind": {k: {key: c[key] for key in ("s", "exposed_s", "bytes")}
                                for k, c in sorted(kinds.items(), key=lambda kc: -kc[1]["s"])},
        "model_tflops_per_device": None, "mfu": None,
    }
    report["pipeline"] = pipeline_figures(sim)
    if model_flops_per_device:
        report["model_tflops_per_device"] = model_flops_per_device / step / 1e12
        report["mfu"] = model_flops_per_device / step / mixed_peak(sim.rates, report)
    return report


def pipeline_iterations(sim):
    """[(loop label, pass, forward iteration t, start, end)] of the pipeline stages' loops' iterations as the
    simulation ran them (the backward pass runs the forward's iterations in reverse). XLA may unroll a loop (each
    trip then runs several iterations: T // trips, its span split evenly between them) and peel an iteration out
    of it (run outside the loop: not listed)."""
    spans = [(label, i, start, end) for label, i, start, end in sim.windows if label.startswith(PIPELINE + " ")]
    trips = collections.Counter(label for label, *_ in spans)
    total = sim.pipeline.iterations
    found = []
    for label, i, start, end in spans:
        direction, per = label.split()[1], max(1, total // trips[label])
        for k in range(per):
            t = i * per + k
            t = t if direction == "forward" else trips[label] * per - 1 - t
            found.append((label, direction, t, start + (end - start) * k / per, start + (end - start) * (k + 1) / per))
    return found


def pipeline_figures(sim):
    """The pipeline stages' part of the step (None without stages): the time of its loops' iterations, of those
    in which a stage idles (the bubble: the mean over the stages of their idle iterations' time; an iteration XLA
    peeled out of a loop counts at that loop's mean iteration time), the collective-permutes that carry the
    activations between stages (their time and what of it compute waited for) and the schedule's own bubble,
    (S - 1) / (R M + S - 1), beside the simulated one."""
    schedule = getattr(sim, "pipeline", None)
    if schedule is None:
        return None
    durations = collections.defaultdict(dict)  # pass label -> {iteration: seconds}
    for label, _, t, start, end in pipeline_iterations(sim):
        durations[label][t] = end - start
    peeled = 0
    for label, found in durations.items():
        mean = sum(found.values()) / len(found)
        missing = [t for t in range(schedule.iterations) if t not in found]
        peeled += len(missing)
        found.update({t: mean for t in missing})
    loop_s = sum(sum(found.values()) for found in durations.values())
    bubble_s = sum(seconds for found in durations.values() for stage in range(schedule.stages)
                   for t, seconds in found.items() if schedule.work(t, stage) is None) / schedule.stages
    permutes = [e for e in sim.events if e.engine == COLLECTIVE and e.kind == "collective-permute"
                and pipeline_pass(e.op_name, body=True)]
    return {"stages": schedule.stages, "repeats": schedule.repeats, "microbatches": schedule.microbatches,
            "iterations": schedule.iterations, "loops": sorted(durations), "peeled_iterations": peeled,
            "loop_s": loop_s, "bubble_s": bubble_s, "bubble_fraction": bubble_s / loop_s if loop_s else None,
            "schedule_bubble": schedule.bubble, "working_s": loop_s - bubble_s,
            "ppermute_s": sum(e.end - e.start for e in permutes),
            "ppermute_exposed_s": sum(e.stall for e in permutes), "ppermute_bytes": sum(e.bytes for e in permutes)}


def mixed_peak(rates, report):
    """The peak FLOP/s MFU counts against: BF16's for the step's BF16 GEMMs, FP8's (fp8_matmul_flops over
    matmul_flops times BF16's) for its FP8 GEMMs, weighted by their FLOPs; BF16's when it has no FP8 GEMM."""
    fp8_peak = rates.peak_flops * (rates.fp8_matmul_flops or 2 * rates.matmul_flops) / rates.matmul_flops
    return hardware.mixed_peak(rates.peak_flops, fp8_peak, report["compiled_matmul_flops"], report["fp8_matmul_flops"])


def format_report(r):
    """Lines for the aot tool and the planner."""
    hidden = "n/a" if r["copy_hidden_fraction"] is None else f"{r['copy_hidden_fraction']:.0%}"
    lines = [f"predicted step time on {r['target']}: {_ms(r['step_s'])} = compute {_ms(r['compute_s'])} "
             f"+ exposed copies {_ms(r['exposed_copy_s'])} + exposed collectives {_ms(r['exposed_collective_s'])}",
             f"  host copies: D2H {_gb(r['d2h_bytes'])} in {_ms(r['d2h_s'])}, H2D {_gb(r['h2d_bytes'])} in "
             f"{_ms(r['h2d_s'])}, {hidden} hidden under compute; collectives {_gb(r['collective_bytes'])} in "
             f"{_ms(r['collective_s'])}"]
    if r["unknown_trip_counts"]:  # said before any figure is read as a prediction
        lines.insert(0, f"WARNING: {len(r['unknown_trip_counts'])} loop(s) without a known trip count were run once "
                        f"({', '.join(r['unknown_trip_counts'][:3])}): the step below is NOT a prediction, only its "
                        "loops' bodies once")
    if r["model_tflops_per_device"]:
        lines.append(f"  predicted {r['model_tflops_per_device']:,.1f} model TFLOP/s per device, MFU "
                     f"{r['mfu']:.1%}")
    p = r.get("pipeline")
    if p:
        fraction = "n/a" if p["bubble_fraction"] is None else f"{p['bubble_fraction']:.1%}"
        lines.append(f"  pipeline: {p['stages']} stages x {p['repeats']} repeats, {p['microbatches']} micro-batches, "
                     f"{p['iterations']} iterations a pass; its loops {_ms(p['loop_s'])}, of which the bubble "
                     f"{_ms(p['bubble_s'])} ({fraction}; the schedule's {p['schedule_bubble']:.1%}) and each stage's "
                     f"work {_ms(p['working_s'])}; ppermute {_gb(p['ppermute_bytes'])} in {_ms(p['ppermute_s'])} "
                     f"({_ms(p['ppermute_exposed_s'])} exposed)")
    if r.get("compute_by_part_s"):
        lines.append("  compute by part: " + ", ".join(f"{part} {_ms(t)}" for part, t in
                                                      list(r["compute_by_part_s"].items())[:6]))
    if r.get("collectives_by_kind"):
        lines.append("  collectives by kind: " + ", ".join(
            f"{kind} {_gb(c['bytes'])} in {_ms(c['s'])} ({_ms(c['exposed_s'])} exposed)"
            for kind, c in r["collectives_by_kind"].items()))
    return lines


def _gb(n):
    return f"{n / 1e9:,.3g} GB"


def _ms(seconds):
    return f"{seconds * 1e3:,.4g} ms"

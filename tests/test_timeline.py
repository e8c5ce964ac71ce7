"""The step-time timeline (MaxOffload/timeline/): hand-written scheduled modules with known answers, the
deviceless GB200 compile of the quickstart under an offload policy, the five H200 programs against their measured
step times, and the planner ranking plans by their compiled timelines."""
import collections
import json
import os

import pytest

from MaxOffload import hardware, hlo
from MaxOffload.timeline import engines, plot, schedule, simulate, summary, trace
from conftest import ROOT, predicted_steps

MS = 1e-3
# Round rates: a kernel of 1e9 FLOPs takes 1 ms; HBM so fast that bytes never decide a kernel here; the host link
# moves 2.5e6 bytes in 2.5 ms; NVLink 1e9 bytes/s within a domain of 4 devices, the network 1e8 across.
RATES = engines.Rates("test", peak_flops=1e12, matmul_flops=1e12, hbm_bytes=1e18, host_link=1e9, nvlink=1e9,
                       network=1e8, domain=4)

# dot [500,1000] x [1000,1000]: 2 x 500 x 1000 x 1000 = 1e9 FLOPs = 1 ms
HEADER = """HloModule m, is_scheduled=true

%fused_dot (p0: f32[500,1000], p1: f32[1000,1000]) -> f32[500,1000] {
  %p0 = f32[500,1000]{1,0} parameter(0)
  %p1 = f32[1000,1000]{1,0} parameter(1)
  ROOT %d = f32[500,1000]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp(layers_0_1)/mlp/dot_general"}
}
"""
PARAMS = """  %a = f32[500,1000]{1,0} parameter(0)
  %b = f32[1000,1000]{1,0} parameter(1)
  %x = f32[625,1000]{1,0} parameter(2)
  %h = f32[625,1000]{1,0:S(5)} parameter(3)
  %y = f32[625,1000]{1,0} parameter(4)
"""
# f32[625,1000] = 2.5e6 bytes: 2.5 ms over the host link
TO_HOST = """  %{n} = (f32[625,1000]{{1,0:S(5)}}, f32[625,1000]{{1,0}}, u32[]) copy-start(%{src})
"""
TO_HOST_DONE = "  %{n}.done = f32[625,1000]{{1,0:S(5)}} copy-done(%{n})\n"
FROM_HOST = "  %{n} = (f32[625,1000]{{1,0}}, f32[625,1000]{{1,0:S(5)}}, u32[]) copy-start(%h)\n"
FROM_HOST_DONE = "  %{n}.done = f32[625,1000]{{1,0}} copy-done(%{n})\n"


def kernels(count, first=0):
    return "".join(f"  %k{i} = f32[500,1000]{{1,0}} fusion(%a, %b), kind=kCustom, calls=%fused_dot\n"
                    for i in range(first, first + count))


def module(body, computations=""):
    return (HEADER + computations + "ENTRY %main (a: f32[500,1000], b: f32[1000,1000], x: f32[625,1000], "
            "h: f32[625,1000], y: f32[625,1000]) -> f32[500,1000] {\n" + PARAMS + body
            + "  ROOT %out = f32[500,1000]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot\n}\n")


def run(text):
    return simulate.simulate(text, RATES)


@pytest.mark.parametrize("between", [0, 1, 2, 3])
def test_a_copy_hides_under_the_kernels_between_its_start_and_done(between):
    """exposed = max(0, copy - compute between): 2.5 ms of copy under 0-3 kernels of 1 ms."""
    text = module(TO_HOST.format(n="c", src="x") + kernels(between) + TO_HOST_DONE.format(n="c"))
    report, sim = run(text)
    exposed = max(0.0, 2.5 - between) * MS
    assert report["exposed_copy_s"] == pytest.approx(exposed)
    assert report["compute_s"] == pytest.approx((between + 1) * MS)  # + the root kernel
    assert report["step_s"] == pytest.approx((between + 1) * MS + exposed)
    assert report["d2h_bytes"] == 2.5e6 and report["h2d_bytes"] == 0
    assert report["copy_hidden_fraction"] == pytest.approx(1 - exposed / (2.5 * MS))


def test_transfers_of_both_directions_run_at_once_and_one_direction_queues():
    both = run(module(TO_HOST.format(n="c", src="x") + FROM_HOST.format(n="f") + TO_HOST_DONE.format(n="c")
                      + FROM_HOST_DONE.format(n="f")))[0]
    assert both["step_s"] == pytest.approx((2.5 + 1) * MS)  # full duplex: 2.5 ms for both, then the root kernel
    assert both["d2h_bytes"] == both["h2d_bytes"] == 2.5e6
    queued = run(module(TO_HOST.format(n="c", src="x") + TO_HOST.format(n="e", src="y") + TO_HOST_DONE.format(n="c")
                        + TO_HOST_DONE.format(n="e")))[0]
    assert queued["step_s"] == pytest.approx((5.0 + 1) * MS)  # one D2H engine: the second waits for the first
    assert queued["exposed_copy_s"] == pytest.approx(5.0 * MS)


ALL_GATHER = """  %ag = (f32[{rows},1000]{{1,0}}, f32[{full},1000]{{1,0}}) all-gather-start(%part), dimensions={{0}}, replica_groups={groups}
"""


def gather_module(rows, groups, between):
    part = f"  %part = f32[{rows},1000]{{1,0}} parameter(5)\n"
    text = (ALL_GATHER.format(rows=rows, full=4 * rows, groups=groups) + kernels(between)
            + f"  %ag.done = f32[{4 * rows},1000]{{1,0}} all-gather-done(%ag)\n")
    return module(part + text).replace("y: f32[625,1000])", f"y: f32[625,1000], part: f32[{rows},1000])")


def test_an_async_all_gather_overlaps_a_gemm():
    """An all-gather over 4 devices of an 4 x 250 x 1000 f32 output moves 3/4 of its 4e6 bytes: 3 ms at 1e9 B/s."""
    hidden, sim = run(gather_module(250, "{{0,1,2,3}}", 3))
    assert hidden["collective_bytes"] == pytest.approx(3e6)
    assert hidden["exposed_collective_s"] == pytest.approx(0.0)
    assert hidden["step_s"] == pytest.approx(4 * MS)
    assert hidden["collectives_by_kind"] == {"all-gather": {"s": pytest.approx(3 * MS), "exposed_s": 0.0,
                                                            "bytes": pytest.approx(3e6)}}
    assert sum(hidden["compute_by_part_s"].values()) == pytest.approx(hidden["compute_s"])
    exposed = run(gather_module(250, "{{0,1,2,3}}", 1))[0]
    assert exposed["exposed_collective_s"] == pytest.approx(2 * MS)
    assert exposed["collectives_by_kind"]["all-gather"]["exposed_s"] == pytest.approx(2 * MS)
    assert exposed["collective_hidden_fraction"] == pytest.approx(1 / 3)
    # the same group in the iota form; across two NVLink domains (devices 0-3 | 4-7), hierarchically: the half
    # from the other domain (2e6 bytes) over the network's 1e8 (20 ms), the quarter from the other local member
    # over NVLink (1 ms) at the same time
    assert run(gather_module(250, "[1,4]<=[4]", 3))[0]["step_s"] == pytest.approx(4 * MS)
    across = run(gather_module(250, "{{0,4,1,5}}", 3))[0]
    assert across["collective_s"] == pytest.approx(20 * MS) and across["exposed_collective_s"] == pytest.approx(17 * MS)
    # the mesh form of XLA 2026 (jaxlib 0.10.2's GPU compiles): groups along the axes in braces of the device ids
    # laid out on the mesh; here two groups of 4 in one NVLink domain each ({0,1,2,3}, {4,5,6,7}), then the 4 pairs
    # that cross the domains ({0,4}, ...: each member's whole share from the other domain, 1e6 bytes, 10 ms)
    assert schedule.replica_groups("replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) "
                                   "{'axis_0'}, dimensions={0}", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert schedule.replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'},", 8)[:2] == [[0, 4], [1, 5]]
    in_domain = "mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'},"
    assert run(gather_module(250, in_domain, 3))[0]["step_s"] == pytest.approx(4 * MS)


def test_an_fp8_gemm_runs_at_twice_the_bf16_rate():
    """cuBLASLt's FP8 matmul of 1e9 FLOPs takes 0.5 ms where the BF16 GEMM of the same shape takes 1 ms (RATES:
    FP8 at twice the matmul rate, as on Hopper and Blackwell; Rates.of gives the target's own), and MFU counts
    the FP8 GEMMs against the FP8 peak."""
    gemm = ('  %{n} = (bf16[500,1000]{{1,0}}, s8[1024]{{0}}) custom-call({ops}), custom_call_target="{target}", '
            'backend_config={{"gemm_backend_config":{{"dot_dimension_numbers":{{"lhs_contracting_dimensions":["1"],'
            '"rhs_contracting_dimensions":["0"]}}}}}}, metadata={{op_name="jit(step)/mlp/dot_general"}}\n')
    text = ("HloModule m, is_scheduled=true\n\nENTRY %main (a: f8e4m3fn[500,1000], b: f8e4m3fn[1000,1000], "
            "x: bf16[500,1000], y: bf16[1000,1000], s: f32[]) -> bf16[500,1000] {\n"
            "  %a = f8e4m3fn[500,1000]{1,0} parameter(0)\n  %b = f8e4m3fn[1000,1000]{1,0} parameter(1)\n"
            "  %x = bf16[500,1000]{1,0} parameter(2)\n  %y = bf16[1000,1000]{1,0} parameter(3)\n"
            "  %s = f32[] parameter(4)\n"
            + gemm.format(n="f8", ops="%a, %b, %s, %s", target="__cublas$lt$matmul$f8")
            + gemm.format(n="bf16", ops="%x, %y", target="__cublas$gemm")
            + "  ROOT %out = bf16[500,1000]{1,0} get-tuple-element(%bf16), index=0\n}\n")
    report, sim = run(text)
    durations = {e.name: e.end - e.start for e in sim.events if e.engine == engines.COMPUTE}
    assert durations["f8"] == pytest.approx(0.5 * MS) and durations["bf16"] == pytest.approx(1 * MS)
    # MFU against the step's own mix: 1e9 FLOPs at 1e12 and 1e9 at 2e12 -> 2e9 FLOPs in 1.5 ms at peak
    assert report["fp8_matmul_flops"] == pytest.approx(1e9)
    assert summary.mixed_peak(RATES, report) == pytest.approx(2e9 / 1.5e-3)
    gb200 = engines.Rates.of(hardware.ACCELERATORS["gb200"])
    assert gb200.fp8_matmul_flops == pytest.approx(2 * gb200.matmul_flops)


def test_a_synchronous_collective_stalls_compute():
    """An all-reduce of 2e6 bytes over 2 devices moves 2 (n - 1) / n x 2e6 = 2e6 bytes: 2 ms, all of it exposed."""
    body = ("  %r = f32[500,1000]{1,0} all-reduce(%a), replica_groups={{0,1}}, to_apply=%sum\n" + kernels(1))
    sum_ = ("%sum (s0: f32[], s1: f32[]) -> f32[] {\n  %s0 = f32[] parameter(0)\n  %s1 = f32[] parameter(1)\n"
            "  ROOT %s = f32[] add(%s0, %s1)\n}\n")
    report = run(module(body, sum_))[0]
    assert report["exposed_collective_s"] == pytest.approx(2 * MS)
    assert report["step_s"] == pytest.approx(4 * MS)


def test_a_while_loop_runs_its_body_trip_count_times_and_a_conditional_its_dearest_branch():
    loop = """%body (t: (s32[], f32[500,1000], f32[1000,1000], f32[625,1000])) -> (s32[], f32[500,1000], f32[1000,1000], f32[625,1000]) {
  %t = (s32[], f32[500,1000]{1,0}, f32[1000,1000]{1,0}, f32[625,1000]{1,0}) parameter(0)
  %a = f32[500,1000]{1,0} get-tuple-element(%t), index=1
  %b = f32[1000,1000]{1,0} get-tuple-element(%t), index=2
  %x = f32[625,1000]{1,0} get-tuple-element(%t), index=3
""" + TO_HOST.format(n="c", src="x") + kernels(2) + TO_HOST_DONE.format(n="c") + """  ROOT %o = (s32[], f32[500,1000]{1,0}, f32[1000,1000]{1,0}, f32[625,1000]{1,0}) tuple(%i, %a, %b, %x)
}

%cond (u: (s32[], f32[500,1000], f32[1000,1000], f32[625,1000])) -> pred[] {
  %u = (s32[], f32[500,1000]{1,0}, f32[1000,1000]{1,0}, f32[625,1000]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

%cheap (v: f32[500,1000]) -> f32[500,1000] {
  ROOT %v = f32[500,1000]{1,0} parameter(0)
}

%dear (w: (f32[500,1000], f32[1000,1000])) -> f32[500,1000] {
  %w = (f32[500,1000]{1,0}, f32[1000,1000]{1,0}) parameter(0)
  %a = f32[500,1000]{1,0} get-tuple-element(%w), index=0
  %b = f32[1000,1000]{1,0} get-tuple-element(%w), index=1
""" + kernels(4) + """  ROOT %r = f32[500,1000]{1,0} copy(%k3)
}

"""
    body = ('  %tup = (s32[], f32[500,1000]{1,0}, f32[1000,1000]{1,0}, f32[625,1000]{1,0}) tuple(%i, %a, %b, %x)\n'
            '  %loop = (s32[], f32[500,1000]{1,0}, f32[1000,1000]{1,0}, f32[625,1000]{1,0}) while(%tup), '
            'condition=%cond, body=%body, metadata={op_name="jit(step)/jvp(layers_0_2)/while"}, '
            'backend_config={"known_trip_count":{"n":"3"}}\n'
            '  %pred = s32[] parameter(6)\n'
            '  %choice = f32[500,1000]{1,0} conditional(%pred, %a, %tup), branch_computations={%cheap, %dear}\n')
    report, sim = run(module(body, loop))
    # 3 x (2 kernels hiding 2 of the 2.5 ms copy) + the dear branch's 4 kernels + the root kernel
    assert report["exposed_copy_s"] == pytest.approx(3 * 0.5 * MS)
    assert report["compute_s"] == pytest.approx((3 * 2 + 4 + 1) * MS, rel=1e-4)  # the branch's copy moves 2e6 B
    assert report["d2h_bytes"] == 3 * 2.5e6
    assert [(w[0], w[1]) for w in sim.windows] == [("layers_0_2 forward (loop)", i) for i in range(3)]
    # the body's copies carry no metadata (as XLA leaves its ragged all-to-alls): they count in the loop's segment
    assert report["groups"]["layers_0_2"]["d2h_s"] == pytest.approx(3 * 2.5 * MS)
    start, end, label = plot.layer_window(sim)
    assert label == "layers_0_2 forward (loop), iteration 2 of 3" and end - start == pytest.approx(2.5 * MS)


def test_fused_slices_and_in_place_updates_count_the_slice_not_the_buffer():
    computations = """%fused_slice (q0: f32[8,1000,1000], q1: s32[]) -> f32[1,1000,1000] {
  %q0 = f32[8,1000,1000]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,1000,1000]{2,1,0} dynamic-slice(%q0, %q1, %z, %z), dynamic_slice_sizes={1,1000,1000}
}

%fused_update (r0: f32[8,1000,1000], r1: f32[1,1000,1000], r2: s32[]) -> f32[8,1000,1000] {
  %r0 = f32[8,1000,1000]{2,1,0} parameter(0)
  %r1 = f32[1,1000,1000]{2,1,0} parameter(1)
  %r2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[8,1000,1000]{2,1,0} dynamic-update-slice(%r0, %r1, %r2, %z, %z)
}

"""
    module_ = hlo.parse(module("  %i = s32[] parameter(7)\n  %stack = f32[8,1000,1000]{2,1,0} parameter(8)\n"
                               "  %s = f32[1,1000,1000]{2,1,0} fusion(%stack, %i), kind=kLoop, calls=%fused_slice\n"
                               "  %u = f32[8,1000,1000]{2,1,0} fusion(%stack, %s, %i), kind=kLoop, "
                               "calls=%fused_update\n", computations))
    by_name = {i.name: i for i in module_.computations[module_.entry]}
    assert schedule.kernel_bytes(module_, module_.entry, by_name["s"]) == 2 * 4e6 + 4  # the slice read and written
    assert schedule.kernel_bytes(module_, module_.entry, by_name["u"]) == 2 * 4e6 + 4  # the update read and written
    assert hlo.nbytes("(f32[2]{0:S(5)}, bf16[4]{0})", host=True) == 8
    assert hlo.nbytes("(f32[2]{0:S(5)}, bf16[4]{0})", host=False) == 8


@pytest.mark.stack("py312")  # a deviceless GPU compile: the GPU stack's jax
def test_the_quickstart_on_gb200_exposes_its_copies_under_baseline_and_the_trace_has_every_kernel(tmp_path):
    """A deviceless GB200 compile of the quickstart with two offloaded tensors, xla.preset=baseline: the copies cost
    exposed time (more than if every copy were free), and the trace holds one event per kernel the entry and the
    loop bodies run (x their trip counts)."""
    from MaxOffload import deviceless, from_config
    from MaxOffload.config import load

    cfg = load(["configs/quickstart.py", "remat.policy=custom", "remat.tensors.mlpwi_0=offload",
                "remat.tensors.query_proj=offload", f"run.output_dir={tmp_path}"])
    setup = from_config.train_setup(cfg, deviceless.compile_only_devices("gb200", "1x1x1"))
    module_ = hlo.parse(setup.compile_train_step().as_text())
    gb200 = hardware.ACCELERATORS["gb200"]
    report, sim = simulate.of_compiled(module_, setup, engines.Rates.of(gb200))
    free = simulate.simulate(module_, engines.Rates.of(gb200, calibration={"link_efficiency": 1e9}))[0]
    assert report["d2h_bytes"] > 0 and report["h2d_bytes"] > 0
    assert report["exposed_copy_s"] > 0 and free["exposed_copy_s"] == pytest.approx(0, abs=1e-12)
    assert report["step_s"] > free["step_s"]
    assert report["step_s"] == pytest.approx(report["compute_s"] + report["exposed_copy_s"]
                                             + report["exposed_collective_s"])
    assert 0 < report["mfu"] < 1 and report["model_tflops_per_device"] > 0
    assert "layers_0_3" in report["groups"]

    trace.write_pictures(sim, str(tmp_path))
    written = json.loads((tmp_path / "timeline.json").read_text())
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    compute_tid = next(e["tid"] for e in written["traceEvents"] if e.get("args", {}).get("name") == "compute")
    seen = collections.Counter(e["name"] for e in written["traceEvents"] if e["ph"] == "X" and e["tid"] == compute_tid)
    expected = collections.Counter()

    def walk(computation, times):
        for ins in module_.computations[computation]:
            if ins.opcode == "while":
                walk(ins.called("condition"), times * ins.trip_count())
                walk(ins.called("body"), times * ins.trip_count())
            elif ins.opcode == "fusion" and not any(a.host for a in hlo.arrays(ins.shape)) and not any(
                    a.host for o in ins.operands for a in hlo.arrays(module_.shapes(computation).get(o, ""))):
                expected[ins.name] += times
            elif ins.opcode == "custom-call" and not ins.target().startswith(schedule.NOT_KERNELS):
                expected[ins.name] += times

    walk(module_.entry, 1)
    assert expected and all(seen[name] == n for name, n in expected.items()), \
        {n: (seen[n], k) for n, k in expected.items() if seen[n] != k}
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in written["traceEvents"] if e["ph"] == "X")
    # a step of more events than a trace viewer takes: its first ones in time, and the trace says so
    short = trace.trace(sim, limit=10)["traceEvents"]
    assert [e["ts"] for e in short if e["ph"] == "X"] == sorted(e.start * 1e6 for e in sim.events)[:10]
    assert f"its first 10 of {len(sim.events):,} events" in short[0]["args"]["name"]


def test_the_h200_programs_are_predicted_within_20_percent_and_ranked_as_measured():
    """The five H200 variants as compiled deviceless on jax 0.12 (tests/data/h200_programs, written by
    benchmarks/predict_vs_measured.py --save_programs) against their measured step times
    (benchmarks/results/h200_2026-11-29), with the calibration in the code."""
    import csv

    with open(os.path.join(ROOT, "benchmarks", "results", "h200_2026-11-29", "offload_sweep.csv")) as f:
        measured = {r["variant"]: float(r["step_s"]) for r in csv.DictReader(f)}
    predicted = predicted_steps("h200_programs", measured, engines.Rates.of(hardware.ACCELERATORS["h200"]))
    for name, seconds in measured.items():
        assert predicted[name] == pytest.approx(seconds, rel=0.2), (name, predicted[name], seconds)
    order = sorted(measured, key=predicted.get)
    assert order[:3] == ["auto", "remat", "offload+lhs+pipelined"] and set(order[3:]) == {"offload", "offload+lhs"}


def test_the_planner_ranks_an_offload_plan_by_its_timeline_per_host_link():
    """Offloading out_proj and mlpwi_0 of a 4096-wide layer: on an H200 (PCIe) its copies cannot hide and it loses
    to full remat; on a GH200 (NVLink-C2C) they hide and it wins, by the compiled timelines."""
    from MaxOffload import deviceless, from_config
    from MaxOffload.config import load
    from MaxOffload.offload import planner
    from MaxOffload.offload.costs import machine

    model = ["configs/llama3_1.py:tiny", "model.emb_dim=4096", "model.mlp_dim=4096", "model.num_heads=32",
             "model.num_kv_heads=8", "model.head_dim=128", "train.seq_len=2048", "train.per_device_batch_size=1"]
    plans = {"remat": ["remat.policy=full"],
             "offload": ["remat.policy=custom", "remat.tensors.out_proj=offload", "remat.tensors.mlpwi_0=offload"]}
    ratio = {}
    for target in ("h200", "gh200"):
        accelerator = hardware.ACCELERATORS[target]
        steps = {}
        for name, policy in plans.items():
            setup = from_config.train_setup(load([*model, *policy]), deviceless.compile_only_devices(target, "1x1x1"))
            trial = planner.measure(planner.Trial(name, "baseline", {}, {}), setup, machine(accelerator, 0.9),
                                    engines.Rates.of(accelerator))
            assert trial.fits and not trial.error
            steps[name] = trial.step_s
        ratio[target] = steps["offload"] / steps["remat"]
    assert ratio["h200"] > 1.1, ratio  # copies over PCIe do not hide
    assert ratio["gh200"] < 0.99, ratio  # over NVLink-C2C they do, and the saved recompute wins


def test_a_pipelined_loop_without_a_proved_trip_count_is_read_from_its_induction_variable():
    """XLA's loop pipelining (e.g. gradient accumulation under lhs_pipelined_offload) peels an iteration and drops
    `known_trip_count`; the loop keeps its induction variable (init 0, step 1) and a condition `i < 2` inside a
    fusion: 2 trips. Without the variable or with another comparison, the count stays unknown."""
    from MaxOffload import hlo

    def loop_module(direction="LT", backend='"known_induction_variable":{"tuple_index":"0"},"dynamic_variables":'
                                           '[{"tuple_index":"0","init":"0","step":"1"},{"tuple_index":"1"}]'):
        return hlo.parse(f"""HloModule m, is_scheduled=true

%fused_compare (p: s32[]) -> pred[] {{
  %p = s32[] parameter(0)
  %c = s32[] constant(2)
  ROOT %lt = pred[] compare(%p, %c), direction={direction}
}}

%cond (u: (s32[], f32[4])) -> pred[] {{
  %u = (s32[], f32[4]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%u), index=0
  ROOT %f = pred[] fusion(%i), kind=kLoop, calls=%fused_compare
}}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {{
  ROOT %t = (s32[], f32[4]{{0}}) parameter(0)
}}

ENTRY %main (a: (s32[], f32[4])) -> (s32[], f32[4]) {{
  %a = (s32[], f32[4]{{0}}) parameter(0)
  ROOT %w = (s32[], f32[4]{{0}}) while(%a), condition=%cond, body=%body, backend_config={{{backend}}}
}}
""")

    def trips(m):
        return m.trip_count(m.root(m.entry))

    assert trips(loop_module()) == 2
    assert trips(loop_module(direction="GT")) is None
    assert trips(loop_module(backend='"known_trip_count":{"n":"7"}')) == 7
    assert trips(loop_module(backend='"dynamic_variables":[]')) is None

    # XLA:GPU after pipelining the gradient accumulation of the 671B recipe's full-remat twin (jaxlib 0.10.2,
    # xla.preset=lhs_pipelined): the config names the variable only, the increment is a fusion of a copy of it, the
    # loop starts from a copy of a constant: 31 trips of i < 31 from 0 (the 32nd peeled out of the loop)
    newer = hlo.parse("""HloModule m, is_scheduled=true

%fused_compare (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  %c = s32[] constant(31)
  ROOT %lt = pred[] compare(%p, %c), direction=LT
}

%fused_add (q: s32[]) -> s32[] {
  %q = s32[] parameter(0)
  %one = s32[] constant(1)
  ROOT %sum = s32[] add(%q, %one)
}

%cond (u: (s32[], f32[4])) -> pred[] {
  %u = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%u), index=0
  ROOT %f = pred[] fusion(%i), kind=kLoop, calls=%fused_compare
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %j = s32[] get-tuple-element(%t), index=0
  %jc = s32[] copy(%j)
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %next = s32[] fusion(%jc), kind=kLoop, calls=%fused_add
  ROOT %o = (s32[], f32[4]{0}) tuple(%next, %x)
}

ENTRY %main (x: f32[4]) -> (s32[], f32[4]) {
  %x = f32[4]{0} parameter(0)
  %zero = s32[] constant(0)
  %zc = s32[] copy(%zero)
  %a = (s32[], f32[4]{0}) tuple(%zc, %x)
  ROOT %w = (s32[], f32[4]{0}) while(%a), condition=%cond, body=%body, backend_config={"known_induction_variable":{"tuple_index":"0"},"dynamic_variables":[]}
}
""")
    assert trips(newer) == 31

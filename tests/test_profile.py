"""Profiling window and the copy/compute overlap report: interval arithmetic on synthetic timelines with
known answers, the trace classifier, config checks, and real CPU traces of short training runs."""
import concurrent.futures
import json
import os

import pytest

from MaxOffload.profile import intervals
from MaxOffload.profile.intervals import COLLECTIVE, COMPUTE, D2H, H2D, Event, analyse
from MaxOffload.profile.trace import classify

MS = 1e6  # ns


def ev(line, start_ms, end_ms, kind, name="", nbytes=0):
    return Event(line=line, start=start_ms * MS, end=end_ms * MS, kind=kind, name=name, bytes=nbytes)


def close(a, b):
    return a == pytest.approx(b, abs=1e-9)


# -- interval sets -------------------------------------------------------------------------------
def test_interval_set_operations():
    assert intervals.union([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 7)]
    assert intervals.intersect([(0, 10)], [(2, 3), (5, 12)]) == [(2, 3), (5, 10)]
    assert intervals.subtract([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]
    assert intervals.subtract([(0, 10)], [(-5, 20)]) == []
    assert intervals.measure([(0, 4), (2, 6), (10, 11)]) == 7


# -- overlap on synthetic timelines --------------------------------------------------------------
def test_fully_hidden_copy():
    r = analyse([ev("compute", 0, 10, COMPUTE), ev("d2h", 2, 6, D2H, "qkv_proj", 4000)])
    assert close(r["compute_s"], 0.010) and close(r["d2h"]["time_s"], 0.004)
    assert r["d2h"]["hidden_fraction"] == 1.0 and r["d2h"]["bytes"] == 4000
    assert close(r["exposed_s"], 0.0) and r["largest_exposed"] == []


def test_partly_hidden_copies_name_the_exposed_one():
    r = analyse([ev("compute", 0, 10, COMPUTE), ev("d2h", 8, 14, D2H, "mlpwi_0", 6),   # 2 hidden, 4 exposed
                 ev("h2d", 12, 13, H2D, "qkv_proj", 1)])                                # 1 exposed
    assert close(r["d2h"]["hidden_s"], 0.002) and close(r["d2h"]["exposed_s"], 0.004)
    assert close(r["h2d"]["exposed_s"], 0.001) and r["h2d"]["hidden_fraction"] == 0.0
    assert close(r["copy"]["time_s"], 0.006) and close(r["copy"]["hidden_fraction"], 2 / 6)
    assert r["copy"]["bytes"] == 7
    assert close(r["exposed_s"], 0.004)  # 10..14: the h2d runs inside the d2h's exposed part
    assert [e["name"] for e in r["largest_exposed"]] == ["mlpwi_0", "qkv_proj"]
    assert close(r["largest_exposed"][0]["exposed_s"], 0.004)


def test_serialised_copies_are_all_exposed():
    r = analyse([ev("s", 0, 5, COMPUTE), ev("copy", 5, 8, D2H), ev("s", 8, 10, COMPUTE), ev("copy", 10, 12, H2D)])
    assert close(r["compute_s"], 0.007) and close(r["span_s"], 0.012)
    assert r["copy"]["hidden_fraction"] == 0.0 and close(r["exposed_s"], 0.005)


def test_compute_on_several_lines_is_one_union():
    r = analyse([ev("a", 0, 4, COMPUTE), ev("b", 2, 6, COMPUTE), ev("c", 3, 9, D2H)])
    assert close(r["compute_s"], 0.006)
    assert close(r["d2h"]["hidden_s"], 0.003) and close(r["d2h"]["exposed_s"], 0.003)


def test_nested_events_own_only_their_uncovered_time():
    # a loop (0..10) around two ops and a copy on the same line: the copy is serialised with them, not
    # hidden by its own loop; on another line a kernel covers 7..8 of it.
    events = [ev("t", 0, 10, COMPUTE, "while"), ev("t", 1, 3, COMPUTE, "dot"), ev("t", 3, 4, COMPUTE, "add"),
              ev("t", 6, 9, D2H, "copy"), ev("u", 7, 8, COMPUTE, "k")]
    owned = dict((e.name, iv) for e, iv in intervals.own_time(events))
    assert owned["while"] == [(0, 1 * MS), (4 * MS, 6 * MS), (9 * MS, 10 * MS)]
    r = analyse(events)
    assert close(r["compute_s"], 0.008)  # 0..6 and 7..8 and 9..10
    assert close(r["d2h"]["hidden_s"], 0.001) and close(r["d2h"]["exposed_s"], 0.002)


def test_collectives_overlap_and_exposed_time():
    r = analyse([ev("compute", 0, 10, COMPUTE), ev("nccl", 5, 15, COLLECTIVE, "all-gather"),
                 ev("d2h", 12, 20, D2H)])
    assert close(r["collective"]["hidden_fraction"], 0.5) and r["collective"]["count"] == 1
    assert close(r["exposed_s"], 0.010)  # 10..20: collective then copy, nothing computing
    assert close(r["d2h"]["exposed_s"], 0.008)


def test_mean_and_verdict_with_copies():
    from MaxOffload.profile import overlap

    steps = [analyse([ev("c", 0, 10, COMPUTE), ev("d", 0, 9, D2H, "moe_mlpwi_0", 2e9)]),
             analyse([ev("c", 0, 10, COMPUTE), ev("d", 0, 11, D2H, "moe_mlpwi_0", 2e9)])]
    result = {"trace_dir": "x", "module": "jit_train_step", "device": "gpu:0", "markers": [3, 4], "steps": steps,
              "mean": overlap.mean(steps)}
    assert close(result["mean"]["copy"]["hidden_fraction"], 19 / 20)
    text = overlap.verdict(result)
    assert "95% of 2 GB/step" in text and "exposed 0.50 ms/step" in text and "moe_mlpwi_0" in text
    assert "   3 " in overlap.format_table(result)


def test_a_window_without_step_ids_is_averaged_over_its_steps():
    from MaxOffload.profile import overlap

    one = [ev("c", 0, 10, COMPUTE), ev("d", 0, 9, D2H, "mlpwi_0", 2e9)]
    two = [ev("c", 20, 30, COMPUTE), ev("d", 20, 33, D2H, "mlpwi_0", 2e9), ev("h", 25, 26, H2D, "mlpwi_0", 1e9)]
    separate, lumped = overlap.mean([analyse(one), analyse(two)]), overlap.per_step(analyse(one + two), 2)
    for path in (("compute_s",), ("exposed_s",), ("copy", "time_s"), ("copy", "bytes"), ("d2h", "exposed_s"),
                 ("h2d", "bytes"), ("copy", "hidden_fraction")):
        a, b = separate, lumped
        for key in path:
            a, b = a[key], b[key]
        assert close(a, b), (path, a, b)
    assert close(lumped["largest_exposed"][0]["exposed_s"], 3e-3 / 2)  # the 3 ms D2H tail of step two


# -- classifying trace events ---------------------------------------------------------------------
@pytest.mark.parametrize("name,op,details,kind", [
    ("MEMCPYDtoH", "", "", D2H), ("MEMCPYHtoD", "", "", H2D), ("fusion.12", "fusion.12", "", COMPUTE),
    ("all-gather-start.3", "", "", COLLECTIVE), ("ncclDevKernel_ReduceScatter_Sum", "", "", COLLECTIVE),
    ("all-reduce.1", "all-reduce.1", "", COLLECTIVE), ("Memcpy DtoD", "", "", "other"), ("copy.4", "copy.4", "", COMPUTE),
    # what an H200 trace with command buffers holds: kernels and copies of one CUDA graph share the HLO op
    # command_buffer_N and a stream named after all it carried; only the event itself tells them apart
    ("loop_dynamic_update_slice_fusion", "command_buffer_201", "", COMPUTE),
    ("MemcpyD2H", "command_buffer_201", "kind_src:device kind_dst:pinned size:268435456 dest:0 async:1", D2H),
    ("Memcpy", "command_buffer_58", "kind_src:pinned kind_dst:device size:268435456", H2D),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "command_buffer_9", "", COLLECTIVE)])
def test_classify(name, op, details, kind):
    assert classify(name, op, details) == kind


# -- the switch and the window ----------------------------------------------------------------
def test_nsys_without_gpu_is_a_noop_with_a_message():
    from MaxOffload.profile.window import Window

    said = []
    window = Window("nsys", 2, 1, "/nonexistent", said.append)
    window.start()
    assert not window.active and "no CUDA GPU" in said[0] and window.stop() is None


def test_bad_profile_settings_cost_one_line(cli, tmp_path):
    for override, expect in (("profile.mode=perf", "profile.mode='perf' is not one of off, xprof, nsys"),
                             ("profile.start_step=5", "after train.steps=5")):
        result = cli(["train.py", "configs/llama3_1.py:tiny", "train.steps=5", "train.warmup_steps=1",
                      "profile.mode=xprof", "profile.num_steps=2", override, f"run.output_dir={tmp_path}"])
        assert result.returncode == 2 and expect in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


SHORT = ["configs/llama3_1.py:tiny", "train.steps=5", "train.warmup_steps=1", "train.seq_len=32",
         "train.per_device_batch_size=4", "train.eval_every=0", "train.eval_batches=1", "profile.mode=xprof",
         "profile.start_step=3", "profile.num_steps=2"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """Two profiled runs, one per CPU core: one device; two simulated devices (FSDP: collectives)."""
    from conftest import run_cli

    tmp = tmp_path_factory.mktemp("profiled")
    plans = {"one": ([], {}), "two": ([], {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_cli, ["train.py", *SHORT, *extra, f"run.output_dir={tmp / name}"], env,
                                     400) for name, (extra, env) in plans.items()}
        return {name: (f.result(), str(tmp / name)) for name, f in futures.items()}


@pytest.mark.stack("py311", "py312")
@pytest.mark.parametrize("name", ["one", "two"])
def test_xprof_window_holds_exactly_the_requested_steps(profiled, name):
    from MaxOffload.profile import overlap

    result, out = profiled[name]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "profile: xprof capturing steps 3-4" in result.stdout and "overlap (2 step(s) of jit_train_step" in \
        result.stdout
    report = overlap.report(os.path.join(out, "profile"))
    assert report["markers"] == [3, 4] and len(report["steps"]) == 2 and report["module"] == "jit_train_step"
    assert all(s["compute_s"] > 0 for s in report["steps"])
    assert json.load(open(os.path.join(out, "profile", "overlap.json")))["markers"] == [3, 4]
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["overlap"]["verdict"].startswith("overlap (2 step(s)")
    collectives = report["mean"]["collective"]["time_s"]
    assert (collectives > 0) == (name == "two")


def test_overlap_cli_json_and_missing_trace(profiled, cli, tmp_path):
    _, out = profiled["two"]
    result = cli(["-m", "MaxOffload.profile.overlap", os.path.join(out, "profile"), "--json"])
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["verdict"].startswith("overlap") and "collectives" in data["verdict"]
    assert cli(["-m", "MaxOffload.profile.overlap", str(tmp_path)]).returncode == 2


def test_overlap_cli_on_a_damaged_trace_or_an_unknown_device_is_one_line(profiled, cli, tmp_path):
    import glob
    import shutil

    _, out = profiled["two"]
    truncated, garbage = tmp_path / "truncated", tmp_path / "garbage"
    for where in (truncated, garbage):
        shutil.copytree(os.path.join(out, "profile"), where)
    for path in glob.glob(str(truncated / "**" / "*.xplane.pb"), recursive=True):
        data = open(path, "rb").read()
        open(path, "wb").write(data[:len(data) // 3])
    for path in glob.glob(str(garbage / "**" / "*.xplane.pb"), recursive=True):
        open(path, "wb").write(b"\x00not a protobuf at all\xff" * 64)
    for args, words in (([str(truncated)], ["not a readable XPlane trace"]), ([str(garbage)], ["not a readable"]),
                        ([os.path.join(out, "profile"), "--device", "/device:GPU:7"],
                         ["--device /device:GPU:7 is not in the trace", "its devices"])):
        result = cli(["-m", "MaxOffload.profile.overlap", *args])
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert all(w in lines[0] for w in words), lines[0]

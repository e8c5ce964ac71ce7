"""Faults of a job of many processes (docs/faults.md, issue 48): processes started with different configs end at
the start, each in one line naming the differing keys and the processes, exit 2, nothing written
(MaxOffload/parallel/consensus.py); a process that stops answering mid-run is named by the others within half the
heartbeat timeout, and a section past its timeout ends the run in one line (MaxOffload/parallel/watchdog.py); a
run's goodput over a kill and a restart (MaxOffload/train/goodput.py)."""
import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, run_cli
from test_checkpoint import start, wait_for_step
from test_slurm import TINY, cpu_env, free_port_pair
from MaxOffload.errors import ConfigError
from MaxOffload.parallel import consensus, watchdog

TINY_CHECKPOINTED = [*TINY, "train.warmup_steps=1", "checkpoint.every_steps=5", "train.eval_every=0", "run.log_every=1"]

pytestmark = pytest.mark.stack("py311")  # its subject does not depend on the Python/JAX version: CI runs it on one stack


def test_processes_with_different_configs_end_in_one_line(tmp_path):
    """A stale node: process 1 runs model.num_layers=3 where process 0 runs 2. Both end within seconds, each with
    the line that names the key, its values and the processes (not a hang in the first collective)."""
    port = free_port_pair()

    def start(rank, extra):
        return subprocess.Popen(
            [sys.executable, "train.py", *TINY, *extra, f"run.output_dir={tmp_path}/out",
             f"distributed.coordinator_address=localhost:{port}", "distributed.num_processes=2",
             f"distributed.process_id={rank}", "distributed.initialization_timeout_s=60"],
            cwd=ROOT, env=cpu_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    started = time.monotonic()
    procs = [start(0, []), start(1, ["model.num_layers=3"])]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    assert time.monotonic() - started < 60
    for code, out, err in results:
        assert code == 2, err[-2000:]
        assert len(err.strip().splitlines()) == 1 and not out.strip(), err[-2000:]
        assert "do not run the same job: model.num_layers: 2 on process 0, 3 on process 1" in err, err
    assert not (tmp_path / "out").exists()  # nothing written


class FakeClient:
    """jax.distributed's key-value store and barrier, for processes that have all written already."""

    def __init__(self, stored):
        self.stored, self.barriers = dict(stored), []

    def key_value_set(self, key, value):
        self.stored[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        return self.stored[key]

    def wait_at_barrier(self, name, timeout_ms):
        self.barriers.append(name)


def test_fingerprints_differ_by_code_and_jax_and_the_line_names_them():
    settings = {"model": {"num_layers": 2}, "distributed": {"process_id": 0, "local_device_ids": [0]}}
    mine = consensus.fingerprint(settings)
    # the per-process keys are left out: two ranks of one job agree
    other = consensus.fingerprint({**settings, "distributed": {"process_id": 1, "local_device_ids": [1]}})
    assert other == mine and "model.num_layers" in mine and "code" in mine and "jax" in mine
    stale = {**mine, "code": "0123456789abcdef", "jax": "0.4.30"}
    line = consensus.disagreement({0: mine, 1: mine, 2: stale})
    assert line.startswith("the 3 processes of this job do not run the same job: code: ")
    assert f"{mine['code']} on processes 0,1, 0123456789abcdef on process 2" in line
    assert f"jax: {mine['jax']} on processes 0,1, 0.4.30 on process 2" in line
    client = FakeClient({"maxoffload/fingerprint/1": json.dumps(stale)})
    with pytest.raises(ConfigError, match="code: "):
        consensus.agree(mine, 0, 2, timeout_s=1, client=client)
    assert client.barriers == ["maxoffload_fingerprints_read"]  # nobody left before all had read
    consensus.agree(mine, 0, 1, timeout_s=1, client=FakeClient({}))  # alone: agrees with itself


def test_a_stopped_process_is_named_within_the_bound(tmp_path):
    """Process 1 is SIGSTOPped mid-run (a frozen node): process 0 ends after half the heartbeat timeout (+ a check),
    with one line naming process 1 and the step, exit 1 — not JAX's abort after the whole heartbeat timeout."""
    port = free_port_pair()

    def start(rank):
        return subprocess.Popen(
            [sys.executable, "train.py", *TINY, "train.steps=100000", "checkpoint.enabled=false", "run.log_every=1",
             "train.eval_every=0", f"run.output_dir={tmp_path}/out", f"distributed.coordinator_address=localhost:{port}",
             "distributed.num_processes=2", f"distributed.process_id={rank}", "distributed.heartbeat_timeout_s=40"],
            cwd=ROOT, env=cpu_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    leader, member = start(0), start(1)
    try:
        for line in leader.stdout:  # training has started on both
            if line.split("/")[0].split() == ["step", "3"]:
                break
        member.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        leader.stdout.read()
        code, err = leader.wait(timeout=90), leader.stderr.read()
        assert time.monotonic() - stopped < 35  # silent for 20 s, checked every 2 s; JAX's own heartbeat: 40 s
    finally:
        member.kill()
        member.wait()
    assert code == 1, err[-2000:]
    assert len(err.strip().splitlines()) == 1, err[-2000:]
    assert err.startswith("error: process 0 of 2: process 1 stopped answering (no heartbeat for 20 s) during step "), err


def test_the_watchdog_names_a_silent_coordinator_and_a_section_past_its_timeout():
    class Reader(FakeClient):
        def key_value_dir_get(self, prefix):
            return [(k, v) for k, v in self.stored.items() if k.startswith(prefix)]

    ended = []
    dog = watchdog.Watchdog(1, 3, silent_s=10, client=Reader({}), exit=ended.append, say=ended.append)
    dog.close()  # its threads stop: the test drives check() by hand
    dog.completed(7)
    dog.enter("step 8", 120)
    now = time.monotonic()
    assert dog.check(now, {0: 1, 1: 1, 2: 1}) is None
    assert dog.check(now + 5, {0: 4, 1: 5, 2: 1}) is None  # process 2 silent for 5 s: not yet
    line = dog.check(now + 11, {0: 9, 1: 10, 2: 1})
    assert line.startswith("error: process 1 of 3: process 2 stopped answering (no heartbeat for 10 s) during step 8 "
                           "(last completed step 7)"), line
    dog._read = lambda: None  # the coordinator does not answer the read
    assert dog.check(now + 12).startswith("error: process 1 of 3: process 0, the coordinator, does not answer (no "
                                          "reply in 10 s) during step 8")
    alive = watchdog.Watchdog(0, 1, silent_s=10, exit=ended.append, say=ended.append)  # one process: no peers
    alive.close()
    with alive.during("the checkpoint save of step 20", 30):
        assert alive.check(time.monotonic()) is None
        line = alive.check(time.monotonic() + 31)
    assert line.startswith("error: process 0 of 1: the checkpoint save of step 20 has run 30 s, past its timeout"), line
    assert alive.section == "start-up"  # back to the section the save interrupted
    assert not ended


def test_goodput_adds_up_over_a_kill_and_a_restart(tmp_path):
    """A run killed (kill -9) after its checkpoints of step 5 (and 10, as its save got on), then resumed to step 20:
    goodput.jsonl has the resumed segment's line (the killed one wrote none), the steps trained again after the
    checkpoint it resumed from are lost time, and the summary's buckets add up to its wall time."""
    args = [*TINY_CHECKPOINTED, f"run.output_dir={tmp_path}"]
    proc, lines = start([*args, "train.steps=400"]), []
    wait_for_step(proc, 12, lines)  # the save of step 10 waited for step 5's: that one is complete
    proc.kill()
    proc.wait()
    logged = [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl") if '"step_time_s"' in line]
    result = run_cli(["train.py", *args, "train.steps=20"])
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in open(tmp_path / "goodput.jsonl")]
    assert len(rows) == 1 and rows[0]["start_step"] in (5, 10) and rows[0]["ended"] == "done", rows
    assert rows[0]["lost_steps"] == len([s for s in logged if s > rows[0]["start_step"]]) >= 2
    total = json.load(open(tmp_path / "summary.json"))["goodput"]
    assert total["lost_steps"] == rows[0]["lost_steps"] and total["lost_s"] > 0
    parts = sum(total[k] for k in ("productive_s", "compile_s", "checkpoint_s", "evaluation_s", "other_s", "lost_s"))
    assert parts == pytest.approx(total["wall_s"]) and total["other_s"] >= 0
    assert total["goodput"] == pytest.approx(total["productive_s"] / total["wall_s"])
    assert f"goodput {total['goodput']:.1%}: steps" in result.stdout
    # a further resume appends its segment
    result = run_cli(["train.py", *args, "train.steps=22"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert [r["start_step"] for r in map(json.loads, open(tmp_path / "goodput.jsonl"))] == [rows[0]["start_step"], 20]
    assert json.load(open(tmp_path / "summary.json"))["goodput"]["restarts"] == 1

"""Faults of a job of many processes (docs/faults.md, issue 48): processes started with different configs end at
the start, each in one line naming the differing keys and the processes, exit 2, nothing written
(MaxOffload/parallel/consensus.py)."""
import json
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from test_slurm import TINY, cpu_env, free_port_pair
from MaxOffload.errors import ConfigError
from MaxOffload.parallel import consensus

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

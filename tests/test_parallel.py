"""Parallelism on 8 simulated CPU devices: the same seed gives the same losses under every mesh (context
parallelism with and without load balancing, through the xla path and the flash kernel per shard, included),
FSDP really splits the state, and impossible meshes fail with one line."""
import json
import os

import pytest

from conftest import EIGHT_CPUS as EIGHT, ROOT, run_cli

TINY = ["configs/llama3_1.py:tiny", "train.seq_len=32", "train.per_device_batch_size=1",
        "model.compute_dtype=float32"]
MESHES = {
    "data8": ["mesh.ici.data=8", "mesh.ici.fsdp=1"],
    "fsdp8": ["mesh.ici.fsdp=8"],
    "fsdp4_tensor2": ["mesh.ici.fsdp=4", "mesh.ici.tensor=2"],
    "data2_fsdp4": ["mesh.ici.data=2", "mesh.ici.fsdp=4"],
    # a sequence split over the context axis: each shard gathers the keys and values (mesh.context_attention's
    # default, all_gather) or XLA partitions the whole attention; load balancing lays the sequence out as 2C
    # chunks (shard i: chunks i and 2C-1-i), masked by position
    "context4_fsdp2": ["mesh.ici.context=4", "mesh.ici.fsdp=2"],
    "context8": ["mesh.ici.context=8", "mesh.ici.fsdp=1"],
    "context4_fsdp2_balanced": ["mesh.ici.context=4", "mesh.ici.fsdp=2", "mesh.context_load_balance=true"],
    "context8_balanced": ["mesh.ici.context=8", "mesh.ici.fsdp=1", "mesh.context_load_balance=true"],
    "context4_partitioned": ["mesh.ici.context=4", "mesh.ici.fsdp=2", "mesh.context_attention=partitioned"],
    # the flash kernel per shard (tokamax's XLA implementation on CPU): two pieces per chunk of queries, combined
    "context8_flash": ["mesh.ici.context=8", "mesh.ici.fsdp=1", "model.attention=flash"],
    "context4_fsdp2_balanced_flash": ["mesh.ici.context=4", "mesh.ici.fsdp=2", "mesh.context_load_balance=true",
                                      "model.attention=flash"],
    "dcn_data2_ici_fsdp4": ["mesh.dcn.data=2", "mesh.ici.fsdp=-1"],
}


# The meshes in two processes (each a tens-of-seconds compile per mesh): the data / fsdp / tensor / dcn meshes, and
# those with a context axis; each group's losses against data8's.
GROUPS = {"plain": [name for name in MESHES if not name.startswith("context")],
          "context": [name for name in MESHES if name.startswith("context")]}


@pytest.fixture(scope="module")
def mesh_runs():
    """mesh_runs(group) -> {mesh: run} of one group's meshes, each group run once (in its own process)."""
    done = {}

    def runs(group):
        if group not in done:
            meshes = {name: MESHES[name] for name in GROUPS[group]}
            result = run_cli([os.path.join(ROOT, "tests", "helpers", "mesh_losses.py"), json.dumps(meshes)], env=EIGHT)
            assert result.returncode == 0, result.stderr[-3000:]
            done[group] = json.loads(result.stdout.strip().splitlines()[-1])
        return done[group]
    return runs


@pytest.mark.parametrize("group", GROUPS)
def test_same_losses_under_every_mesh(mesh_runs, group):
    reference = mesh_runs("plain")["data8"]["losses"]
    assert len(reference) == 3 and reference[0] > reference[-1]
    runs = mesh_runs(group)
    assert sorted(runs) == sorted(GROUPS[group])
    for name, run in runs.items():
        assert run["losses"] == pytest.approx(reference, rel=1e-5), name


def test_fsdp_splits_parameters_eight_ways(mesh_runs):
    runs = mesh_runs("plain")
    replicated, fsdp = runs["data8"]["param_bytes"], runs["fsdp8"]["param_bytes"]
    # only the small norm scales stay replicated, so the ratio is just under 8
    assert 7.5 < replicated / fsdp <= 8.0
    # wq is [layers, embed, heads, head_dim]: embed over fsdp, heads over tensor
    assert runs["fsdp8"]["wq_spec"] == ["None", "fsdp", "tensor", "None"]
    assert runs["fsdp8"]["wq_shard_shape"] == [2, 64 // 8, 4, 16]
    assert runs["fsdp4_tensor2"]["wq_shard_shape"] == [2, 64 // 4, 4 // 2, 16]
    assert runs["data8"]["wq_shard_shape"] == [2, 64, 4, 16]


def test_dry_run_state_bytes_follow_the_mesh(tmp_path):
    sizes = {}
    for name, mesh in (("data8", MESHES["data8"]), ("fsdp8", MESHES["fsdp8"])):
        out = tmp_path / name
        result = run_cli(["train.py", "configs/llama3_1.py:8b", "run.dry_run=true", f"run.output_dir={out}", *mesh],
                         env=EIGHT)
        assert result.returncode == 0, result.stderr
        sizes[name] = json.loads((out / "dry_run.json").read_text())["summary"]["state_bytes_per_device"]
    assert sizes["data8"] / sizes["fsdp8"] == pytest.approx(8, rel=0.001)


@pytest.mark.parametrize("overrides, words", [
    (["mesh.ici.data=3"], ["data=3", "8 devices"]),
    (["mesh.ici.data=2", "mesh.ici.fsdp=2"], ["product 4", "8 devices"]),
    (["mesh.ici.data=-1", "mesh.ici.fsdp=-1"], ["at most one -1"]),
    (["mesh.ici.tensor=8", "mesh.ici.fsdp=1"], ["attention/w", "8 ways", "tensor"]),
    (["mesh.ici.context=8", "mesh.ici.fsdp=1", "train.seq_len=36"], ["seq_len=36", "context"]),
    (["mesh.ici.context=4", "mesh.ici.fsdp=2", "train.seq_len=36", "mesh.context_load_balance=true"],
     ["2 x 4 chunks", "seq_len=36", "multiple of 8"]),
    (["mesh.context_load_balance=true", "mesh.context_attention=partitioned"],
     ["only mesh.context_attention=all_gather masks by position"]),
    (["mesh.dcn.data=3"], ["dcn", "3"]),
    (["train.per_device_batch_size=0.3"], ["per_device_batch_size=0.3", "8 devices", "not a whole number"]),
    (["mesh.ici.fsdp=8", "train.per_device_batch_size=0.25"], ["batch of 2 sequences", "split 8 ways"]),
    (["mesh.rules.embed=fsdp,bogus"], ["bogus", "mesh.rules.embed"]),
])
def test_impossible_mesh_is_one_line(tmp_path, overrides, words):
    result = run_cli(["train.py", *TINY, "train.steps=2", "train.warmup_steps=1", f"run.output_dir={tmp_path}",
                      *overrides], env=EIGHT)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_slices_are_contiguous_device_blocks():
    code = ("import json, jax; from MaxOffload.config import load; from MaxOffload.parallel.mesh import make;"
            "c = load(['configs/llama3_1.py:tiny', 'mesh.dcn.data=2', 'mesh.ici.fsdp=2', 'mesh.ici.tensor=2']);"
            "m = make(c.mesh); import numpy as np; rows = np.moveaxis(m.devices, m.axis_names.index('data'), 0);"
            "print(json.dumps([[d.id for d in row.flatten()] for row in rows]))")
    result = run_cli(["-c", code], env=EIGHT)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    # data axis = dcn: each data index holds one simulated slice (4 consecutive devices)
    assert [sorted(r) for r in rows] == [[0, 1, 2, 3], [4, 5, 6, 7]]

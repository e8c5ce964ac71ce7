"""Activation offloading: what each policy really does to every tagged activation, per layer group.

Every expectation here is stated independently of the code under test: literal sets of names
worked out from the model's math (which tagged values the backward pass needs), byte counts
worked out by hand from the tiny model's dimensions, and hand-built JAX functions whose
residuals are known. The CUDA lowering is produced on this CPU machine with jax.export.

CLI runs (inspect, parity, train.py) are started in the background at the beginning of the
module, so that they use the second core while the in-process tests run.
"""
import collections
import concurrent.futures
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

from MaxOffload import models, from_config
from MaxOffload.config import ConfigError, defaults, load
from MaxOffload.offload import inspect as inspect_lib
from MaxOffload.offload import names, parity, placement, policy, segments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "configs", "llama3_1.py")

# The tiny Llama (configs/llama3_1.py:tiny): d 64, 2 layers, 4 query heads / 2 kv heads of 16,
# MLP 176, vocab 512. float32 compute so that bytes are 4 per element.
PER_DEVICE_BATCH, SEQ, F32 = 2, 32, 4
TINY = [f"{LLAMA}:tiny", f"train.seq_len={SEQ}", f"train.per_device_batch_size={PER_DEVICE_BATCH}",
        "model.compute_dtype=float32", "data.source=synthetic"]
# the per-token width (trailing dimensions) of every tensor the llama layer tags, from the tiny dims
WIDTH = {"decoder_layer_input": (64,), "query_proj": (4, 16), "key_proj": (2, 16), "value_proj": (2, 16),
         "attention_out": (4, 16), "out_proj": (64,), "mlpwi_0": (176,), "mlpwi_1": (176,), "mlpwo": (64,)}

DLI, Q, K, V = "decoder_layer_input", "query_proj", "key_proj", "value_proj"
ATT, OUT, WI0, WI1, WO = "attention_out", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo"
TAGGED = {DLI, Q, K, V, ATT, OUT, WI0, WI1, WO}

# Which tagged values the backward pass of a llama layer needs under a name-based policy
# (untagged values are recomputed):
#   q, k, v (pre-RoPE): the attention backward needs RoPE(q), RoPE(k) and v -> recomputed from them;
#   attention_out: d wo = attention_out^T @ g;
#   out_proj: x_mid = x + out_proj feeds mlp_norm, whose backward needs x_mid;
#   mlpwi_0, mlpwi_1: the silu(gate) * up product and silu' need both;
#   decoder_layer_input: the input of the checkpointed layer (always kept by jax.checkpoint).
# mlpwo is never needed: it only enters the residual add x_mid + mlpwo, whose gradient is the
# identity, so the backward pass neither saves nor recomputes it ("unused").
NEEDED = TAGGED - {WO}

# preset -> (offloaded, saved in HBM) for the tiny llama. Rule (name-based presets): offloaded =
# {names the preset marks "offload"} & TAGGED & NEEDED; saved = {names marked "device"} & TAGGED &
# NEEDED, plus decoder_layer_input. Everything else that is NEEDED is recomputed, and mlpwo is unused.
# The *_with_context presets also name "context", which the llama layer never tags (its attention
# output is tagged attention_out), so they act exactly like their context-less counterparts.
EXPECTED = {
    "full": (set(), {DLI}),
    "minimal": (set(), {DLI, Q, K, V, OUT, WI0, WI1}),
    "minimal_offloaded": ({Q, K, V, OUT, WI0, WI1}, {DLI}),
    "minimal_with_context": (set(), {DLI, Q, K, V, OUT, WI0, WI1}),
    "qkv_proj_offloaded": ({Q, K, V}, {DLI}),
    "save_qkv_proj": (set(), {DLI, Q, K, V}),
    "save_out_proj": (set(), {DLI, OUT}),
    "save_dot_except_mlp": (set(), {DLI, Q, K, V, OUT}),
    "save_dot_except_mlpwi": (set(), {DLI, Q, K, V, OUT}),  # mlpwo is asked for, but is unused
    "save_dot_with_context_except_mlp": (set(), {DLI, Q, K, V, OUT}),
    # save_all is not name-based (everything_saveable keeps every intermediate), so the backward
    # saves what it consumes directly: v, attention_out, the MLP inputs and the layer input. q and k
    # are consumed after RoPE (the rotated values are saved instead) and out_proj only through the
    # saved residual sum, so query_proj, key_proj and out_proj are unused there, as is mlpwo.
    "save_all": (set(), {DLI, V, ATT, WI0, WI1}),
}
SAVE_ALL_UNUSED = {Q, K, OUT, WO}

# The per-group custom config of the issue: 4 layers; globally mlpwi_0 offloaded; layers 0-1
# fully rematerialised (a group policy replaces the global settings); layer 3 inherits the global
# settings and also offloads query_proj; layer 2 is in no group.
GROUPS = ["model.num_layers=4", "remat.policy=custom", "remat.tensors.mlpwi_0=offload",
          "remat.groups.first.layers=0-1", "remat.groups.first.policy=full",
          "remat.groups.last.layers=3", "remat.groups.last.tensors.query_proj=offload"]
GROUP_SEGMENTS = {  # label -> (remat group, [first, last layer], offloaded)
    "layers_0_1": ("first", [0, 1], set()),
    "layers_2_2": (None, [2, 2], {WI0}),
    "layers_3_3": ("last", [3, 3], {Q, WI0}),
}


def tiny(out, *overrides):
    return load(TINY + [f"run.output_dir={out}", *overrides])


def bytes_per_device(name, layers, per_device_batch=PER_DEVICE_BATCH, seq=SEQ, itemsize=F32):
    """batch x seq x width x itemsize x layers: one offloaded tensor of one segment, per device."""
    return per_device_batch * seq * math.prod(WIDTH[name]) * itemsize * layers


def cuda_text(setup):
    """The training step lowered for CUDA on this machine (StableHLO text)."""
    return setup.lower_train_step(lambda jitted, *args: jax.export.export(jitted, platforms=["cuda"])(*args)
                                  ).mlir_module()


# --------------------------------------------------------------------------------------------
# CLI runs, started in the background (one at a time, on the second core)

def _cli_jobs(tmp):
    base = ["configs/llama3_1.py:tiny", "run.dry_run=true", f"run.output_dir={tmp}/bad"]
    jobs = {
        "inspect_ok": ["-m", "MaxOffload.offload.inspect", "configs/quickstart.py", "remat.policy=custom",
                       "remat.tensors.mlpwi_0=offload", "remat.tensors.query_proj=offload",
                       f"run.output_dir={tmp}/inspect", "model.num_layers=2", "train.seq_len=64",
                       "--no_cpu_memory"],
        "parity_ok": ["-m", "MaxOffload.offload.parity", *TINY, "remat.policy=minimal_offloaded",
                      f"run.output_dir={tmp}/parity"],
        "verify_parity": ["train.py", *TINY, f"run.output_dir={tmp}/verify", "remat.policy=custom",
                          "remat.tensors.mlpwi_0=offload", "remat.tensors.out_proj=offload", "train.steps=2",
                          "train.warmup_steps=0", "train.eval_every=0", "train.eval_batches=1", "run.log_every=1",
                          "offload.verify_parity=true"],
    }
    jobs["two_devices"] = ["-c", TWO_DEVICES_SCRIPT, tmp]
    for key, (entry, overrides, _) in BAD_INPUTS.items():
        if entry == "train":
            jobs[key] = ["train.py", *base, *overrides]
        else:
            jobs[key] = ["-m", f"MaxOffload.offload.{entry}", "configs/llama3_1.py:tiny",
                         f"run.output_dir={tmp}/bad", *overrides]
    return jobs


# On 2 simulated CPU devices: the inspect report (CUDA lowering included) for q + mlpwi_0 offloaded,
# once data-parallel (fsdp=2: the batch is split) and once tensor-parallel (tensor=2: heads and the MLP
# dimension are split), and how many times the compiled (XLA:CPU, partitioned) tensor-parallel step
# mentions the per-device shapes of the stacked (2 layers) mlpwi_0 residual.
TWO_DEVICES_SCRIPT = """
import json, sys
from MaxOffload import from_config
from MaxOffload.config import load
from MaxOffload.offload import placement
base = %r
out = {}
for label, mesh in (("dp", ["mesh.ici.fsdp=2"]), ("tp", ["mesh.ici.fsdp=1", "mesh.ici.tensor=2"])):
    cfg = load(base + ["run.output_dir=" + sys.argv[1] + "/" + label] + mesh)
    setup = from_config.train_setup(cfg)
    report = placement.build_report(cfg, setup, cpu_memory=False)
    out[label] = {"report": report, "devices": setup.mesh.size}
    if label == "tp":
        hlo = setup.compile_train_step().as_text()
        out[label]["hlo"] = {s: hlo.count(s) for s in ("f32[2,4,32,88]", "f32[2,4,32,176]")}
print("RESULT " + json.dumps(out))
""" % (TINY + ["remat.policy=custom", "remat.tensors.query_proj=offload", "remat.tensors.mlpwi_0=offload"])

# key -> (entry point, overrides, what the one-line error must say)
BAD_INPUTS = {
    "unknown_preset": ("train", ["remat.policy=minimall"], ["remat.policy='minimall'", "did you mean minimal?"]),
    "unknown_tensor": ("train", ["remat.tensors.qkv_projj=offload"],
                       ["remat.tensors.qkv_projj", "did you mean remat.tensors.qkv_proj?"]),
    "invalid_value": ("train", ["remat.tensors.mlpwi_0=host"],
                      ["remat.tensors.mlpwi_0='host'", "remat, device, offload"]),
    "never_tagged": ("train", ["remat.tensors.moe_mlpwi_0=offload"], ["never tags 'moe_mlpwi_0'"]),
    "overlap": ("train", ["remat.groups.a.layers=0-1", "remat.groups.b.layers=1"], ["both claim layer 1"]),
    "out_of_range": ("train", ["remat.groups.a.layers=0-99"], ["remat.groups.a.layers='0-99'", "out of range"]),
    "bad_range_syntax": ("train", ["remat.groups.a.layers=x-y"],
                         ["remat.groups.a.layers='x-y'", "neither a layer range"]),
    "unknown_group_key": ("train", ["remat.groups.a.polcy=full"],
                          ["remat.groups.a.polcy", "did you mean remat.groups.a.policy?"]),
    "bad_group_policy": ("train", ["remat.groups.a.layers=0", "remat.groups.a.policy=minimall"],
                         ["remat.groups.a.policy='minimall'", "did you mean minimal?"]),
    "group_without_layers": ("train", ["remat.groups.a.policy=full"], ["remat.groups.a.layers", "layer range"]),
    "bad_group_tensor": ("train", ["remat.groups.a.layers=1", "remat.groups.a.tensors.mlpwi_0=hots"],
                         ["remat.groups.a.tensors.mlpwi_0='hots'"]),
    "inspect_overlap": ("inspect", ["remat.groups.a.layers=0-", "remat.groups.b.layers=decoder"],
                        ["both claim layer 0"]),
    "inspect_unscanned": ("inspect", ["model.scan_layers=false"], ["scan_layers"]),
    "parity_unknown_tensor": ("parity", ["remat.tensors.mlpwi0=offload"],
                              ["remat.tensors.mlpwi0", "did you mean remat.tensors.mlpwi_0?"]),
}


@pytest.fixture(scope="module", autouse=True)
def background(request, tmp_path_factory):
    """{job: Future[CompletedProcess]} for the CLI runs that the selected tests need."""
    from conftest import run_cli

    tmp = str(tmp_path_factory.mktemp("offload_cli"))
    selected = " ".join(item.nodeid for item in request.session.items if item.nodeid.startswith(request.node.nodeid))
    needs = {"inspect_ok": "test_inspect_cli", "parity_ok": "test_parity_cli",
             "verify_parity": "test_train_verify_parity",
             "two_devices": "test_bytes_per_device_on_two_devices", **{k: "test_bad_input" for k in BAD_INPUTS}}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    order = ["verify_parity", "two_devices", "parity_ok", "inspect_ok", *BAD_INPUTS]
    jobs = _cli_jobs(tmp)
    env = {"two_devices": {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}}
    futures = {key: pool.submit(run_cli, jobs[key], env=env.get(key), timeout=500)
               for key in order if needs[key] in selected}
    yield {"tmp": tmp, "futures": futures}
    for future in futures.values():
        future.cancel()
    pool.shutdown(wait=True)


def cli_result(background, key):
    return background["futures"][key].result()


# --------------------------------------------------------------------------------------------
# 1. Every preset: offloaded / saved / recomputed names, CUDA placements


def test_expected_table_covers_every_preset():
    """A new preset needs its expected sets written here."""
    assert set(EXPECTED) == set(policy.PRESETS) - {"custom"}
    config = models.model_config(load(TINY + ["run.output_dir=/tmp/x"]).model)
    assert set(models.FAMILIES["llama"].tagged_names(config)) == TAGGED


def test_expected_sets_follow_the_rule():
    """The literal table above agrees with the stated rule applied to the preset definitions."""
    for preset, (offloaded, saved) in EXPECTED.items():
        if preset == "save_all":
            continue
        chosen = policy.PRESETS[preset]
        assert offloaded == {n for n, d in chosen.items() if d == "offload"} & TAGGED & NEEDED, preset
        assert saved == ({n for n, d in chosen.items() if d == "device"} & TAGGED & NEEDED) | {DLI}, preset


@pytest.mark.stack("py311", "py312")
@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_preset_report(preset, tmp_path):
    cfg = tiny(tmp_path, f"remat.policy={preset}")
    setup = from_config.train_setup(cfg)
    report = placement.build_report(cfg, setup, cpu_memory=False)
    offloaded, saved = EXPECTED[preset]
    unused = SAVE_ALL_UNUSED if preset == "save_all" else {WO}
    recomputed = TAGGED - offloaded - saved - unused

    assert list(report["groups"]) == ["layers_0_1"]
    group = report["groups"]["layers_0_1"]
    assert group["layers"] == [0, 1] and group["remat_group"] is None and group["model_group"] == "decoder"
    assert set(group["offloaded"]) == offloaded
    assert set(group["saved"]) == saved
    assert set(group["remat"]) == recomputed
    assert set(group["unused"]) == unused
    assert group["missing"] == []
    # every name the preset does not keep is recomputed or unneeded, never kept (bar the scan carry)
    for name in TAGGED - set(policy.PRESETS[preset]) - set(names.ALWAYS_KEPT):
        assert name not in group["offloaded"] and name not in group["saved"], name

    global_batch = PER_DEVICE_BATCH * jax.device_count()
    for name in TAGGED:
        tensor = group["tensors"][name]
        assert tensor["requested"] == policy.PRESETS[preset].get(name, "remat")
        assert tensor["shape"] == [global_batch, SEQ, *WIDTH[name]], name
        assert tensor["dtype"] == "float32"
        assert tensor["bytes_per_device_per_step"] == bytes_per_device(name, layers=2), name
    assert group["offload_bytes_per_device"] == sum(bytes_per_device(n, layers=2) for n in offloaded)
    assert report["offload_bytes_per_device"] == group["offload_bytes_per_device"]
    # one pinned_host placement per offloaded (segment, name) in the CUDA lowering
    assert report["cuda_pinned_host_placements"] == len(offloaded)
    assert report["problems"] == []


def test_minimal_offloaded_bytes_by_hand(tmp_path):
    """q 4x16 + k 2x16 + v 2x16 + out_proj 64 + mlpwi_0 176 + mlpwi_1 176 = 544 floats per token,
    x 2 sequences x 32 tokens x 4 bytes x 2 layers."""
    cfg = tiny(tmp_path, "remat.policy=minimal_offloaded")
    report = placement.build_report(cfg, from_config.train_setup(cfg), cpu_memory=False)
    assert report["offload_bytes_per_device"] == 544 * 2 * 32 * 4 * 2 == 278528


@pytest.mark.stack("py311", "py312")
def test_offloading_the_layer_input_takes_effect(tmp_path):
    """On this JAX the forward scan hands the backward only the host copy of the scan carry
    (jax#23869 does not bite here): decoder_layer_input=offload is reported offloaded, with one
    placement, and nothing else changes."""
    cfg = tiny(tmp_path, "remat.tensors.decoder_layer_input=offload")
    report = placement.build_report(cfg, from_config.train_setup(cfg), cpu_memory=False)
    group = report["groups"]["layers_0_1"]
    assert group["offloaded"] == [DLI] and group["saved"] == []
    assert set(group["remat"]) == NEEDED - {DLI}
    assert report["cuda_pinned_host_placements"] == 1
    assert report["problems"] == []


# --------------------------------------------------------------------------------------------
# 2. Per-group custom config: three segments


@pytest.fixture(scope="module")
def group_cfg(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("groups"), *GROUPS)


def test_group_segments(group_cfg):
    segs = from_config.static_plan(group_cfg).segments
    assert [(s.start, s.stop, s.group, s.label) for s in segs] == [
        (0, 2, "first", "layers_0_1"), (2, 3, "", "layers_2_2"), (3, 4, "last", "layers_3_3")]
    first, middle, last = (dict(s.decisions) for s in segs)
    assert set(first.values()) == {"remat"}  # policy=full replaces the global mlpwi_0=offload
    assert {n for n, d in middle.items() if d != "remat"} == {WI0}
    assert {n for n, d in last.items() if d != "remat"} == {WI0, Q}
    assert all(d == "offload" for n, d in last.items() if n in (WI0, Q))


def test_group_report(group_cfg):
    report = placement.build_report(group_cfg, from_config.train_setup(group_cfg), cpu_memory=False)
    assert list(report["groups"]) == list(GROUP_SEGMENTS)
    for label, (remat_group, layers, offloaded) in GROUP_SEGMENTS.items():
        group = report["groups"][label]
        count = layers[1] - layers[0] + 1
        assert group["remat_group"] == remat_group, label
        assert group["layers"] == layers, label
        assert set(group["offloaded"]) == offloaded, label
        assert group["saved"] == [DLI], label
        assert set(group["remat"]) == NEEDED - offloaded - {DLI}, label
        assert group["unused"] == [WO], label
        assert group["offload_bytes_per_device"] == sum(bytes_per_device(n, count) for n in offloaded), label
    # by hand: layer 2: mlpwi_0 2*32*176*4 = 45056; layer 3: that + query_proj 2*32*64*4 = 16384
    assert report["groups"]["layers_0_1"]["offload_bytes_per_device"] == 0
    assert report["groups"]["layers_2_2"]["offload_bytes_per_device"] == 45056
    assert report["groups"]["layers_3_3"]["offload_bytes_per_device"] == 45056 + 16384
    assert report["groups"]["layers_0_1"]["tensors"][WI0]["requested"] == "remat"
    assert report["cuda_pinned_host_placements"] == 3
    assert report["problems"] == []


# The shipped recipe configs/llama3_1_offload.py: q/k/v and the attention output projection
# offloaded, the MLP recomputed, and the last two layers on `minimal`.
OFFLOAD_RECIPE = os.path.join(ROOT, "configs", "llama3_1_offload.py")


def test_offload_recipe_small(tmp_path):
    cfg = load([f"{OFFLOAD_RECIPE}:small", f"train.seq_len={SEQ}", f"train.per_device_batch_size={PER_DEVICE_BATCH}",
                "model.compute_dtype=float32", f"run.output_dir={tmp_path}"])  # small: 4 layers
    report = placement.build_report(cfg, from_config.train_setup(cfg), cpu_memory=False)
    assert list(report["groups"]) == ["layers_0_1", "layers_2_3"]
    body, last_two = report["groups"]["layers_0_1"], report["groups"]["layers_2_3"]
    assert set(body["offloaded"]) == {Q, K, V, OUT} and set(body["saved"]) == {DLI}
    assert set(body["remat"]) == {"attention_out", WI0, WI1}
    assert last_two["remat_group"] == "last_two"
    assert last_two["offloaded"] == [] and set(last_two["saved"]) == {DLI, Q, K, V, OUT, WI0, WI1}
    assert report["cuda_pinned_host_placements"] == 4 and report["problems"] == []


def test_offload_recipe_keeps_the_last_two_layers_after_a_depth_override(tmp_path):
    """The recipe promises that the last two layers keep everything in HBM. With the depth changed
    on the command line (model.num_layers=8 on :small), those are layers 6-7 and layers 0-5 offload."""
    cfg = load([f"{OFFLOAD_RECIPE}:small", "model.num_layers=8", f"run.output_dir={tmp_path}"])
    assert [(s.start, s.stop, s.group) for s in from_config.static_plan(cfg).segments] == [(0, 6, ""), (6, 8, "last_two")]


# --------------------------------------------------------------------------------------------
# 3. Problems: the placement cross-check and the exit status 1


@pytest.fixture(scope="module")
def qkv_offloaded(tmp_path_factory):
    cfg = tiny(tmp_path_factory.mktemp("qkv"), "remat.policy=qkv_proj_offloaded")
    setup = from_config.train_setup(cfg)
    return cfg, setup, cuda_text(setup)


EXTRA_PLACEMENT = ('%999 = stablehlo.custom_call @annotate_device_placement(%998) {has_side_effect = true, '
                   'mhlo.frontend_attributes = {_xla_buffer_placement = "pinned_host"}} : '
                   '(tensor<2x32x64xf32>) -> tensor<2x32x64xf32>\n')


@pytest.mark.stack("py311", "py312")
def test_placement_cross_check(qkv_offloaded):
    cfg, setup, text = qkv_offloaded
    assert placement.build_report(cfg, setup, cpu_memory=False, lowered_text=text)["problems"] == []
    # one placement too many
    report = placement.build_report(cfg, setup, cpu_memory=False, lowered_text=text + EXTRA_PLACEMENT)
    assert report["cuda_pinned_host_placements"] == 4
    assert len(report["problems"]) == 1 and "4 pinned_host placements" in report["problems"][0]
    assert "expected 3" in report["problems"][0]
    # the offloads missing from the lowering
    report = placement.build_report(cfg, setup, cpu_memory=False,
                                      lowered_text=text.replace('"pinned_host"', '"device"'))
    assert report["cuda_pinned_host_placements"] == 0
    assert len(report["problems"]) == 1 and "0 pinned_host placements" in report["problems"][0]


def test_inspect_exits_1_on_a_problem(tmp_path, monkeypatch, capsys):
    """The CLI's exit status 1 path: the lowering shows no placement for the requested offload."""
    monkeypatch.setattr(placement, "cuda_host_placements", lambda text: [])  # where build_report finds it
    status = inspect_lib.main(TINY + [f"run.output_dir={tmp_path}", "remat.tensors.mlpwi_1=offload",
                                      "--no_cpu_memory"])
    out = capsys.readouterr().out
    assert status == 1
    assert "PROBLEMS" in out and "0 pinned_host placements" in out
    assert json.load(open(tmp_path / "offload_report.json"))["problems"]


def test_as_requested():
    ok = placement._as_requested
    assert ok(Q, "offload", "offload") and ok(Q, "device", "device") and ok(Q, "remat", "remat")
    assert ok(WO, "offload", "unused") and ok(WO, "device", "unused")
    assert not ok(Q, "offload", "offload+device")  # a host copy that saves no HBM
    assert not ok(Q, "offload", "device") and not ok(Q, "device", "remat") and not ok(Q, "remat", "device")
    assert ok(DLI, "remat", "device")  # the scan carry is always kept
    assert not ok(DLI, "offload", "offload+device")


# --------------------------------------------------------------------------------------------
# 4. Hand-built scanned function: classification and pinned_host placements in a real lowering


def _hand_built():
    """A 3-step scan of a checkpointed layer with known residuals:
    p = h @ w1 (offload; sin' needs it), b = bf16(sin p) (offload; tanh' needs it),
    q = tanh(b) @ w2 (device; the product q * r needs it), r = cos h (remat; needed by the product),
    s = q * r (offload requested, but only added to h: unused, so not placed on the host)."""
    policy_fn = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=["q"], names_which_can_be_offloaded=["p", "b", "s"],
        offload_src="device", offload_dst="pinned_host")

    def body(h, w):
        w1, w2 = w
        p = checkpoint_name(h @ w1, "p")
        b = checkpoint_name(jnp.sin(p).astype(jnp.bfloat16), "b")
        q = checkpoint_name(jnp.tanh(b.astype(jnp.float32)) @ w2, "q")
        r = checkpoint_name(jnp.cos(h), "r")
        s = checkpoint_name(q * r, "s")
        return s + h, None

    def loss(x, w1, w2):
        with jax.named_scope("layers_0_2"):
            y, _ = jax.lax.scan(jax.checkpoint(body, policy=policy_fn, prevent_cse=False), x, (w1, w2))
        return jnp.sum(y)

    args = (jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((3, 8, 16), jnp.float32),
            jax.ShapeDtypeStruct((3, 16, 8), jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2)), args


@pytest.mark.stack("py311", "py312")
def test_cuda_host_placements_of_a_real_export():
    grad, args = _hand_built()
    text = jax.export.export(jax.jit(grad), platforms=["cuda"])(*args).mlir_module()
    placements = placement.cuda_host_placements(text)
    assert collections.Counter(placements) == collections.Counter([((4, 16), "float32"), ((4, 16), "bfloat16")])
    # a placement to device memory is not a host placement; scalar shapes parse
    extra = ('%5 = stablehlo.custom_call @annotate_device_placement(%4) {has_side_effect = true, '
             'mhlo.frontend_attributes = {_xla_buffer_placement = "device"}} : (tensor<4x16xf32>) -> '
             'tensor<4x16xf32>\n'
             '%7 = stablehlo.custom_call @annotate_device_placement(%6) {has_side_effect = true, '
             'mhlo.frontend_attributes = {_xla_buffer_placement = "pinned_host"}} : (tensor<f32>) -> tensor<f32>\n')
    assert placement.cuda_host_placements(extra) == [((), "float32")]


@pytest.mark.stack("py311", "py312")
def test_classify_residuals_of_a_hand_built_scan():
    grad, args = _hand_built()
    found = placement.classify_residuals(jax.make_jaxpr(grad)(*args))
    assert {name: kind for name, (kind, _) in found["layers_0_2"].items()} == {
        "p": "offload", "b": "offload", "q": "device", "r": "remat", "s": "unused"}
    assert found["layers_0_2"]["b"][1].dtype == jnp.bfloat16
    assert found["layers_0_2"]["p"][1].shape == (4, 16)


# --------------------------------------------------------------------------------------------
# 5. Parity: same loss and gradients as full remat


PARITY_PRESETS = [p for p in policy.PRESETS if p not in ("full", "custom")]


@pytest.mark.parametrize("half", [0, 1])
def test_parity_all_presets_and_groups(group_cfg, half):
    """Every preset on every layer, and the layer groups' own plan ("this config"), give full remat's loss and
    gradients: the presets in two halves (each compiles full remat as its reference), so no test runs the whole
    sweep; a preset that changes the result fails its half."""
    presets = PARITY_PRESETS[half::2]
    ref_loss, tolerance, rows = parity.compare(from_config.train_setup(group_cfg), parity.first_batch(group_cfg), presets)
    assert tolerance == 1e-5  # float32
    assert abs(ref_loss - math.log(512)) < 0.1  # small-init model: about uniform over the vocabulary
    assert [row[0] for row in rows] == ["this config"] + presets
    for label, loss, loss_diff, grad_diff, ok in rows:
        assert ok, label
        assert loss_diff == 0 or loss_diff < 1e-6, (label, loss_diff)
        assert grad_diff < 1e-6, (label, grad_diff)
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), label


def test_parity_through_the_flash_attention_path(tmp_path):
    """The flash path (tokamax's custom VJP; its XLA implementation on CPU) under offloading (q/k/v and the
    MLP inputs to the host) and under save_all (the kernel's own residuals kept) against full remat."""
    cfg = tiny(tmp_path, "model.attention=flash", "remat.policy=minimal_offloaded")
    ref_loss, tolerance, rows = parity.compare(from_config.train_setup(cfg), parity.first_batch(cfg), ["save_all"])
    assert tolerance == 1e-5 and [row[0] for row in rows] == ["this config", "save_all"]
    for label, loss, loss_diff, grad_diff, ok in rows:
        assert ok and grad_diff < 1e-6 and abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (label, loss, grad_diff)


@pytest.mark.stack("py311", "py312")
def test_parity_gate_can_fail(tmp_path, monkeypatch):
    """compare() marks a variant not ok when its loss or its gradients differ beyond the relative
    tolerance (1e-5 for float32), and ok when within it."""
    base_grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.zeros(2)}  # |g_ref| = 5

    cfg = tiny(tmp_path, "remat.policy=custom", "remat.tensors.mlpwi_0=offload")
    setup = from_config.train_setup(cfg)
    preset_of = {setup.plan.uniform(p): p for p in ("full", "minimal", "minimal_offloaded", "save_all")}

    def fake(variant, params, batch, *_):
        loss, grads = 2.0, dict(base_grads)
        preset = preset_of.get(variant.plan, "custom")
        if preset == "minimal":
            loss = 2.0 * (1 + 1e-3)  # loss off by 1e-3 relative
        elif preset == "save_all":
            grads["b"] = jnp.array([0.0, 5e-3])  # |dg| / |g_ref| = 1e-3
        elif preset == "minimal_offloaded":
            grads["b"] = jnp.array([0.0, 2.5e-5])  # 5e-6: within tolerance
        return jnp.float32(loss), grads

    monkeypatch.setattr(parity, "_loss_and_grads", fake)
    ref_loss, tolerance, rows = parity.compare(setup, parity.first_batch(cfg), ["minimal", "minimal_offloaded", "save_all"])
    assert ref_loss == 2.0 and tolerance == 1e-5
    by_label = {row[0]: row for row in rows}
    assert by_label["this config"][2:] == (0.0, 0.0, True)
    assert by_label["minimal"][2] == pytest.approx(1e-3, rel=1e-3) and not by_label["minimal"][4]
    assert by_label["minimal"][3] == 0.0
    assert by_label["save_all"][3] == pytest.approx(1e-3, rel=1e-3) and not by_label["save_all"][4]
    assert by_label["minimal_offloaded"][3] == pytest.approx(5e-6, rel=1e-3) and by_label["minimal_offloaded"][4]
    assert "MISMATCH" in parity.format_rows(ref_loss, tolerance, rows)


@pytest.mark.stack("py311", "py312")
def test_train_stops_on_parity_failure(tmp_path, monkeypatch, capsys):
    """offload.verify_parity=true: a mismatch stops train.py before training, exit status 1."""
    sys.path.insert(0, ROOT)
    import train

    monkeypatch.setattr(parity, "compare", lambda cfg, presets=(): (2.0, 1e-5, [("this config", 2.1, 0.05, 0.0,
                                                                                   False)]))
    status = train.main(TINY + [f"run.output_dir={tmp_path}", "offload.verify_parity=true", "train.steps=2",
                                "train.warmup_steps=0"])
    captured = capsys.readouterr()
    assert status == 1
    assert captured.err.startswith("error: ") and "MISMATCH" in captured.out
    assert not os.path.exists(tmp_path / "summary.json")


# --------------------------------------------------------------------------------------------
# 7. segments.layer_segments and the group semantics


def remat_cfg(preset="custom", groups=(), **tensors):
    cfg = defaults.get_config()
    cfg.remat.policy = preset
    for name, decision in tensors.items():
        cfg.remat.tensors[name] = decision
    for name, layers, group_policy, group_tensors in groups:
        defaults.add_layer_group(cfg, name, layers, group_policy, **group_tensors)
    return cfg.remat


def spans(segs):
    return [(s.model_group, s.start, s.stop, s.group) for s in segs]


DECODER16 = {"decoder": (0, 16)}


@pytest.mark.parametrize("layers, expected", [
    ("5", [(0, 5, ""), (5, 6, "a"), (6, 16, "")]),
    ("0-7", [(0, 8, "a"), (8, 16, "")]),
    ("8-", [(0, 8, ""), (8, 16, "a")]),
    (" 3-3 ", [(0, 3, ""), (3, 4, "a"), (4, 16, "")]),
    ("decoder", [(0, 16, "a")]),
    ("15", [(0, 15, ""), (15, 16, "a")]),
])
def test_layer_ranges(layers, expected):
    segs = segments.layer_segments(remat_cfg(groups=[("a", layers, "full", {})]), DECODER16)
    assert spans(segs) == [("decoder", *e) for e in expected]
    assert [s.label for s in segs] == [f"layers_{a}_{b - 1}" for a, b, _ in expected]


def test_no_groups_is_one_segment():
    segs = segments.layer_segments(remat_cfg("minimal"), DECODER16)
    assert spans(segs) == [("decoder", 0, 16, "")]
    assert dict(segs[0].decisions) == policy.decisions("minimal", {})


def test_consecutive_layers_merge_per_group_and_model_group():
    # layers in no group merge across the gap between groups; two groups never merge, even with
    # identical decisions; a model-group boundary always splits
    cfg = remat_cfg(groups=[("a", "2-3", "full", {}), ("b", "4-5", "full", {}), ("c", "9", "minimal", {})])
    assert spans(segments.layer_segments(cfg, DECODER16)) == [
        ("decoder", 0, 2, ""), ("decoder", 2, 4, "a"), ("decoder", 4, 6, "b"), ("decoder", 6, 9, ""),
        ("decoder", 9, 10, "c"), ("decoder", 10, 16, "")]
    two_stacks = {"dense": (0, 3), "moe": (3, 8)}
    assert spans(segments.layer_segments(remat_cfg(), two_stacks)) == [("dense", 0, 3, ""), ("moe", 3, 8, "")]
    assert spans(segments.layer_segments(remat_cfg(groups=[("x", "2-4", "full", {})]), two_stacks)) == [
        ("dense", 0, 2, ""), ("dense", 2, 3, "x"), ("moe", 3, 5, "x"), ("moe", 5, 8, "")]
    assert spans(segments.layer_segments(remat_cfg(groups=[("x", "moe", "full", {})]), two_stacks)) == [
        ("dense", 0, 3, ""), ("moe", 3, 8, "x")]


def test_group_policy_replaces_global_tensors_empty_policy_inherits():
    cfg = remat_cfg("minimal", groups=[("a", "0-3", "qkv_proj_offloaded", {"out_proj": "device"}),
                                       ("b", "4-7", "", {"query_proj": "offload"})], mlpwi_0="offload")
    a, b, rest = segments.layer_segments(cfg, DECODER16)
    all_remat = {n: "remat" for n in names.VOCABULARY}
    # a: the group's preset only (global minimal and mlpwi_0=offload dropped), then its tensors
    assert dict(a.decisions) == {**all_remat, "query_proj": "offload", "key_proj": "offload",
                                 "value_proj": "offload", "qkv_proj": "offload", "kv_proj": "offload",
                                 "out_proj": "device"}
    # b: global minimal + global mlpwi_0=offload, then the group's query_proj=offload
    minimal = {n: "device" for n in ("query_wa_proj", "kv_wa_proj", "mla_q", "mla_kv", "query_proj", "key_proj",
                                     "value_proj", "qkv_proj", "kv_proj", "out_proj", "mlpwi", "mlpwi_0", "mlpwi_1",
                                     "mlpwo", "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo")}
    assert dict(b.decisions) == {**all_remat, **minimal, "mlpwi_0": "offload", "query_proj": "offload"}
    # the rest: global settings
    assert dict(rest.decisions) == {**all_remat, **minimal, "mlpwi_0": "offload"}
    assert [s.group for s in (a, b, rest)] == ["a", "b", ""]
    # the global config is not changed by the group overlays
    assert cfg.tensors.query_proj == ""


def test_save_everything_only_for_plain_save_all():
    everything = jax.checkpoint_policies.everything_saveable
    seg, = segments.layer_segments(remat_cfg("save_all"), DECODER16)
    assert seg.save_everything and seg.policy() is everything
    seg, = segments.layer_segments(remat_cfg("save_all", mlpwo="offload"), DECODER16)
    assert not seg.save_everything and seg.policy() is not everything
    # a group's save_all replaces the global tensors, so it is plain save_all again
    grouped = remat_cfg("minimal", groups=[("a", "0-7", "save_all", {})], mlpwi_0="offload")
    a, rest = segments.layer_segments(grouped, DECODER16)
    assert a.save_everything and not rest.save_everything
    # an empty group policy inherits save_all together with the group's own tensors
    inherit = remat_cfg("save_all", groups=[("a", "0-7", "", {"mlpwo": "offload"})])
    a, rest = segments.layer_segments(inherit, DECODER16)
    assert not a.save_everything and rest.save_everything


@pytest.mark.parametrize("spec, message", [
    ("1-0", "reversed"), ("0-16", "out of range"), ("16", "out of range"), ("16-", "out of range"),
    ("x-y", "neither a layer range"), ("", "give a layer range"), ("decodr", "did you mean decoder?"),
    ("1-2-3", "neither a layer range"),
])
def test_parse_layers_errors(spec, message):
    with pytest.raises(ConfigError, match=message.replace("?", r"\?")):
        segments.parse_layers(spec, "a", DECODER16, 16)


def test_overlapping_groups_error():
    with pytest.raises(ConfigError, match="both claim layer 7"):
        segments.layer_segments(remat_cfg(groups=[("a", "0-7", "full", {}), ("b", "7-", "full", {})]), DECODER16)


def test_uniform_plan_clears_tensors_and_groups(group_cfg):
    """A plan's uniform variant (the reference of parity, the anchors of the planner) is the preset alone: what
    the config spells out with the preset and no per-tensor settings or groups."""
    own = from_config.static_plan(group_cfg)
    variant = own.uniform("minimal")
    alone = tiny(group_cfg.run.output_dir, "model.num_layers=4", "remat.policy=minimal")
    assert variant == from_config.static_plan(alone)
    assert [(s.start, s.stop, s.group) for s in variant.segments] == [(0, 4, "")]
    assert [(s.start, s.stop) for s in own.segments] == [(0, 2), (2, 3), (3, 4)]  # untouched


def test_layer_group_rejects_unknown_tensor_names():
    with pytest.raises(ValueError, match="qkv_projj"):
        defaults.layer_group("0-1", qkv_projj="offload")


def test_presets_and_families_speak_only_the_vocabulary_table():
    """Every name a preset, a family's tagged names or its recompute-cost table uses is a row of names.TABLE
    (a misspelt name would otherwise be silently recomputed, or costed as 0 FLOPs); the layer's tag() refuses
    any other."""
    from MaxOffload.offload import names

    used = {n for preset in policy.PRESETS.values() for n in preset}
    for config in (load(TINY + ["run.output_dir=/tmp/x"]), load(["configs/deepseek_v3.py:tiny", "run.output_dir=/tmp/x"])):
        mc = models.model_config(config.model)
        used |= set(models.tagged_names(mc))
        for group in models.layer_groups(config.model):
            used |= set(mc.contractions(group, 64))
    assert used and used <= set(names.TABLE), used - set(names.TABLE)
    assert set(names.VOCABULARY) == set(names.TABLE) and set(names.ACTIVATION_AXES) <= set(names.TABLE)
    with pytest.raises(KeyError, match="query_projj"):
        names.tag(jnp.zeros(2), "query_projj")


def test_unknown_preset_in_decisions():
    with pytest.raises(ValueError, match="minimall"):
        policy.decisions("minimall", {})


# --------------------------------------------------------------------------------------------
# CLI runs (started in the background): 3. inspect, 5. parity, 6. bad inputs, 8. verify_parity


@pytest.mark.stack("py311", "py312")
def test_inspect_cli(background):
    result = cli_result(background, "inspect_ok")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "on host: query_proj, mlpwi_0 |" in result.stdout
    assert "all requested placements confirmed" in result.stdout
    report = json.load(open(os.path.join(background["tmp"], "inspect", "offload_report.json")))
    assert list(report["groups"]) == ["layers_0_1"]
    group = report["groups"]["layers_0_1"]
    for key in ("offloaded", "saved", "remat", "offload_bytes_per_device"):
        assert key in group
    assert group["offloaded"] == [Q, WI0]
    assert group["saved"] == [DLI]
    assert set(group["remat"]) == {K, V, ATT, OUT, WI1}
    # quickstart: batch 8 per device, here 64 tokens, bfloat16 (2 bytes), 2 layers; q is 8 heads x 32,
    # mlpwi_0 is 704 wide: 8 * 64 * (256 + 704) * 2 * 2
    assert group["offload_bytes_per_device"] == 8 * 64 * (256 + 704) * 2 * 2 > 0
    assert report["cuda_pinned_host_placements"] == 2 and report["problems"] == []


def test_parity_cli(background):
    result = cli_result(background, "parity_ok")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "parity holds" in result.stdout
    row = [line for line in result.stdout.splitlines() if line.strip().startswith("this config")]
    assert len(row) == 1 and row[0].rstrip().endswith("ok")


@pytest.mark.parametrize("key", list(BAD_INPUTS))
def test_bad_input(background, key):
    entry, overrides, expected = BAD_INPUTS[key]
    result = cli_result(background, key)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for text in expected:
        assert text in lines[0], lines[0]


@pytest.mark.stack("py311", "py312")
def test_train_verify_parity(background):
    result = cli_result(background, "verify_parity")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "offload.verify_parity" in out and "reference (full remat)" in out
    row = [line for line in out.splitlines() if line.strip().startswith("this config")]
    assert len(row) == 1 and row[0].rstrip().endswith("ok")
    assert out.index("reference (full remat)") < out.index("compiling the training step")
    summary = json.load(open(os.path.join(background["tmp"], "verify", "summary.json")))
    assert summary["steps"] == 2 and math.isfinite(summary["final_loss"])


@pytest.fixture(scope="module")
def two_devices(background):
    result = cli_result(background, "two_devices")
    assert result.returncode == 0, result.stdout + result.stderr
    line, = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


@pytest.mark.stack("py311", "py312")
def test_bytes_per_device_on_two_devices_data_parallel(two_devices):
    """fsdp=2 splits the batch of 2 x 2 sequences: per device 2 sequences, as on one device."""
    out = two_devices["dp"]
    assert out["devices"] == 2
    report = out["report"]
    group = report["groups"]["layers_0_1"]
    assert group["offloaded"] == [Q, WI0] and report["problems"] == []
    assert report["cuda_pinned_host_placements"] == 2
    assert group["tensors"][WI0]["shape"] == [4, SEQ, 176]  # global shape
    assert group["offload_bytes_per_device"] == bytes_per_device(Q, 2) + bytes_per_device(WI0, 2) == 32768 + 90112


@pytest.mark.stack("py311", "py312")
def test_bytes_per_device_on_two_devices_tensor_parallel(two_devices):
    """tensor=2 leaves the batch of 4 whole on each device but splits query_proj's 4 heads
    (activation_heads -> tensor) and mlpwi_0's 176 MLP columns (activation_mlp -> tensor). The
    compiled step confirms it: the stacked mlpwi_0 residual is f32[2,4,32,88] per device, never
    f32[2,4,32,176]. So per device: q 4*32*(2*16)*4*2 = 32768, mlpwi_0 4*32*88*4*2 = 90112 bytes."""
    out = two_devices["tp"]
    assert out["devices"] == 2
    assert out["hlo"]["f32[2,4,32,88]"] > 0 and out["hlo"]["f32[2,4,32,176]"] == 0
    report = out["report"]
    group = report["groups"]["layers_0_1"]
    assert group["offloaded"] == [Q, WI0] and report["problems"] == []
    assert group["tensors"][WI0]["bytes_per_device_per_step"] == 4 * 32 * 88 * 4 * 2 == 90112
    assert group["tensors"][Q]["bytes_per_device_per_step"] == 4 * 32 * 2 * 16 * 4 * 2 == 32768
    assert group["offload_bytes_per_device"] == 90112 + 32768


def test_a_report_that_cannot_be_written_is_printed_first_then_one_line(tmp_path):
    """offload.inspect into a directory where offload_report.json cannot be written (a directory holds its
    name; permissions would not stop root): the whole report on stdout, then one error line, exit 2."""
    from conftest import run_cli

    out = tmp_path / "inspect"
    (out / "offload_report.json").mkdir(parents=True)
    result = run_cli(["-m", "MaxOffload.offload.inspect", *TINY, "remat.policy=minimal_offloaded",
                      f"run.output_dir={out}", "--no_cpu_memory"])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert lines[0].startswith(f"error: could not write {out / 'offload_report.json'}") and "above" in lines[0]
    assert "placements" in result.stdout  # the report came first, whole

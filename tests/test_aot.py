"""Deviceless GPU compile (XLA's GPU compiler on this CPU machine) and the XLA presets."""
import json
import re

import pytest

from conftest import run_cli

TINY = ["configs/llama3_1.py:tiny", "train.seq_len=64", "train.per_device_batch_size=4", "model.num_layers=4"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """One deviceless compile on 4 GB200s per policy, each with jax's global device reads refused
    (tests/helpers/no_global_devices.py): the target's kernels and peak come from its compile-only devices."""
    out = {}
    for policy in ("full", "save_all", "minimal_offloaded", "custom"):
        extra = ["remat.tensors.mlpwi_0=offload", "remat.tensors.query_proj=offload",
                 "offload.optimizer_state=true"] if policy == "custom" else []
        directory = tmp_path_factory.mktemp(policy)
        result = run_cli(["tests/helpers/no_global_devices.py", "MaxOffload.aot", *TINY, f"remat.policy={policy}",
                          *extra, "--target", "gb200", "--topology", "1x1x4", f"run.output_dir={directory}"])
        assert result.returncode == 0, result.stdout + result.stderr
        assert "FITS" in result.stdout
        out[policy] = json.loads((directory / "aot_report.json").read_text())
        out[policy]["trace"] = json.loads((directory / "timeline.json").read_text())
        assert (directory / "timeline.png").exists() and "predicted step time on NVIDIA GB200" in result.stdout
    return out


@pytest.mark.stack("py312")  # a deviceless GPU compile: the GPU stack's jax
def test_report_has_the_promised_fields(reports):
    r = reports["full"]
    for key in ("hbm_bytes_per_device", "host_bytes_per_device", "hbm_capacity_bytes", "fits", "temp_bytes_per_device",
                "argument_bytes_per_device", "compile_time_s", "offloaded"):
        assert key in r, key
    assert r["devices"] == 4 and r["accelerator"] == "NVIDIA GB200" and r["fits"] is True
    assert r["hbm_capacity_bytes"] == 197_897_748_480
    # arguments hold at least the state (params + Adam moments) of this device
    assert r["argument_bytes_per_device"] >= r["state_bytes_per_device"] > 0


@pytest.mark.stack("py312")  # a deviceless GPU compile: the GPU stack's jax
def test_the_compiled_work_audit_reads_the_step(reports):
    """The optimized GB200 step's matmul FLOPs against the model FLOPs, per part: save_all does the model's
    work (attention: tokamax's flash kernels, model.attention=auto on GPUs, counted from their shapes: the
    causal half and the VJP's recomputed scores), full remat adds the recomputed forward."""
    from MaxOffload.expected_work import attention_work_multiple

    save_all, full = reports["save_all"]["compiled_work"], reports["full"]["compiled_work"]
    assert 1.0 <= save_all["ratio"] <= 1.15 and save_all["recompute_flops"] == 0, save_all
    assert save_all["counted_kernels"] == {"PallasTritonFlashAttention": 4, "PallasTritonFlashAttentionVjp": 4}
    assert 1.25 <= full["ratio"] <= 1.45 and full["recompute_flops"] > 0, full
    assert full["compiled_matmul_flops"] == pytest.approx(save_all["compiled_matmul_flops"] + full["recompute_flops"],
                                                          rel=0.02)
    parts = save_all["components"]
    assert set(parts) == {"projections", "mlp", "attention_scores", "unembed"}, parts
    assert parts["attention_scores"]["ratio"] == pytest.approx(attention_work_multiple("flash:triton", 64, 16, 16),
                                                               rel=0.01)
    for name in ("projections", "unembed", "mlp"):
        assert parts[name]["ratio"] == pytest.approx(1.0, abs=0.05), (name, parts[name])
    assert save_all["warnings"] == [] and save_all["dense_ragged_dots"] == 0 and save_all["unknown_trip_counts"] == []


@pytest.mark.stack("py312")  # a deviceless GPU compile: the GPU stack's jax
def test_the_report_predicts_the_step_from_its_timeline(reports):
    """aot_report.json's `timeline` (these keys are promised to scripts) and the trace beside it: offloading
    moves bytes over the host link, collectives run over the 4 GPUs (FSDP), and the trace has them all."""
    for policy, r in reports.items():
        t = r["timeline"]
        for key in ("step_s", "compute_s", "exposed_copy_s", "exposed_collective_s", "copy_hidden_fraction",
                    "model_tflops_per_device"):
            assert key in t, (policy, key)
        assert t["step_s"] >= t["compute_s"] > 0 and t["collective_bytes"] > 0
        assert t["step_s"] == pytest.approx(t["compute_s"] + t["exposed_copy_s"] + t["exposed_collective_s"])
        lanes = {e["args"]["name"] for e in r["trace"]["traceEvents"] if e["ph"] == "M" and "tid" in e}
        assert lanes == {"compute", "d2h", "h2d", "collective"}
    for policy in ("full", "save_all"):
        assert reports[policy]["timeline"]["d2h_bytes"] == 0 and reports[policy]["timeline"]["copy_hidden_fraction"] is None
    custom = reports["custom"]["timeline"]
    assert custom["d2h_bytes"] == pytest.approx(reports["custom"]["host_temp_bytes_per_device"], rel=0.05)
    assert custom["h2d_bytes"] == custom["d2h_bytes"] and 0 <= custom["copy_hidden_fraction"] <= 1


@pytest.mark.stack("py312")  # a deviceless GPU compile: the GPU stack's jax
def test_host_bytes_only_when_offloading(reports):
    assert reports["full"]["host_bytes_per_device"] == 0
    assert reports["save_all"]["host_bytes_per_device"] == 0
    assert reports["minimal_offloaded"]["host_bytes_per_device"] > 0
    assert reports["custom"]["host_bytes_per_device"] > 0
    # XLA's host buffers hold what the sharding rules predict for the offloaded activations
    for policy in ("minimal_offloaded", "custom"):
        r = reports[policy]
        assert r["host_temp_bytes_per_device"] == pytest.approx(r["offload_bytes_per_device_rules"], rel=0.05)


@pytest.mark.stack("py312")  # a deviceless GPU compile: the GPU stack's jax
def test_host_resident_state_is_counted_on_the_host(reports):
    """offload.optimizer_state: XLA's compile-only GPU devices have no pinned_host memory kind, so the compile holds
    the Adam moments in HBM; the report counts them in host memory, where the run puts them, and says so."""
    r = reports["custom"]
    moved = r["host_state_counted_from_shardings_bytes"]
    assert moved == r["host_state_bytes_per_device"] > 0.6 * r["state_bytes_per_device"]  # two moments of three
    compiled = (r["argument_bytes_per_device"] + r["output_bytes_per_device"] - r["alias_bytes_per_device"]
                + r["temp_bytes_per_device"])
    assert r["hbm_bytes_per_device"] == compiled - moved
    assert r["host_bytes_per_device"] == r["host_temp_bytes_per_device"] + moved
    assert reports["full"]["host_state_counted_from_shardings_bytes"] == 0
    # ... and its traffic, which the compiled step leaves out: the update reads the moments and writes them back
    traffic = r["host_state_traffic"]
    assert traffic["h2d_bytes"] == traffic["d2h_bytes"] == moved
    assert traffic["step_s_if_exposed"] == pytest.approx(r["timeline"]["step_s"] + traffic["seconds"])
    assert reports["full"]["host_state_traffic"] is None


@pytest.mark.stack("py312")  # a deviceless GPU compile: the GPU stack's jax
def test_offloading_and_remat_lower_hbm_temporaries_vs_save_all(reports):
    save_all = reports["save_all"]["temp_bytes_per_device"]
    assert reports["minimal_offloaded"]["temp_bytes_per_device"] < save_all
    assert reports["full"]["temp_bytes_per_device"] < save_all
    assert reports["custom"]["temp_bytes_per_device"] < save_all


@pytest.mark.stack("py312")  # a deviceless GPU compile: the GPU stack's jax
def test_offloaded_list_matches_the_request(reports):
    assert reports["custom"]["offloaded"] == {"layers_0_3": ["query_proj", "mlpwi_0"]}
    assert reports["full"]["offloaded"] == {"layers_0_3": []}
    assert set(reports["minimal_offloaded"]["offloaded"]["layers_0_3"]) == {
        "query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1"}


def test_does_not_fit_verdict(tmp_path):
    # the 8B model's state alone (8.03e9 x 12 bytes of fp32 params + Adam = 96 GB) cannot fit one 80 GB H100
    result = run_cli(["-m", "MaxOffload.aot", "configs/llama3_1.py:8b", "--target", "h100",
                      "--topology", "1x1x1", "train.seq_len=512", f"run.output_dir={tmp_path}"])
    report = json.loads((tmp_path / "aot_report.json").read_text())
    assert report["fits"] is False and report["argument_bytes_per_device"] > 80e9
    assert result.returncode == 1 and "DOES NOT FIT" in result.stdout


def test_xla_rematerialization_is_counted_and_can_be_left_to_the_plan(tmp_path):
    """Every activation kept at a batch far over an H200's memory: XLA's own rematerialization recomputes matmuls
    of its choosing (instructions it cloned, *.remat), which the audit counts and names; with
    xla.hlo_rematerialization=false it recomputes none, and the step does exactly the plan's work (no
    recomputation under remat.policy=save_all: the MLP at 1.00x its model FLOPs)."""
    found = {}
    for label, extra in (("xla", []), ("plan", ["xla.hlo_rematerialization=false"])):
        result = run_cli(["-m", "MaxOffload.aot", *TINY, "train.seq_len=4096", "train.per_device_batch_size=4096",
                          "remat.policy=save_all", *extra, "--target", "h200", "--topology", "1x1x1",
                          f"run.output_dir={tmp_path / label}"])
        assert result.returncode == 1 and "DOES NOT FIT" in result.stdout, result.stdout + result.stderr
        found[label] = (json.loads((tmp_path / label / "aot_report.json").read_text())["compiled_work"], result.stdout)
    (xla_work, xla_out), (plan_work, plan_out) = found["xla"], found["plan"]
    assert xla_work["xla_remat_flops"] > 0 and xla_work["recompute_flops"] >= xla_work["xla_remat_flops"]
    assert "recomputed by XLA's own rematerialization" in xla_out
    assert plan_work["xla_remat_flops"] == 0 and plan_work["recompute_flops"] == 0
    assert plan_work["components"]["mlp"]["ratio"] == pytest.approx(1.0, abs=0.01)
    assert plan_work["compiled_matmul_flops"] < xla_work["compiled_matmul_flops"]
    assert "XLA's own rematerialization" not in plan_out


@pytest.mark.stack("py311", "py312")
def test_presets_give_the_expected_flags():
    from MaxOffload import xla

    flags = xla.preset_flags

    assert flags("baseline") == []
    assert flags("lhs") == ["--xla_gpu_enable_latency_hiding_scheduler=true"]
    pipelined = flags("lhs_pipelined")
    assert len(pipelined) == 5 and pipelined[0] == "--xla_gpu_enable_latency_hiding_scheduler=true"
    for feature, flag in zip(xla.PRESETS["lhs_pipelined"], pipelined):
        assert flag in xla.FEATURES[feature]
    assert flags("lhs_pipelined_offload") == pipelined + ["--xla_gpu_enable_pipelined_host_offloading=true"]
    # the chosen spellings really start a backend
    assert xla.rejected_flag(flags("lhs_pipelined_offload")) is None
    import jaxlib

    if jaxlib.__version__ == "0.10.2":  # this jaxlib predates the enum spellings
        assert "--xla_gpu_enable_pipelined_all_gather=true" in pipelined
    # as compile options (the way a preset reaches the step): booleans, and the pipelining enum's own names
    options = xla.compiler_options("lhs_pipelined_offload")
    assert xla.compiler_options("baseline") == {}
    assert options["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert options["xla_gpu_enable_pipelined_host_offloading"] is True
    assert options.get("xla_gpu_pipeline_all_gather", "COLLECTIVE_PIPELINING_MODE_ON") == "COLLECTIVE_PIPELINING_MODE_ON"


def test_unknown_flag_is_rejected_with_one_line(tmp_path):
    result = run_cli(["train.py", *TINY, "run.dry_run=true", f"run.output_dir={tmp_path}",
                      "xla.extra_flags=[--xla_gpu_pipeline_everything=on]"])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--xla_gpu_pipeline_everything=on" in lines[0] and "Traceback" not in result.stderr
    result = run_cli(["train.py", *TINY, "run.dry_run=true", f"run.output_dir={tmp_path}", "xla.preset=lhs_pipelinde"])
    assert result.returncode == 2 and "did you mean lhs_pipelined" in result.stderr


@pytest.mark.stack("py312")  # a deviceless GPU compile: the GPU stack's jax
def test_a_preset_reaches_the_compiled_step(tmp_path):
    """xla.preset is applied to each compile (compile options): in one process the same offloading step compiles
    differently under baseline and lhs_pipelined_offload (double buffering rewrites the layer loops). XLA_FLAGS
    changed inside a running process did not always reach the deviceless compiler; train.py says what it uses."""
    import dataclasses
    import re

    from MaxOffload import deviceless, from_config
    from MaxOffload.config import load

    cfg = load([*TINY, "remat.policy=minimal_offloaded", f"run.output_dir={tmp_path}"])
    setup = from_config.train_setup(cfg, deviceless.compile_only_devices("gb200", "1x1x1"))

    def trips(plan):
        text = setup.with_plan(plan).compile_train_step().as_text()
        return re.findall(r'"known_trip_count":\{"n":"(\d+)"', text)

    assert setup.plan.xla_preset == "baseline" and trips(setup.plan) == ["4", "4"]
    piped = trips(dataclasses.replace(setup.plan, xla_preset="lhs_pipelined_offload"))
    assert piped != ["4", "4"], piped
    result = run_cli(["train.py", *TINY, "run.dry_run=true", f"run.output_dir={tmp_path}", "xla.preset=lhs"])
    assert result.returncode == 0, result.stderr
    assert "xla.preset=lhs: the step compiles with --xla_gpu_enable_latency_hiding_scheduler=true" in result.stdout


@pytest.mark.stack("py311", "py312")
def test_missing_plugin_says_what_to_install(monkeypatch):
    import importlib.util

    import jaxlib

    from MaxOffload import deviceless

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("jax_plugins") else real(name, *a))
    message = deviceless.plugin_missing()
    assert f"jax-cuda13-plugin=={jaxlib.__version__}" in message and f"jax-cuda13-pjrt=={jaxlib.__version__}" in message


@pytest.mark.stack("py311", "py312")
def test_target_config_is_generated_from_the_hardware_table():
    from MaxOffload import hardware

    text = hardware.xla_target_config(hardware.ACCELERATORS["gb200"])
    assert "core_count: 152" in text and "device_memory_size: 197897748480" in text
    assert "cuda_compute_capability { major: 10 minor: 0 }" in text


def test_host_memory_limit_follows_the_plan(tmp_path):
    from MaxOffload.config import load
    from MaxOffload.parallel.launch_env import host_memory_limit_gb

    cfg = load(["configs/llama3_1.py:tiny", f"run.output_dir={tmp_path}"])
    assert host_memory_limit_gb(cfg) == 180  # no plan yet: generous, below the GB200 cap of 216
    (tmp_path / "aot_report.json").write_text(json.dumps({"host_bytes_per_device": 40e9}))
    assert host_memory_limit_gb(cfg) == 54  # 40 GB + 25% + 4 GB
    (tmp_path / "aot_report.json").write_text(json.dumps({"host_bytes_per_device": 400e9}))
    assert host_memory_limit_gb(cfg) == 216  # capped at 90% of a GB200's 240 GB host RAM per GPU
    fixed = load(["configs/llama3_1.py:tiny", f"run.output_dir={tmp_path}", "launch.host_memory_limit_gb=99"])
    assert host_memory_limit_gb(fixed) == 99


@pytest.mark.stack("py312")  # a deviceless GPU compile: the GPU stack's jax
def test_dropless_experts_compile_to_the_grouped_gemm_kernel_on_gpus(tmp_path):
    """Tiny DeepSeek-V3, dropless, EP8 on 8 GB200s (deviceless): model.moe_kernel=auto puts tokamax's Triton
    ragged_dot in the compiled step: no dense ragged_dot, expert FLOPs (counted from the kernels' shapes) the
    dispatch buffer's 1.25x. (XLA's own ragged_dot, which multiplies every row by every local expert, is
    tests/test_audit.py's ragged_dot test.)"""
    result = run_cli(["-m", "MaxOffload.aot", "configs/deepseek_v3.py:tiny", "train.seq_len=64",
                      "train.per_device_batch_size=2", "remat.policy=save_all", "mesh.ici.expert=8", "mesh.ici.fsdp=1",
                      "model.num_layers=2", "model.num_experts=16", "model.moe_buffer_factor=1.25",
                      "--target", "gb200", "--topology", "1x2x4", f"run.output_dir={tmp_path}"])
    assert result.returncode == 0, result.stdout + result.stderr
    work = json.loads((tmp_path / "aot_report.json").read_text())["compiled_work"]
    # one MoE layer (after the dense one): 3 grouped matmuls x (forward, d rows, d weights)
    assert work["counted_kernels"] == {"PallasTritonRaggedDot": 3 * 3, "PallasTritonFlashAttention": 2,
                                       "PallasTritonFlashAttentionVjp": 2} and work["unreadable_kernels"] == {}, work
    assert work["dense_ragged_dots"] == 0 and work["warnings"] == [], work
    assert work["components"]["routed_experts"]["ratio"] == pytest.approx(1.25, rel=0.05)
    assert work["ratio"] <= 1.5
    assert "kernels counted from their shapes" in result.stdout


def _attention_step(attention, length, model=("configs/llama3_1.py:tiny",), topology="1x1x4", policy="save_all"):
    """(compiled GB200 step text, its audit, temporaries) of a 2-layer model under model.attention=attention."""
    from MaxOffload import audit, deviceless, from_config
    from MaxOffload.config import load

    cfg = load([model[0], "model.num_layers=2", f"train.seq_len={length}", "train.per_device_batch_size=1",
                f"remat.policy={policy}", f"model.attention={attention}", "run.output_dir=/tmp/maxoffload_attention",
                *model[1:]])
    setup = from_config.train_setup(cfg, deviceless.compile_only_devices("gb200", topology))
    compiled = setup.compile_train_step()
    return compiled.as_text(), audit.of_compiled(compiled, setup), compiled.memory_analysis().temp_size_in_bytes


def square_buffers(text, length, ways, at_least=512):
    """The float32 and boolean buffers of a compiled module shaped [.., q, k]: queries by keys, both token counts
    of a `length`-token sequence split `ways` ways (the whole, a shard's, a load-balanced chunk's), >= at_least."""
    tokens = {length, length // ways, length // (2 * ways)}
    found = set()
    for dtype, shape in re.findall(r"\b(pred|f32)\[([0-9,]+)\]", text):
        dims = [int(d) for d in shape.split(",")]
        if len(dims) >= 2 and min(dims[-2:]) >= at_least and set(dims[-2:]) <= tokens:
            found.add(f"{dtype}[{shape}]")
    return sorted(found)


# DeepSeek-V3 small (MLA) gathers its latent and makes the keys and values block by block (model.mla_context_gather)
LONG_CONTEXT = {"llama": ["configs/llama3_1.py:8b"], "deepseek": ["configs/deepseek_v3.py:small"]}


@pytest.mark.parametrize("family", sorted(LONG_CONTEXT))
def test_128k_tokens_over_eight_gpus_compile_with_the_flash_kernel_per_shard_and_no_dense_mask(family):
    """Deviceless GB200, two layers at the model's width (Llama 3.1 8B, DeepSeek-V3 small): 131,072 tokens
    split 8 ways attend through tokamax's flash kernels per shard without a float32 or boolean
    [.., q, k] buffer (q, k >= 512: no dense mask, no scores), the kernels in a loop over the earlier key blocks
    doing exactly their work multiple (in sequence order: the last shard's C - 1 blocks on every shard), and
    need at most twice the temporaries of the same 16,384 tokens per GPU on one GPU (one sequence: a per-device
    batch of 1/8; what grows is the gathered keys and values or latent, linearly)."""
    context = ["mesh.ici.context=8", "mesh.ici.fsdp=1", "train.per_device_batch_size=0.125"]
    text, work, temp = _attention_step("flash", 131072, (*LONG_CONTEXT[family], *context), "1x2x4", "full")
    assert "__gpu$xla.gpu.triton" in text and square_buffers(text, 131072, 8) == [], square_buffers(text, 131072, 8)
    assert work["counted_kernels"]["PallasTritonFlashAttentionVjp"] > 0 and work["warnings"] == [], work
    scores = work["components"]["attention_scores"]
    # per shard its own 16,384 queries' causal half and 7 earlier blocks whole, of the causal half of 131,072^2;
    # each (query, key) pair's forward + backward FLOPs against the model's 3 x forward (audit.py)
    qk, v = (48, 32) if family == "deepseek" else (128, 128)
    expected = 8 * (16384 * 16385 / 2 + 7 * 16384 ** 2) / (131072 ** 2 / 2) * (8 * qk + 6 * v) / (6 * (qk + v))
    assert (scores["compiled_flops"] - scores["recompute_flops"]) / scores["model_flops"] == pytest.approx(expected,
                                                                                                         rel=0.01)
    _, _, one_gpu = _attention_step("flash", 16384, LONG_CONTEXT[family], "1x1x1", "full")
    print(f"{family}: temporaries {temp / 2**30:.2f} GiB per GPU at 131,072 tokens over 8, {one_gpu / 2**30:.2f} GiB "
          "at 16,384 on one")
    assert temp <= 2 * one_gpu, (temp, one_gpu)


def test_attention_kernels_compile_for_gpus_without_the_score_square():
    """Deviceless GB200, 1,100 tokens (two query blocks of 512 and a short one): the xla path computes only
    the keys each block sees (sum rows x keys: 0.72 of the square here, 0.53 at 8,192) and flash is tokamax's
    fused kernel; neither has a [.., L, L] float32 buffer in the compiled module, and the audit holds each to
    its own work multiple."""
    from MaxOffload.expected_work import attention_work_multiple, xla_work_multiple

    length = 1100
    for attention, kernel in (("xla", "xla"), ("flash", "flash:triton")):
        text, work, temp = _attention_step(attention, length)
        assert f"f32[1,4,{length},{length}]" not in text and f"{length},{length}]" not in text, attention
        scores = work["components"]["attention_scores"]
        assert scores["ratio"] == pytest.approx(attention_work_multiple(kernel, length, 16, 16), rel=0.02), attention
        assert work["warnings"] == [], work["warnings"]
        if attention == "flash":
            assert work["counted_kernels"] == {"PallasTritonFlashAttention": 2, "PallasTritonFlashAttentionVjp": 2}
            assert "__gpu$xla.gpu.triton" in text
        else:
            assert work["counted_kernels"] == {} and xla_work_multiple(length) / 2 == pytest.approx(0.72, abs=0.01)


@pytest.mark.stack("py312")  # shares the py312 tests' reports
def test_accumulated_micro_batches_compile_to_the_whole_batch_work_with_micro_batch_memory(reports, tmp_path):
    """train.grad_accum_steps=2 of 2 sequences against the fixture's one batch of 4: the same matmul work and
    no recompute (the accumulation loop adds none), offloaded bytes per micro-batch. Under
    the pipelined preset, whose loop pipelining peels an iteration and drops XLA's proved trip count (the
    count is read off the loop's induction variable)."""
    extra = ["remat.tensors.mlpwi_0=offload", "remat.tensors.query_proj=offload", "xla.preset=lhs_pipelined_offload"]
    result = run_cli(["-m", "MaxOffload.aot", *TINY, "train.per_device_batch_size=2", "train.grad_accum_steps=2",
                      "remat.policy=custom", *extra, "--target", "gb200", "--topology", "1x1x4",
                      f"run.output_dir={tmp_path}"])
    assert result.returncode == 0, result.stdout + result.stderr
    micro = json.loads((tmp_path / "aot_report.json").read_text())
    whole = reports["custom"]
    assert micro["compiled_work"]["model_flops"] == pytest.approx(whole["compiled_work"]["model_flops"], rel=1e-6)
    assert micro["compiled_work"]["compiled_matmul_flops"] == pytest.approx(
        whole["compiled_work"]["compiled_matmul_flops"], rel=0.02)
    assert micro["compiled_work"]["ratio"] == pytest.approx(whole["compiled_work"]["ratio"], rel=0.02)
    # offloaded buffers are per micro-batch: at most the whole batch's (the pipelined loop keeps the peeled
    # iteration's beside the loop's, so here both micro-batches' are live at once; under baseline it is half)
    assert 0 < micro["host_temp_bytes_per_device"] <= whole["host_temp_bytes_per_device"]
    assert micro["compiled_work"]["unknown_trip_counts"] == [] and micro["timeline"]["unknown_trip_counts"] == []
    # FSDP over the 4 GPUs: the weights are gathered inside the accumulation loop, once per micro-batch
    gathers = micro["weight_gathers"]
    assert gathers["where"] == "per micro-batch" and 0 < gathers["in_micro_batch_loop_bytes"] < gathers["per_step_bytes"]
    assert whole["weight_gathers"]["where"] == "per step" and "gathered per micro-batch (train.gather_weights=per_micro_batch, 2 micro-batches" in result.stdout


@pytest.mark.stack("py312")  # a deviceless GPU compile: the GPU stack's jax
def test_the_token_all_to_all_on_gpus_gathers_no_expert_weight_and_the_decomposer_turns_it_dense():
    """mesh.exchange=all_to_all with the experts at home (mesh.rules.exp_embed=[]) on a deviceless GB200 compile: the
    program all-gathers no routed-expert weight (the FSDP layout of the same experts does: the check can tell), and
    its tokens move by XLA's ragged all-to-all, whose one-shot lowering crashed past 32 ranks and gave wrong
    gradients on some builds (docs/parallelism.md): xla.ragged_decomposer=true compiles the GPU step with XLA's
    decomposer, dense all-to-alls and no ragged-all-to-all left; by default the primitive stays."""
    from MaxOffload import aot, deviceless, from_config, hlo
    from MaxOffload.config import load

    found = {}
    base = ["configs/deepseek_v3.py:tiny", "train.per_device_batch_size=1", "train.seq_len=64",
            "mesh.exchange=all_to_all", "run.output_dir=/tmp/maxoffload_decomposer"]
    for case, overrides in {"decomposed": ["mesh.ici.expert=4", "mesh.ici.fsdp=1", "mesh.rules.exp_embed=[]",
                                           "xla.ragged_decomposer=true"],
                            "ragged": ["mesh.ici.expert=4", "mesh.ici.fsdp=1", "mesh.rules.exp_embed=[]"],
                            "fsdp_experts": ["mesh.ici.expert=2", "mesh.ici.fsdp=2"]}.items():
        cfg = load([*base, *overrides])
        setup = from_config.train_setup(cfg, deviceless.compile_only_devices("gb200", "1x1x4"))
        assert setup.exchanges_ragged()
        text = setup.compile_train_step().as_text()
        found[case] = (len(re.findall(r" ragged-all-to-all(?:-start)?\(", text)),
                       len(re.findall(r" all-to-all(?:-start)?\(", text)),
                       aot.expert_weight_gathers(hlo.parse(text), setup.model_config))
    assert found["decomposed"][0] == 0 and found["decomposed"][1] > 0
    assert found["ragged"][0] > 0
    assert found["ragged"][2] == [] and found["decomposed"][2] == []
    assert found["fsdp_experts"][2]  # experts sharded over fsdp: gathered for their GEMMs

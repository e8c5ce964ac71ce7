"""TPUs: the platform picked where a chip is attached, the TPU rows of the hardware table, XLA:TPU's compiled
program read by the audit and the timeline, and the deviceless TPU compile (libtpu on this CPU machine)."""
import json
import os

import pytest

from conftest import ROOT, predicted_steps, run_cli
from MaxOffload import aot, audit, hardware, hlo, memory, platform
from MaxOffload.timeline import engines

TINY = ["configs/llama3_1.py:tiny", "train.seq_len=256", "train.per_device_batch_size=8"]

pytestmark = pytest.mark.stack("py311")  # the TPU v5e's stack: the lent chip runs jax 0.10.2 (docs/testing.md)


def test_the_platform_is_the_chip_the_machine_has(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(platform, "nvidia_gpu_present", lambda: False)
    monkeypatch.setattr(platform, "_set", lambda value: os.environ.__setitem__("JAX_PLATFORMS", value))
    for chip, expected in ((True, "tpu,cpu"), (False, "cpu")):
        monkeypatch.delenv("JAX_PLATFORMS", raising=False)
        monkeypatch.setattr(platform, "tpu_present", lambda chip=chip: chip)
        platform.pick_platform()
        assert os.environ["JAX_PLATFORMS"] == expected
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the user's choice wins, a TPU or not
    monkeypatch.setattr(platform, "tpu_present", lambda: True)
    platform.pick_platform()
    assert os.environ["JAX_PLATFORMS"] == "cpu"


def test_tpu_rows_of_the_hardware_table():
    v5e = hardware.lookup("TPU v5 lite")
    assert v5e is hardware.ACCELERATORS["v5e"] and hardware.lookup("TPU v5") is hardware.ACCELERATORS["v5p"]
    assert hardware.lookup("TPU v6 lite") is hardware.ACCELERATORS["v6e"] and hardware.lookup("TPU v9") is None
    assert v5e.hbm_bytes == int(15.75 * 2**30) and v5e.bf16_peak_flops == 197e12 and v5e.platform == "tpu"
    assert hardware.usable_hbm(v5e, 0.9) == v5e.hbm_bytes  # no preallocation share on TPUs
    assert hardware.slice_devices(v5e, "4x4") == 16 and hardware.slice_devices(hardware.ACCELERATORS["gb200"],
                                                                                  "2x16x4") == 64
    assert hardware.topology_problem(v5e, "2x2") is None
    assert "AxB" in hardware.topology_problem(v5e, "1x1x4")
    assert "AxBxC" in hardware.topology_problem(hardware.ACCELERATORS["v5p"], "2x2")
    assert "TPU targets" in hardware.topology_problem(hardware.ACCELERATORS["gb200"], "1x1x4", num_slices=2)


# three of XLA:TPU's dots-as-convolutions from a compiled Llama step (jax 0.10.2, libtpu 0.0.42): a projection
# (ble,ehd->blhd: the window runs over the heads, padded so each output sees one input), attention scores over a
# dilated input (blkgd,bskd->bkgls) and a weight gradient (spatial labels out of order)
CONVOLUTIONS = """HloModule m, is_scheduled=true

ENTRY %main (a: bf16[8,256,64,1], b: bf16[64,4,16,1], c: bf16[8,256,2,16,1], d: bf16[8,256,2,2,16], e: bf16[8,256,2,16]) -> bf16[] {
  %a = bf16[8,256,64,1]{1,2,3,0} parameter(0)
  %b = bf16[64,4,16,1]{0,2,1,3} parameter(1)
  %c = bf16[8,256,2,16,1]{1,3,4,2,0} parameter(2)
  %d = bf16[8,256,2,2,16]{1,4,3,2,0} parameter(3)
  %e = bf16[8,256,2,16]{1,3,2,0} parameter(4)
  %projection = bf16[8,256,4,16]{1,3,2,0} convolution(%a, %b), window={size=1x4 pad=0_0x3_3 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f
  %scores = f32[8,2,256,256,2]{3,2,4,1,0} convolution(%c, %d), window={size=8x2x2 stride=7x1x1 pad=0_0x0_0x1_1 lhs_dilate=8x2x1 rhs_reversal=0x0x1}, dim_labels=0b1f2_0o12i->01bf2
  ROOT %gradient = bf16[64,2,16,1]{0,2,1,3} convolution(%a, %e), window={size=2x8 pad=1_1x0_0 rhs_reversal=1x0}, dim_labels=1fb0_1i0o->b0f1
}
"""


def test_the_audit_counts_xla_tpu_dots_written_as_convolutions():
    module = hlo.parse(CONVOLUTIONS)
    flops = {ins.name: audit.convolution_flops(ins, module.shapes(module.entry)) for ins in module.computations[
        module.entry] if ins.opcode == "convolution"}
    assert flops == {"projection": 2 * 8 * 256 * 64 * 4 * 16,  # b l e -> b l h d, contracting e
                     "scores": 2 * 8 * 2 * 2 * 256 * 256 * 16,  # b k g l s, contracting d
                     "gradient": 2 * 64 * 2 * 16 * 8 * 256}  # e h d, contracting b l
    assert audit.count(module).total == sum(flops.values())  # the audit and the timeline count them


RAGGED = """HloModule m, is_scheduled=true

ENTRY %main (g: s32[4], x: bf16[16384,128], w: bf16[4,128,256]) -> bf16[16384,256] {
  %g = s32[4]{0} parameter(0)
  %x = bf16[16384,128]{1,0} parameter(1)
  %w = bf16[4,128,256]{2,1,0} parameter(2)
  ROOT %ragged-dot-none.8 = bf16[16384,256]{1,0:T(8,128)(2,1)} custom-call(%g, %g, %g, %g, %g, %x, %w), custom_call_target="tpu_custom_call", operand_layout_constraints={s32[1]{0}, s32[5]{0}, s32[131]{0}, s32[131]{0}, s32[1]{0}, bf16[16384,128]{1,0}, bf16[4,128,256]{2,1,0}}, frontend_attributes={mosaic_fusion_entry_point="true"}, metadata={op_name="jit(train_step)/routed_experts/weight_matmul/ragged_dot_general/ragged-dot-none"}
}
"""


def test_the_audit_counts_xla_tpu_native_ragged_dot():
    """XLA:TPU runs jax.lax.ragged_dot as a Mosaic kernel (a tpu_custom_call, invisible to XLA's cost analysis): each
    of its rows meets one expert's matrix."""
    count = audit.count(hlo.parse(RAGGED))
    assert count.total == 2 * 16384 * 128 * 256
    assert [(m.kind, m.component) for m in count.matmuls] == [("ragged_dot", "routed_experts")]


# XLA:TPU's gradient of ragged_dot for its expert weights (DeepSeek small on a deviceless v5e): a convolution over
# every row per expert, the others' rows masked by output_mask
MASKED = """HloModule m, is_scheduled=true

%convolution_select_fusion.clone.1 (kernel.20: bf16[4096,128], activations.20: bf16[4096,256], output_mask.6: pred[16,4096]) -> bf16[16,256,128] {
  %activations.20 = bf16[4096,256]{1,0:T(8,128)(2,1)S(1)} parameter(1)
  %output_mask.6 = pred[16,4096]{1,0:T(8,128)(4,1)S(1)} parameter(2)
  %fusion.1056 = bf16[16,4096,256]{2,1,0:T(8,128)(2,1)} fusion(%activations.20, %output_mask.6), kind=kLoop, calls=%activations_select_fusion.clone.1
  %kernel.20 = bf16[4096,128]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %fusion.1057 = bf16[16,4096,128]{2,1,0:T(8,128)(2,1)} fusion(%kernel.20, %output_mask.6), kind=kLoop, calls=%kernel_select_fusion.clone.1
  ROOT %convolution-base-dilated.6 = bf16[16,256,128]{2,1,0:T(8,128)(2,1)S(1)} convolution(%fusion.1056, %fusion.1057), window={size=16 stride=15 lhs_dilate=16}, dim_labels=0fb_0io->0bf
}

ENTRY %main (k: bf16[4096,128], a: bf16[4096,256], m: pred[16,4096]) -> bf16[16,256,128] {
  %k = bf16[4096,128]{1,0} parameter(0)
  %a = bf16[4096,256]{1,0} parameter(1)
  %m = pred[16,4096]{1,0} parameter(2)
  ROOT %fusion.1129 = bf16[16,256,128]{2,1,0:T(8,128)(2,1)S(1)} fusion(%k, %a, %m), kind=kOutput, calls=%convolution_select_fusion.clone.1
}
"""


def test_the_expert_weight_gradient_counts_each_row_once():
    """Written dense over 16 experts x 4,096 rows, the masked convolution is counted as the grouped GEMM it is on the
    chip (each row against its own expert's block), in the routed experts' backward pass."""
    count = audit.count(hlo.parse(MASKED))
    dense = 2 * 16 * 4096 * 256 * 128  # one (output, window) pair per expert position
    assert count.total == dense / 16 == 2 * 4096 * 256 * 128
    assert [(m.component, m.phase, m.weight_gradient) for m in count.matmuls] == [("routed_experts", "backward", True)]
    plain = hlo.parse(MASKED.replace("convolution_select_fusion", "fusion_elsewhere"))
    assert audit.count(plain).total == dense  # a convolution elsewhere keeps its dense count


LOOP = """HloModule m, is_scheduled=true

%condition (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %copy = s32[] copy(%i)
  %one = s32[] constant(2)
  %next = s32[] add(%copy, %one)
  %x = f32[4] get-tuple-element(%t), index=1
  ROOT %out = (s32[], f32[4]) tuple(%next, %x)
}

ENTRY %main (x: f32[4]) -> (s32[], f32[4]) {
  %x = f32[4] parameter(0)
  %start = s32[] constant(1)
  %init = (s32[], f32[4]) tuple(%start, %x)
  ROOT %loop = (s32[], f32[4]) while(%init), condition=%condition, body=%body
}
"""


def test_a_loop_without_backend_config_has_its_trip_count_from_its_variable():
    module = hlo.parse(LOOP)
    loop = module.computations[module.entry][-1]
    assert loop.opcode == "while" and module.trip_count(loop) == 3  # i = 1, 3, 5 (< 7)


def test_out_of_memory_refusals_read_as_needed_and_available_bytes():
    refusal = memory.out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
                                                "required for HLO temporaries (18.64G) exceeds available HBM (15.75G)."))
    assert refusal["needed"] == int(18.64 * 2**30) and refusal["available"] == int(15.75 * 2**30)
    used = memory.out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory "
                                             "in memory space hbm. Used 27.60G of 15.75G hbm."))
    assert used["needed"] == int(27.6 * 2**30)
    assert memory.out_of_memory(RuntimeError("INVALID_ARGUMENT: shapes")) is None


def test_a_compiler_failure_is_one_line_and_other_errors_pass_through():
    """XLA failing on a step (jaxlib 0.10.2's GPU compiler under xla.preset=lhs_pipelined_offload on the 671B recipe:
    this status) is a ConfigError naming it and what to try; our own errors are not disguised as the compiler's."""
    import jax
    from MaxOffload.errors import ConfigError

    status = "INVALID_ARGUMENT: layout minor_to_major field contains 2 elements, but shape has 0 dimensions"

    def fails(error):
        def compile_fn():
            raise error
        return compile_fn

    with pytest.raises(ConfigError) as raised:
        memory.compile_or_refusal(fails(jax.errors.JaxRuntimeError(status + "\n(C++ stack)")))
    line = str(raised.value)
    assert "\n" not in line and status in line and "xla.preset" in line
    with pytest.raises(ValueError):
        memory.compile_or_refusal(fails(ValueError("a bug of ours")))


def test_deviceless_v5e_slices_fit_and_predict_their_step(tmp_path):
    """One slice of 2x2 v5e and two of them (multislice): the verdict, the compiled work read from XLA:TPU's
    convolutions, a predicted step on the v5e's rates."""
    for slices, devices, preset in ((1, 4, "baseline"), (2, 8, "tpu_overlap_offload")):
        out = tmp_path / f"slices{slices}"
        result = run_cli(["-m", "MaxOffload.aot", *TINY, "--target", "v5e", "--topology", "2x2",
                          f"aot.num_slices={slices}", f"xla.preset={preset}", f"run.output_dir={out}"])
        assert result.returncode == 0, result.stdout + result.stderr[-2000:]
        report = json.loads((out / "aot_report.json").read_text())
        assert report["accelerator"] == "TPU v5 lite" and report["devices"] == devices and report["fits"]
        assert report["hbm_usable_bytes"] == hardware.ACCELERATORS["v5e"].hbm_bytes
        work = report["compiled_work"]
        assert work["compiled_matmul_flops"] >= work["model_flops"] > 0  # full remat: the model's work and more
        assert not work["unknown_trip_counts"]
        assert report["timeline"]["step_s"] > 0 and "predicted step time on TPU v5 lite" in result.stdout
        assert report["xla_preset"] == preset
    assert "2 x 2x2" in result.stdout


def test_a_step_libtpu_refuses_does_not_fit_in_one_verdict(tmp_path):
    result = run_cli(["-m", "MaxOffload.aot", *TINY, "train.per_device_batch_size=32768", "--target", "v5e",
                      "--topology", "1x1", f"run.output_dir={tmp_path}"])
    assert result.returncode == 1, result.stdout + result.stderr[-2000:]
    assert "verdict: DOES NOT FIT" in result.stdout and "needs" in result.stdout and "Traceback" not in result.stderr
    report = json.loads((tmp_path / "aot_report.json").read_text())
    assert report["hbm_bytes_per_device"] > report["hbm_available_bytes"] == int(15.75 * 2**30)


@pytest.mark.parametrize("args, says", [
    (["--target", "v5e"], "AxB"),  # the default topology is a GPU one
    (["--target", "v5e", "--topology", "2x2", "xla.preset=lhs"], "xla.preset=lhs sets XLA:GPU flags only"),
    (["--target", "gb200", "aot.num_slices=2"], "for TPU targets"),
])
def test_tpu_target_mistakes_are_one_line(args, says, tmp_path):
    result = run_cli(["-m", "MaxOffload.aot", *TINY, *args, f"run.output_dir={tmp_path}"])
    assert result.returncode == 2 and says in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_tpu_preset_flags_are_checked_against_the_installed_libtpu(tmp_path, monkeypatch):
    """A libtpu flag is accepted only if libtpu compiles with it (a compile-only v5e); XLA:TPU takes an XLA:GPU
    flag and ignores it, so the platforms' presets are kept apart."""
    from MaxOffload import xla

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    known = xla.accepted(["--xla_tpu_enable_host_aware_passes=true", "--xla_tpu_enable_no_such_pass=true"])
    assert known == {"--xla_tpu_enable_host_aware_passes=true": True, "--xla_tpu_enable_no_such_pass=true": False}
    assert xla.presets_for("tpu") == ["baseline", "tpu_overlap", "tpu_overlap_offload"]
    assert "tpu_overlap" not in xla.presets_for("gpu") and "lhs" not in xla.presets_for("tpu")


def test_the_v5e_programs_are_predicted_within_15_percent_and_ordered_as_measured():
    """The six variants measured on the lent v5e (benchmarks/results/tpu_v5e_2026-12-05), as compiled deviceless on
    jax 0.10.2 + libtpu 0.0.42 (tests/data/v5e_programs, written by benchmarks/predict_vs_measured.py --target v5e
    --save_programs), simulated with the TPU calibration in the code."""
    with open(os.path.join(ROOT, "benchmarks", "results", "tpu_v5e_2026-12-05", "measured_variants.json")) as f:
        measured = {name: run["summary"]["mean_step_time_s"] for name, run in json.load(f).items()}
    predicted = predicted_steps("v5e_programs", measured, engines.Rates.of(hardware.ACCELERATORS["v5e"], "1x1"))
    for name, seconds in measured.items():
        assert predicted[name] == pytest.approx(seconds, rel=0.15), (name, predicted[name], seconds)
    for size in ("l4b4", "l2b8"):  # keep < remat < offload, as measured
        assert predicted[f"{size}_keep"] < predicted[f"{size}_remat"] < predicted[f"{size}_offload"]


def test_splash_attention_equals_the_xla_path_per_shard():
    """jax's splash kernel, interpreted on the CPU, per shard of batch x heads meshes (a tensor axis wider than the
    kv heads included) and with MLA's narrower v, and over a sequence split by context axes (each shard's queries
    against the gathered keys: in sequence order, and load-balanced, whose rows' positions and keys' order the
    kernel's mask must follow), and with rows of packed documents (the kernel's segment ids; sharded, MLA, over
    context shards): the outputs and all three gradients of the XLA path on the whole sequence."""
    result = run_cli(["tests/helpers/splash_check.py"], timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    cases = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(cases) == {"gqa_data2_tensor2", "gqa_tensor4_wider_than_kv", "mla_data2_tensor2", "context4_gqa",
                          "context2_balanced_gqa_data2", "context4_balanced_mla", "packed_gqa_data2_tensor2",
                          "packed_mla_data2_tensor2", "packed_context2_balanced_gqa"}
    for name, case in cases.items():
        assert case["output"] < 1e-5 and case["gradients"] < 1e-4, (name, case)


def test_splash_on_a_deviceless_v5e_never_holds_the_scores(tmp_path):
    """One layer of Llama-8B attention shape (16 heads on 4 kv heads of 128, 2 x 2,048 tokens) on one v5e:
    model.attention=auto runs splash, counted by the audit from its kernels (at the work its causal blocks take),
    and the step's temporaries stay below one layer's float32 score matrix, which XLA's path materializes in
    blocks (1.17 GiB against splash's 426 MiB at 32 heads, benchmarks of 2026-12-05). jax's global device reads are
    refused (tests/helpers/no_global_devices.py): the kernel and the v5e's peak come from the target's devices.
    The layers are a Python loop (model.scan_layers=false, the v5e benchmarks' fastest): the placement proof, which
    reads scanned segments, is left out with a warning, not reported as tags the step never made."""
    batch, heads, length = 2, 16, 2048
    out = tmp_path / "splash"
    result = run_cli(["tests/helpers/no_global_devices.py", "MaxOffload.aot", "configs/llama3_1.py:tiny",
                      f"train.seq_len={length}",
                      f"train.per_device_batch_size={batch}", f"model.num_heads={heads}", "model.num_kv_heads=4",
                      "model.head_dim=128", "model.emb_dim=256", "model.mlp_dim=256", "model.num_layers=1",
                      "model.scan_layers=false", "--target", "v5e", "--topology", "1x1", f"run.output_dir={out}"])
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    report = json.loads((out / "aot_report.json").read_text())
    assert report["accelerator"] == "TPU v5 lite" and report["timeline"]["mfu"] > 0  # the v5e's peak
    assert report["problems"] == [] and aot.UNSCANNED in report["warnings"], report["problems"]
    assert report["compiled_work"]["counted_kernels"].get("splash", 0) >= 3  # forward, its recompute, backward
    assert report["temp_bytes_per_device"] < batch * heads * length * length * 4
    scores = report["compiled_work"]["components"]["attention_scores"]
    expected = (length + 1024) / length * (8 * 128 + 6 * 128) / (6 * 256)  # expected_work.attention_work_multiple
    assert scores["compiled_flops"] - scores["recompute_flops"] == pytest.approx(expected * scores["model_flops"],
                                                                                  rel=0.02)


def test_splash_over_context_shards_on_a_deviceless_v5e_counts_each_shards_causal_blocks(tmp_path):
    """A sequence of 1,024 tokens load-balanced over 4 context shards of a deviceless 2x2 v5e: splash runs on each
    shard's 256 rows (two chunks of 128, one block each) against the gathered 1,024 keys, and the audit counts from
    the kernel's operands (its block tables give the block) exactly the causal blocks' share the model's formula
    says, (T + block) / T of the causal half (not the whole rows x keys, nor blocks of 256)."""
    out = tmp_path / "context"
    result = run_cli(["-m", "MaxOffload.aot", *TINY, "train.seq_len=1024", "train.per_device_batch_size=2",
                      "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=128", "model.emb_dim=256",
                      "model.mlp_dim=256", "model.num_layers=1", "--target", "v5e", "--topology", "2x2",
                      "mesh.ici.context=4", "mesh.context_load_balance=true", f"run.output_dir={out}"])
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    report = json.loads((out / "aot_report.json").read_text())
    assert report["compiled_work"]["counted_kernels"].get("splash", 0) >= 3
    scores = report["compiled_work"]["components"]["attention_scores"]
    expected = (1024 + 128) / 1024 * (8 * 128 + 6 * 128) / (6 * 256)
    assert scores["compiled_flops"] - scores["recompute_flops"] == pytest.approx(expected * scores["model_flops"],
                                                                                  rel=1e-3)


@pytest.mark.parametrize("args, says", [
    (["train.seq_len=200"], "blocks of 1024 or 512 or 256 or 128"),
    (["train.seq_len=512", "--topology", "2x2", "mesh.ici.context=4", "mesh.context_load_balance=true"],
     "a shard's chunk of 64 tokens (load-balanced: half its rows)"),
])
def test_what_splash_cannot_run_is_one_line(args, says, tmp_path):
    result = run_cli(["-m", "MaxOffload.aot", *TINY, "--target", "v5e", "--topology", "1x1", *args,
                      f"run.output_dir={tmp_path}"])
    assert result.returncode == 2 and says in result.stdout + result.stderr, result.stderr[-1500:]
    assert "Traceback" not in result.stderr


# Instructions as a TPU trace names its ops (the offload variant's, benchmarks/results/tpu_v5e_2026-12-06)
_D2H = ("%dynamic-update-slice-start.4 = ((bf16[4,4,2048,14336]{3,2,1,0:T(8,128)(2,1)S(5)}, bf16[1,4,2048,14336]"
        "{3,2,1,0:T(8,128)(2,1)}, s32[]{:T(128)}, s32[]{:T(128)}), bf16[4,4,2048,14336]{3,2,1,0:T(8,128)(2,1)S(5)}, "
        "u32[]{:S(2)}) async-start(bf16[4,4,2048,14336]{3,2,1,0:T(8,128)(2,1)S(5)} %p, bf16[1,4,2048,14336]"
        "{3,2,1,0:T(8,128)(2,1)} %u)")
_H2D = ("%dynamic-slice-start.1 = ((bf16[4,4,2048,8,128]{2,4,3,1,0:T(8,128)(2,1)S(5)}, s32[]{:T(128)}), "
        "bf16[1,4,2048,8,128]{2,4,3,1,0:T(8,128)(2,1)}, u32[]{:S(2)}) async-start(bf16[4,4,2048,8,128]"
        "{2,4,3,1,0:T(8,128)(2,1)S(5)} %h, s32[]{:T(128)} %i)")
_ON_CHIP = ("%copy-start.3 = (bf16[4,2048,4096]{2,1,0:T(8,128)(2,1)}, bf16[4,2048,4096]{2,1,0:T(8,128)(2,1)S(1)}, "
            "u32[]{:S(2)}) copy-start(bf16[4,2048,4096]{2,1,0:T(8,128)(2,1)S(1)} %x)")


def test_tpu_trace_ops_are_classified_from_their_hlo_text():
    from MaxOffload.profile import trace

    assert trace.tpu_event("Async XLA Ops", _D2H) == ("d2h", 4 * 2048 * 14336 * 2)  # the update, into host memory
    assert trace.tpu_event("Async XLA Ops", _H2D) == ("h2d", 4 * 2048 * 8 * 128 * 2)  # the slice, out of it
    assert trace.tpu_event("Async XLA Ops", _ON_CHIP) == ("other", 0)  # between the chip's own memories
    host_copy = _ON_CHIP.replace("S(1)", "S(5)")
    assert trace.tpu_event("Async XLA Ops", host_copy) == ("h2d", 4 * 2048 * 4096 * 2)
    assert trace.tpu_event("Async XLA Ops", "%all-gather-start.2 = (f32[8]{0}, f32[64]{0}) all-gather-start("
                                            "f32[8]{0} %a)") == ("collective", 0)
    assert trace.tpu_event("XLA Ops", _D2H) == ("other", 0)  # its issue; the transfer is on the async line
    assert trace.tpu_event("XLA Ops", "%fusion.805 = f32[4,2048]{1,0} fusion(bf16[4,2048,4096]{2,1,0} %g), "
                                      "kind=kLoop") == ("compute", 0)


def test_the_overlap_report_reads_a_tpu_trace(tmp_path):
    """The offload variant's xprof trace from the v5e (2 steps): the five projections of 4 layers, 2.28 GB each
    way a step, and the exposed copy time the step lost to offloading (0.709 s against 0.440 s kept)."""
    import tarfile

    with tarfile.open(os.path.join(ROOT, "benchmarks/results/tpu_v5e_2026-12-06/profile.tar.gz")) as archive:
        archive.extractall(tmp_path, filter="data")
    result = run_cli(["-m", "MaxOffload.profile.overlap", str(tmp_path / "profile"), "--json"])
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["device"] == "/device:TPU:0" and report["module"].startswith("jit_train_step")
    assert len(report["steps"]) == 2
    per_layer = 4 * 2048 * (32 * 128 + 2 * 8 * 128 + 2 * 14336) * 2  # q, k, v, mlpwi_0, mlpwi_1 in bf16
    mean = report["mean"]
    assert mean["d2h"]["bytes"] == mean["h2d"]["bytes"] == 4 * per_layer
    assert 0.25 < mean["exposed_s"] < 0.29 and 0.40 < mean["compute_s"] < 0.48


def test_the_step_breakdown_reads_a_tpu_trace(tmp_path):
    """benchmarks/tpu/breakdown.py on the same trace: the step's device time from the XLA Modules line (0.711 s a
    step as measured there), the MLP GEMMs first, forward and backward apart, with the rate XLA's FLOPs give."""
    import tarfile

    with tarfile.open(os.path.join(ROOT, "benchmarks/results/tpu_v5e_2026-12-06/profile.tar.gz")) as archive:
        archive.extractall(tmp_path, filter="data")
    result = run_cli(["benchmarks/tpu/breakdown.py", str(tmp_path / "profile"), "--top", "40"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert 705 < float(lines[0].split()[1]) < 715
    rows = {line[38:]: float(line.split()[0]) for line in lines[1:]}
    mlp = [ms for name, ms in rows.items() if name.endswith("mlp/weight_matmul")]
    assert len(mlp) == 2 and 1.8 < max(mlp) / min(mlp) < 2.3  # the backward's two GEMMs against the forward's one
    assert max(rows.values()) < float(lines[0].split()[1])


def test_a_step_the_compiler_refuses_for_memory_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """train.py where libtpu refuses the step at compile (its message as the v5e gave it for save_all): one line with
    the bytes needed and available and what to change, exit 2, not a traceback; other compile errors stay errors."""
    import sys

    from MaxOffload.train import step

    sys.path.insert(0, ROOT)
    import train

    refusal = RuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
                           "hbm. Used 27.60G of 15.75G hbm. Exceeded hbm capacity by 11.85G.")
    monkeypatch.setattr(step.TrainSetup, "compile_train_step", lambda self: (_ for _ in ()).throw(refusal))
    argv = [*TINY, f"run.output_dir={tmp_path}", "train.steps=1", "train.warmup_steps=0", "checkpoint.enabled=false"]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the training step does not fit the device's memory: it needs "
                                               "27.60 GiB of 15.75 GiB; keep fewer activations"), err
    assert memory.compile_or_config_error(lambda: "compiled") == "compiled"
    with pytest.raises(ValueError):
        memory.compile_or_config_error(lambda: (_ for _ in ()).throw(ValueError("INVALID_ARGUMENT: shapes")))


def test_the_token_all_to_all_is_ragged_on_a_deviceless_v5e(tmp_path):
    """mesh.exchange=all_to_all on TPUs moves the routed rows by XLA's ragged all-to-all (the padded all_to_all is the
    CPU's transport): DeepSeek tiny over 4 expert ranks of a v5e 2x2, read in its optimized program."""
    dump = tmp_path / "hlo"
    result = run_cli(["-m", "MaxOffload.aot", "configs/deepseek_v3.py:tiny", "mesh.ici.expert=4", "mesh.ici.fsdp=1",
                      "mesh.exchange=all_to_all", "--target", "v5e", "--topology", "2x2",
                      f"run.output_dir={tmp_path / 'out'}"],
                     env={"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text "
                                       "--xla_dump_hlo_module_re=.*train_step.*"})
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    program = next(p for p in dump.iterdir() if p.name.endswith("after_optimizations.txt")).read_text()
    ops = [ins for instructions in hlo.parse(program).computations.values() for ins in instructions]
    ragged = [ins for ins in ops if ins.opcode == "ragged-all-to-all"]
    assert any(hlo.arrays(ins.shape)[0].dtype == "bf16" for ins in ragged), "no ragged all-to-all of the rows"
    # the plain all-to-alls left are the ragged primitive's offsets (s32), never padded rows
    assert all(a.dtype == "s32" for ins in ops if ins.opcode == "all-to-all" for a in hlo.arrays(ins.shape))
    assert json.loads((tmp_path / "out" / "aot_report.json").read_text())["fits"]


def test_device_check_variants_run_in_one_process(tmp_path):
    """benchmarks/tpu/run_variants.py: two device-check variants (shrunk to the CPU's size by trailing overrides) in
    one process, each with its own summary and log; variants of different xla.preset values refused in one line."""
    small = ["--", "model.emb_dim=64", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=32",
             "model.mlp_dim=128", "model.vocab_size=256", "model.num_layers=1", "train.seq_len=64",
             "train.per_device_batch_size=1", "train.steps=3", "train.warmup_steps=1"]
    result = run_cli(["benchmarks/tpu/run_variants.py", str(tmp_path), "l4b4_remat", "l4b4_keep", *small])
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    for name in ("l4b4_remat", "l4b4_keep"):
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["steps"] == 3 and summary["final_loss"] > 0
        assert f"{name} rc=0" in result.stdout and (tmp_path / f"{name}.log").exists()
    mixed = run_cli(["benchmarks/tpu/run_variants.py", str(tmp_path), "l4b4_remat", "l4b4_offload_tpu_overlap"])
    assert mixed.returncode == 2 and "different xla.preset" in mixed.stderr

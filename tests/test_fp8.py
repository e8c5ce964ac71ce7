"""FP8 weight GEMMs (quant.mode, models/fp8.py): on CPU, fp8 and mxfp8 train like bf16 and their gradients stay
near bf16's; in the deviceless GPU compile, every GEMM of the parts the mode covers (forward, both backward
GEMMs, recomputation) is an FP8 kernel (cuBLASLt FP8, cuDNN's block-scaled dot, tokamax's grouped GEMM on FP8
operands), counted by the audit, with the dropless routed experts' weight gradient named as BF16 by design; bad
settings are one line.
mxfp8 needs jax >= 0.11: on the py311 stack (jax 0.10.2) its cases are the one-line error instead."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, process_env, run_cli
from MaxOffload import audit, deviceless, from_config
from MaxOffload.config import ConfigError, load
from MaxOffload.platform import jax_at_least

NEW_JAX = jax_at_least(0, 11)
# every dimension an MXFP8 GEMM contracts a multiple of its blocks of 32 (DeepSeek-V3's own are: 7168, 1536, 576)
LLAMA = ["configs/llama3_1.py:tiny", "model.mlp_dim=192"]
DEEPSEEK = ["configs/deepseek_v3.py:tiny", "model.qk_rope_head_dim=32", "model.kv_lora_rank=32"]
SMALL = ["train.seq_len=32", "train.per_device_batch_size=2"]


# The training test's mode per stack: CI trains fp8 on jax 0.10.2 and mxfp8 (which only jax >= 0.11 has) on 0.12,
# each beside bf16; the quantization code is the same on both (its compiled kernels are tested on both below).
TRAINED = ["mxfp8"] if NEW_JAX else ["fp8"]


# Llama's GEMMs (per-tensor FP8 like the capacity-mode experts, whose compiled kernels are checked below) and the
# dropless routed experts' grouped GEMM on FP8 operands (its own scales and custom gradient)
TRAINING = {"llama": [*LLAMA, *SMALL], "deepseek dropless": [*DEEPSEEK, *SMALL]}


@pytest.mark.stack("py311", "py312")  # fp8 on py311, mxfp8 on py312 (TRAINED)
@pytest.mark.parametrize("model", TRAINING)
def test_fp8_modes_train_like_bf16_and_their_gradients_stay_near_it(model):
    """300 steps on the same text from the same seed: the final loss (mean of the last 10 steps) within 3% of
    bf16's; Llama's first-batch gradient within 15% (relative norm of the difference) of bf16's: e4m3 keeps 3
    mantissa bits, so each operand is off by up to 6% per element, and the measured differences are 5-8%. One
    model a test (each process trains both modes)."""
    cases = {model: {"overrides": TRAINING[model], "modes": TRAINED, "gradient": model == "llama"}}
    helper = "tests/helpers/fp8_check.py"
    result = subprocess.run([sys.executable, helper, json.dumps(cases)], cwd=ROOT, text=True, capture_output=True,
                            env=process_env([helper]), timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    for case, modes in found.items():
        bf16 = modes["bf16"]["final_loss"]
        assert bf16 < modes["bf16"]["first_loss"] - 0.5, (case, modes)  # it trained
        assert set(modes) == {"bf16", *cases[case]["modes"]}
        for mode in cases[case]["modes"]:
            assert abs(modes[mode]["final_loss"] - bf16) <= 0.03 * bf16, (case, mode, modes)
    for mode in TRAINED:
        if model == "llama":
            assert 0 < found["llama"][mode]["grad"] < 0.15, (mode, found["llama"])  # quantized, and not far off


def test_bad_quant_settings_are_one_line(tmp_path):
    base = [*LLAMA, f"run.output_dir={tmp_path}"]
    with pytest.raises(ConfigError, match=r"quant.mode='fp4' is not one of bf16, fp8, mxfp8"):
        load([*base, "quant.mode=fp4"])
    with pytest.raises(ConfigError, match=r"quant.parts='unembed' is not one of projections, mlp, routed_experts"):
        load([*base, "quant.parts=[unembed]"])
    if not NEW_JAX:
        with pytest.raises(ConfigError, match=r"quant.mode=mxfp8 needs jax >= 0.11"):
            load([*base, "quant.mode=mxfp8"])
        return
    with pytest.raises(ConfigError, match=r"aot.target=h200 \(NVIDIA H200\) runs it as dequantize \+ BF16: use "
                                          r"quant.mode=fp8 there"):
        load([*base, "quant.mode=mxfp8", "aot.target=h200"])
    odd = from_config.train_setup(load(["configs/llama3_1.py:tiny", *SMALL, "quant.mode=mxfp8",
                                        f"run.output_dir={tmp_path}"]))  # mlp_dim 176: not whole blocks of 32
    with pytest.raises(ConfigError, match=r"quant.mode=mxfp8 quantizes in blocks of 32, and the GEMM .* contracts "
                                          r"176 elements in one of its passes"):
        odd.lower_train_step()


def test_fp8_storage_offloads_half_the_bytes(tmp_path):
    """quant.fp8_storage=[offloaded] (every name the plan offloads: mlpwi_0 here): the offloaded gate projection
    goes to pinned host memory as its float8_e4m3fn bytes and its scale (two placements in the CUDA lowering, both
    expected), half the bytes of bfloat16."""
    args = ["-m", "MaxOffload.offload.inspect", *LLAMA, "train.per_device_batch_size=8", "remat.policy=custom",
            "remat.tensors.mlpwi_0=offload", "--no_cpu_memory"]
    found = {}
    for label, extra in (("bf16", []), ("fp8", ["quant.fp8_storage=[offloaded]"])):  # mlpwi_0, from the plan
        result = run_cli([*args, *extra, f"run.output_dir={tmp_path / label}"])
        assert result.returncode == 0, result.stdout + result.stderr
        report = json.loads((tmp_path / label / "offload_report.json").read_text())
        assert report["problems"] == [], report["problems"]
        found[label] = report
    bf16, fp8 = (sum(g["offload_bytes_per_device"] for g in found[k]["groups"].values()) for k in ("bf16", "fp8"))
    layers = 2  # the tiny Llama's, both offloading mlpwi_0
    assert fp8 == bf16 // 2 + 4 * layers  # the e4m3 tensor and its float32 scale per layer
    assert found["fp8"]["cuda_pinned_host_placements"] == 2 * found["bf16"]["cuda_pinned_host_placements"]


@pytest.mark.parametrize("policy", [["remat.policy=save_all"], ["quant.fp8_storage=[mlpwi_0]", "remat.tensors.mlpwi_0=device"]],
                         ids=["save_all", "fp8_storage_saved"])
def test_fp8_values_a_policy_saves_come_back_whole(policy):
    """FP8 tensors a remat policy keeps (the GEMMs' e4m3 residuals under save_all; a quant.fp8_storage activation)
    give full remat's loss and gradients: jax.checkpoint passes a saved float tensor through reduce_precision, which
    made e4m3's top binade (the amax element's 448 among it) infinite, and the step's loss NaN (models/fp8.as_bytes
    saves the bytes instead)."""
    import jax
    import numpy as np
    import optax

    from MaxOffload import data

    def step(extra):
        cfg = load([*LLAMA, *SMALL, "quant.mode=fp8", "model.compute_dtype=float32", "data.source=synthetic",
                    *extra])
        setup = from_config.train_setup(cfg, jax.devices()[:1])
        state = setup.init_state()
        return jax.device_get(jax.jit(setup.gradients)(state["params"], state["model_state"],
                                                       setup.put_batch(data.build(cfg).train_batch(0))))

    full, kept = step(["quant.fp8_storage=[mlpwi_0]"] if "mlpwi_0" in policy[-1] else []), step(policy)
    assert np.isfinite(kept[0]) and kept[0] == pytest.approx(full[0], rel=1e-6)
    diff = jax.tree.map(lambda a, b: a.astype(np.float64) - b, kept[2], full[2])
    assert float(optax.tree.norm(diff)) < 1e-5 * float(optax.tree.norm(full[2]))


def fp8_audit(target, overrides, topology="1x1x1"):
    cfg = load([*overrides, *SMALL, "run.output_dir=/tmp/maxoffload-fp8-audit"])
    setup = from_config.train_setup(cfg, deviceless.compile_only_devices(target, topology))
    compiled = setup.compile_train_step()
    return audit.of_compiled(compiled, setup), compiled.as_text()


@pytest.mark.stack("py312")  # a deviceless GPU compile: the GPU stack's jax (mxfp8 there)
@pytest.mark.parametrize("target, mode, overrides, kernel, topology", [
    ("h200", "fp8", LLAMA, "__cublas$lt$matmul$f8", "1x1x1"),
    ("gb200", "fp8", [*DEEPSEEK, "model.capacity_factor=2.0"], "__cublas$lt$matmul$f8", "1x1x1"),
    ("h200", "fp8", DEEPSEEK, "__cublas$lt$matmul$f8", "1x1x1"),  # the grouped GEMM's FP8 Triton kernel on Hopper
    # FSDP over 8 GPUs: the weights' 64-wide contraction split 8 ways (8 a device), which jax's block-scaled dot
    # can neither partition in blocks of 32 nor all-reduce the e8m0 scales of on NCCL, unless the weight is
    # gathered first (models/matmul.weight)
    ("gb200", "mxfp8" if NEW_JAX else "fp8", [*DEEPSEEK, "mesh.ici.fsdp=8"],
     "__cudnn$blockScaledDot" if NEW_JAX else "__cublas$lt$matmul$f8", "1x2x4"),
], ids=["llama-h200-fp8", "deepseek-capacity-gb200-fp8", "deepseek-dropless-h200-fp8",
        "deepseek-dropless-fsdp8-gb200-mxfp8"])
def test_every_gemm_the_mode_covers_compiles_to_an_fp8_kernel(target, mode, overrides, kernel, topology):
    """The projections (MLA's six), the dense MLPs, the shared experts and the routed experts in the forward, both
    backward GEMMs and the recomputation: each an FP8 kernel (dropless routed experts: tokamax's grouped GEMM on
    FP8 operands, forward and rows' gradient), but for the dropless experts' weight gradient, named BF16 by
    design; bf16 compiles none."""
    report, text = fp8_audit(target, [*overrides, f"quant.mode={mode}"], topology)
    share = report["fp8"]
    assert share["asked"] >= 3 * 7 and share["fp8"] == share["asked"] and share["not_fp8"] == [], share
    assert share["fp8_flops"] == share["asked_flops"] > 0 and kernel in text
    capacity = "model.capacity_factor=2.0" in overrides
    dropless = overrides[:len(DEEPSEEK)] == DEEPSEEK and not capacity
    assert (share["bf16_by_design"] > 0) == dropless, share
    if dropless:  # per weight gradient (BF16): a forward, its recomputation and the rows' gradient, all FP8
        assert share["kernels"]["routed_experts"] == {"PallasTritonRaggedDot": 3 * share["bf16_by_design"]}, share
    elif overrides is not LLAMA:
        assert set(share["kernels"]["routed_experts"]) == {"cublas-fp8"}, share
    assert any(line.startswith(f"FP8 GEMMs: {share['fp8']} of {share['asked']} asked")
               for line in audit.format_audit(report))
    if overrides is LLAMA:
        plain, plain_text = fp8_audit(target, overrides)
        assert "fp8" not in plain and "$f8" not in plain_text and "blockScaledDot" not in plain_text


@pytest.mark.stack("py311", "py312")
@pytest.mark.parametrize("kernel", ["xla", "tokamax:xla"])
def test_the_dropless_fp8_grouped_gemm_and_its_gradients_stay_near_bf16(kernel):
    """models/fp8.ragged_dot_fp8 (rows scaled per row, weights per expert, e4m3; the backward ours) against
    jax.lax.ragged_dot in float32, with an empty group and rows past the groups: the product and both gradients
    within 8% (relative norm of the difference; e4m3 measures 3-4% here) and not exact (it did quantize), and
    the rows past the groups get zeros."""
    import jax
    import jax.numpy as jnp

    from MaxOffload.models import fp8

    rows, weights, cotangent = (jax.random.normal(k, shape) for k, shape in zip(
        jax.random.split(jax.random.key(0), 3), [(40, 64), (4, 64, 32), (40, 32)]))
    sizes = jnp.array([10, 5, 0, 17], jnp.int32)  # 32 of the 40 rows

    def product(matmul):
        return jax.vjp(lambda x, w: matmul(x, w, sizes), rows, weights)

    want, want_vjp = product(jax.lax.ragged_dot)
    got, got_vjp = product(lambda x, w, s: fp8.ragged_dot_fp8(kernel, x, w, s))
    pairs = [(got, want), *zip(got_vjp(cotangent), want_vjp(cotangent))]
    for a, b in pairs:
        assert 0 < float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 0.08
    assert float(jnp.abs(got[32:]).max()) == 0 and float(jnp.abs(got_vjp(cotangent)[0][32:]).max()) == 0


def test_the_trainers_mfu_counts_the_fp8_parts_against_the_fp8_peak(monkeypatch, tmp_path):
    """On a GB200 (its lookup faked: this machine has none) an fp8 run's MFU peak is the FLOP-weighted harmonic
    mean of the FP8 peak for the model FLOPs of the quantized parts and BF16's for the rest (the embedding, head
    and attention scores); a bf16 run's is BF16's."""
    from MaxOffload import hardware
    from MaxOffload.models import components
    from MaxOffload.train import flops, trainer

    gb200 = hardware.ACCELERATORS["gb200"]
    monkeypatch.setattr(trainer.hardware, "lookup", lambda kind: gb200)
    peaks = {}
    for mode in ("bf16", "fp8"):
        cfg = load([*LLAMA, *SMALL, f"quant.mode={mode}", f"run.output_dir={tmp_path / mode}"])
        peaks[mode] = trainer.peak_flops_per_device(cfg, from_config.train_setup(cfg))
    work = flops.by_component(from_config.train_setup(cfg).model_config, 1, 32)
    fp8 = sum(work[p] for p in (components.PROJECTIONS, components.MLP))
    assert 0 < fp8 < sum(work.values())
    assert peaks["bf16"] == gb200.bf16_peak_flops
    assert peaks["fp8"] == pytest.approx(sum(work.values()) / (
        (sum(work.values()) - fp8) / gb200.bf16_peak_flops + fp8 / (2 * gb200.bf16_peak_flops)), rel=1e-12)

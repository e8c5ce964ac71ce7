"""The configurations the TPU device check runs on the chip and the deviceless v5e compile predicts.

Llama-3.1-8B width (configs/llama3_1.py:8b, vocab 32,768, bf16 parameters and optimizer state, 2,048 tokens a row)
at two sizes that fill a v5e's 15.75 GiB, 4 layers x 4 rows (l4b4) and 2 layers x 8 rows (l2b8), under:
    remat        full remat                    offload   the five projections q/k/v and mlpwi_0/1 to host memory
    keep         the five kept in HBM          auto      remat.policy=auto, the planner's choice
    splash       full remat, splash attention  keep_splash  the five kept, splash attention (MaxText's "minimal")
    splash_context, keep_splash_context   as splash / keep_splash, and splash's residuals kept (no second forward kernel)
    minimal_splash_context  every projection kept (MaxText's "minimal": + out_proj, mlpwo) and splash's residuals
    save_all_splash  every named activation kept, splash attention
    ..._b512     the same in splash blocks of 512 (MaxText's) instead of 1,024
    (all with the whole logits, model.vocab_tiles=1, as measured before tiles existed)
    ..._unrolled  the layers a Python loop (model.scan_layers=false), not a scan
    ..._text, ..._documents  real text (data.source=text), attended across its packed documents or within each
    offload_tpu_overlap  offload under the xla.preset=tpu_overlap_offload flags
XLA's attention unless the name says splash (auto follows model.attention=auto: splash on TPUs). And DeepSeek small
at the chip's size (ds_xla; ds_auto, splash: configs/deepseek_v3.py:small widened to 2,048, 4 layers, 16 heads with MLA
q/k 96 and v 64, 16 routed experts of 1,408 top-4, full remat, 4 x 2,048 tokens). And v128k_b{4,8}_{whole,tiled}:
the loss from the whole logits or by vocabulary tiles at Llama 3's 128,256 tokens (2 layers, splash attention, 4 or 8
rows). ~80 s a train.py run on the v5e.

    python benchmarks/tpu/variants.py names          the variants, one a line
    python benchmarks/tpu/variants.py args NAME      its train.py arguments, one a line: the config, then overrides
"""
import sys

LLAMA, DEEPSEEK = "configs/llama3_1.py:8b", "configs/deepseek_v3.py:small"
STEPS = 8  # steps 2-8 are timed (the trainer's steady mean leaves the first out)
FIVE = ("query_proj", "key_proj", "value_proj", "mlpwi_0", "mlpwi_1")
SIZES = {"l4b4": {"model.num_layers": 4, "train.per_device_batch_size": 4},
         "l2b8": {"model.num_layers": 2, "train.per_device_batch_size": 8}}
POLICIES = {"remat": {"remat.policy": "full"},
            "offload": {"remat.policy": "full", **{f"remat.tensors.{n}": "offload" for n in FIVE}},
            "keep": {"remat.policy": "full", **{f"remat.tensors.{n}": "device" for n in FIVE}},
            # splash attention (issue 47): full remat and the five kept, with model.attention=auto (splash on TPUs)
            "splash": {"remat.policy": "full", "model.attention": "auto"},
            "keep_splash": {"remat.policy": "full", "model.attention": "auto",
                            **{f"remat.tensors.{n}": "device" for n in FIVE}},
            # + splash's residuals kept (remat.tensors.context=device): no second forward kernel in the backward
            "splash_context": {"remat.policy": "full", "model.attention": "auto", "remat.tensors.context": "device"},
            "keep_splash_context": {"remat.policy": "full", "model.attention": "auto", "remat.tensors.context": "device",
                                    **{f"remat.tensors.{n}": "device" for n in FIVE}},
            # splash in blocks of 512 (MaxText's default) instead of the 1,024 chosen from the kernel table
            "splash_context_b512": {"remat.policy": "full", "model.attention": "auto", "model.attention_block": 512,
                                    "remat.tensors.context": "device"},
            "keep_splash_context_b512": {"remat.policy": "full", "model.attention": "auto", "model.attention_block": 512,
                                         "remat.tensors.context": "device",
                                         **{f"remat.tensors.{n}": "device" for n in FIVE}},
            "offload_tpu_overlap": {"remat.policy": "full", "xla.preset": "tpu_overlap_offload",
                                    **{f"remat.tensors.{n}": "offload" for n in FIVE}},
            # MaxText's "minimal" (every projection kept: q/k/v, out_proj, mlpwi_0/1, mlpwo) + splash's residuals, and
            # everything kept (remat.policy=save_all): what keeping more than the five buys on the chip
            "minimal_splash_context": {"remat.policy": "minimal_with_context", "model.attention": "auto"},
            "save_all_splash": {"remat.policy": "save_all", "model.attention": "auto"},
            "auto": {"remat.policy": "auto", "model.attention": "auto"}}
# model.attention=xla: the runs of 2026-12-05 used XLA's attention (then `auto` on TPUs); splash is measured apart
# model.vocab_tiles=1: the whole logits, as measured before the tiled cross-entropy (issue 44) existed
COMMON = {"model.vocab_size": 32768, "model.vocab_tiles": 1, "model.param_dtype": "bfloat16", "model.attention": "xla",
          "train.seq_len": 2048,
          "train.steps": STEPS, "train.warmup_steps": 2, "train.eval_every": 0, "train.eval_batches": 1,
          "run.log_every": 1, "data.source": "synthetic", "checkpoint.enabled": False}
# DeepSeek small widened to the MLA and MoE shapes of issue 47's kernel tables
DEEPSEEK_SMALL = {"model.emb_dim": 2048, "model.num_layers": 4, "model.first_k_dense": 1, "model.mlp_dim": 5632,
                  "model.num_heads": 16, "model.q_lora_rank": 512, "model.kv_lora_rank": 256,
                  "model.qk_nope_head_dim": 64, "model.qk_rope_head_dim": 32, "model.v_head_dim": 64,
                  "model.num_experts": 16, "model.num_experts_per_tok": 4, "model.moe_mlp_dim": 1408,
                  "model.rope_original_max_len": 2048, "train.per_device_batch_size": 4, "remat.policy": "full"}
# fixed policies first, the planner's last (its compiles on the chip cost the most)
ORDER = [(size, policy) for size in SIZES for policy in POLICIES if policy != "auto"] + [(size, "auto") for size in SIZES]
VARIANTS = {f"{size}_{policy}": (LLAMA, {**COMMON, **SIZES[size], **POLICIES[policy]}) for size, policy in ORDER}
VARIANTS.update({f"ds_{attention}": (DEEPSEEK, {**COMMON, **DEEPSEEK_SMALL, "model.attention": attention})
                 for attention in ("xla", "auto")})
# the cross-entropy by vocabulary tiles (model.vocab_tiles, issue 44) against the whole logits at Llama 3's own 128,256
# tokens, 2 layers, splash attention, full remat, 4 and 8 rows (benchmarks/cross_entropy.py predicts them deviceless)
VARIANTS.update({f"v128k_b{rows}_{loss}": (LLAMA, {**COMMON, "model.vocab_size": 128256, "model.vocab_tiles": tiles,
                                                   "model.attention": "auto", "model.num_layers": 2,
                                                   "train.per_device_batch_size": rows, "remat.policy": "full"})
                 for rows in (4, 8) for loss, tiles in (("whole", 1), ("tiled", 0))})
# (2026-12-05's device check ran remat, offload, keep and auto with XLA's attention)
# rows of packed documents kept apart (data.attend_within_documents: splash's segment ids) against the same real text
# (the bundled Python documentation, byte tokens) attended across documents, for Llama and DeepSeek small
TEXT = {"data.source": "text"}
for within in (False, True):
    suffix = "_documents" if within else "_text"
    VARIANTS[f"l4b4_keep_splash_context{suffix}"] = (LLAMA, {**COMMON, **SIZES["l4b4"], **POLICIES["keep_splash_context"],
                                                            **TEXT, "data.attend_within_documents": within})
    VARIANTS[f"ds_auto{suffix}"] = (DEEPSEEK, {**COMMON, **DEEPSEEK_SMALL, "model.attention": "auto", **TEXT,
                                               "data.attend_within_documents": within})
# the layers as a Python loop (model.scan_layers=false) instead of a scan: the forward's kept outputs are then buffers of
# their own, not written into the scan's stacked buffer by the GEMM's fusion (issue 47: 165 against 190 TFLOP/s)
VARIANTS.update({f"l4b4_{policy}_unrolled": (LLAMA, {**COMMON, **SIZES["l4b4"], **POLICIES[policy],
                                                     "model.scan_layers": False})
                 for policy in ("splash_context", "keep_splash_context", "minimal_splash_context", "auto")})


def arguments(name):
    """train.py's arguments for variant `name`: the config, then its overrides."""
    config, overrides = VARIANTS[name]
    return [config, *(f"{key}={value}" for key, value in overrides.items())]


def main(argv):
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    if argv == ["names"]:
        print("\n".join(VARIANTS))
        return 0
    if len(argv) == 2 and argv[0] == "args" and argv[1] in VARIANTS:
        print("\n".join(arguments(argv[1])))
        return 0
    print(f"error: give `names` or `args NAME` (NAME one of {', '.join(VARIANTS)}), got {' '.join(argv) or 'nothing'}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

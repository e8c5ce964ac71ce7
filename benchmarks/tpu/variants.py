"""The configurations the TPU device check runs on the chip and the deviceless v5e compile predicts: two sizes that
fill a v5e's 15.75 GiB (Llama-3.1-8B width, vocab 32,768, bf16 parameters and optimizer state, 2,048 tokens a
row: 4 layers x 4 rows, and 2 layers x 8 rows) x six policies (full remat; the five projections q/k/v and
mlpwi_0/1 offloaded to host memory; the same kept in HBM; full remat and keep with splash attention;
remat.policy=auto, the planner's choice). XLA's attention unless the policy says splash. Twelve train.py runs of
~80 s each: two device calls (device_check.sh skips what its budget leaves out).

    python benchmarks/tpu/variants.py names          the variants, one a line
    python benchmarks/tpu/variants.py args NAME      its overrides of configs/llama3_1.py:8b, one a line
"""
import sys

CONFIG = "configs/llama3_1.py:8b"
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
            "auto": {"remat.policy": "auto"}}
# model.attention=xla: the runs of 2026-12-05 used XLA's attention (then `auto` on TPUs); splash is measured apart
COMMON = {"model.vocab_size": 32768, "model.param_dtype": "bfloat16", "model.attention": "xla", "train.seq_len": 2048,
          "train.steps": STEPS, "train.warmup_steps": 2, "train.eval_every": 0, "train.eval_batches": 1,
          "run.log_every": 1, "data.source": "synthetic", "checkpoint.enabled": False}
# fixed policies first, the planner's last (its compiles on the chip cost the most)
ORDER = [(size, policy) for size in SIZES for policy in POLICIES if policy != "auto"] + [(size, "auto") for size in SIZES]
VARIANTS = {f"{size}_{policy}": {**COMMON, **SIZES[size], **POLICIES[policy]} for size, policy in ORDER}
# (2026-12-05's device check ran remat, offload, keep and auto: the splash rows are for the next chip session)


def overrides(name):
    return [f"{key}={value}" for key, value in VARIANTS[name].items()]


def main(argv):
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    if argv == ["names"]:
        print("\n".join(VARIANTS))
        return 0
    if len(argv) == 2 and argv[0] == "args" and argv[1] in VARIANTS:
        print("\n".join(overrides(argv[1])))
        return 0
    print(f"error: give `names` or `args NAME` (NAME one of {', '.join(VARIANTS)}), got {' '.join(argv) or 'nothing'}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""DeepSeek-V3: configs/deepseek_v3.py:671b (also :tiny, :small for CPU).

671b has the published dimensions (61 layers, the first 3 dense; 256 routed experts top-8 in 8
groups of which 4 may be used, + 1 shared expert; MLA with q/kv latents 1536/512; YaRN x40)
and DeepSeek-V3's training recipe's multi-token prediction (model.mtp_depth=1, the layer group
"mtp", lambda = model.mtp_loss_weight = 0.3): 671.0B parameters in the main model, 682.6B with
the MTP block (684.5B as released, whose MTP layer also stores a copy of the shared embedding and
output head: the published 685B). model.mtp_depth=0 is the main model alone. The big size is for
GPUs (and for `run.dry_run=true` / the deviceless compile anywhere).
"""
from MaxOffload.config.defaults import get_config as defaults
from MaxOffload.models.deepseek import PRESETS

SIZES = {"671b": "deepseek_v3_671b", "tiny": "tiny", "small": "small"}


def get_config(size="671b"):
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    cfg = defaults()
    cfg.run.output_dir = f"runs/deepseek_v3_{size}"
    cfg.model.update(PRESETS[SIZES[size]])
    if size == "671b":
        cfg.train.seq_len = 4096
        cfg.train.per_device_batch_size = 1
        cfg.train.learning_rate = 2.2e-4
        cfg.train.warmup_steps = 2000
        cfg.train.steps = 100_000
        cfg.data.source = "synthetic"
    else:
        cfg.train.seq_len = 128
        cfg.train.learning_rate = 3e-3
        cfg.train.warmup_steps = 5
    return cfg

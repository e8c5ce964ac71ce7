"""AdamW with linear warmup + cosine decay, global-norm clipping and a weight-decay mask."""
import jax
import optax

# Parameter names (last path element) that are never decayed: norm scales and biases.
_NO_DECAY = ("scale", "bias")
_EMBEDDINGS = ("embed", "unembed")


def schedule(train_cfg):
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=train_cfg.learning_rate, warmup_steps=train_cfg.warmup_steps,
        decay_steps=train_cfg.steps, end_value=train_cfg.learning_rate * train_cfg.final_lr_ratio)


def decay_mask(params, decay_embeddings):
    """True for parameters that get weight decay."""

    def decays(path, _):
        name = str(getattr(path[-1], "key", path[-1]))
        if name in _NO_DECAY:
            return False
        return decay_embeddings or name not in _EMBEDDINGS

    return jax.tree_util.tree_map_with_path(decays, params)


def build(train_cfg):
    chain = []
    if train_cfg.grad_clip_norm > 0:
        chain.append(optax.clip_by_global_norm(train_cfg.grad_clip_norm))
    chain.append(optax.adamw(
        schedule(train_cfg), b1=train_cfg.adam_b1, b2=train_cfg.adam_b2, eps=train_cfg.adam_eps,
        weight_decay=train_cfg.weight_decay, mask=lambda p: decay_mask(p, train_cfg.decay_embeddings)))
    return optax.chain(*chain)

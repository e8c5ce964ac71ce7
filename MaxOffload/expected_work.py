"""What each part of a compiled step computes by construction, as a multiple of its model FLOPs (train/flops.py):
the compiled-work audit's expectation (audit.py, which warns where a part takes more than TOLERANCE x its
multiple, recomputation aside). Read off the model's structure, never run: the attention kernel and its
sequence length (the xla path's query blocks, flash's and splash's causal blocks, a context split), a MoE's
capacity or row buffer, DeepSeek's MLA latent made into keys and values on every context shard."""
from MaxOffload.models import components, cross_entropy, kernels
from MaxOffload.models.attention.plain import BLOCK, query_blocks
from MaxOffload.parallel.layout import NONE


def xla_work_multiple(length, block=BLOCK):
    """The xla path's score FLOPs as a multiple of the causal half the model counts (train/flops.py): each
    block computes rows x visible keys, 2x for one block, (n + 1) / n for n equal blocks."""
    return sum((stop - start) * stop for start, stop in query_blocks(length, block)) / (length * length / 2)


def attention_work_multiple(kernel, length, qk_dim, v_dim, block=BLOCK, layout=NONE):
    """The multiple of the model's attention FLOPs (the causal half: train/flops.py) the compiled step's
    attention takes by construction under `kernel` (models/kernels.attention_for): the xla path's blocks
    (xla_work_multiple), or over a context split gathering keys (models/attention/all_gather.context_attention)
    every query x every key: 2; flash's (T + 1) / T pairs per query, and its VJP's recomputed QK^T (audit.py
    _attention_flops: (8 d + 6 dv) / (6 (d + dv))); flash over C context shards gathering keys
    (all_gather.context_flash_attention), as the audit counts its kernels from their shapes: each chunk of c
    queries c (c + 1) / 2 pairs with its own keys and c^2 with each earlier block of c keys: load-balanced exactly
    the causal half's (T + 1) / T; in sequence order every shard computes the last shard's C - 1 blocks,
    (c + 1) / T + 2 - 2 / C."""
    if kernel == "xla":
        if layout.gathers_context:
            return 2.0
        return xla_work_multiple(length, block)
    per_pair = (8 * qk_dim + 6 * v_dim) / (6 * (qk_dim + v_dim))
    if kernels.is_splash(kernel):  # whole blocks on and below the diagonal (audit.tpu_splash_flops); over context
        #                             shards, of each shard's chunks of rows (splash.context_splash_attention)
        piece = length // layout.context_ways // (2 if layout.token_order(length) is not None else 1)
        return (length + (kernels.splash_block(piece, kernel) or length)) / length * per_pair
    if layout.gathers_context and layout.token_order(length) is None:
        ways = layout.context_ways
        return ((length // ways + 1) / length + 2 - 2 / ways) * per_pair
    return (length + 1) / length * per_pair


def config_multiples(config, layout=None):
    """{models/components part: x} a model configuration's parts compute by construction under a parallel layout
    (1 where absent). Capacity mode computes every expert's `capacity` rows, filled or not: ~capacity_factor x the
    routed experts' model FLOPs (which count each token's top-k choices once); a dropless buffer's rows are the
    kernel's shapes, which the audit counts: ~moe_buffer_factor x. A context shard gathering what makes the keys
    and values (DeepSeek's MLA latent: the config's context_gathered_params, the up-projections wk_b, wv_b) makes
    the keys and values of about the whole sequence (C + 1/2 of its shard's tokens load-balanced: its own two chunks
    and 2C - 1 blocks) in the forward pass and again in the backward's three GEMMs (the keys, the latent's and the
    weights' gradients): those weights at 4 (C + 1/2) / 3 their model FLOPs, the rest of the projections at 1. The
    loss by vocabulary tiles (model.vocab_tiles, models/cross_entropy.py) makes each tile's logits again in the
    backward pass: the output head at 4 / 3."""
    factor = getattr(config, "capacity_factor", 0) or getattr(config, "moe_buffer_factor", 0)
    multiples = {components.EXPERTS: factor} if factor else {}
    if cross_entropy.tiles_under(config, layout or NONE)[0] > 1:
        multiples[components.UNEMBED] = 4 / 3
    gathered = config.context_gathered_params() if hasattr(config, "context_gathered_params") else 0
    if layout is not None and layout.gathers_context and gathered:
        ways = layout.context_ways + (0.5 if layout.load_balance else 0)
        share = gathered / config.matmul_params_by_component()[components.PROJECTIONS]
        multiples[components.PROJECTIONS] = 1 + share * (4 * ways / 3 - 1)
    return multiples


def work_multiples(setup):
    """{component: x} a TrainSetup's step takes by construction: its model configuration's (config_multiples), and
    its attention kernel's at its sequence length (attention_work_multiple)."""
    c = setup.model_config
    multiples = config_multiples(c, setup.layout)
    if hasattr(c, "attention") and hasattr(c, "attention_dims"):
        _, _, qk_dim, v_dim = c.attention_dims()
        multiples[components.ATTENTION_SCORES] = attention_work_multiple(c.attention, setup.seq_len, qk_dim, v_dim,
                                                                         layout=setup.layout)
    return multiples

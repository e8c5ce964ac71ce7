"""Model correctness: RoPE, causal GQA attention, scan/remat equivalence, tagged names,
the FLOP formula and the published parameter counts. Every check is against an
independent reference written here (numpy / hand arithmetic), never against the code itself."""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxOffload import from_config
from MaxOffload import models
from MaxOffload.config import get_config
from MaxOffload.models import llama
from MaxOffload.models.attention.plain import causal_attention
from MaxOffload.models.rope import apply_rope, rope_inv_freq
from MaxOffload.offload.names import VOCABULARY
from MaxOffload.train.flops import train_flops_per_step


# --------------------------------------------------------------------------------------------
# helpers


def tiny_cfg(**model_overrides):
    cfg = get_config()
    cfg.model.update(llama.PRESETS["tiny"])
    cfg.model.compute_dtype = "float32"
    cfg.model.param_dtype = "float32"
    cfg.model.update(model_overrides)
    return cfg


def tokens_for(cfg, batch=2, length=8, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.model.vocab_size, (batch, length)), jnp.int32)


def forward(model, tokens):
    """Jitted forward pass (eager op-by-op execution is slow on CPU)."""
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)


def n_params(tree):
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


# --------------------------------------------------------------------------------------------
# 1. RoPE


def ref_inv_freq_llama3(head_dim, theta, factor, low, high, orig):
    """Llama 3.1 frequency scaling, written element by element from the definition."""
    out, regimes = [], []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(freq)
            regimes.append("high")
        elif wavelen > orig / low:
            out.append(freq / factor)
            regimes.append("low")
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
            regimes.append("mid")
    return np.array(out), regimes


def test_rope_inv_freq_none():
    ref = np.array([1.0 / 500000.0 ** (i / 128) for i in range(0, 128, 2)])
    got = np.asarray(rope_inv_freq(128, 500000.0, "none"))
    assert got.shape == (64,)
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_rope_inv_freq_llama3():
    ref, regimes = ref_inv_freq_llama3(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    # all three regimes occur for Llama 3.1's settings
    assert {"high", "mid", "low"} <= set(regimes), regimes
    got = np.asarray(rope_inv_freq(128, 500000.0, "llama3", factor=8.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_len=8192))
    assert got.shape == (64,)
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    # and it really scales something: low frequencies divided by 8
    unscaled = np.array([1.0 / 500000.0 ** (i / 128) for i in range(0, 128, 2)])
    low = np.array([r == "low" for r in regimes])
    np.testing.assert_allclose(got[low], unscaled[low] / 8.0, rtol=1e-6)


def test_rope_inv_freq_rejects_unknown_scaling():
    with pytest.raises(ValueError):
        rope_inv_freq(16, 10000.0, "yarn")


def ref_rope(x, positions, inv_freq):
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    angles = np.asarray(positions, np.float64)[:, :, None] * np.asarray(inv_freq, np.float64)[None, None, :]
    cos, sin = np.cos(angles)[:, :, None, :], np.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def test_apply_rope_matches_numpy_rotate_half():
    rng = np.random.default_rng(0)
    b, l, h, d = 2, 7, 3, 16
    x = rng.standard_normal((b, l, h, d)).astype(np.float32)
    positions = np.stack([np.arange(l), np.arange(l) + 11]).astype(np.int32)
    inv_freq = rope_inv_freq(d, 10000.0)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), jnp.asarray(inv_freq)))
    np.testing.assert_allclose(got, ref_rope(x, positions, inv_freq), rtol=1e-5, atol=1e-5)
    # a rotation preserves the norm of every head vector
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    # position 0 is the identity
    np.testing.assert_allclose(got[0, 0], x[0, 0], rtol=1e-6, atol=1e-6)


def test_apply_rope_in_bfloat16_rotates_in_bfloat16_as_transformers_does():
    """bf16 in, bf16 out, the rotation in bf16 with cos and sin cast to bf16 (transformers' apply_rotary_pos_emb):
    equal to the numpy reference of exactly that, and within bf16 rounding of the float32 rotation."""
    rng = np.random.default_rng(2)
    b, l, h, d = 2, 64, 3, 16
    x = jnp.asarray(rng.standard_normal((b, l, h, d)), jnp.bfloat16)
    positions = np.stack([np.arange(l), np.arange(l) + 1000]).astype(np.int32)
    inv_freq = rope_inv_freq(d, 500000.0)
    got = apply_rope(x, jnp.asarray(positions), jnp.asarray(inv_freq))
    assert got.dtype == jnp.bfloat16
    angles = positions[:, :, None].astype(np.float32) * inv_freq[None, None, :]
    cos, sin = (jnp.asarray(f(angles)[:, :, None, :], jnp.bfloat16) for f in (np.cos, np.sin))
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    expected = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)  # each op rounded to bf16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))
    exact = ref_rope(np.asarray(x, np.float32), positions, inv_freq)
    np.testing.assert_allclose(np.asarray(got, np.float32), exact, atol=0.05)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_swiglu_gate_gradient_is_autodiff_s_written_out_once(dtype):
    """layers.gated_silu (silu(gate) * up with its own backward): its gradients equal float32 autodiff of the same
    function (to float32 rounding; in bfloat16, the float32 gradients rounded once, where autodiff in bfloat16 rounds
    every step), and the backward hands them over through an optimization barrier, so XLA writes them once instead
    of recomputing the sigmoid inside every GEMM that reads them (the v5e step: 0.362 -> 0.351 s, docs/tpu.md)."""
    from MaxOffload.models.layers import gated_silu

    rng = np.random.default_rng(3)
    gate, up, cotangent = (jnp.asarray(rng.standard_normal((16, 64)) * scale, dtype) for scale in (4.0, 1.0, 1.0))
    loss = lambda f: lambda g, u: (f(g, u).astype(jnp.float32) * cotangent.astype(jnp.float32)).sum()  # noqa: E731
    got = jax.grad(loss(gated_silu), (0, 1))(gate, up)
    as_f32 = lambda g, u: jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)  # noqa: E731
    reference = jax.grad(loss(as_f32), (0, 1))(gate, up)
    for g, r in zip(got, reference):
        assert g.dtype == jnp.dtype(dtype)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r.astype(dtype), np.float32), rtol=1e-6,
                                   atol=1e-6)
    np.testing.assert_array_equal(gated_silu(gate, up), jax.nn.silu(gate) * up)  # the forward is the plain one
    backward = str(jax.make_jaxpr(jax.grad(loss(gated_silu), (0, 1)))(gate, up))
    assert "optimization_barrier" in backward


def test_apply_rope_dot_product_depends_only_on_relative_position():
    rng = np.random.default_rng(1)
    d = 32
    q = jnp.asarray(rng.standard_normal((1, 1, 1, d)).astype(np.float32))
    k = jnp.asarray(rng.standard_normal((1, 1, 1, d)).astype(np.float32))
    inv_freq = jnp.asarray(rope_inv_freq(d, 10000.0))

    def dot(m, n):
        qr = apply_rope(q, jnp.array([[m]], jnp.int32), inv_freq)
        kr = apply_rope(k, jnp.array([[n]], jnp.int32), inv_freq)
        return float(jnp.sum(qr * kr))

    base = dot(5, 2)
    for shift in (1, 17, 100):
        assert dot(5 + shift, 2 + shift) == pytest.approx(base, rel=1e-4, abs=1e-4)
    # and it does depend on the relative position
    assert abs(dot(5, 2) - dot(9, 2)) > 1e-3


# --------------------------------------------------------------------------------------------
# 2-3. causal grouped-query attention


def ref_attention(q, k, v):
    """Plain multi-head causal attention with k/v repeated per group (float64)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, l, h, d = q.shape
    group = h // k.shape[2]
    k = np.repeat(k, group, axis=2)  # query head i uses kv head i // group
    v = np.repeat(v, group, axis=2)
    scores = np.einsum("blhd,bshd->bhls", q, k) / np.sqrt(d)
    mask = np.tril(np.ones((l, l), bool))
    scores = np.where(mask, scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhls,bshd->blhd", p, v)


def qkv(seed, b=2, l=6, heads=6, kv_heads=2, d=8):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, l, heads, d)).astype(np.float32),
            rng.standard_normal((b, l, kv_heads, d)).astype(np.float32),
            rng.standard_normal((b, l, kv_heads, d)).astype(np.float32))


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (4, 1), (8, 4)])
def test_gqa_matches_numpy_reference(heads, kv_heads):
    q, k, v = qkv(0, heads=heads, kv_heads=kv_heads)
    got = np.asarray(causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)))
    assert got.shape == q.shape
    np.testing.assert_allclose(got, ref_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_causal_mask():
    q, k, v = qkv(1)
    l = q.shape[1]
    base = np.asarray(causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)))
    rng = np.random.default_rng(2)
    for t in range(l):
        # changing keys/values (and queries) after t leaves positions <= t unchanged
        k2, v2, q2 = k.copy(), v.copy(), q.copy()
        k2[:, t + 1:] += 10 * rng.standard_normal(k2[:, t + 1:].shape).astype(np.float32)
        v2[:, t + 1:] += 10 * rng.standard_normal(v2[:, t + 1:].shape).astype(np.float32)
        q2[:, t + 1:] += 10 * rng.standard_normal(q2[:, t + 1:].shape).astype(np.float32)
        out = np.asarray(causal_attention(jnp.asarray(q2), jnp.asarray(k2), jnp.asarray(v2)))
        np.testing.assert_allclose(out[:, :t + 1], base[:, :t + 1], rtol=1e-6, atol=1e-6)
        if t + 1 < l:
            assert not np.allclose(out[:, t + 1:], base[:, t + 1:], atol=1e-3)
    # changing an earlier key or value changes later outputs
    for t in range(1, l):
        k2, v2 = k.copy(), v.copy()
        k2[:, t - 1] += 3.0
        out_k = np.asarray(causal_attention(jnp.asarray(q), jnp.asarray(k2), jnp.asarray(v)))
        assert np.abs(out_k[:, t] - base[:, t]).max() > 1e-3
        v2[:, t - 1] += 3.0
        out_v = np.asarray(causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v2)))
        assert np.abs(out_v[:, t] - base[:, t]).max() > 1e-3


# --------------------------------------------------------------------------------------------
# 4. scanned vs unscanned, remat policies


def build_with(cfg, params=None):
    model = from_config.model(cfg)
    if params is not None:
        nnx.update(model, params)
    return model


def test_scanned_and_unscanned_give_same_logits():
    cfg_scan = tiny_cfg(scan_layers=True)
    cfg_loop = tiny_cfg(scan_layers=False)
    cfg_loop.run.seed = 123  # different init, then overwritten with the scanned model's params
    m_scan = build_with(cfg_scan)
    params = nnx.state(m_scan, nnx.Param)
    m_loop = build_with(cfg_loop, params)
    tokens = tokens_for(cfg_scan)
    a = np.asarray(forward(m_scan, tokens))
    b = np.asarray(forward(m_loop, tokens))
    assert a.shape == (2, 8, cfg_scan.model.vocab_size)
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # the layers really differ from each other (a bug applying layer 0 twice would show)
    assert a.std() > 0


def test_unscanned_loop_uses_every_layer():
    """Zeroing layer 1's output projections must change the logits for both scan modes."""
    for scan in (True, False):
        cfg = tiny_cfg(scan_layers=scan)
        model = build_with(cfg)
        tokens = tokens_for(cfg)
        before = np.asarray(forward(model, tokens))
        model.layers.mlp.wo[...] = model.layers.mlp.wo[...].at[1].set(0.0)
        model.layers.attention.wo[...] = model.layers.attention.wo[...].at[1].set(0.0)
        after = np.asarray(forward(model, tokens))
        assert np.abs(after - before).max() > 1e-6, f"scan={scan}: layer 1 ignored"


def loss_and_grads(cfg, params, tokens, weights):
    graphdef, _ = nnx.split(from_config.model(cfg))

    def loss(p):
        return jnp.sum(nnx.merge(graphdef, p)(tokens) * weights)

    logits = jax.jit(lambda p: nnx.merge(graphdef, p)(tokens))(params)
    return logits, jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("scan", [True, False])
def test_remat_policies_do_not_change_logits_or_gradients(scan):
    base_cfg = tiny_cfg(scan_layers=scan)
    _, params = nnx.split(from_config.model(base_cfg))
    tokens = tokens_for(base_cfg)
    weights = jnp.asarray(np.random.default_rng(3).standard_normal((2, 8, base_cfg.model.vocab_size)), jnp.float32)
    results = {}
    for pol in ("full", "save_all", "minimal"):
        cfg = tiny_cfg(scan_layers=scan)
        cfg.remat.policy = pol
        results[pol] = loss_and_grads(cfg, params, tokens, weights)
    ref_logits, (ref_loss, ref_grads) = results["full"]
    assert n_params(ref_grads) == n_params(params)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(ref_grads)) > 0
    for pol in ("save_all", "minimal"):
        logits, (loss, grads) = results[pol]
        np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-6, atol=1e-6)
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5, abs=1e-5)
        jax.tree.map(assert_grads_close, grads, ref_grads)


def assert_grads_close(a, b, rtol=1e-5):
    """Elementwise rtol, with an absolute floor of ~8 float32 ulps of the leaf's largest gradient: an element of a
    leaf whose entries reach 160 (the embedding's, summed over tokens) cannot be resolved below ulp(160) = 1.5e-5
    when recomputing reorders its sums (jax 0.12's XLA:CPU: 2.3e-5 at 1.5e-7 relative in norm)."""
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6 * max(1.0, float(np.abs(b).max())))


def test_gradients_match_between_scanned_and_unscanned():
    tokens = tokens_for(tiny_cfg())
    cfg_s, cfg_l = tiny_cfg(scan_layers=True), tiny_cfg(scan_layers=False)
    _, params = nnx.split(from_config.model(cfg_s))
    weights = jnp.asarray(np.random.default_rng(4).standard_normal((2, 8, cfg_s.model.vocab_size)), jnp.float32)
    _, (ls, gs) = loss_and_grads(cfg_s, params, tokens, weights)
    _, (ll, gl) = loss_and_grads(cfg_l, params, tokens, weights)
    assert float(ls) == pytest.approx(float(ll), rel=1e-5, abs=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6), gs, gl)


# --------------------------------------------------------------------------------------------
# 5. tagged checkpoint names


def _sub_jaxprs(value):
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _sub_jaxprs(v)


def checkpoint_names(jaxpr):
    """Every `name` primitive's name in jaxpr, recursively through scan/remat/pjit/... bodies."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name":
            found.add(eqn.params["name"])
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                found |= checkpoint_names(sub)
    return found


# What a Llama decoder layer tags, in forward order (the family's list is read off its trace: models.tagged_names).
TAGGED_NAMES = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "attention_out", "out_proj",
                "mlpwi_0", "mlpwi_1", "mlpwo")


def test_tagged_names_are_in_vocabulary():
    traced = models.FAMILIES["llama"].tagged_names(models.model_config(tiny_cfg().model))
    assert traced == TAGGED_NAMES
    assert len(set(traced)) == len(traced)
    for name in traced:
        assert name in VOCABULARY, name


def test_walker_finds_names_inside_scan_and_checkpoint():
    """The jaxpr walker itself can find a name nested in scan(checkpoint(...))."""
    from jax.ad_checkpoint import checkpoint_name

    f = lambda x: jax.lax.scan(jax.checkpoint(lambda c, _: (checkpoint_name(c * 2, "mlpwo"), None)),
                               x, None, length=2)[0]
    assert checkpoint_names(jax.make_jaxpr(f)(1.0).jaxpr) == {"mlpwo"}


@pytest.mark.parametrize("scan,policy", [(True, "full"), (False, "full"), (True, "minimal")])
def test_forward_pass_tags_exactly_the_declared_names(scan, policy):
    cfg = tiny_cfg(scan_layers=scan)
    cfg.remat.policy = policy
    graphdef, params = nnx.split(from_config.model(cfg))
    tokens = tokens_for(cfg)
    jaxpr = jax.make_jaxpr(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens)
    found = checkpoint_names(jaxpr.jaxpr)
    # every declared name appears, and no other vocabulary name does
    assert set(TAGGED_NAMES) <= found, set(TAGGED_NAMES) - found
    assert found & set(VOCABULARY) == set(TAGGED_NAMES), (found & set(VOCABULARY)) - set(TAGGED_NAMES)
    assert found <= set(VOCABULARY), found - set(VOCABULARY)
    # and the textual form agrees
    text = str(jaxpr)
    for name in TAGGED_NAMES:
        assert f"name={name}" in text, name


# --------------------------------------------------------------------------------------------
# 6. FLOP formula


def small_flops_config():
    return llama.LlamaConfig(vocab_size=100, emb_dim=8, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
                             mlp_dim=16)


def test_train_flops_by_hand():
    c = small_flops_config()
    batch, seq = 3, 5
    # multiply-adds per token, per weight matrix
    q = 8 * (4 * 4)       # emb x (heads * head_dim)     = 128
    k = 8 * (2 * 4)       # emb x (kv_heads * head_dim)  = 64
    v = 8 * (2 * 4)       #                              = 64
    o = (4 * 4) * 8       # (heads * head_dim) x emb     = 128
    wi_0 = 8 * 16         # emb x mlp                    = 128
    wi_1 = 8 * 16         #                              = 128
    wo = 16 * 8           # mlp x emb                    = 128
    per_layer = q + k + v + o + wi_0 + wi_1 + wo  # 768
    unembed = 8 * 100     # 800
    macs_per_token = 2 * per_layer + unembed      # 2336
    assert macs_per_token == 2336
    tokens = batch * seq  # 15
    dense = 2 * 3 * tokens * macs_per_token       # x2 FLOPs per MAC, x3 for fwd + bwd
    # causal attention: QK^T and PV, half the score matrix
    attention = 6 * tokens * 2 * seq * 4 * (4 + 4) / 2
    expected = dense + attention
    assert expected == 210240 + 14400
    assert c.matmul_params_per_token() == macs_per_token
    assert train_flops_per_step(c, batch, seq) == pytest.approx(expected, rel=1e-12)


def test_matmul_params_match_built_model():
    cfg = get_config()
    cfg.model.update(dict(vocab_size=100, emb_dim=8, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
                          mlp_dim=16))
    model = nnx.eval_shape(lambda: from_config.model(cfg))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    total = n_params(params)
    embedding = math.prod(params["embed"].shape)
    norms = n_params(params["final_norm"]) + n_params(params["layers"]["attention_norm"]) + \
        n_params(params["layers"]["mlp_norm"])
    assert embedding == 100 * 8
    assert norms == 8 + 2 * 8 + 2 * 8
    assert models.model_config(cfg.model).matmul_params_per_token() == total - embedding - norms


# --------------------------------------------------------------------------------------------
# 7. published sizes


@pytest.mark.parametrize("size,published", [("8b", 8.03e9), ("70b", 70.6e9), ("405b", 405.9e9)])
def test_published_param_counts(size, published):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "llama3_1_cfg", os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "llama3_1.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config(size)
    model = nnx.eval_shape(lambda: from_config.model(cfg))
    total = n_params(nnx.state(model, nnx.Param))
    assert total == pytest.approx(published, rel=0.01)


def test_dry_run_405b(cli, tmp_path):
    import time

    started = time.perf_counter()
    result = cli(["train.py", "configs/llama3_1.py:405b", "run.dry_run=true", f"run.output_dir={tmp_path}"],
                 timeout=120)
    elapsed = time.perf_counter() - started
    assert result.returncode == 0, result.stdout + result.stderr
    assert elapsed < 30, f"dry run took {elapsed:.1f} s"
    summary = json.loads((tmp_path / "dry_run.json").read_text())["summary"]
    params = summary["params_total"]
    assert params == pytest.approx(405.9e9, rel=0.01)
    # fp32 params + Adam mu and nu = 12 bytes per parameter on the single CPU device
    assert summary["state_bytes_per_device"] > 0
    assert summary["state_bytes_per_device"] == pytest.approx(12 * params, rel=0.02)


def _full_attention(q, k, v, scale):
    """The whole causal square, k/v repeated per query head: the plain definition the kernels are held to."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("blhd,bshd->bhls", q, k) * scale
    scores = jnp.where(jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool)), scores, -jnp.inf)
    return jnp.einsum("bhls,bshd->blhd", jax.nn.softmax(scores, axis=-1), v)


@pytest.mark.parametrize("heads,kv_heads,qk_dim,v_dim,length", [(4, 2, 8, 8, 64), (4, 2, 8, 8, 50), (4, 4, 12, 8, 37)],
                         ids=["gqa_blocks", "gqa_ragged_last_block", "mla_dims_ragged"])
def test_both_attention_paths_equal_the_full_square_with_gradients(heads, kv_heads, qk_dim, v_dim, length):
    """The xla path (query blocks of 16 here, the last one shorter when the length is no multiple) and the
    flash path (tokamax behind the same call; its chunked XLA implementation on CPU) against the plain full
    causal square: values and gradients, GQA and MLA's q/k head dim above v's."""
    from MaxOffload.models import kernels
    from MaxOffload.models.attention.dispatch import attention

    rng = np.random.default_rng(length)
    q = jnp.asarray(rng.normal(size=(2, length, heads, qk_dim)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, length, kv_heads, qk_dim)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, length, kv_heads, v_dim)), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(v_dim,)), jnp.float32)
    paths = {"full": lambda q, k, v: _full_attention(q, k, v, 0.3),
             "xla": lambda q, k, v: causal_attention(q, k, v, 0.3, block=16),
             "flash": lambda q, k, v: attention(q, k, v, 0.3, kernels.attention_for("flash", "cpu"))}
    results = {name: (fn(q, k, v), jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * weights), (0, 1, 2))(q, k, v))
               for name, fn in paths.items()}
    want, want_grads = results.pop("full")
    for name, (got, grads) in results.items():
        np.testing.assert_allclose(got, want, atol=2e-6, err_msg=name)
        for a, b in zip(grads, want_grads):
            np.testing.assert_allclose(a, b, atol=2e-5, err_msg=name)


def test_tokamax_s_private_attention_ops_are_read_in_one_adapter():
    """Attention in pieces needs the residuals tokamax's public call hides: only models/attention/tokamax_adapter.py
    reads tokamax._src, written for the versions requirements.txt admits (SUPPORTED: every pin, nothing else); the
    installed tokamax is one of them, and one without the op is one line naming the installed and supported ones."""
    import glob

    import tokamax
    from packaging.requirements import Requirement

    from MaxOffload.errors import ConfigError
    from MaxOffload.models.attention import tokamax_adapter

    readers = []
    for path in glob.glob(os.path.join(os.path.dirname(__file__), "..", "MaxOffload", "**", "*.py"), recursive=True):
        with open(path) as f:
            if "tokamax._src" in f.read():
                readers.append(os.path.basename(path))
    assert readers == ["tokamax_adapter.py"]
    with open(os.path.join(os.path.dirname(__file__), "..", "requirements.txt")) as f:
        pins = [Requirement(line.split("#")[0].strip()) for line in f if line.startswith("tokamax")]
    admitted = {f"0.0.{n}" for n in range(30) for pin in pins if pin.specifier.contains(f"0.0.{n}")}
    assert pins and admitted == set(tokamax_adapter.SUPPORTED)
    assert tokamax.__version__ in tokamax_adapter.SUPPORTED
    with pytest.raises(ConfigError, match=f"tokamax {tokamax.__version__} has no attention op 'nowhere'") as error:
        tokamax_adapter.attention_op("nowhere")
    assert "0.0.12, 0.0.13, 0.0.14" in str(error.value) and "\n" not in str(error.value)


def test_attention_takes_only_a_kernel_chosen_for_a_platform():
    """The models never pick a kernel for the devices this process happens to have: TrainSetup chooses it for its
    mesh (kernels.for_platform), and attention refuses a choice not made yet."""
    from MaxOffload.models.attention.dispatch import attention

    q = k = v = jnp.zeros((1, 8, 2, 4), jnp.float32)
    for unchosen in ("auto", "flash"):
        with pytest.raises(ValueError, match="for_platform"):
            attention(q, k, v, None, unchosen)
    assert attention(q, k, v, None, "xla").shape == (1, 8, 2, 4)


def test_the_xla_path_skips_the_keys_a_query_block_cannot_see():
    """Query block i multiplies only by the keys up to its last row: score blocks [16, 16], [16, 32], [16, 48]
    and the last one (50 = 3 x 16 + 2) [2, 50]; none is the whole [50, 50] square, and the work is
    xla_work_multiple = sum(rows x keys) / (L^2 / 2) of the causal half (<= 0.6 of the square at 8,192)."""
    from MaxOffload.expected_work import xla_work_multiple

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, 50, 2, 8)), jnp.float32)
    k = v = jnp.asarray(rng.normal(size=(1, 50, 2, 8)), jnp.float32)
    text = str(jax.make_jaxpr(lambda q, k, v: jnp.sum(causal_attention(q, k, v, block=16)))(q, k, v)).replace(" ", "")
    for rows, keys in ((16, 16), (16, 32), (16, 48), (2, 50)):
        assert f"{rows},{keys}]" in text, (rows, keys)
    assert "50,50]" not in text
    assert xla_work_multiple(50, 16) == pytest.approx((16 * 16 + 16 * 32 + 16 * 48 + 2 * 50) / (50 * 50 / 2))
    assert xla_work_multiple(8192) / 2 <= 0.6 and xla_work_multiple(64) == 2.0


def test_kernel_choices_resolve_per_platform():
    """auto: tokamax on GPUs (deviceless compiles for GPU targets included), XLA on CPU; an explicit choice is
    tokamax's implementation for the platform; a resolved name stays as it is (TrainSetup resolves once)."""
    from MaxOffload.models import kernels

    assert [kernels.attention_for(c, on) for c, on in (("auto", "gpu"), ("auto", "cpu"), ("flash", "cpu"),
                                                           ("xla", "gpu"), ("flash:triton", "cpu"))] == [
        "flash:triton", "xla", "flash:xla_chunked", "xla", "flash:triton"]
    assert [kernels.grouped_gemm_for(c, on) for c, on in (("auto", "gpu"), ("auto", "cpu"), ("tokamax", "cpu"))] == [
        "tokamax:triton", "xla", "tokamax:xla"]

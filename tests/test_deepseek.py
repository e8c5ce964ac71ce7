"""DeepSeek-V3: YaRN, MLA, the DeepSeekMoE router and dispatch, expert parallelism on 8 simulated devices,
per-group offload, tagged names, the parameter count, FLOPs and a training run. Every check is against an
independent reference written here (numpy loops, brute force, hand arithmetic)."""
import itertools
import json
import math
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import EIGHT_CPUS as EIGHT, ROOT, process_env
from test_model import checkpoint_names  # the jaxpr walker, itself tested there
from MaxOffload import from_config
from MaxOffload import models
from MaxOffload.config import ConfigError, load
from MaxOffload.models import deepseek, exchange, kernels, matmul, moe, routing
from MaxOffload.models.model_context import ModelContext
from MaxOffload.models.positions import Positions
from MaxOffload.models.rope import yarn_inv_freq
from MaxOffload.train.flops import train_flops_per_step

TINY = "configs/deepseek_v3.py:tiny"
PUBLISHED_671B = 671.0e9  # the main model; the released checkpoint adds a 14B MTP module (685B: test_mtp.py)
# two processes, one per core: dropless and capacity mode, each against its single-device reference
EP_RUNS = {
    "single": ["single"],
    "expert8": ["mesh.ici.expert=8", "mesh.ici.fsdp=1"],
    "expert4_fsdp2": ["mesh.ici.expert=4", "mesh.ici.fsdp=2"],
}
EP_CAPACITY_RUNS = {  # in this order, each of its first two runs loads the state's init the other job's compiled
    # (tests/conftest.py's compilation cache: a kernel, a capacity or a buffer changes the step, not the state)
    # the tokamax path (its XLA implementation on CPU) with a buffer of 8x a balanced step's rows: all of them
    "expert8_tokamax_buffer": ["mesh.ici.expert=8", "mesh.ici.fsdp=1", "model.moe_kernel=tokamax",
                               "model.moe_buffer_factor=8"],
    "single_capacity": ["single", "model.capacity_factor=1.0"],
    "expert2_fsdp2_tensor2_capacity": ["mesh.ici.expert=2", "mesh.ici.fsdp=2", "mesh.ici.tensor=2",
                                       "model.capacity_factor=1.0"],
}
# the token all-to-all (mesh.exchange=all_to_all) against the all-gather exchange and one device, with multi-token
# prediction (its MoE block exchanges too): dropless, and with a buffer of half a balanced step's rows (choices dropped)
A2A = ["mesh.exchange=all_to_all", "model.mtp_depth=1"]
EXCHANGE_RUNS = {  # three jobs of 2-3 runs (a run on 8 CPU devices: about 25 s on one core, more on jax 0.12; the
    #                 dropping buffer at expert 8 x fsdp 1 is the 4 x 2 job's arithmetic, which CI no longer repeats),
    #                 each making only the runs its selected cases read. single_mtp is exchange8's first run and
    #                 the last of the other jobs: they load its compiles (and a run its job's init) from the run's
    #                 compilation cache (tests/conftest.py) instead of compiling them again
    "exchange8": {
        "single_mtp": ["single", "model.mtp_depth=1"],
        "expert8_all_to_all": ["mesh.ici.expert=8", "mesh.ici.fsdp=1", *A2A],
        # the ragged transport GPUs and TPUs run, its primitive emulated on the CPU
        "expert8_all_to_all_ragged": ["mesh.ici.expert=8", "mesh.ici.fsdp=1", "mesh.exchange=all_to_all_ragged",
                                      "model.mtp_depth=1"]},
    "exchange4": {
        "expert4_fsdp2_all_to_all": ["mesh.ici.expert=4", "mesh.ici.fsdp=2", *A2A],
        "single_mtp": ["single", "model.mtp_depth=1"]},
    "exchange_buffer4": {
        "expert4_fsdp2_half_buffer_all_gather": ["mesh.ici.expert=4", "mesh.ici.fsdp=2", "model.mtp_depth=1",
                                                 "model.moe_buffer_factor=0.5"],
        "expert4_fsdp2_half_buffer_all_to_all": ["mesh.ici.expert=4", "mesh.ici.fsdp=2", *A2A,
                                                 "model.moe_buffer_factor=0.5"],
        "expert4_fsdp2_half_buffer_all_to_all_ragged": ["mesh.ici.expert=4", "mesh.ici.fsdp=2", "model.mtp_depth=1",
                                                        "mesh.exchange=all_to_all_ragged", "model.moe_buffer_factor=0.5"]},
}


def job_of(jobs, run):
    """The job (of EXCHANGE_RUNS or CONTEXT_RUNS) that makes `run`."""
    return next(job for job, runs in jobs.items() if run in runs)


# context parallelism (MLA and multi-token prediction on): the keys and values gathered per context shard, with and
# without the load-balanced layout
CONTEXT_RUNS = {  # two jobs, each against its own one-device run: the xla path, the flash kernel per shard
    "context": {  # single_mtp last: exchange8's, from the compilation cache
        "context4_fsdp2_mtp": ["mesh.ici.context=4", "mesh.ici.fsdp=2", "model.mtp_depth=1"],
        # each shard gathers the per-head keys and values instead of the latent (model.mla_context_gather)
        "context8_balanced_kv_mtp": ["mesh.ici.context=8", "mesh.ici.fsdp=1", "mesh.context_load_balance=true",
                                     "model.mla_context_gather=kv", "model.mtp_depth=1"],
        "single_mtp": ["single", "model.mtp_depth=1"]},
    # the flash kernel per shard (tokamax's XLA implementation on CPU) on MLA's head dimensions (q/k 48, v 32), from
    # the gathered latent, in sequence order and load-balanced
    "context_flash": {
        "context8_flash_mtp": ["mesh.ici.context=8", "mesh.ici.fsdp=1", "model.attention=flash", "model.mtp_depth=1"],
        "context4_fsdp2_balanced_flash_mtp": ["mesh.ici.context=4", "mesh.ici.fsdp=2", "mesh.context_load_balance=true",
                                              "model.attention=flash", "model.mtp_depth=1"],
        "single_mtp": ["single", "model.mtp_depth=1"]},
}
TRAIN_STEPS = 40


# --------------------------------------------------------------------------------------------
# the slow parts (subprocesses) start when the module starts and run beside the in-process tests


class Background:
    """The module's subprocess jobs, at most LANES running at once (the rest wait in the order started): seven
    jobs at once on two cores slowed every test beside them (the other xdist worker's too) about fourfold."""
    LANES = 2

    def __init__(self, tmp):
        self.tmp, self.procs, self.waiting = tmp, {}, []
        self.lock, self.stopped = threading.Lock(), threading.Event()
        threading.Thread(target=self._keep_lanes_busy, daemon=True).start()

    def _keep_lanes_busy(self):
        while not self.stopped.wait(0.5):
            self._pump()

    def start(self, name, args, env=None):
        with self.lock:
            self.waiting.append((name, args, env))
        self._pump()

    def _launch(self, name, args, env):
        out = open(os.path.join(self.tmp, f"{name}.out"), "w")
        err = open(os.path.join(self.tmp, f"{name}.err"), "w")
        self.procs[name] = (subprocess.Popen([sys.executable, *args], cwd=ROOT, env=process_env(args, env),
                                             stdout=out, stderr=err, text=True), out, err)

    def _pump(self, first=None):
        """Starts waiting jobs (`first` ahead of the others) while a lane is free."""
        with self.lock:
            self.waiting.sort(key=lambda job: job[0] != first)
            while self.waiting and sum(p.poll() is None for p, _, _ in self.procs.values()) < self.LANES:
                self._launch(*self.waiting.pop(0))

    def result(self, name, timeout=600):
        deadline = time.monotonic() + timeout
        while name not in self.procs:  # waiting for a lane: it goes next
            self._pump(first=name)
            if name not in self.procs:
                time.sleep(1)
            assert time.monotonic() < deadline, f"background job {name} never started"
        proc, out, err = self.procs[name]
        proc.wait(timeout=max(1, deadline - time.monotonic()))
        out.close(), err.close()
        self._pump()
        read = lambda ext: open(os.path.join(self.tmp, f"{name}.{ext}")).read()  # noqa: E731
        return proc.returncode, read("out"), read("err")

    def stop(self):
        """Ends the jobs no test waited for (a run of selected tests only), so none outlives the module."""
        self.stopped.set()
        with self.lock:
            self.waiting.clear()
        for proc, out, err in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close(), err.close()


@pytest.fixture(scope="module")
def background(tmp_path_factory, request):
    tmp = str(tmp_path_factory.mktemp("deepseek"))
    jobs = Background(tmp)
    helper = os.path.join(ROOT, "tests", "helpers", "deepseek_mesh_losses.py")
    selected = " ".join(item.nodeid for item in request.session.items)
    # each job only when a selected test reads it (CI's py312 stack leaves the mesh runs out), in the order the
    # tests read them
    if "test_offload_recipe_fits_128" in selected:
        jobs.start("recipe_128", ["train.py", "configs/deepseek_v3_offload.py:671b", "run.dry_run=true",
                                  f"run.output_dir={tmp}/recipe"],
                   {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=128"})
    if "test_expert_parallel" in selected:
        jobs.start("ep", [helper, json.dumps(EP_RUNS)], EIGHT)
        jobs.start("ep_capacity", [helper, json.dumps(EP_CAPACITY_RUNS)], EIGHT)
    # the token all-to-all's runs that its selected cases read (CI's py312 stack leaves the ragged ones out)
    read = {item.callspec.params[arg] for item in request.session.items for arg in ("name", "reference")
            if item.originalname == "test_token_all_to_all_equals_the_all_gather_exchange_and_one_device"}
    for job, runs in EXCHANGE_RUNS.items():
        if read & set(runs):
            jobs.start(job, [helper, json.dumps({run: runs[run] for run in runs if run in read})], EIGHT)
    if "test_context_parallel" in selected:
        for job, runs in CONTEXT_RUNS.items():
            jobs.start(job, [helper, json.dumps(runs)], EIGHT)
    if "test_offload_in_moe_group_only" in selected:
        jobs.start("inspect", ["-m", "MaxOffload.offload.inspect", TINY, "remat.groups.m.layers=moe",
                               "remat.groups.m.tensors.moe_mlpwi_0=offload", "remat.groups.m.tensors.moe_mlpwi_1=offload",
                               "train.seq_len=32", "train.per_device_batch_size=2", f"run.output_dir={tmp}/inspect",
                               "--no_cpu_memory"])
    if "test_tiny_training_loss_falls" in selected:
        jobs.start("train", ["train.py", TINY, f"train.steps={TRAIN_STEPS}", "train.seq_len=64",
                             "train.per_device_batch_size=8", "train.eval_every=0", "train.eval_batches=1",
                             f"run.output_dir={tmp}/train"])
    jobs.tmp = tmp
    return jobs


@pytest.fixture(autouse=True, scope="module")
def _start_background(background):
    yield
    background.stop()


# --------------------------------------------------------------------------------------------
# helpers


def tiny_config(**overrides):
    cfg = load([TINY, "model.compute_dtype=float32"])
    cfg.model.update(overrides)
    return cfg


def rand(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


F32 = ModelContext(numerics=matmul.Numerics("float32"))  # layers built for one device, computing in float32


def router_logits(x, w):
    """The routing logits x @ w [b, l, E] in float32, as the MoE layer makes them for its router."""
    return jnp.einsum("ble,en->bln", jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))


def ref_rope(x, positions, inv_freq):
    """Rotate-half RoPE in float64; x [b, l, h, d]."""
    half = x.shape[-1] // 2
    angles = positions[:, :, None, None] * inv_freq[None, None, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(angles) - x2 * np.sin(angles), x2 * np.cos(angles) + x1 * np.sin(angles)], -1)


def ref_rms_norm(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def silu(x):
    return x / (1 + np.exp(-x))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


# --------------------------------------------------------------------------------------------
# 1. YaRN


def ref_yarn(dim, base, factor, orig, beta_fast, beta_slow):
    """DeepSeek-V3's YaRN (its Hugging Face modeling code), element by element."""
    def correction_dim(rotations):
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(dim // 2):
        extra = 1.0 / base ** (2 * i / dim)
        inter = extra / factor
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(inter * ramp + extra * (1 - ramp))
    return np.array(out), low, high


@pytest.mark.parametrize("dim,base,factor,orig", [(64, 10000.0, 40.0, 4096), (8, 10000.0, 4.0, 32),
                                                  (16, 500000.0, 8.0, 8192)])
def test_yarn_frequencies_match_reference(dim, base, factor, orig):
    ref, low, high = ref_yarn(dim, base, factor, orig, 32.0, 1.0)
    got = yarn_inv_freq(dim, base, factor, orig, 32.0, 1.0)
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    unscaled = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    if dim == 64:  # DeepSeek-V3: all three regimes occur
        assert 0 < low < high < dim // 2
        np.testing.assert_allclose(got[:low], unscaled[:low], rtol=1e-6)  # fast: kept
        np.testing.assert_allclose(got[high:], unscaled[high:] / factor, rtol=1e-6)  # slow: interpolated


def test_deepseek_v3_attention_scale_and_rope_amplitude():
    c = models.model_config(load(["configs/deepseek_v3.py:671b"]).model)
    _, amplitude, scale = deepseek.rope_setup(c)
    assert amplitude == 1.0  # mscale == mscale_all_dim
    assert scale == pytest.approx((0.1 * math.log(40) + 1) ** 2 / math.sqrt(128 + 64), rel=1e-12)


# --------------------------------------------------------------------------------------------
# 2. Multi-head latent attention


def test_mla_matches_naive_reference():
    rng = np.random.default_rng(0)
    b, l, d, h, ql, kl, nope, rope, vd = 2, 7, 24, 3, 12, 10, 8, 6, 5
    inv_freq = yarn_inv_freq(rope, 10000.0, 4.0, 4, 32.0, 1.0)
    mla = deepseek.MLA(emb_dim=d, num_heads=h, q_lora_rank=ql, kv_lora_rank=kl, qk_nope_head_dim=nope,
                       qk_rope_head_dim=rope, v_head_dim=vd, inv_freq=inv_freq, rope_amplitude=1.3,
                       softmax_scale=0.37, norm_eps=1e-6, param_dtype=jnp.float32, ctx=F32, init_std=0.3,
                       rngs=nnx.Rngs(params=1), attention="xla")
    mla.q_norm.scale[...] = jnp.asarray(rand(rng, ql)) + 1
    mla.kv_norm.scale[...] = jnp.asarray(rand(rng, kl)) + 1
    x = rand(rng, b, l, d)
    positions = np.stack([np.arange(l), np.arange(l) + 5])
    got = np.asarray(jax.jit(lambda x, p: mla(x, Positions(p)))(jnp.asarray(x), jnp.asarray(positions, jnp.int32)))

    w = {k: np.asarray(getattr(mla, k)[...], np.float64) for k in ("wq_a", "wq_b", "wkv_a", "wk_b", "wv_b", "wo")}
    x = x.astype(np.float64)
    q = np.einsum("blr,rhd->blhd", ref_rms_norm(x @ w["wq_a"], np.asarray(mla.q_norm.scale[...]), 1e-6), w["wq_b"])
    kv = x @ w["wkv_a"]
    latent = ref_rms_norm(kv[..., :kl], np.asarray(mla.kv_norm.scale[...]), 1e-6)
    k_rope = 1.3 * ref_rope(kv[:, :, None, kl:], positions, inv_freq.astype(np.float64))[:, :, 0]  # [b, l, rope]
    out = np.zeros((b, l, h, vd))
    for bi, head, t in itertools.product(range(b), range(h), range(l)):
        q_t = np.concatenate([q[bi, t, head, :nope],
                              1.3 * ref_rope(q[None, None, None, bi, t, head, nope:], positions[bi:bi + 1, t:t + 1],
                                             inv_freq.astype(np.float64))[0, 0, 0]])
        keys = [np.concatenate([latent[bi, s] @ w["wk_b"][:, head], k_rope[bi, s]]) for s in range(t + 1)]
        values = [latent[bi, s] @ w["wv_b"][:, head] for s in range(t + 1)]
        logits = np.array([q_t @ key for key in keys]) * 0.37
        p = np.exp(logits - logits.max())
        out[bi, t, head] = (p / p.sum()) @ np.array(values)
    ref = np.einsum("blhd,hde->ble", out, w["wo"])
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


# --------------------------------------------------------------------------------------------
# 3. router


def brute_force_group_top_k(scores, top_k, n_groups, topk_groups):
    """For one token: try every set of topk_groups groups, keep the one with the highest sum of group ranks."""
    per = len(scores) // n_groups
    rank = [sum(sorted(scores[g * per:(g + 1) * per])[-2:]) for g in range(n_groups)]
    best = max(itertools.combinations(range(n_groups), topk_groups), key=lambda gs: sum(rank[g] for g in gs))
    allowed = [e for g in best for e in range(g * per, (g + 1) * per)]
    return set(sorted(allowed, key=lambda e: -scores[e])[:top_k])


@pytest.mark.parametrize("experts,top_k,groups,topk_groups", [(16, 3, 4, 2), (12, 4, 3, 1), (8, 2, 8, 3),
                                                              (10, 3, 1, 1)])
def test_group_limited_top_k_matches_brute_force(experts, top_k, groups, topk_groups):
    scores = np.random.default_rng(experts + top_k).standard_normal((50, experts)).astype(np.float32)
    got = np.asarray(routing.group_limited_top_k(jnp.asarray(scores), top_k, groups, topk_groups))
    for t in range(len(scores)):
        assert set(got[t].tolist()) == brute_force_group_top_k(scores[t], top_k, groups, topk_groups), t


def test_router_sigmoid_scores_bias_selects_gates_unbiased():
    rng = np.random.default_rng(1)
    x, w = rand(rng, 2, 5, 16), rand(rng, 16, 8, scale=0.5)
    bias = np.zeros(8, np.float32)
    bias[6] = 10.0  # expert 6 wins every selection, whatever its score
    experts, gates, scores = routing.route(router_logits(x, w), jnp.asarray(bias), top_k=3, n_groups=1,
                                           topk_groups=1, scaling=2.5)
    ref_scores = sigmoid(x.astype(np.float64) @ w)
    np.testing.assert_allclose(np.asarray(scores), ref_scores, rtol=1e-5)
    experts, gates = np.asarray(experts), np.asarray(gates)
    for b, t in itertools.product(range(2), range(5)):
        s = ref_scores[b, t]
        want = [6] + [e for e in np.argsort(-s) if e != 6][:2]
        assert set(experts[b, t].tolist()) == set(want)
        # gates: the chosen experts' unbiased scores, normalised, x routed_scaling_factor
        np.testing.assert_allclose(gates[b, t], s[experts[b, t]] / s[experts[b, t]].sum() * 2.5, rtol=1e-5)
    # the bias never receives a gradient: it only selects
    grad = jax.grad(lambda bias: routing.route(router_logits(x, w), bias, top_k=3, n_groups=1, topk_groups=1,
                                               scaling=2.5)[1].sum())(jnp.asarray(bias))
    assert float(jnp.abs(grad).max()) == 0.0


def test_bias_update_sign_rule():
    load = jnp.array([[5.0, 1.0, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0]])
    bias = jnp.array([[0.1, 0.0, -0.2, 0.0], [0.0, 0.0, 0.0, 0.0]])
    new = np.asarray(routing.updated_bias(bias, load, 0.001))
    np.testing.assert_allclose(new, [[0.099, 0.001, -0.2, 0.0], [0, 0, 0, 0]], rtol=1e-6, atol=1e-9)


def test_sequence_balance_loss_by_hand():
    scores = np.array([[[0.9, 0.1, 0.5, 0.5], [0.2, 0.8, 0.4, 0.6]]], np.float32)  # 1 sequence, 2 tokens
    experts = np.array([[[0, 2], [1, 3]]])
    # f_i = E / (k L) * count = 4 / 4 * 1 for every expert; P_i = mean over tokens of normalised scores
    p = (scores[0] / scores[0].sum(-1, keepdims=True)).mean(0)
    assert float(routing.sequence_balance_loss(jnp.asarray(scores), jnp.asarray(experts))) == pytest.approx(p.sum())


# --------------------------------------------------------------------------------------------
# 4. routed experts: dropless and capacity


def make_moe(rng_seed=0, capacity_factor=0.0, num_shared=1, **kw):
    args = dict(emb_dim=16, num_experts=6, mlp_dim=12, num_shared=num_shared,
                router=routing.DeepSeekRouter(top_k=2, n_groups=1, topk_groups=1, scaling=2.5),
                capacity_factor=capacity_factor, param_dtype=jnp.float32, ctx=F32, init_std=0.3)
    if "kernel" in kw:
        kw["kernel"] = kernels.grouped_gemm_for(kw["kernel"], "cpu")
    args.update(kw)
    return moe.MoE(**args, rngs=nnx.Rngs(params=rng_seed))


def ref_moe(layer, x, kept=lambda b, t, c, e: True):
    """Per token: route (numpy), then the chosen experts one by one (those `kept(b, t, choice, expert)`), plus
    the shared expert."""
    w = lambda p: np.asarray(p[...], np.float64)  # noqa: E731
    router, bias, wi_0, wi_1, wo = (w(layer.router), w(layer.router_bias), w(layer.wi_0), w(layer.wi_1), w(layer.wo))
    out = np.zeros(x.shape)
    for b, t in itertools.product(range(x.shape[0]), range(x.shape[1])):
        xt = x[b, t].astype(np.float64)
        s = sigmoid(xt @ router)
        chosen = np.argsort(-(s + bias))[:layer.routing.top_k]
        gates = s[chosen] / s[chosen].sum() * layer.routing.scaling
        for c, (e, g) in enumerate(zip(chosen, gates)):
            if kept(b, t, c, e):
                out[b, t] += g * (silu(xt @ wi_0[e]) * (xt @ wi_1[e])) @ wo[e]
        if layer.shared is not None:
            sh = layer.shared
            out[b, t] += (silu(xt @ w(sh.wi_0)) * (xt @ w(sh.wi_1))) @ w(sh.wo)
    return out


def test_dropless_moe_matches_loop_over_tokens_and_experts():
    layer = make_moe()
    layer.router_bias[...] = jnp.asarray(np.random.default_rng(5).standard_normal(6), jnp.float32) * 0.1
    x = rand(np.random.default_rng(2), 3, 5, 16)
    out, stats = jax.jit(lambda x: layer(x))(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(out), ref_moe(layer, x), rtol=1e-4, atol=1e-5)
    assert float(stats["load"].sum()) == 3 * 5 * 2 and float(stats["dropped"]) == 0


@pytest.mark.stack("py311", "py312")
def test_tokamax_grouped_gemm_equals_ragged_dot_values_and_gradients():
    """The tokamax path of the grouped GEMM (models/kernels.py; on CPU tokamax's XLA implementation, behind the
    same call and custom VJP as its Triton kernel) gives jax.lax.ragged_dot's values and gradients, with zeros
    for the rows past the groups."""
    rng = np.random.default_rng(8)
    rows, w, target = jnp.asarray(rand(rng, 20, 8)), jnp.asarray(rand(rng, 4, 8, 5)), jnp.asarray(rand(rng, 20, 5))
    sizes = jnp.asarray([3, 0, 9, 5], jnp.int32)  # 17 of the 20 rows; the last 3 are in no group

    def run(kernel):
        loss = lambda a, b: jnp.sum(kernels.ragged_dot(a, b, sizes, kernel) * target)  # noqa: E731
        return jax.jit(lambda a, b: kernels.ragged_dot(a, b, sizes, kernel))(rows, w), jax.grad(loss, (0, 1))(rows, w)

    (y_tokamax, g_tokamax), (y_xla, g_xla) = run("tokamax:xla"), run("xla")
    assert np.all(np.asarray(y_tokamax)[17:] == 0) and np.abs(np.asarray(y_tokamax)[:17]).min() > 0
    for got, want in zip((y_tokamax, *g_tokamax), (y_xla, *g_xla)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert kernels.grouped_gemm_for("auto", "gpu") == "tokamax:triton" and kernels.grouped_gemm_for("auto", "cpu") == "xla"
    assert kernels.grouped_gemm_for("tokamax", "cpu") == "tokamax:xla"


@pytest.mark.stack("py311", "py312")
def test_moe_layer_through_tokamax_matches_the_loop_reference():
    layer = make_moe(kernel="tokamax")
    assert layer.kernel == "tokamax:xla"
    x = rand(np.random.default_rng(2), 3, 5, 16)
    out, _ = jax.jit(lambda x: layer(x))(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(out), ref_moe(layer, x), rtol=1e-4, atol=1e-5)


def test_dropless_buffer_keeps_the_first_rows_in_expert_order_and_counts_the_rest():
    """model.moe_buffer_factor=0.5 on one device: rows for half of the 30 choices; the choices sorted by expert
    (then token, then choice) past row 15 are dropped, counted, and give nothing."""
    layer = make_moe(buffer_factor=0.5)
    x = rand(np.random.default_rng(9), 3, 5, 16)
    out, stats = jax.jit(lambda x: layer(x))(jnp.asarray(x))
    experts, _, _ = routing.route(router_logits(x, layer.router[...]), layer.router_bias[...], top_k=2, n_groups=1,
                                  topk_groups=1, scaling=2.5)
    rank = np.argsort(np.argsort(np.asarray(experts).reshape(-1), kind="stable"), kind="stable").reshape(3, 5, 2)
    np.testing.assert_allclose(np.asarray(out), ref_moe(layer, x, lambda b, t, c, e: rank[b, t, c] < 15),
                               rtol=1e-4, atol=1e-5)
    assert float(stats["dropped"]) == 15
    full, _ = make_moe(buffer_factor=1.0)(jnp.asarray(x))  # a buffer of every row drops nothing
    np.testing.assert_allclose(np.asarray(full), ref_moe(layer, x), rtol=1e-4, atol=1e-5)


def test_dropless_gradients_match_dense_reference():
    """Gradients through sort + ragged_dot == gradients of every expert on every token, masked by the routing."""
    layer = make_moe(num_shared=0)
    x = jnp.asarray(rand(np.random.default_rng(3), 2, 4, 16))
    experts, gates, _ = routing.route(router_logits(x, layer.router[...]), layer.router_bias[...], top_k=2,
                                      n_groups=1, topk_groups=1, scaling=2.5)

    def dense(x, gates, wi_0, wi_1, wo):
        h = jax.nn.silu(jnp.einsum("bld,edm->blem", x, wi_0)) * jnp.einsum("bld,edm->blem", x, wi_1)
        y = jnp.einsum("blem,emd->bled", h, wo)
        weight = jnp.einsum("blk,blke->ble", gates, jax.nn.one_hot(experts, 6))
        return jnp.einsum("bled,ble->bld", y, weight)

    def sparse(x, gates, wi_0, wi_1, wo):
        return moe.routed_experts(x, experts, gates, None, wi_0, wi_1, wo, capacity=0, ctx=F32)[0]

    target = jnp.asarray(rand(np.random.default_rng(4), 2, 4, 16))
    args = (x, gates, layer.wi_0[...], layer.wi_1[...], layer.wo[...])
    grads = [jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * target), argnums=(0, 1, 2, 3, 4)))(*args)
             for f in (dense, sparse)]
    for g_dense, g_sparse in zip(*grads):
        np.testing.assert_allclose(np.asarray(g_sparse), np.asarray(g_dense), rtol=1e-4, atol=1e-6)


def test_capacity_mode_drops_later_tokens_and_counts_them():
    rng = np.random.default_rng(6)
    b, l, k, e, d, m, capacity = 2, 9, 2, 4, 8, 6, 3
    x = rand(rng, b, l, d)
    experts = np.stack([rng.permutation(e)[:k] for _ in range(b * l)]).reshape(b, l, k)
    experts[0] = [[1, rng.choice([0, 2, 3])] for _ in range(l)]  # sequence 0: all want expert 1 -> 3 get it
    gates = rand(rng, b, l, k) ** 2
    wi_0, wi_1, wo = rand(rng, e, d, m), rand(rng, e, d, m), rand(rng, e, m, d)
    positions = exchange.capacity_positions(jnp.asarray(experts), e)
    got, counted = moe.routed_experts(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(gates), positions,
                                      jnp.asarray(wi_0), jnp.asarray(wi_1), jnp.asarray(wo), capacity=capacity,
                                      ctx=F32)
    got = np.asarray(got)
    ref, dropped = np.zeros((b, l, d)), []
    for bi in range(b):
        taken = [0] * e  # per sequence: each expert takes the first `capacity` choices, in token then choice order
        for t, c in itertools.product(range(l), range(k)):
            ex = experts[bi, t, c]
            if taken[ex] >= capacity:
                dropped.append((bi, t, c))
                continue
            taken[ex] += 1
            ref[bi, t] += gates[bi, t, c] * (silu(x[bi, t] @ wi_0[ex]) * (x[bi, t] @ wi_1[ex])) @ wo[ex]
    assert (0, 3, 0) in dropped and (0, 2, 0) not in dropped
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    assert int(jnp.sum(positions >= capacity)) == len(dropped) == int(counted)


def test_capacity_mode_multiplies_as_one_batched_gemm_equal_to_ragged_dot():
    """Capacity mode's equal groups go through a batched GEMM (no ragged_dot, whose GPU lowering is a dense
    dot over every expert): the same values and gradients as ragged_dot on the same groups."""
    rng = np.random.default_rng(7)
    e, per, k, n = 4, 6, 8, 5
    rows, w = jnp.asarray(rand(rng, e * per, k)), jnp.asarray(rand(rng, e, k, n))
    sizes = jnp.full((e,), per, jnp.int32)
    target = jnp.asarray(rand(rng, e * per, n))
    for argnums in ((), (0, 1)):
        def f(impl):
            out = lambda a, b: jnp.sum(impl(a, b) * target)  # noqa: E731
            return jax.grad(out, argnums=argnums)(rows, w) if argnums else impl(rows, w)
        batched = f(lambda a, b: matmul.grouped(a, b, sizes, per, "xla", matmul.Numerics("float32")))
        ragged = f(lambda a, b: jax.lax.ragged_dot(a, b, sizes))
        for got, want in zip(jax.tree.leaves(batched), jax.tree.leaves(ragged)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    jaxpr = str(jax.make_jaxpr(lambda a, b: matmul.grouped(a, b, sizes, per, "xla", matmul.Numerics("float32")))(rows, w))
    assert "ragged_dot" not in jaxpr and "dot_general" in jaxpr


def test_capacity_mode_statistics_count_dropped_choices():
    layer = make_moe(capacity_factor=0.5)  # capacity = ceil(0.5 * 10 * 2 / 6) = 2 per expert and sequence
    x = jnp.asarray(rand(np.random.default_rng(7), 3, 10, 16))
    _, stats = layer(x)
    experts, _, _ = routing.route(router_logits(x, layer.router[...]), layer.router_bias[...], top_k=2, n_groups=1,
                                  topk_groups=1, scaling=2.5)
    counts = np.stack([np.bincount(np.asarray(experts[b]).ravel(), minlength=6) for b in range(3)])
    assert float(stats["dropped"]) == np.maximum(counts - 2, 0).sum() > 0
    np.testing.assert_array_equal(np.asarray(stats["load"]), counts.sum(0))


# --------------------------------------------------------------------------------------------
# 5. the model: state, tagged names, configuration


def test_model_state_is_the_router_biases_and_moves_against_the_load():
    from MaxOffload import from_config

    cfg = tiny_config()
    setup = from_config.train_setup(cfg)
    state = jax.jit(setup._init)()
    assert jax.tree.map(lambda a: a.shape, state["model_state"]) == {"moe_layers": {"mlp": {"router_bias": (2, 8)}}}
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 16)), jnp.int32)
    logits, aux = jax.jit(setup.forward)(state["params"], state["model_state"], tokens)
    assert logits.shape == (2, 16, 512)
    new_bias = np.asarray(aux["model_state"]["moe_layers"]["mlp"]["router_bias"])
    assert jax.tree.structure(aux["model_state"]) == jax.tree.structure(state["model_state"])
    # recompute the loads: busier than average -> bias down by gamma, quieter -> up
    assert set(np.round(new_bias.ravel() / cfg.model.router_bias_update_rate).tolist()) <= {-1.0, 0.0, 1.0}
    assert {"moe/max_load", "moe/mean_bias_range", "moe/max_load_layer1", "moe/max_load_layer2",
            "moe/bias_range_layer2", "moe/balance_loss"} <= set(aux["metrics"])
    assert float(aux["aux_loss"]) == pytest.approx(1e-4 * 2 * float(aux["metrics"]["moe/balance_loss"]), rel=1e-5)


@pytest.mark.stack("py311", "py312")
def test_every_tagged_name_is_tagged_in_the_training_step():
    from MaxOffload import from_config

    setup = from_config.train_setup(tiny_config())
    jaxpr = jax.make_jaxpr(setup.train_step)(setup.abstract_state, setup.abstract_batch())
    expected = ("decoder_layer_input", "query_wa_proj", "mla_q", "query_proj", "kv_wa_proj", "mla_kv", "key_proj",
                "value_proj", "attention_out", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo", "moe_rows", "moe_mlpwi_0",
                "moe_mlpwi_1", "moe_mlpwo")
    assert checkpoint_names(jaxpr.jaxpr) == set(expected)
    assert models.FAMILIES["deepseek"].tagged_names(setup.model_config) == expected
    assert models.FAMILIES["deepseek"].layer_groups(setup.model_config) == {"dense": (0, 1), "moe": (1, 3)}


@pytest.mark.parametrize("overrides,words", [
    (["model.num_experts_per_tok=9"], ["num_experts_per_tok=9", "num_experts=8"]),
    (["model.n_groups=3"], ["num_experts=8", "n_groups=3"]),
    (["model.topk_groups=5"], ["topk_groups=5", "n_groups=4"]),
    (["model.num_experts_per_tok=5", "model.topk_groups=2"], ["num_experts_per_tok=5", "topk_groups"]),
    (["model.first_k_dense=4"], ["first_k_dense=4"]),
    (["model.capacity_factor=-1.0"], ["capacity_factor"]),
    (["model.rope_scaling=llama3"], ["rope_scaling", "yarn"]),
    (["remat.groups.d.layers=dense", "remat.groups.d.tensors.qkv_proj=offload"], ["qkv_proj", "deepseek"]),
])
def test_invalid_deepseek_config_is_one_clear_line(overrides, words):
    with pytest.raises(ConfigError) as e:
        load([TINY, *overrides])
    message = str(e.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


# --------------------------------------------------------------------------------------------
# 6. sizes and FLOPs


def test_671b_parameter_count_by_hand():
    cfg = load(["configs/deepseek_v3.py:671b", "model.mtp_depth=0"])  # the main model (its MTP: test_mtp.py)
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: from_config.model(cfg)),
                                                                       nnx.Param)))
    d, vocab, heads = 7168, 129280, 128
    mla = d * 1536 + 1536 + 1536 * heads * 192 + d * (512 + 64) + 512 + 512 * heads * 128 * 2 + heads * 128 * d
    dense = 3 * d * 18432
    moe_mlp = d * 256 + 256 * 3 * d * 2048 + 3 * d * 2048  # router, 256 routed, 1 shared
    expected = 2 * vocab * d + d + 61 * (mla + 2 * d) + 3 * dense + 58 * moe_mlp
    assert total == expected == 671_026_404_352
    assert total == pytest.approx(PUBLISHED_671B, rel=0.001)


def test_train_flops_by_hand():
    cfg = tiny_config()
    cfg.model.update(dict(vocab_size=100, emb_dim=8, num_layers=3, first_k_dense=1, mlp_dim=16, num_heads=2,
                          q_lora_rank=4, kv_lora_rank=6, qk_nope_head_dim=3, qk_rope_head_dim=2, v_head_dim=5,
                          num_experts=4, num_experts_per_tok=2, num_shared_experts=1, moe_mlp_dim=7, n_groups=1,
                          topk_groups=1))
    c = models.model_config(cfg.model)
    # multiply-adds per token
    q_down, q_up = 8 * 4, 4 * 2 * (3 + 2)  # 32, 40
    kv_down, k_up, v_up = 8 * (6 + 2), 6 * 2 * 3, 6 * 2 * 5  # 64, 36, 60
    out = 2 * 5 * 8  # 80
    mla = q_down + q_up + kv_down + k_up + v_up + out  # 312
    dense_mlp = 3 * 8 * 16  # 384
    router = 8 * 4  # 32
    experts = (2 + 1) * 3 * 8 * 7  # top-2 routed + 1 shared: 504
    unembed = 8 * 100
    macs = 3 * mla + dense_mlp + 2 * (router + experts) + unembed
    assert macs == 936 + 384 + 1072 + 800 == 3192
    assert c.matmul_params_per_token() == macs
    batch, seq = 3, 5
    tokens = batch * seq
    attention = 6 * tokens * 3 * seq * 2 * ((3 + 2) + 5) / 2  # qk_dim = nope + rope, v_dim
    assert train_flops_per_step(c, batch, seq) == pytest.approx(6 * tokens * macs + attention, rel=1e-12)
    # every routed expert and router weight counted once per chosen expert, never all experts
    model = nnx.eval_shape(lambda: from_config.model(cfg))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    all_experts = 2 * 4 * 3 * 8 * 7
    assert all_experts == sum(math.prod(params["moe_layers"]["mlp"][w].shape) for w in ("wi_0", "wi_1", "wo"))


def test_dry_run_671b(cli, tmp_path):
    started = time.perf_counter()
    result = cli(["train.py", "configs/deepseek_v3.py:671b", "run.dry_run=true", f"run.output_dir={tmp_path}"])
    seconds = time.perf_counter() - started
    assert result.returncode == 0, result.stderr
    assert seconds < 60, f"dry run took {seconds:.0f} s"
    summary = json.loads((tmp_path / "dry_run.json").read_text())["summary"]
    # with its MTP block (test_mtp.py counts it by hand), which also attends: 61 + 1 layers of attention
    assert summary["params_total"] == 682_636_472_320
    assert summary["params_as_released"] == 682_636_472_320 + 2 * 129280 * 7168
    assert "682.6B parameters (684.5B as released)" in result.stdout
    assert summary["model_flops_per_step"] == pytest.approx(
        6 * 4096 * models.model_config(load(["configs/deepseek_v3.py:671b"]).model).matmul_params_per_token()
        + 6 * 4096 * 62 * 4096 * 128 * (192 + 128) / 2, rel=1e-9)


def test_offload_recipe_fits_128_devices_ep64_per_rack(background):
    """The 671B recipe's layout on 128 (forced host) devices: two data-parallel racks of 64 expert ranks, the token
    all-to-all (its padded transport on CPUs), the state in host memory."""
    code, out, err = background.result("recipe_128")
    assert code == 0, err
    assert "mesh data=2 x expert=64" in out and "token all-to-all over 64 expert ranks" in out
    summary = json.load(open(os.path.join(background.tmp, "recipe", "dry_run.json")))["summary"]
    # fp32 params + Adam: 12 bytes per parameter (the MTP block's included), split 64 ways inside a rack and held
    # by both racks (norms and router biases aside), all of it in pinned host memory
    assert summary["state_bytes_per_device"] == pytest.approx(12 * 682.64e9 / 64, rel=0.01)
    assert "(128GB of it in pinned host memory)" in out
    # active per token: router + top-8 routed + shared experts, MLA, dense MLPs, embedding and head (and the MTP
    # block's one pass); the main model alone is DeepSeek-V3's published "37B activated" (test_mtp: 37.55B)
    assert summary["params_active"] == pytest.approx(39.17e9, rel=0.001)
    assert "39.17B active per token" in out


# --------------------------------------------------------------------------------------------
# 7. expert parallelism, per-group offload, training


@pytest.fixture(scope="module")
def ep_runs(background):
    runs = {}
    for name in ("ep", "ep_capacity"):
        code, out, err = background.result(name)
        assert code == 0, err[-3000:]
        runs.update(json.loads(out.strip().splitlines()[-1]))
    return runs


@pytest.mark.parametrize("name,reference", [("expert8", "single"), ("expert4_fsdp2", "single"),
                                            ("expert2_fsdp2_tensor2_capacity", "single_capacity"),
                                            ("expert8_tokamax_buffer", "single")])
def test_expert_parallel_equals_single_device(ep_runs, name, reference):
    run, ref = ep_runs[name], ep_runs[reference]
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    for got, want in zip(run["metrics"], ref["metrics"]):
        assert {k: got[k] for k in want} == pytest.approx(want, rel=1e-5, abs=1e-6)
        # a dispatch buffer adds its drop counts, which must be zero: it holds every row
        assert all(k.startswith("moe/dropped_fraction") and v == 0 for k, v in got.items() if k not in want), got
    np.testing.assert_allclose(run["router_bias"], ref["router_bias"], atol=1e-6)
    assert np.abs(np.asarray(ref["router_bias"])).max() > 0  # the biases did move


def test_destination_rows_are_the_all_gathered_choices_in_expert_order():
    """Each rank's choices land where the all-gather exchange puts them: in their owner's rows in expert order,
    then rank, then token order (so a budget drops the same choices). Fails if a row collides or moves."""
    from MaxOffload.models.exchange import destination_rows

    ranks, num_local, per_rank = 4, 3, 10
    experts = np.random.default_rng(0).integers(0, ranks * num_local, (ranks, per_rank))
    counts = np.stack([np.bincount(e, minlength=ranks * num_local) for e in experts])
    got = np.stack([np.asarray(destination_rows(jnp.asarray(e), jnp.asarray(counts), num_local, r))
                    for r, e in enumerate(experts)])
    flat = experts.reshape(-1)  # the all-gathered choices, rank-major
    for owner in range(ranks):
        mine = np.flatnonzero(flat // num_local == owner)
        in_order = mine[np.argsort(flat[mine], kind="stable")]  # expert order, then rank, then token
        np.testing.assert_array_equal(got.reshape(-1)[in_order], np.arange(len(in_order)))


# the padded transport (jax.lax.all_to_all, what XLA:CPU runs) on both stacks, as issue 42 asks: its CPU equalities
# on both; the ragged transport's CPU emulation on py311 only: its arithmetic in jnp, the same on every jax (the ragged
# GPU program: test_aot.py)
BOTH = pytest.mark.stack("py311", "py312")


@pytest.mark.parametrize("name,reference", [pytest.param("expert8_all_to_all", "single_mtp", marks=BOTH),
                                            pytest.param("expert4_fsdp2_all_to_all", "single_mtp", marks=BOTH),
                                            pytest.param("expert4_fsdp2_half_buffer_all_to_all",
                                                         "expert4_fsdp2_half_buffer_all_gather", marks=BOTH),
                                            ("expert8_all_to_all_ragged", "single_mtp"),
                                            ("expert4_fsdp2_half_buffer_all_to_all_ragged",
                                             "expert4_fsdp2_half_buffer_all_gather")])
def test_token_all_to_all_equals_the_all_gather_exchange_and_one_device(background, name, reference):
    """mesh.exchange=all_to_all (each choice to its expert's owner and back, the padded all_to_all that XLA:CPU runs;
    _ragged: the ragged transport of GPUs and TPUs, its primitive emulated here) over 8 expert ranks and 4 x fsdp 2,
    with multi-token prediction: the losses, metrics (the MTP loss, the loads) and router biases of one device (which
    the all-gather exchange equals: test_expert_parallel_equals_single_device), and with a buffer of half a balanced
    step's rows the same choices dropped as the all-gather exchange drops (moe/dropped_fraction > 0) and its
    losses."""
    code, out, err = background.result(job_of(EXCHANGE_RUNS, name), timeout=1200)
    assert code == 0, err[-3000:]
    runs = json.loads(out.strip().splitlines()[-1])
    run, ref = runs[name], runs[reference]
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    for got, want in zip(run["metrics"], ref["metrics"]):
        assert {k: got[k] for k in want} == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert all(v == 0 for k, v in got.items() if k not in want), got  # single: no dropped counts at all
    np.testing.assert_allclose(run["router_bias"], ref["router_bias"], atol=1e-6)
    if "half_buffer" in name:
        assert all(m["moe/dropped_fraction"] > 0 for m in run["metrics"]), run["metrics"]


@pytest.mark.parametrize("name", ["context4_fsdp2_mtp", "context8_balanced_kv_mtp", "context8_flash_mtp",
                                  "context4_fsdp2_balanced_flash_mtp"])
def test_context_parallel_mla_with_mtp_equals_single_device(background, name):
    """MLA attention and multi-token prediction over a sequence split 4 (x fsdp 2) and 8 ways, in sequence order and
    load-balanced, on the XLA path and through the flash kernel per shard, gathering the latent (the default) or
    the keys and values: the losses, the MTP loss and the router biases of the one-device run."""
    code, out, err = background.result(job_of(CONTEXT_RUNS, name), timeout=1500)
    assert code == 0, err[-3000:]
    runs = json.loads(out.strip().splitlines()[-1])
    run, ref = runs[name], runs["single_mtp"]
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert all(m["mtp_loss"] > 0 for m in ref["metrics"])  # multi-token prediction ran
    for got, want in zip(run["metrics"], ref["metrics"]):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(run["router_bias"], ref["router_bias"], atol=1e-6)


def test_expert_parallel_shards_the_experts(ep_runs):
    # wi_0 is [moe layers, experts, emb, moe_mlp]: experts over `expert`, emb over fsdp, moe_mlp over tensor
    assert ep_runs["expert8"]["wi_0_spec"] == ["None", "expert", "fsdp", "tensor"]
    assert ep_runs["expert8"]["wi_0_shard_shape"] == [2, 1, 64, 32]
    assert ep_runs["expert4_fsdp2"]["wi_0_shard_shape"] == [2, 2, 32, 32]
    assert ep_runs["expert2_fsdp2_tensor2_capacity"]["wi_0_shard_shape"] == [2, 4, 32, 16]
    assert ep_runs["single_capacity"]["metrics"][0]["moe/dropped_fraction"] > 0  # capacity 1.0 really drops
    assert ep_runs["expert8_tokamax_buffer"]["metrics"][0]["moe/dropped_fraction"] == 0


@pytest.mark.stack("py311", "py312")
def test_offload_in_moe_group_only(background):
    code, out, err = background.result("inspect")
    assert code == 0, out + err
    report = json.load(open(os.path.join(background.tmp, "inspect", "offload_report.json")))
    groups = {g["model_group"]: g for g in report["groups"].values()}
    assert groups["dense"]["offloaded"] == []
    assert sorted(groups["moe"]["offloaded"]) == ["moe_mlpwi_0", "moe_mlpwi_1"]
    assert groups["moe"]["layers"] == [1, 2] and groups["moe"]["missing"] == []
    assert report["cuda_pinned_host_placements"] == 2 and report["problems"] == []
    assert "all requested placements confirmed" in out


@pytest.mark.stack("py311", "py312")
def test_tiny_training_loss_falls_and_logs_expert_load(background):
    code, out, err = background.result("train")
    assert code == 0, err[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(background.tmp, "train", "metrics.jsonl"))]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == TRAIN_STEPS
    assert np.mean(losses[-5:]) < losses[0] - 1.0, losses
    last = [r for r in rows if "loss" in r][-1]
    for key in ("moe/max_load", "moe/mean_max_load", "moe/mean_bias_range", "moe/max_load_layer2",
                "moe/bias_range_layer1", "moe/balance_loss"):
        assert key in last and math.isfinite(last[key])
    assert last["moe/mean_bias_range"] > 0
    tensorboard = os.path.join(background.tmp, "train", "tensorboard")
    events = b"".join(open(os.path.join(root, f), "rb").read() for root, _, files in os.walk(tensorboard) for f in files)
    assert b"train/moe/max_load_layer1" in events and b"train/moe/mean_bias_range" in events


def test_mla_goes_through_the_shared_chunked_attention():
    """At 2,048 tokens (four query blocks of 512, each multiplying only by the keys it can see) no
    intermediate of the forward pass holds the whole [length x length] score matrix: DeepSeek's MLA uses the
    shared causal attention (models/attention/plain.py)."""
    from test_model import _sub_jaxprs

    length = 2048
    cfg = load(["configs/deepseek_v3.py:tiny", f"train.seq_len={length}", "model.compute_dtype=float32"])
    model = from_config.model(cfg)
    jaxpr = jax.make_jaxpr(lambda t: model(t)[0])(jnp.zeros((1, length), jnp.int32)).jaxpr

    def shapes(jp):
        for eqn in jp.eqns:
            for var in eqn.outvars:
                yield tuple(getattr(var.aval, "shape", ()))
            for sub in _sub_jaxprs(list(eqn.params.values())):
                yield from shapes(sub)

    seen = list(shapes(jaxpr))
    for keys in (512, 1024, 1536, length):  # the query blocks' scores
        assert any(s[-2:] == (512, keys) for s in seen if len(s) >= 2), keys
    assert not [s for s in seen if len(s) >= 2 and s[-2:] == (length, length)]

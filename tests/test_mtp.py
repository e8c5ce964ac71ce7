"""DeepSeek-V3's multi-token prediction (model.mtp_depth): the logits and the loss against a reference written
here from the definition, what depth 0 leaves unchanged, where the gradients go, the layer group "mtp" under a
policy of its own, training with it and an exact resume."""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import run_cli
from test_checkpoint import losses, sigterm_and_resume
from MaxOffload import models, from_config
from MaxOffload.config import ConfigError, load
from MaxOffload.models.positions import Positions
from MaxOffload.offload import placement


TINY = "configs/deepseek_v3.py:tiny"
LENGTH = 16


def config(*overrides):
    return load([TINY, "model.compute_dtype=float32", f"train.seq_len={LENGTH}", "train.per_device_batch_size=2",
                 *overrides])


def batch(rng_seed=0, vocab=512, rows=2):
    """A batch cut from longer sequences: inputs = seq[:-1], targets = seq[1:] (the data pipeline's layout)."""
    seq = np.random.default_rng(rng_seed).integers(0, vocab, (rows, LENGTH + 1))
    mask = np.ones((rows, LENGTH), np.float32)
    mask[1, 11] = 0.0  # one masked target: the MTP loss must skip the positions that predict it
    return {"inputs": jnp.asarray(seq[:, :-1], jnp.int32), "targets": jnp.asarray(seq[:, 1:], jnp.int32),
            "mask": jnp.asarray(mask)}, seq, mask


def rms(x, scale, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_logits_and_loss_match_a_reference_from_the_definition(monkeypatch):
    """Depth 2: h_k = block_k(eh_proj_k [enorm_k(Emb(t_{i+k})); hnorm_k(h_{k-1})]), logits_k =
    unembed(head_norm_k(h_k)), h_0 = the main model's normalised final hidden state; loss = main + lambda / D x
    sum_k CE_k, where depth k at position i predicts seq[i + k + 1] and only where that target exists and is
    not masked. The blocks are the model's own DecoderLayer (tested against references in test_deepseek.py):
    what is checked here is the wiring around them. The layers run unscanned here (a Python loop over the
    same stacked parameters); the other tests scan them."""
    cfg = config("model.mtp_depth=2", "model.mtp_loss_weight=0.25", "model.seq_balance_loss_weight=0",
                 "model.scan_layers=false")
    setup = from_config.train_setup(cfg)
    state = jax.jit(setup._init)()
    data, seq, mask = batch()
    seen = []  # the normalised hidden states the shared head is given: the MTP depths', then the main model's
    unembed = models.stack.DecoderModel.unembed_normed
    monkeypatch.setattr(models.stack.DecoderModel, "unembed_normed",
                        lambda self, x, embed: (seen.append(x), unembed(self, x, embed))[1])
    def forward_and_loss(params, model_state):  # one compile for both
        logits, aux = setup.forward(params, model_state, data["inputs"])
        return logits, aux, seen[-1], setup.loss(params, model_state, data)

    logits, aux, h, (objective, loss_aux) = jax.jit(forward_and_loss)(state["params"], state["model_state"])
    assert aux["mtp_logits"].shape == (2, 2, LENGTH, 512) and logits.shape == (2, LENGTH, 512)
    h = np.asarray(h)
    params = state["params"]
    embed, head = np.asarray(params["embed"]), np.asarray(params["unembed"])
    mtp = params["mtp_layers"]
    model = nnx.merge(setup.graphdef, params, state["model_state"])
    block_graph, block_state = nnx.split(model.mtp_layers.block)
    positions = Positions(jnp.broadcast_to(jnp.arange(LENGTH), (2, LENGTH)))
    run_block = jax.jit(lambda k, x: nnx.merge(block_graph, jax.tree.map(lambda p: p[k], block_state))(x, positions))
    ref_ce = []
    for k in range(1, 3):
        layer = jax.tree.map(lambda p: np.asarray(p[k - 1]), mtp)
        nxt = np.zeros((2, LENGTH, setup.model_config.emb_dim), np.float32)
        nxt[:, :LENGTH - k] = embed[seq[:, k:LENGTH]]  # Emb(t_{i+k}), t = the inputs; the end: no such token
        nxt[:, LENGTH - k:] = embed[seq[:, :k]]  # what the model puts there (the inputs rolled); masked below
        joined = np.concatenate([rms(nxt, layer["enorm"]["scale"]), rms(h, layer["hnorm"]["scale"])], -1)
        out = run_block(k - 1, jnp.asarray(joined @ layer["eh_proj"]))
        h = rms(np.asarray(out[0] if isinstance(out, tuple) else out), layer["head_norm"]["scale"])
        ref_logits = h @ head
        np.testing.assert_allclose(np.asarray(aux["mtp_logits"][k - 1]), ref_logits, rtol=2e-4, atol=2e-4)
        logp = log_softmax(ref_logits.astype(np.float64))
        total = count = 0.0
        for b in range(2):
            for i in range(LENGTH - k):  # predicts seq[i + k + 1], the target at index i + k
                if mask[b, i + k]:
                    total -= logp[b, i, seq[b, i + k + 1]]
                    count += 1
        ref_ce.append(total / count)
    assert count == 2 * (LENGTH - 2) - 1  # the masked target dropped one position of depth 2
    main_logp = log_softmax(np.asarray(logits, np.float64))
    main = -sum(main_logp[b, i, seq[b, i + 1]] * mask[b, i] for b in range(2) for i in range(LENGTH)) / mask.sum()
    assert float(loss_aux["metrics"]["mtp_loss"]) == pytest.approx(np.mean(ref_ce), rel=1e-5)
    assert float(objective) == pytest.approx(main + 0.25 * np.mean(ref_ce), rel=1e-5)
    assert "mtp_logits" not in loss_aux  # the loss consumed them


class Gradients:
    """One compiled value-and-gradient of a config's objective + weight x its MTP loss (the weight an argument:
    one compile serves every weight; the config's own mtp_loss_weight is tested above)."""

    def __init__(self, *overrides):
        self.setup = from_config.train_setup(config(*overrides))
        self.state = jax.jit(self.setup._init)()
        self.data = batch()[0]
        self.step = jax.jit(jax.value_and_grad(self._objective, has_aux=True))

    def _objective(self, params, weight):
        value, aux = self.setup.loss(params, self.state["model_state"], self.data)
        return value + weight * aux["metrics"].get("mtp_loss", jnp.zeros(())), aux

    def __call__(self, weight):
        """(objective, MTP loss, gradients of the parameters, the loss's aux)."""
        (value, aux), grads = self.step(self.state["params"], weight)
        return value, aux["metrics"].get("mtp_loss", jnp.zeros(())), grads, aux


@pytest.fixture(scope="module")
def gradients():
    """Depth 0 and depth 1, both with mtp_loss_weight = 0 and no balance loss (which the MTP block's router
    would add to)."""
    return {depth: Gradients("model.seq_balance_loss_weight=0", f"model.mtp_depth={depth}", "model.mtp_loss_weight=0")
            for depth in (0, 1)}


def test_depth_zero_is_the_model_without_mtp_and_mtp_only_adds_to_it(gradients):
    """The MTP parameters are created after the main model's: with and without MTP the main model starts from
    the same weights (bit for bit). With lambda = 0 the objective and every main-model gradient are depth 0's;
    depth 0 has no MTP parameters or output."""
    loss0, mtp0, grads0, _ = gradients[0](0.0)
    loss1, mtp1, grads1, _ = gradients[1](0.0)
    assert "mtp_layers" not in gradients[0].state["params"] and float(mtp0) == 0
    main = {k: v for k, v in gradients[1].state["params"].items() if k != "mtp_layers"}
    jax.tree.map(np.testing.assert_array_equal, main, gradients[0].state["params"])
    # equal up to float32 rounding: XLA fuses the two programs differently
    assert float(loss1) == pytest.approx(float(loss0), rel=1e-6) and float(mtp1) > 0
    same = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)  # noqa: E731
    jax.tree.map(same, {k: v for k, v in grads1.items() if k != "mtp_layers"}, grads0)
    assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(grads1["mtp_layers"]))  # lambda 0: no signal


def test_gradients_reach_the_mtp_block_and_the_shared_embedding_and_head(gradients):
    loss0, mtp, grads0, _ = gradients[1](0.0)
    loss1, _, grads1, _ = gradients[1](0.3)
    assert float(loss1) == pytest.approx(float(loss0) + 0.3 * float(mtp), rel=1e-6)
    mtp = grads1["mtp_layers"]
    for path in (("eh_proj",), ("enorm", "scale"), ("hnorm", "scale"), ("head_norm", "scale"),
                 ("block", "attention", "wq_a"), ("block", "mlp", "router"), ("block", "mlp", "wi_0")):
        leaf = mtp
        for key in path:
            leaf = leaf[key]
        assert float(jnp.abs(leaf).max()) > 0, path
    for shared in ("embed", "unembed"):  # the MTP loss changes the shared weights' gradients
        assert float(jnp.abs(grads1[shared] - grads0[shared]).max()) > 1e-6, shared
    # the main model's last layers feed h_0: the MTP loss reaches them too
    assert float(jnp.abs(grads1["moe_layers"]["attention"]["wo"] - grads0["moe_layers"]["attention"]["wo"]).max()) > 0


def test_the_mtp_block_is_a_layer_group_with_its_own_policy(gradients):
    """remat.groups.m.layers=mtp: the MTP block (global layer 3 of the tiny model) offloads its routed experts'
    inputs while the main MoE layers keep the global policy; every name a main layer tags, the MTP block tags
    too; router biases and expert loads of the MTP block are model state and metrics like a layer's."""
    cfg = config("model.mtp_depth=1", "remat.groups.m.layers=mtp", "remat.groups.m.tensors.moe_mlpwi_0=offload",
                 "remat.groups.m.tensors.query_proj=offload")
    c = models.model_config(cfg.model)
    assert c.layer_groups() == {"dense": (0, 1), "moe": (1, 3), "mtp": (3, 4)}
    assert models.tagged_names(c) == models.tagged_names(models.model_config(config().model))
    setup = from_config.train_setup(cfg)
    jaxpr = jax.make_jaxpr(setup.train_step)(setup.abstract_state, setup.abstract_batch())
    found = placement.classify_residuals(jaxpr)
    assert {n: kind for n, (kind, _) in found["layers_3_3"].items() if kind == "offload"} == {
        "moe_mlpwi_0": "offload", "query_proj": "offload"}
    assert found["layers_1_2"]["moe_mlpwi_0"][0] == "remat" and found["layers_3_3"]["key_proj"][0] == "remat"
    assert jax.tree.map(lambda a: a.shape, setup.abstract_state["model_state"]) == {
        "moe_layers": {"mlp": {"router_bias": (2, 8)}}, "mtp_layers": {"block": {"mlp": {"router_bias": (1, 8)}}}}
    aux = gradients[1](0.0)[3]  # the same model without the remat group
    assert {"moe/max_load_layer3", "moe/bias_range_layer3", "moe/max_load_layer1"} <= set(aux["metrics"])
    bias = np.asarray(aux["model_state"]["mtp_layers"]["block"]["mlp"]["router_bias"])
    assert set(np.round(bias.ravel() / cfg.model.router_bias_update_rate).tolist()) <= {-1.0, 0.0, 1.0}
    assert np.abs(bias).max() > 0


@pytest.mark.parametrize("overrides,words", [(["model.mtp_depth=-1"], ["model.mtp_depth", ">= 0"]),
                                             (["model.mtp_loss_weight=-0.1"], ["model.mtp_loss_weight"]),
                                             (["model.mtp_depth=1", "remat.groups.g.layers=4"],
                                              ["out of range", "0-3"])])
def test_bad_mtp_settings_are_one_line(overrides, words):
    with pytest.raises(ConfigError) as e:
        load([TINY, *overrides])
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_671b_with_mtp_counts_the_block_and_its_work():
    """The 671b preset has DeepSeek-V3's one MTP depth: the main model's 671.0B parameters + one MoE block,
    its eh_proj and three norms (682.6B); 684.5B as released (the MTP layer's copies of the embedding and the
    head). Its FLOPs: one more layer of MLA + MoE, eh_proj and a second pass through the output head."""
    c = models.model_config(load(["configs/deepseek_v3.py:671b"]).model)
    main = models.model_config(load(["configs/deepseek_v3.py:671b", "model.mtp_depth=0"]).model)
    d, vocab, heads = 7168, 129280, 128
    mla = d * 1536 + 1536 + 1536 * heads * 192 + d * (512 + 64) + 512 + 512 * heads * 128 * 2 + heads * 128 * d
    moe_layer = mla + 2 * d + d * 256 + 256 * 3 * d * 2048 + 3 * d * 2048
    block = 2 * d * d + 3 * d + moe_layer
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(nnx.eval_shape(
        lambda: from_config.model(load(["configs/deepseek_v3.py:671b"]))), nnx.Param)))
    assert total == 671_026_404_352 + block == 682_636_472_320
    assert total + c.params_stored_twice() == total + 2 * vocab * d == pytest.approx(685e9, rel=0.001)
    mla_macs = d * 1536 + 1536 * heads * 192 + d * 576 + 512 * heads * 256 + heads * 128 * d
    extra = mla_macs + 2 * d * d + d * 256 + (8 + 1) * 3 * d * 2048 + d * vocab
    assert c.matmul_params_per_token() == main.matmul_params_per_token() + extra
    # activated per token (model cards' count: its matmul weights and the embedding table): the published 37B
    assert main.active_params() == main.matmul_params_per_token() + vocab * d == pytest.approx(37.55e9, rel=0.001)
    assert c.active_params() == main.active_params() + extra
    assert c.attention_dims()[0] == 62


# --------------------------------------------------------------------------------------------
# training with MTP, and an exact resume

RUN = [TINY, "model.mtp_depth=1", "train.seq_len=64", "train.per_device_batch_size=4", "train.eval_every=0",
       "model.compute_dtype=float32", "run.log_every=1", "train.steps=40"]


def rows(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("mtp_straight")
    result = run_cli(["train.py", *RUN, f"run.output_dir={out}"])
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_tiny_deepseek_with_mtp_trains_and_logs_the_mtp_loss(straight):
    logged = rows(straight)
    assert [r["step"] for r in logged] == list(range(1, 41))
    main, mtp = [r["loss"] for r in logged], [r["mtp_loss"] for r in logged]
    assert np.mean(main[-5:]) < main[0] - 1.0 and np.mean(mtp[-5:]) < mtp[0] - 0.5, (main, mtp)
    tensorboard = os.path.join(straight, "tensorboard")
    events = b"".join(open(os.path.join(root, f), "rb").read() for root, _, files in os.walk(tensorboard)
                      for f in files)
    assert b"train/mtp_loss" in events and b"train/moe/max_load_layer3" in events


def test_resume_with_mtp_is_bit_identical(tmp_path, straight):
    saved, result = sigterm_and_resume([*RUN, f"run.output_dir={tmp_path}", "checkpoint.every_steps=10"], tmp_path, 12)
    assert f"(step {saved})" in result.stdout and 12 <= saved < 40
    assert losses(tmp_path) == losses(straight)
    assert [r["mtp_loss"] for r in rows(tmp_path)] == [r["mtp_loss"] for r in rows(straight)]

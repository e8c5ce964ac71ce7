"""A model family is one `models.register` call: this file defines a toy family (LayerNorm, a GELU MLP, the
shared attention) that MaxOffload has never seen, registers it, and trains, inspects and plans it through the
same entry points as Llama and DeepSeek, without any edit under MaxOffload/.

What the registry must give it: config keys of its own (model.mlp_activation) in the schema, its own checks
in validation, its tagged names read off its trace (so remat.tensors of a name it never tags is refused),
its recompute-cost table in the planner, and its layer group for remat.groups."""
import dataclasses
import json
import math
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from conftest import ROOT
from MaxOffload import models, from_config
from MaxOffload.config import ConfigError, load
from MaxOffload.errors import require, require_choice
from MaxOffload.models.base import ModelConfig, field
from MaxOffload.models import components
from MaxOffload.models.attention.gqa import Attention
from MaxOffload.models.layers import BATCH_LENGTH_EMBED, param
from MaxOffload.models.rope import rope_inv_freq
from MaxOffload.models.stack import SingleStackDecoder
from MaxOffload.offload import inspect as inspect_lib
from MaxOffload.offload import names, planner


ACTIVATIONS = {"gelu": jax.nn.gelu, "relu": jax.nn.relu}
TAGGED = (names.DECODER_LAYER_INPUT, names.QUERY_PROJ, names.KEY_PROJ, names.VALUE_PROJ, names.ATTENTION_OUT,
          names.OUT_PROJ, names.MLPWI, names.MLPWO)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyConfig(ModelConfig):
    """The shared fields come from ModelConfig; the toy's own keys are declared here, once."""
    num_kv_heads: int = field(4, "toy: key/value heads")
    head_dim: int = field(32, "toy: dimension per attention head")
    mlp_activation: str = field("gelu", "toy: the MLP's activation: gelu | relu")

    def validate(self):
        require_choice("model.mlp_activation", self.mlp_activation, tuple(ACTIVATIONS))
        require(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads must divide model.num_heads")

    def matmul_params_per_token(self):
        d, hd = self.emb_dim, self.head_dim
        return self.num_layers * (d * hd * (2 * self.num_heads + 2 * self.num_kv_heads) + 2 * d * self.mlp_dim) \
            + d * self.vocab_size

    def attention_dims(self):
        return self.num_layers, self.num_heads, self.head_dim, self.head_dim

    def contractions(self, model_group, seq_len):
        d = self.emb_dim
        return {names.DECODER_LAYER_INPUT: 0, names.QUERY_PROJ: d, names.KEY_PROJ: d, names.VALUE_PROJ: d,
                names.ATTENTION_OUT: seq_len / 2, names.OUT_PROJ: self.num_heads * self.head_dim, names.MLPWI: d,
                names.MLPWO: self.mlp_dim}


class LayerNorm(nnx.Module):
    def __init__(self, dim, *, eps, param_dtype):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=("norm",), eager_sharding=False)
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), out_sharding=("norm",), eager_sharding=False)

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        normed = (x32 - mean) * jax.lax.rsqrt(jnp.var(x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...] + self.bias[...]).astype(x.dtype)


class ToyLayer(nnx.Module):
    def __init__(self, c, *, rngs, ctx):
        pdt = jnp.dtype(c.param_dtype)
        self.activation, self.ctx = c.mlp_activation, ctx
        self.attention_norm = LayerNorm(c.emb_dim, eps=c.norm_eps, param_dtype=pdt)
        self.attention = Attention(emb_dim=c.emb_dim, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                                   head_dim=c.head_dim, inv_freq=rope_inv_freq(c.head_dim, c.rope_theta),
                                   param_dtype=pdt, init_std=c.init_std, rngs=rngs, attention=c.attention, ctx=ctx)
        self.mlp_norm = LayerNorm(c.emb_dim, eps=c.norm_eps, param_dtype=pdt)
        self.wi = param(rngs, (c.emb_dim, c.mlp_dim), ("embed", "mlp"), pdt, c.init_std)
        self.wo = param(rngs, (c.mlp_dim, c.emb_dim), ("mlp", "embed"), pdt, c.init_std)

    def __call__(self, x, positions):
        x = names.tag(x, names.DECODER_LAYER_INPUT)
        x = x + self.attention(self.attention_norm(x), positions)
        mlp = lambda a, w: self.ctx.dense(a, w[...], None, components.MLP)  # noqa: E731
        hidden = names.tag(mlp(self.mlp_norm(x), self.wi), names.MLPWI)
        out = mlp(ACTIVATIONS[self.activation](hidden), self.wo)
        return x + names.tag(self.ctx.constrain(out, BATCH_LENGTH_EMBED), names.MLPWO)


class Toy(SingleStackDecoder):
    @staticmethod
    def make_layer(c, rngs, ctx):
        return ToyLayer(c, rngs=rngs, ctx=ctx)


@pytest.fixture
def toy():
    models.register("toy", models.Family(ToyConfig, Toy))  # its keys: ToyConfig's own fields
    yield
    del models.FAMILIES["toy"]


SEQ, BATCH, MLP = 32, 2, 96
BASE = ["configs/llama3_1.py:tiny", "model.family=toy", f"model.mlp_dim={MLP}", f"train.seq_len={SEQ}",
        f"train.per_device_batch_size={BATCH}", "train.warmup_steps=0", "train.eval_every=0", "train.eval_batches=1"]


def _train(argv):
    sys.path.insert(0, ROOT)
    import train

    return train.main(argv)


def _losses(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [row["loss"] for row in map(json.loads, f) if "loss" in row and "step" in row]


def test_the_registry_gives_a_new_family_config_keys_checks_and_traced_names(toy, tmp_path):
    cfg = load(BASE + ["model.mlp_activation=relu", f"run.output_dir={tmp_path}"])
    config = models.model_config(cfg.model)
    assert isinstance(config, ToyConfig) and config.mlp_activation == "relu"
    assert models.tagged_names(config) == TAGGED  # read off the trace: the MLP tags mlpwi, not mlpwi_0/1
    assert config.layer_groups() == {"decoder": (0, 2)}
    with pytest.raises(ConfigError, match="model.mlp_activation='swish' is not one of gelu, relu"):
        load(BASE + ["model.mlp_activation=swish", f"run.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="the toy model never tags 'mlpwi_0'.*it tags: decoder_layer_input, "
                                          "query_proj, key_proj, value_proj, attention_out, out_proj, mlpwi, mlpwo"):
        load(BASE + ["remat.tensors.mlpwi_0=offload", f"run.output_dir={tmp_path}"])


def test_a_registered_family_trains_and_its_offload_is_proven(toy, tmp_path):
    """train.py's own path (the parity gate on, so the offloaded step matches full remat), then the inspect
    tool's report: the toy's GELU input projection lands on the host, the attention projections stay."""
    argv = BASE + ["remat.tensors.mlpwi=offload", "remat.tensors.query_proj=device", "offload.verify_parity=true",
                   "train.steps=6", "train.learning_rate=3e-3", "checkpoint.enabled=false"]
    assert _train(argv + [f"run.output_dir={tmp_path / 'run'}"]) == 0
    losses = _losses(tmp_path / "run")
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses

    assert inspect_lib.main(argv + [f"run.output_dir={tmp_path / 'inspect'}", "--no_cpu_memory"]) == 0
    report = json.load(open(tmp_path / "inspect" / "offload_report.json"))
    assert report["problems"] == [] and report["cuda_pinned_host_placements"] == 1  # the CUDA lowering, too
    group = report["groups"]["layers_0_1"]
    assert group["model_group"] == "decoder" and group["offloaded"] == [names.MLPWI]
    assert names.QUERY_PROJ in group["saved"] and names.KEY_PROJ in group["remat"]
    assert group["tensors"][names.MLPWI]["shape"] == [BATCH * jax.device_count(), SEQ, MLP]
    assert group["offload_bytes_per_device"] > 0


def test_a_registered_family_is_planned_from_its_own_cost_table_and_trains_on_the_plan(toy, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = load(BASE + ["remat.policy=auto", f"run.output_dir={tmp_path}"])
    result = planner.decide(cfg, confirm=False, log=lambda *_: None)
    by_name = {c.name: c for c in result.candidates}
    assert set(by_name) <= set(TAGGED) and names.MLPWI in by_name
    tokens, d = BATCH * SEQ, 64
    assert by_name[names.MLPWI].recompute_flops == 2 * tokens * MLP * d  # the toy's contractions: K = emb_dim
    plan = planner.plan_for(cfg, log=lambda *_: None)
    assert [(s.model_group, s.start, s.stop) for s in plan.segments] == [("decoder", 0, 2)]
    assert {n for n, _ in plan.segments[0].decisions} >= set(TAGGED)
    assert plan != from_config.template(cfg)  # the planner chose something other than full remat
    assert _train(BASE + ["remat.policy=auto", "train.steps=2", "checkpoint.enabled=false",
                          f"run.output_dir={tmp_path / 'run'}"]) == 0
    assert len(_losses(tmp_path / "run")) == 2

"""The house the next features build on: every weight matmul goes through models/matmul.py (read off the traced
training step of both families), and a MoE layer is a router + an exchange + the experts' grouped GEMM, each
replaceable from outside: this file adds a router and an exchange MaxOffload has never seen and trains a tiny MoE
with them."""
import collections
import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import EIGHT_CPUS, ROOT, process_env
from MaxOffload import from_config
from MaxOffload.config import load
from MaxOffload.models import components, exchange, matmul, routing
from MaxOffload.offload import names as offload_names


SMALL = ["train.seq_len=16", "train.per_device_batch_size=2"]


def matmul_scopes(jaxpr):
    """[(primitive, name stack)] of every matmul of a jaxpr, sub-jaxprs (scan, remat, custom VJP, shard_map) too."""
    out = []

    def walk(j, stack):
        for eqn in j.eqns:
            here = f"{stack}/{eqn.source_info.name_stack}"
            if eqn.primitive.name in ("dot_general", "ragged_dot", "ragged_dot_general"):
                out.append((eqn.primitive.name, here))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else [value]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner, here)

    walk(jaxpr.jaxpr, "")
    return out


@pytest.mark.parametrize("spec, forward", [
    # per layer: q, k, v, o + the SwiGLU's 3; the output head
    (["configs/llama3_1.py:tiny"], 7 + 1),
    # the dense layer: MLA's 6 projections + its SwiGLU's 3; a MoE layer: MLA 6 + router + 3 grouped + the shared
    # expert's 3; the MTP block: eh_proj + a MoE layer's 13; the output head twice (main, MTP)
    (["configs/deepseek_v3.py:tiny", "model.mtp_depth=1"], 9 + 13 + 14 + 2),
    (["configs/deepseek_v3.py:tiny", "model.capacity_factor=1.5"], 9 + 13 + 1),
])
def test_every_weight_matmul_goes_through_the_entry_point(spec, forward):
    """No dot_general or ragged_dot of the training step outside models/matmul's scope, except the two that contract
    activations (attention scores and values; the experts' gate-weighted combine); the forward pass's weight
    matmuls counted by hand (each scanned stack's body once)."""
    setup = from_config.train_setup(load([*spec, *SMALL]))
    found = matmul_scopes(jax.make_jaxpr(setup.train_step)(setup.abstract_state, setup.abstract_batch()))
    outside = [(p, s) for p, s in found if matmul.SCOPE not in s and not any(a in s for a in matmul.ACTIVATION_SCOPES)]
    assert not outside, outside[:3]
    weights = [s for _, s in found if matmul.SCOPE in s]
    forward_only = [s for s in weights if "transpose(" not in s and "rematted_computation" not in s]
    assert len(forward_only) == forward, collections.Counter(s.split("/")[-2] for s in forward_only)
    # the backward pass's matmuls are the entry point's too (its transposes keep the scope)
    assert any("transpose(" in s for s in weights)


def test_numerics_is_where_weights_meet_activations():
    """bf16: the weight cast to the compute dtype, the router in float32, the output head accumulated in float32."""
    numerics = matmul.Numerics("bfloat16")
    x, w = jnp.ones((2, 3, 4), jnp.bfloat16), jnp.ones((4, 5), jnp.float32)
    assert matmul.dense(x, w, None, components.MLP, numerics).dtype == jnp.bfloat16
    assert matmul.dense(x, w, "ble,ev->blv", components.UNEMBED, numerics).dtype == jnp.float32
    assert matmul.dense(x, w, "ble,en->bln", components.ROUTER, numerics).dtype == jnp.float32


# --------------------------------------------------------------------------------------------
# a router and an exchange from outside


@dataclasses.dataclass(frozen=True)
class CountingRouter(routing.Router):
    """Softmax scores, the top-k experts with equal gates, and a router state that counts every expert's choices
    (so the state's update and the router's metrics are exercised)."""
    state = {"choices_seen": routing.RouterBias}

    def route(self, logits, state):
        scores = jax.nn.softmax(logits, axis=-1)
        experts = jax.lax.top_k(scores, self.top_k)[1]
        return routing.Routing(experts, jnp.full(experts.shape, 1.0 / self.top_k, jnp.float32), scores)

    def next_state(self, state, load):
        return {"choices_seen": jax.lax.stop_gradient(state["choices_seen"] + load)}

    def metrics(self, stats, state):
        return {"choices_seen": state["choices_seen"].sum(-1)}


class LocalExchange(exchange.Exchange):
    """Every expert on this device: dispatch, grouped matmuls and combine with no communication (one device)."""

    def dispatch(self, x, experts, positions):
        positions = jnp.zeros_like(experts) if positions is None else positions
        return exchange.dispatch(x, experts, positions, first_expert=0, num_local=self.num_experts,
                                 capacity=self.capacity)

    def matmul_in(self, rows, w, sizes):
        return self.ctx.grouped(rows, w, sizes, self.capacity, self.kernel)

    matmul_out = matmul_in

    def combine(self, y_rows, row, gates):
        return exchange.combine(y_rows, row, gates)


@pytest.fixture
def toys():
    routing.ROUTERS["counting"] = CountingRouter
    exchange.EXCHANGES["local"] = LocalExchange
    yield
    del routing.ROUTERS["counting"], exchange.EXCHANGES["local"]


def train(cfg, steps):
    setup = from_config.train_setup(cfg)
    state, step = setup.init_state(), setup.compile_train_step()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (int(cfg.train.per_device_batch_size), cfg.train.seq_len + 1)).astype(np.int32)
    batch = setup.put_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                             "mask": np.ones(tokens[:, 1:].shape, np.float32)})
    losses, metrics = [], None
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, state, jax.device_get(metrics)


def test_a_router_and_an_exchange_added_from_a_test_file_train_a_tiny_moe(toys):
    cfg = load(["configs/deepseek_v3.py:tiny", "model.router=counting", "mesh.exchange=local",
                "model.seq_balance_loss_weight=0", "train.learning_rate=0.01", "train.warmup_steps=1", *SMALL])
    steps = 25
    losses, state, metrics = train(cfg, steps)
    assert losses[-1] < 0.7 * losses[0], losses
    seen = np.asarray(state["model_state"]["moe_layers"]["mlp"]["choices_seen"])  # [MoE layers, experts]
    per_step = cfg.train.per_device_batch_size * cfg.train.seq_len * cfg.model.num_experts_per_tok
    np.testing.assert_array_equal(seen.sum(-1), steps * per_step)
    assert metrics["moe/choices_seen_layer1"] == steps * per_step and "moe/bias_range_layer1" not in metrics
    with pytest.raises(Exception, match="model.router='nope' is not one of"):
        load(["configs/deepseek_v3.py:tiny", "model.router=nope"])


def test_the_softmax_router_trains_and_has_no_state():
    cfg = load(["configs/deepseek_v3.py:tiny", "model.router=softmax", "model.seq_balance_loss_weight=0",
                "train.learning_rate=0.01", "train.warmup_steps=1", *SMALL])
    losses, state, metrics = train(cfg, 15)
    assert losses[-1] < 0.8 * losses[0], losses
    assert state["model_state"] == {} and "moe/max_load" in metrics


def primitive_counts(jaxpr, names):
    """{primitive name: how many times it appears in a jaxpr and its sub-jaxprs (a rematerialized block's too)}."""
    counts = collections.Counter()

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive.name in names:
                counts[eqn.primitive.name] += 1
            for sub in offload_names.sub_jaxprs(eqn):
                walk(sub)

    walk(jaxpr.jaxpr)
    return counts


ROWS_CHECK = """
import json, sys
import jax
from MaxOffload import from_config
from MaxOffload.config import load
sys.path.insert(0, "tests")
from test_moe_parts import primitive_counts
counts = {}
for decision in ("remat", "device"):
    setup = from_config.train_setup(load(["configs/deepseek_v3.py:tiny", "mesh.ici.expert=8", "mesh.ici.fsdp=1",
                                          "mesh.exchange=all_to_all", f"remat.tensors.moe_rows={decision}"]))
    jaxpr = jax.make_jaxpr(setup.train_step)(setup.abstract_state, setup.abstract_batch())
    counts[decision] = primitive_counts(jaxpr, ("all_to_all",))["all_to_all"]
print(json.dumps(counts))
"""


def test_saving_the_dispatched_rows_spares_the_backward_the_exchange():
    """moe_rows (the rows a device holds for its experts and where they came from) saved: the backward pass does
    not dispatch again, one all-to-all of rows (and its indices) fewer in the traced step on 8 expert ranks."""
    env = process_env([], EIGHT_CPUS)
    out = subprocess.run([sys.executable, "-c", ROWS_CHECK], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts["device"] < counts["remat"], counts

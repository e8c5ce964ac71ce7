"""MoE routers: which experts each token goes to, with what gate weight, and the load statistics and router state
(DeepSeek-V3's selection bias) that come with that choice. `model.router` picks one from ROUTERS; a new kind is
one class and one `ROUTERS[name] = ...` (tests/test_moe_parts.py adds one from a test file).

A router is a strategy over what the MoE layer computes and holds: the routing logits x @ router [b, l, E] in
float32 (the layer's `router` weight, through models/matmul.py) and, when the router keeps state, its model-state
variables (e.g. `router_bias`), so parameter paths do not depend on the router kind:
  route(logits, state)               -> Routing(experts [b, l, k], gates [b, l, k] f32, scores [b, l, E] f32)
  statistics(routing)                -> {name: array} per layer (`load` [E] at least), stacked over layers
  next_state(state, load)            -> the router state after a step with these expert loads (stop-gradient)
  metrics(stats, state)              -> {name: per-layer array} logged beside the loads
"""
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from MaxOffload.models import components


class RouterBias(nnx.Variable):
    """Per-expert selection bias: model state the model updates itself, not an optimizer Param."""


class Routing(NamedTuple):
    experts: jax.Array  # [b, l, k] int32
    gates: jax.Array  # [b, l, k] float32
    scores: jax.Array  # [b, l, E] float32


def load_of(experts, num_experts):
    """Choices per expert [E] of one layer's routing."""
    return jax.nn.one_hot(experts, num_experts).sum((0, 1, 2))


@dataclasses.dataclass(frozen=True)
class Router:
    """The interface (module docstring). `state` names the router's non-Param variables and their class."""
    top_k: int
    state = {}

    @classmethod
    def of(cls, config):
        """The router a family's model configuration asks for (its num_experts_per_tok; more fields where a kind
        has them)."""
        return cls(top_k=config.num_experts_per_tok)

    def route(self, logits, state):
        raise NotImplementedError

    def statistics(self, routing):
        return {"load": load_of(routing.experts, routing.scores.shape[-1])}

    def next_state(self, state, load):
        return state

    def metrics(self, stats, state):
        return {}


# --------------------------------------------------------------------------------------------
# DeepSeek-V3: sigmoid scores, group-limited top-k on scores + bias, auxiliary-loss-free balancing


def group_limited_top_k(biased, top_k, n_groups, topk_groups):
    """Indices [..., top_k] of the best experts by `biased`, among the experts of the `topk_groups`
    groups ranked highest by the sum of their two best scores (DeepSeek-V3's node-limited routing)."""
    if n_groups > 1:
        grouped = biased.reshape(*biased.shape[:-1], n_groups, -1)
        group_score = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0].sum(-1)
        kept = jax.nn.one_hot(jax.lax.top_k(group_score, topk_groups)[1], n_groups).sum(-2) > 0
        biased = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(biased.shape)
    return jax.lax.top_k(biased, top_k)[1]


@components.scoped(components.ROUTER)
def route(logits, bias, *, top_k, n_groups, topk_groups, scaling):
    """(experts [b, l, k] int32, gates [b, l, k] float32, scores [b, l, E] float32) of DeepSeek-V3's router from
    the routing logits [b, l, E].

    The bias changes which experts are chosen, never the gate weights or the gradient."""
    scores = jax.nn.sigmoid(logits)
    experts = group_limited_top_k(scores + jax.lax.stop_gradient(bias), top_k, n_groups, topk_groups)
    chosen = jnp.take_along_axis(scores, experts, axis=-1)
    return Routing(experts, chosen / (chosen.sum(-1, keepdims=True) + 1e-20) * scaling, scores)


def updated_bias(bias, load, rate):
    """Auxiliary-loss-free balancing: bias += rate * sign(mean load - load), per expert (last axis)."""
    return bias + rate * jnp.sign(jnp.mean(load, -1, keepdims=True) - load)


def sequence_balance_loss(scores, experts):
    """DeepSeek-V3's sequence-wise balance loss before its weight alpha: the mean over sequences of
    sum_i f_i P_i, f_i = E / (k L) * (tokens choosing expert i), P_i = mean_t s_i,t / sum_j s_j,t."""
    _, length, num_experts = scores.shape
    chosen = jax.nn.one_hot(experts, num_experts).sum((1, 2))  # [b, E]
    f = chosen * num_experts / (experts.shape[-1] * length)
    p = (scores / scores.sum(-1, keepdims=True)).mean(1)
    return jnp.mean(jnp.sum(f * p, -1))


@dataclasses.dataclass(frozen=True)
class DeepSeekRouter(Router):
    n_groups: int = 1
    topk_groups: int = 1
    scaling: float = 1.0
    bias_update_rate: float = 0.001
    state = {"router_bias": RouterBias}

    @classmethod
    def of(cls, c):
        return cls(c.num_experts_per_tok, c.n_groups, c.topk_groups, c.routed_scaling_factor, c.router_bias_update_rate)

    def route(self, logits, state):
        return route(logits, state["router_bias"], top_k=self.top_k, n_groups=self.n_groups,
                     topk_groups=self.topk_groups, scaling=self.scaling)

    def statistics(self, routing):
        return {"load": load_of(routing.experts, routing.scores.shape[-1]),
                "balance": sequence_balance_loss(routing.scores, routing.experts)}

    def next_state(self, state, load):
        return {"router_bias": jax.lax.stop_gradient(updated_bias(state["router_bias"], load, self.bias_update_rate))}

    def metrics(self, stats, state):
        bias = state["router_bias"]
        return {"bias_range": bias.max(-1) - bias.min(-1)}


# --------------------------------------------------------------------------------------------
# softmax top-k (Mixtral, Qwen-MoE): gates = the chosen experts' softmax probabilities, renormalised


@components.scoped(components.ROUTER)
def softmax_route(logits, top_k):
    probs = jax.nn.softmax(logits, axis=-1)
    gates, experts = jax.lax.top_k(probs, top_k)
    return Routing(experts, gates / gates.sum(-1, keepdims=True), probs)


@dataclasses.dataclass(frozen=True)
class SoftmaxRouter(Router):
    def route(self, logits, state):
        return softmax_route(logits, self.top_k)


ROUTERS = {"deepseek": DeepSeekRouter, "softmax": SoftmaxRouter}

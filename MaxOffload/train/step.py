"""The pure, jitted core: train state, loss, one training step, one evaluation step."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from MaxOffload import deviceless, models, xla
from MaxOffload.models import components, kernels, matmul
from MaxOffload.models.stack import to_device
from MaxOffload.errors import ConfigError
from MaxOffload.parallel import logical
from MaxOffload.parallel import mesh as mesh_lib
from MaxOffload.parallel.layout import ParallelLayout
from MaxOffload.parallel.pipeline import Pipeline

BATCH_AXES = ("activation_batch", "activation_length")
PER_MICRO_BATCH, PER_STEP = "per_micro_batch", "per_step"  # where accumulation gathers the fsdp-sharded weights
HOST, DEVICE = "pinned_host", "device"


def check_splash(model_config, seq_len, layout):
    """ConfigError (one line) for a step TPUs cannot run with their attention kernel (models/attention/splash.py):
    a sequence, or over context axes a shard's chunk of it, that no splash block divides."""
    kernel = getattr(model_config, "attention", None)
    if not kernels.is_splash(kernel or ""):
        return
    block = model_config.attention_block
    blocks = [block] if block else kernels.SPLASH_BLOCKS
    fix = f"{', or model.attention_block=0' if block else ''}, or model.attention=xla"
    if kernels.splash_block(seq_len, kernel) is None:
        raise ConfigError(f"train.seq_len={seq_len}: splash attention (model.attention=auto/flash on TPUs) runs "
                          f"sequences in blocks of {' or '.join(map(str, blocks))} tokens; use a multiple of "
                          f"{blocks[-1]}{fix}")
    ways = layout.context_ways
    chunk = seq_len // ways // (2 if layout.token_order(seq_len) is not None else 1)
    if ways > 1 and kernels.splash_block(chunk, kernel) is None:
        raise ConfigError(f"train.seq_len={seq_len} over {ways} context shards: splash attention runs a shard's "
                          f"chunk of {chunk} tokens{' (load-balanced: half its rows)' if layout.load_balance else ''} "
                          f"in blocks of {' or '.join(map(str, blocks))}; use a train.seq_len whose chunks are "
                          f"multiples of {blocks[-1]}{fix}")


def check_documents(model_config, layout):
    """ConfigError (one line) for a layout that cannot keep packed documents apart (data.attend_within_documents):
    pipeline stages (every row runs at one set of positions) and the flash kernel over context shards (its pieces
    take no mask)."""
    if layout.pipeline is not None:
        raise ConfigError("data.attend_within_documents=true: pipeline stages (mesh stage > 1) run every row at one "
                          "set of positions, with no documents within rows; set mesh.ici/dcn.stage=1 or "
                          "data.attend_within_documents=false")
    if layout.context_ways > 1 and model_config.attention.startswith("flash:"):
        raise ConfigError("data.attend_within_documents=true: the flash kernel over context shards takes no mask of "
                          "documents; set model.attention=xla there, or data.attend_within_documents=false")


def pipelined_layers(model_config):
    """How many layers the model's pipelined group (pipelined_group) has: 0 where it has none."""
    start, stop = model_config.layer_groups().get(model_config.pipelined_group(), (0, 0))
    return stop - start


def mxfp8_partitioned(numerics):
    """The model parts whose MXFP8 GEMMs XLA would partition (all but the routed experts, whose GEMMs run in the
    exchange's own shard_map): jax's MXFP8 matmul cannot be partitioned inside a shard_map (empty unless mxfp8)."""
    return [p for p in numerics.parts if p != components.EXPERTS] if numerics.mode == "mxfp8" else []


def check_divisible(abstract_params, shardings, mesh):
    """ConfigError naming the first parameter dimension that its mesh axes do not divide."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(abstract_params))[0]
    for (path, leaf), sharding in zip(flat, jax.tree.leaves(shardings)):
        for dim, entry in zip(leaf.shape, sharding.spec):
            ways = logical.ways(mesh, entry)
            if dim % ways:
                name = "/".join(str(getattr(k, "key", k)) for k in path)
                raise ConfigError(f"parameter {name} {tuple(leaf.shape)}: dimension {dim} cannot be split {ways} ways "
                                  f"over mesh axes {entry} ({mesh_lib.describe(mesh)}); change mesh.ici/mesh.dcn "
                                  "or mesh.rules")


def _without(axes, mesh_axis):
    """A PartitionSpec entry (None, a mesh axis or a tuple of them) without `mesh_axis`."""
    kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a != mesh_axis)
    return kept or None


def _outputs(model, inputs):
    out = model(inputs)
    return out if isinstance(out, tuple) else (out, {})


def skip_nonfinite(step, finite):
    """train.on_nonfinite=skip: (whether to apply the update, the new step) -- a bad step is dropped, counted."""
    return finite, step + 1


def halt_on_nonfinite(step, finite):
    """train.on_nonfinite=stop. The host learns of a bad step only after it has queued the next one, so the bad
    step halts the state on the device: its step becomes -(last good step) - 1 and every later step keeps it as it
    is, so the state the host stops with is the last good one (TrainSetup.last_good)."""
    halted = step < 0
    finite = finite & ~halted
    return finite, jnp.where(finite, step + 1, jnp.where(halted, step, -step - 1))


ON_NONFINITE = {"skip": skip_nonfinite, "stop": halt_on_nonfinite}


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What a training step is built from (MaxOffload/from_config.train_setup reads it from a config): TrainSetup(spec)
    builds the step; the same run under another plan or mesh is dataclasses.replace(spec, plan=...)."""
    model_config: object  # the family's model configuration (TrainSetup chooses its kernels for the mesh's devices)
    plan: object  # the OffloadPlan
    mesh: object  # the jax Mesh the step runs on (compile-only devices for a deviceless target)
    rules: dict  # {logical axis: mesh axes}
    tx: object  # the optax optimizer
    schedule: object  # its learning-rate schedule
    seq_len: int
    per_device_batch: float
    seed: int
    exchange: str = "all_gather"  # the MoE exchange (models/exchange.py)
    micro_batches: int = 1  # per optimizer step (gradient accumulation: a step's batch is [micro_batches, rows, len])
    # with several micro-batches: PER_MICRO_BATCH (the fsdp-sharded weights all-gathered inside each micro-batch's
    # passes, XLA's choice) or PER_STEP (gathered once before them and kept in HBM for the step)
    gather_weights: str = PER_MICRO_BATCH
    # with several micro-batches and a data axis: PER_MICRO_BATCH (XLA sums each micro-batch's gradients over the
    # data replicas) or PER_STEP (each replica accumulates its own; one sum over the data axis a step)
    reduce_gradients: str = PER_MICRO_BATCH
    ragged_decomposer: bool = False  # XLA:GPU decomposes the exchange's ragged all-to-all (xla.ragged_decomposer)
    numerics: object = None  # the weight matmuls' models/matmul.Numerics (None: bf16 in the compute dtype)
    on_nonfinite: object = skip_nonfinite  # skip_nonfinite or halt_on_nonfinite
    # how a sequence split over the context axes attends (mesh.context_attention) and whether its tokens are laid out
    # for balanced causal work
    context_attention: str = "all_gather"
    load_balance: bool = False
    # with a stage mesh axis: the virtual stages per stage (mesh.pipeline.repeats); the step's micro-batches are the
    # pipeline's
    pipeline_repeats: int = 1
    pipeline_remat: str = "layers"  # parallel/pipeline.Pipeline.remat
    # rows hold packed documents (data.attend_within_documents): a batch carries `documents` and a token attends only
    # within its own
    documents: bool = False


class TrainSetup:
    """What a run needs to create, shard and step its state, built once from a StepSpec.

    The state is a plain pytree {'step', 'params', 'opt_state'} so that checkpointing and
    sharding see ordinary dicts; `graphdef` turns params back into the NNX model.
    """

    def __init__(self, spec):
        """Raises ConfigError when the model's dimensions or the sequence do not fit the mesh."""
        self.spec = spec
        self.plan, self.mesh, self.rules, self.tx, self.schedule = spec.plan, spec.mesh, spec.rules, spec.tx, spec.schedule
        self.seq_len, self.per_device_batch, self.seed = spec.seq_len, spec.per_device_batch, spec.seed
        self.on_nonfinite, self.micro_batches, self.gather_weights = spec.on_nonfinite, spec.micro_batches, \
            spec.gather_weights
        self.numerics = spec.numerics or matmul.Numerics(spec.model_config.compute_dtype)
        self.pipeline = self._pipeline(spec, self.numerics)
        self.layout = ParallelLayout.of(spec.mesh, spec.rules, spec.exchange, spec.context_attention,
                                        spec.load_balance, self.pipeline)  # to the model, once
        platform = kernels.platform(spec.mesh.devices.flat[0])
        # every compile of the step gets the preset and what the weight GEMMs' mode needs
        self.compiler_options = xla.compiler_options(spec.plan.xla_preset, self.numerics.mode,
                                                     spec.plan.hlo_rematerialization, platform)
        # kernel choices (model.attention, model.moe_kernel) for the devices the step runs on
        self.model_config = kernels.for_platform(spec.model_config, platform)
        self.ragged_decomposed = bool(spec.ragged_decomposer) and self.exchanges_ragged()
        if self.ragged_decomposed:
            self.compiler_options.update(xla.RAGGED_DECOMPOSER)
        check_splash(self.model_config, spec.seq_len, self.layout)
        if spec.documents:
            check_documents(self.model_config, self.layout)
        # Param = trained by the optimizer; any other Variable (e.g. MoE router biases) is model
        # state that the model itself updates, returned in aux["model_state"].
        self.graphdef, abstract_params, _ = nnx.split(nnx.eval_shape(self._model), nnx.Param, ...)
        logical_specs = nnx.to_pure_dict(nnx.get_partition_spec(abstract_params))
        self.param_shardings = jax.tree.map(  # in HBM: where gradients are accumulated
            lambda spec: logical.named_sharding(self.mesh, tuple(spec), self.rules), logical_specs,
            is_leaf=lambda x: isinstance(x, PartitionSpec))
        check_divisible(abstract_params, self.param_shardings, self.mesh)
        self.replicas, self.replica_graphdef = self._replicas(spec.reduce_gradients, self.param_shardings)
        # evaluation's batch is one micro-batch: with stages, a model whose pipeline runs it as one
        self.eval_graphdef = self.graphdef if self.pipeline is None else nnx.split(nnx.eval_shape(
            lambda: self._model(dataclasses.replace(self.layout, pipeline=dataclasses.replace(
                self.pipeline, microbatches=1)))), nnx.Param, ...)[0]
        self.abstract_state = jax.eval_shape(self._init)
        self.state_shardings = self._state_shardings()
        self.host_state_asked = {"params": self.plan.params_on_host, "opt_state": self.plan.optimizer_on_host}
        # gather_weights=PER_STEP: the weights without their fsdp sharding, held through the step's micro-batches
        self.gathered_shardings = jax.tree.map(
            lambda s: NamedSharding(self.mesh, PartitionSpec(*(_without(axes, "fsdp") for axes in s.spec))),
            self.param_shardings)
        self._batch_layout()

    @staticmethod
    def _pipeline(spec, numerics):
        """The pipeline schedule with a stage mesh axis (None without); ConfigError when the model's pipelined layer
        group does not split into the virtual stages or is asked to run under more than one policy, or the step
        asks for what the pipeline does differently."""
        stages = spec.mesh.shape["stage"]
        if stages == 1:
            return None
        schedule = Pipeline(stages, spec.pipeline_repeats, spec.micro_batches, spec.pipeline_remat)
        group, layers = spec.model_config.pipelined_group(), pipelined_layers(spec.model_config)
        if not layers:
            raise ConfigError(f"mesh stage={stages}: this model has no {group!r} layers to pipeline; set "
                              "mesh.ici.stage=1 and mesh.dcn.stage=1")
        schedule.per_stage(layers)
        if len(spec.plan.by_stack().get(group, ())) != 1:
            raise ConfigError(f"mesh stage={stages}: the pipelined layer group {group!r} runs under one remat/offload "
                              f"policy (each stage runs any of its layers); make remat.groups.{group} cover all of "
                              "them, or give one policy")
        partitioned = mxfp8_partitioned(numerics)
        if partitioned:  # as for the data replicas' shard_map (_replicas)
            raise ConfigError(f"mesh stage={stages}: the pipeline stages run in a shard_map over the stage axis, inside "
                              f"which jax's MXFP8 matmul cannot be partitioned (quant.parts {','.join(partitioned)}; "
                              "jaxlib 0.12's compiler fails in its custom partitioner); set quant.parts=[routed_experts] "
                              "or quant.mode=fp8")
        if spec.reduce_gradients == PER_STEP and spec.micro_batches > 1:
            raise ConfigError("train.reduce_gradients=per_step is for the micro-batches' scan, which pipeline stages "
                              "replace (their micro-batches run in one pass): use train.reduce_gradients="
                              "per_micro_batch with mesh stage > 1")
        return schedule

    def layer_order(self):
        """The model's layers that the pipelined stack stores at each position (parallel/pipeline.Pipeline.order), or
        None where it stores them in the model's order (no stages, or one repeat)."""
        if self.pipeline is None or self.pipeline.repeats == 1:
            return None
        return self.pipeline.order(pipelined_layers(self.model_config))

    def reorder(self, tree, saved):
        """A state (or its params / model_state part) restored into this run's shardings whose pipelined stack was
        stored in the layer order `saved` (a checkpoint's; None: the model's), with that stack's leaves (its
        parameters, their optimizer state, its model state) in this run's order: a checkpoint resumes under another
        pipeline schedule. One leaf at a time, in place."""
        current, key = self.layer_order(), models.family_of(self.model_config).model_class.PIPELINED_STACK
        if saved is None and current is None:
            return tree
        layers = pipelined_layers(self.model_config)
        saved = np.arange(layers) if saved is None else np.asarray(saved)
        current = np.arange(layers) if current is None else current
        if np.array_equal(saved, current):
            return tree
        take = np.argsort(saved)[current]  # position p now holds layer current[p], saved at argsort(saved)[...]

        def move(path, leaf):
            if not any(getattr(k, "key", None) == key for k in path) or not leaf.ndim or leaf.shape[0] != layers:
                return leaf
            return jax.jit(lambda a: a[take], out_shardings=leaf.sharding, donate_argnums=0)(leaf)

        return jax.tree_util.tree_map_with_path(move, tree)

    def _state_shardings(self):
        """The state's shardings: the parameters' and the optimizer state's in HBM or host memory (the plan's)."""
        replicated = NamedSharding(self.mesh, PartitionSpec())
        params_kind = HOST if self.plan.params_on_host else DEVICE
        opt_kind = HOST if self.plan.optimizer_on_host else DEVICE
        return {
            "step": replicated,
            "params": jax.tree.map(lambda s: s.with_memory_kind(params_kind), self.param_shardings),
            "opt_state": optax.tree_map_params(self.tx, lambda _, sharding: sharding.with_memory_kind(opt_kind),
                                               self.abstract_state["opt_state"], self.param_shardings,
                                               transform_non_params=lambda _: replicated),
            "model_state": jax.tree.map(lambda _: replicated, self.abstract_state["model_state"]),
        }

    def _batch_layout(self):
        """The batch's shardings and rows; ConfigError when they do not split over the mesh."""
        mesh, seq_len, per_device_batch = self.mesh, self.seq_len, self.per_device_batch
        self.batch_sharding = logical.named_sharding(mesh, BATCH_AXES, self.rules)
        # a step's batch: one batch, or its micro-batches stacked in front (not sharded)
        self.step_batch_sharding = self.batch_sharding if self.micro_batches == 1 else \
            NamedSharding(mesh, PartitionSpec(None, *self.batch_sharding.spec))
        context = logical.ways(mesh, self.batch_sharding.spec[1])
        # sequences of one (micro-)batch over the whole mesh
        rows = self.batch_rows = mesh_lib.sequences(per_device_batch, mesh.size)
        batch_ways = logical.ways(mesh, self.batch_sharding.spec[0])
        if rows % batch_ways:
            raise ConfigError(f"a batch of {rows} sequences (train.per_device_batch_size={per_device_batch:g} x "
                              f"{mesh.size} devices) does not split {batch_ways} ways over the batch's mesh axes "
                              f"({mesh_lib.describe(mesh)}); give a per-device batch that makes a multiple of "
                              f"{batch_ways}")
        if seq_len % context:
            raise ConfigError(f"train.seq_len={seq_len} is not divisible by the {context}-way sharding of "
                              f"activation_length ({mesh_lib.describe(mesh)})")
        if self.layout.token_order(seq_len) is not None:
            if seq_len % (2 * context):
                raise ConfigError(f"mesh.context_load_balance=true cuts the sequence into 2 x {context} chunks, and "
                                  f"train.seq_len={seq_len} is not a multiple of {2 * context}: choose a multiple")

    def with_plan(self, plan):
        """The same run (model, mesh, optimizer, batch) under another OffloadPlan: a planner's or a report's
        variant."""
        return TrainSetup(dataclasses.replace(self.spec, plan=plan))

    def exchanges_ragged(self):
        """Whether the step moves routed tokens between GPUs by XLA's ragged all-to-all (models/exchange.py)."""
        from MaxOffload.models import exchange

        platform = kernels.platform(self.mesh.devices.flat[0])
        return (platform == "gpu" and exchange.EXCHANGES[self.layout.exchange].transport_on(platform) == "ragged"
                and logical.ways(self.mesh, self.layout.expert) > 1
                and getattr(self.model_config, "num_experts", 0) > 0)

    def _model(self, layout=None):
        return models.build(self.model_config, self.plan, nnx.Rngs(params=self.seed), layout or self.layout,
                            self.numerics)

    def _replicas(self, reduce_gradients, param_shardings):
        """(data replicas that accumulate their own gradients, the model's graphdef for one replica's share of a
        micro-batch) under reduce_gradients=PER_STEP with several micro-batches and a data axis; else (1, None).
        A replica's model is laid out by the rules without the data axis: `gradients` runs it in a shard_map manual
        over that axis (parallel/layout.current_mesh)."""
        data = self.mesh.shape["data"]
        if reduce_gradients != PER_STEP or self.micro_batches == 1 or data == 1:
            return 1, None
        on_data = [s for s in jax.tree.leaves(param_shardings)
                   if any("data" in logical.spec_axes(entry) for entry in s.spec)]
        if on_data:
            raise ConfigError(f"train.reduce_gradients=per_step sums each data replica's gradients once a step, but "
                              f"mesh.rules shard a weight over the data axis ({on_data[0].spec}); take `data` out of "
                              "the weights' rules or use train.reduce_gradients=per_micro_batch")
        partitioned = mxfp8_partitioned(self.numerics)
        if partitioned:  # the routed experts' GEMMs run inside the exchange's
            # shard_map, manual over every axis; the others are partitioned by jax's cuDNN scaled-matmul rule
            raise ConfigError(f"train.reduce_gradients=per_step runs each data replica in a shard_map over the data "
                              f"axis, inside which jax's MXFP8 matmul cannot be partitioned (quant.parts "
                              f"{','.join(partitioned)}); set quant.parts=[routed_experts] or "
                              "train.reduce_gradients=per_micro_batch")
        rules = {axis: tuple(a for a in mesh_axes if a != "data") for axis, mesh_axes in self.layout.rules}
        layout = ParallelLayout.of(self.mesh, rules, self.layout.exchange, self.layout.context_attention,
                                   self.layout.load_balance)
        return data, nnx.split(nnx.eval_shape(lambda: self._model(layout)), nnx.Param, ...)[0]

    def _init(self):
        weights = models.weights(self._model())
        return {"step": jnp.zeros((), jnp.int32), "params": weights["params"],
                "opt_state": self.tx.init(weights["params"]), "model_state": weights["model_state"]}

    def init_state(self):
        """Freshly initialised state, created directly in its sharding (never whole on one device)."""
        return jax.jit(self._init, out_shardings=self.state_shardings)()

    def forward(self, params, model_state, inputs):
        """(logits, aux). A model returns logits, or (logits, aux) with optional aux entries: "aux_loss" (added to
        the objective), "metrics" ({name: scalar}, logged), "model_state" (the new values of its non-Param
        variables, applied after the step) and what its family's `target_losses` consumes."""
        return _outputs(nnx.merge(self.graphdef, params, model_state), inputs)

    def loss(self, params, model_state, batch, count=None, micro_batches=1, graphdef=None):
        """(objective, aux): mean next-token cross-entropy + the model's aux_loss + its family's losses of the
        targets (models/stack.DecoderModel.target_losses, e.g. DeepSeek-V3's weighted multi-token prediction).
        One micro-batch of a step: `count` is the whole step's number of target positions, and the other terms
        are divided by `micro_batches`, so that the micro-batches' objectives sum to the step's. `graphdef`: the
        model's (default: self.graphdef; a data replica's share: self.replica_graphdef)."""
        model = nnx.merge(graphdef or self.graphdef, params, model_state)
        total, own, extra, aux = model.losses(batch["inputs"], batch["targets"], batch["mask"],
                                              batch.get("documents"))
        count = jnp.maximum(own, 1.0) if count is None else count
        return total / count + aux.get("aux_loss", 0.0) / micro_batches + extra / micro_batches, aux

    def gradients(self, params, model_state, batch):
        """(objective, aux, gradients) of a step's batch: one batch, or (micro_batches > 1) a scan over its
        micro-batches [k, rows, seq_len] accumulating float32 gradients in HBM with the parameters' sharding. Over
        micro-batches the metrics are averaged, the model's statistics summed and its new state computed once
        from them (e.g. the router biases from the whole step's expert loads), as one batch of k x rows would.
        Under reduce_gradients=PER_STEP each of `self.replicas` data replicas accumulates its own gradients,
        [replicas, ...] over the data axis, summed once after the loop."""
        if self.micro_batches == 1 or self.pipeline is not None:  # the pipeline runs the micro-batches in one pass
            (loss, aux), grads = jax.value_and_grad(self.loss, has_aux=True)(params, model_state,
                                                                             self._pipelined(batch))
            return loss, aux, grads
        k, replicas = self.micro_batches, self.replicas
        if self.gather_weights == PER_STEP:  # one all-gather of the fsdp shards, outside the micro-batches' loop
            params = jax.lax.with_sharding_constraint(params, self.gathered_shardings)
        count = jnp.maximum(jnp.sum(batch["mask"]), 1.0)
        f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # noqa: E731
        if replicas == 1:
            grad_fn = jax.value_and_grad(lambda p, b: self.loss(p, model_state, b, count, k), has_aux=True)
            accumulated = self.param_shardings
        else:
            # reduce_gradients=PER_STEP: each data replica's rows of a micro-batch are a micro-batch of its own (k x
            # replicas of them a step), its gradients computed and accumulated in a shard_map manual over the data
            # axis only (XLA partitions the other axes as before): no reduction over the data axis inside the loop;
            # the sum over the replicas after it is the step's one reduction
            P = PartitionSpec
            share = jax.value_and_grad(
                lambda p, b, n: self.loss(p, model_state, b, n, k * replicas, self.replica_graphdef), has_aux=True)

            def replica(p, micro_batch, n):
                (loss, aux), grads = share(p, micro_batch, n)
                return jax.tree.map(lambda x: jnp.asarray(x)[None], ((loss, aux), grads))

            def grad_fn(p, micro_batch):
                run = jax.shard_map(replica, mesh=self.mesh, in_specs=(P(), P("data"), P()), out_specs=P("data"),
                                    axis_names={"data"}, check_vma=False)
                (loss, aux), grads = run(p, micro_batch, count)
                aux = {**aux, "metrics": jax.tree.map(lambda m: m.mean(0), aux.get("metrics", {})),
                       "statistics": jax.tree.map(lambda s: s.sum(0), aux.get("statistics", {}))}
                return (loss.sum(), aux), grads

            accumulated = jax.tree.map(lambda s: NamedSharding(self.mesh, PartitionSpec("data", *s.spec)),
                                       self.param_shardings)

        def micro(carry, micro_batch):
            (loss, aux), grads = grad_fn(params, micro_batch)
            loss, metrics, statistics, summed = jax.tree.map(
                jnp.add, carry, (loss, f32(aux.get("metrics", {})), aux.get("statistics", {}), f32(grads)))
            return (loss, metrics, statistics, jax.lax.with_sharding_constraint(summed, accumulated)), None

        shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], batch))
        (_, aux_shape), grad_shape = shapes
        zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), tree)  # noqa: E731
        start = (jnp.zeros((), jnp.float32), zeros(aux_shape.get("metrics", {})),
                 jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape.get("statistics", {})),
                 jax.lax.with_sharding_constraint(zeros(grad_shape), accumulated))
        (loss, metrics, statistics, grads), _ = jax.lax.scan(micro, start, batch)
        if replicas > 1:  # the step's one sum over the data replicas
            grads = jax.lax.with_sharding_constraint(jax.tree.map(lambda g: g.sum(0), grads), self.param_shardings)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        model = nnx.merge(self.graphdef, params, model_state)
        aux = {"metrics": jax.tree.map(lambda m: m / k, metrics), "model_state": model.next_model_state(statistics)}
        return loss, aux, grads

    def _pipelined(self, batch):
        """A step's micro-batches [M, rows, length] as the pipelined model takes them: one batch [rows x M, length]
        whose row g x M + m is micro-batch m's row g (parallel/pipeline.run); the batch itself otherwise."""
        if self.pipeline is None or self.micro_batches == 1:
            return batch
        return jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(-1, *a.shape[2:]), batch)

    def train_step(self, state, batch):
        loss, aux, grads = self.gradients(state["params"], state["model_state"], batch)
        # Host-resident state visits HBM for the elementwise update only; the out_shardings
        # send the results back to pinned host memory.
        params = to_device(state["params"], self.plan.params_on_host)
        grads = to_device(grads, self.plan.params_on_host)
        opt_state = to_device(state["opt_state"], self.plan.optimizer_on_host)
        updates, new_opt_state = self.tx.update(grads, opt_state, params)
        grad_norm = optax.tree.norm(grads)
        # A non-finite loss or gradient never reaches the state: keep the old values.
        finite, step = self.on_nonfinite(state["step"], jnp.isfinite(loss) & jnp.isfinite(grad_norm))
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        new_state = {"step": step,
                     "params": keep(optax.apply_updates(params, updates), params),
                     "opt_state": keep(new_opt_state, opt_state),
                     "model_state": keep(aux.get("model_state", state["model_state"]), state["model_state"])}
        metrics = {"loss": loss, "grad_norm": grad_norm, "learning_rate": self.schedule(state["step"]),
                   "nonfinite": 1.0 - finite.astype(jnp.float32), **aux.get("metrics", {})}
        return new_state, metrics

    def last_good(self, state):
        """(the last good step, the state as saved under it) of a state a train step may have halted (stop mode:
        a non-finite step stores -(last good step) - 1 in its step and leaves the rest as it was)."""
        step = int(jax.device_get(state["step"]))
        if step >= 0:
            return step, state
        good = -step - 1
        sharding = self.state_shardings["step"]
        value = np.asarray(good, self.abstract_state["step"].dtype)
        return good, {**state, "step": jax.make_array_from_callback((), sharding, lambda _: value)}

    def eval_step(self, params, model_state, batch):
        model = nnx.merge(self.eval_graphdef, params, model_state)
        x, embed, _ = model.hidden(batch["inputs"], batch.get("documents"))
        return model.cross_entropy(x, embed, *model.laid_out(batch["targets"], batch["mask"]))

    def abstract_batch(self, step=True):
        """Shapes, dtypes and shardings of one global batch (see MaxOffload.data): a step's (its micro-batches
        stacked in front when there are several), or (step=False) one batch, as evaluation takes."""
        shape = (self.batch_rows, self.seq_len)
        shape, sharding = ((self.micro_batches, *shape), self.step_batch_sharding) \
            if step and self.micro_batches > 1 else (shape, self.batch_sharding)
        return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for k, dtype in self.batch_dtypes().items()}

    def batch_dtypes(self):
        """{key: dtype} of a batch (MaxOffload.data): `documents` too where rows hold packed documents."""
        return {"inputs": jnp.int32, "targets": jnp.int32, "mask": jnp.float32,
                **({"documents": jnp.int32} if self.spec.documents else {})}

    def batch_shardings(self, step=True):
        sharding = self.step_batch_sharding if step else self.batch_sharding
        return {key: sharding for key in self.batch_dtypes()}

    def jitted_train_step(self):
        """The training step under jit with explicit shardings; the state is donated."""
        return jax.jit(self.train_step, in_shardings=(self.state_shardings, self.batch_shardings()),
                       out_shardings=(self.state_shardings, None), donate_argnums=0)

    def lower_train_step(self, lower=None):
        """Lowers the real training step for abstract inputs; `lower(jitted, *args)` may replace
        `jitted.lower(*args)` (e.g. jax.export for another platform)."""
        jitted, args = self.jitted_train_step(), (self.abstract_state, self.abstract_batch())
        with deviceless.lowering(self.mesh.devices.flat[0]):
            return lower(jitted, *args) if lower else jitted.lower(*args)

    def compile(self, jitted, *args):
        """A jitted function of this run's arrays (or their shapes), compiled as the step is: lowered for the run's
        devices, with the plan's XLA preset."""
        with deviceless.lowering(self.mesh.devices.flat[0]):
            return jitted.lower(*args).compile(compiler_options=self.compiler_options)

    def compile_train_step(self):
        return self.compile(self.jitted_train_step(), self.abstract_state, self.abstract_batch())

    def compile_eval_step(self):
        jitted = jax.jit(self.eval_step, in_shardings=(self.state_shardings["params"],
                                                       self.state_shardings["model_state"],
                                                       self.batch_shardings(step=False)))
        return self.compile(jitted, self.abstract_state["params"], self.abstract_state["model_state"],
                            self.abstract_batch(step=False))

    def put_batch(self, batch):
        """This process's rows of a global batch -> global arrays sharded over the batch axes."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in batch.items()}

    def put_step_batch(self, batches):
        """This process's rows of a step's micro-batches (a list of `micro_batches` batches) -> the step's global
        arrays: the batch itself for one, else the micro-batches stacked in front."""
        if self.micro_batches == 1:
            return self.put_batch(batches[0])
        return {k: jax.make_array_from_process_local_data(self.step_batch_sharding, np.stack([b[k] for b in batches]))
                for k in batches[0]}

    def _state_bytes(self, counted, parts=None):
        """Bytes per device of the state `parts` (default all) whose shardings `counted(sharding)` says to count."""
        def nbytes(leaf, sharding):
            return math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize if counted(sharding) else 0

        return int(sum(sum(jax.tree.leaves(jax.tree.map(nbytes, self.abstract_state[part], self.state_shardings[part])))
                       for part in (self.state_shardings if parts is None else parts)))

    def state_bytes_per_device(self, memory_kind=None):
        """Bytes of params + optimizer state per device under the state shardings (in one memory kind)."""
        return self._state_bytes(lambda s: not memory_kind or (s.memory_kind or DEVICE) == memory_kind)

    def host_state_dropped(self, parts=("params", "opt_state")):
        """Bytes per device of the params / optimizer state (of `parts`) asked for in pinned host memory
        (offload.params, offload.optimizer_state) whose shardings lost that memory kind on these devices: XLA's
        compile-only GPU devices have none, so a deviceless GPU compile holds that state in HBM. 0 where the kind is
        kept."""
        return self._state_bytes(lambda s: s.memory_kind != HOST,
                                 [part for part in parts if self.host_state_asked[part]])

    def params_total(self):
        return int(sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(self.abstract_state["params"])))

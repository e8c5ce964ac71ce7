"""The one place a loaded config becomes what a run consumes: the model configuration and the OffloadPlan
(per layer segment, the decision for every tagged name; where parameters and optimizer state live).

Below this module nothing reads cfg.remat or cfg.offload: the model, TrainSetup and every report take the
plan. remat.policy=auto is planned by MaxOffload.offload.planner.plan_for, which starts from `template` and
`pins` here and returns an OffloadPlan too (its override lines are printed, never parsed back).
"""
from flax import nnx

from MaxOffload import models
from MaxOffload.errors import ConfigError
from MaxOffload.offload import segments
from MaxOffload.offload.plan import OffloadPlan
from MaxOffload.offload.policy import AUTO
from MaxOffload.parallel import mesh as mesh_lib


def planned(cfg):
    """Whether the planner chooses the policy (remat.policy=auto)."""
    return cfg.remat.policy == AUTO


def pins(cfg):
    """{name: decision} fixed by remat.tensors: what the planner must honour."""
    return {name: d for name, d in cfg.remat.tensors.items() if d}


def template(cfg):
    """The run's state placement with full remat on every layer: the planner's starting point."""
    return OffloadPlan(tuple(segments.uniform("full", models.layer_groups(cfg.model))),
                       params_on_host=bool(cfg.offload.params), optimizer_on_host=bool(cfg.offload.optimizer_state),
                       verify_parity=bool(cfg.offload.verify_parity), xla_preset=cfg.xla.preset,
                       hlo_rematerialization=bool(cfg.xla.hlo_rematerialization))


def static_plan(cfg):
    """The OffloadPlan cfg spells out (remat.policy, remat.tensors, remat.groups, offload.*)."""
    if planned(cfg):
        raise ValueError("remat.policy=auto is planned by MaxOffload.offload.planner.plan_for(cfg)")
    return template(cfg).with_segments(segments.layer_segments(cfg.remat, models.layer_groups(cfg.model)))


def model(cfg, plan=None, rngs=None, platform="cpu"):
    """cfg's model with freshly initialised parameters (under jax.eval_shape for shapes only), its kernels chosen
    for `platform` (models/kernels.platform of the devices it will run on; TrainSetup chooses for its mesh's)."""
    from MaxOffload.models import kernels

    config = kernels.for_platform(models.model_config(cfg.model), platform)
    plan = plan if plan is not None else static_plan(cfg)
    return models.build(config, plan, rngs if rngs is not None else nnx.Rngs(params=cfg.run.seed),
                        numerics=numerics(cfg, plan))


OFFLOADED = "offloaded"  # quant.fp8_storage's word for every name the plan offloads


def numerics(cfg, plan=None):
    """The weight matmuls' numerics (models/matmul.Numerics): the compute dtype, quant.mode, its parts and the
    activations stored in FP8 (quant.fp8_storage; "offloaded": every name `plan`, default cfg's own, offloads)."""
    from MaxOffload.models import matmul

    quant = cfg.quant
    stored = set(quant.fp8_storage) - {OFFLOADED}
    if OFFLOADED in quant.fp8_storage:
        stored |= set((plan if plan is not None else static_plan(cfg)).offloaded_names())
    return matmul.Numerics(cfg.model.compute_dtype, quant.mode, tuple(quant.parts), tuple(sorted(stored)))


def micro_batches(cfg, device_count):
    """Micro-batches per optimizer step on `device_count` devices: train.grad_accum_steps, or derived from
    train.global_batch_size. Raises ConfigError when the global batch is not a whole number of micro-batches."""
    train = cfg.train
    if cfg.mesh.pipeline.microbatches:
        return cfg.mesh.pipeline.microbatches
    if not train.global_batch_size:
        return train.grad_accum_steps
    micro = mesh_lib.sequences(train.per_device_batch_size, device_count)
    if train.global_batch_size % micro:
        raise ConfigError(f"train.global_batch_size={train.global_batch_size} is not a multiple of "
                          f"per_device_batch_size {train.per_device_batch_size:g} x {device_count} devices = {micro} "
                          f"sequences a micro-batch; give a multiple of {micro} or change per_device_batch_size")
    return train.global_batch_size // micro


def train_setup(cfg, devices=None, plan=None):
    """TrainSetup for cfg on `devices` (default: this process's) under `plan` (default: cfg's own): the mesh,
    the model configuration, the optimizer and the batch, read here so that TrainSetup never sees the config.
    Raises ConfigError when the mesh does not fit the devices or the model."""
    from MaxOffload.parallel import mesh
    from MaxOffload.train import optimizer, step

    device_mesh = mesh.make(cfg.mesh, devices)
    plan = plan if plan is not None else static_plan(cfg)
    return step.TrainSetup(step.StepSpec(
        models.model_config(cfg.model), plan, device_mesh,
        {axis: tuple(mesh_axes) for axis, mesh_axes in cfg.mesh.rules.items()},
        tx=optimizer.build(cfg.train), schedule=optimizer.schedule(cfg.train), seq_len=cfg.train.seq_len,
        per_device_batch=cfg.train.per_device_batch_size, seed=cfg.run.seed, exchange=cfg.mesh.exchange,
        micro_batches=micro_batches(cfg, device_mesh.size), gather_weights=cfg.train.gather_weights,
        reduce_gradients=cfg.train.reduce_gradients, ragged_decomposer=bool(cfg.xla.ragged_decomposer),
        numerics=numerics(cfg, plan), on_nonfinite=step.ON_NONFINITE[cfg.train.on_nonfinite],
        context_attention=cfg.mesh.context_attention, load_balance=cfg.mesh.context_load_balance,
        pipeline_repeats=cfg.mesh.pipeline.repeats, pipeline_remat=cfg.mesh.pipeline.remat,
        documents=cfg.data.attend_within_documents))

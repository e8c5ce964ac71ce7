"""Checks a whole config before any JAX work; the first problem raises ConfigError."""
import math
import os
import re

from MaxOffload.config import defaults
from MaxOffload.config.defaults import flat_keys, get_path
from MaxOffload.errors import ConfigError, require as _require, require_choice as _choice, suggest
from MaxOffload.models import kernels
from MaxOffload.offload import policy
from MaxOffload.offload.names import VOCABULARY

DTYPES = ("float32", "bfloat16")
# Upper bounds, each beyond any real run: a larger value is a typo (an extra digit) that would otherwise exhaust
# memory or overflow a size or counter with a traceback, before any message.
MAX_INT = 2**31 - 1  # every integer key (XLA's sizes, step counters and seeds are 32-bit)
MAX_LAYERS = 10_000  # the model's layers, all stacks together (the remat segments are listed per layer)
MAX_ACTIVE_PARAMS = 10**12  # the weights one token's pass uses (models/base.active_params; Llama 3.1 405B: 4e11)


def _get(cfg, key):
    return get_path(cfg, key)


def _check_keys_and_types(cfg, reference=None, prefix=""):
    """Every key of the reference present, no other, each of the reference's type."""
    reference = reference if reference is not None else defaults.get_config()
    known = flat_keys(reference)
    given = [k for k in flat_keys(cfg) if not k.startswith("remat.groups.")]
    for key in given:
        if key not in known:
            raise ConfigError(f"unknown config key {prefix + key!r}{suggest(key, known)}; "
                              "`python train.py --help` lists all keys")
    for key in known:
        if key not in given:
            raise ConfigError(f"config key {prefix + key!r} is missing; build configs on "
                              "MaxOffload.config.defaults.get_config() (and layer_group() for remat.groups)")
        parent, _, leaf = key.rpartition(".")
        want, value = (_get(reference, parent) if parent else reference).get_type(leaf), _get(cfg, key)
        if value is None and _get(reference, key) is None:  # a placeholder: None is allowed
            continue
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            continue
        if want in (list, tuple) and isinstance(value, (list, tuple)):
            continue
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ConfigError(f"{prefix + key} must be {want.__name__}, got {type(value).__name__} {value!r}")


def _check_numbers(cfg):
    """Every number of the config (list items included) finite and within MAX_INT: no key takes nan or inf."""
    for key in flat_keys(cfg):
        value = _get(cfg, key)
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, float):
                _require(math.isfinite(item), f"{key}={item} is not a finite number; give a finite value")
            elif isinstance(item, int) and not isinstance(item, bool):
                _require(abs(item) <= MAX_INT, f"{key}={item:,} is beyond any real run (at most {MAX_INT:,}); "
                                               "check for an extra digit")


def _check_model_size(config):
    """The family's model within MAX_LAYERS and MAX_ACTIVE_PARAMS (pure Python: nothing is built)."""
    layers = max(stop for _, stop in config.layer_groups().values())
    _require(layers <= MAX_LAYERS, f"model: {layers:,} layers (model.num_layers and the extra stacks) are more "
                                   f"than the {MAX_LAYERS:,} this framework takes; check model.num_layers")
    active = config.active_params()
    _require(active <= MAX_ACTIVE_PARAMS, f"model: {active:.3g} parameters per token are more than the "
                                          f"{MAX_ACTIVE_PARAMS:.0e} this framework takes; check the model's sizes "
                                          "(model.emb_dim, model.mlp_dim, model.vocab_size, heads and head dims)")


def _positive(cfg, *keys):
    for key in keys:
        _require(_get(cfg, key) > 0, f"{key} must be > 0, got {_get(cfg, key)}")


def _check_tensors(prefix, tensors, family, tagged):
    """tagged(): the names the family's model tags (traced, so only asked for when a tensor is set)."""
    for name, decision in tensors.items():
        if decision:
            _choice(f"{prefix}.{name}", decision, policy.DECISIONS)
            _require(name in tagged(), f"{prefix}.{name}={decision}: the {family} model never tags {name!r}, "
                                       f"so the setting would do nothing; it tags: {', '.join(tagged())}")


def _validate_remat(cfg):
    from MaxOffload import models
    from MaxOffload.offload import segments

    family = cfg.model.family
    config = models.model_config(cfg.model)

    def tagged():
        """What the model tags; with model.attention=auto/flash also what it tags on TPUs, where splash attention
        names its residuals 'context' (the platform is not known yet when a config is read)."""
        from MaxOffload.models import kernels

        found = models.tagged_names(config)
        if config.attention in ("auto", "flash"):
            on_tpu = models.tagged_names(kernels.for_platform(config, "tpu"))
            found += tuple(n for n in on_tpu if n not in found)
        return found

    _choice("remat.policy", cfg.remat.policy, policy.ACCEPTED)
    _check_tensors("remat.tensors", cfg.remat.tensors, family, tagged)
    remat = cfg.remat
    if remat.policy == policy.AUTO:  # the planner chooses per model group; remat.tensors pin decisions
        _require(not remat.groups, f"remat.policy=auto plans the layer groups itself; drop remat.groups."
                                   f"{next(iter(remat.groups), '')} or choose a preset")
        _require(cfg.model.scan_layers, "remat.policy=auto plans from the scanned layer segments, which a Python loop "
                                        "of layers has not; drop model.scan_layers=false or choose a preset")
        remat = remat.copy_and_resolve_references()
        with remat.unlocked():
            remat.policy = "custom"  # only the layer ranges are checked below
    template = defaults.layer_group("")
    for name, group in cfg.remat.groups.items():
        prefix = f"remat.groups.{name}"
        _require(isinstance(group, type(template)), f"{prefix} must be a layer group; build it with "
                                                    "MaxOffload.config.defaults.layer_group()")
        _check_keys_and_types(group, template, prefix + ".")
        if group.policy:
            _choice(f"{prefix}.policy", group.policy, tuple(policy.PRESETS))
        _check_tensors(f"{prefix}.tensors", group.tensors, family, tagged)
    segments.layer_segments(remat, models.layer_groups(cfg.model))  # ranges: in bounds, disjoint


QUANT_MODES, QUANT_PARTS = ("bf16", "fp8", "mxfp8"), ("projections", "mlp", "routed_experts")


def _validate_quant(cfg):
    quant = cfg.quant
    _choice("quant.mode", quant.mode, QUANT_MODES)
    for part in quant.parts:
        _choice("quant.parts", part, QUANT_PARTS)
    for name in quant.fp8_storage:
        _choice("quant.fp8_storage", name, ("offloaded", *VOCABULARY))
    if quant.mode != "mxfp8":
        return
    import jax

    from MaxOffload.platform import jax_at_least

    _require(jax_at_least(0, 11),
             f"quant.mode=mxfp8 needs jax >= 0.11 (its block-scaled dot has no CPU or differentiable lowering in "
             f"jax {jax.__version__}): pip install -U jax jaxlib on Python 3.12, or use quant.mode=fp8")
    from MaxOffload import hardware

    target = hardware.ACCELERATORS[cfg.aot.target]
    _require(target.compute_capability >= (10, 0),
             f"quant.mode=mxfp8 needs Blackwell's block-scaled tensor cores; aot.target={cfg.aot.target} "
             f"({target.name}) runs it as dequantize + BF16: use quant.mode=fp8 there")


def validate(cfg):
    from MaxOffload import models  # the families say which names they tag
    from MaxOffload.data import tokenizer

    _check_keys_and_types(cfg)
    _check_numbers(cfg)
    run, train, model, data = cfg.run, cfg.train, cfg.model, cfg.data

    _require(run.output_dir.strip() != "", "run.output_dir is empty; give a directory, e.g. runs/my_run")
    _positive(cfg, "run.log_every", "train.steps", "train.per_device_batch_size", "train.seq_len",
              "train.eval_batches", "train.grad_accum_steps")
    _choice("train.gather_weights", train.gather_weights, ("per_micro_batch", "per_step"))
    _choice("train.reduce_gradients", train.reduce_gradients, ("per_micro_batch", "per_step"))
    _require(train.global_batch_size >= 0, f"train.global_batch_size must be >= 0 (0: per_device_batch_size x "
                                           f"devices x grad_accum_steps), got {train.global_batch_size}")
    _require(not train.global_batch_size or train.grad_accum_steps == 1,
             f"train.global_batch_size={train.global_batch_size} and train.grad_accum_steps={train.grad_accum_steps} "
             "both set the step's batch; set one of them (grad_accum_steps is derived from global_batch_size)")
    for key in ("train.learning_rate", "train.weight_decay", "train.grad_clip_norm", "train.adam_eps"):
        value = _get(cfg, key)
        _require(value >= 0, f"{key} must be >= 0, got {value}")
    _require(train.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {train.warmup_steps}")
    _require(train.warmup_steps < train.steps,
             f"train.warmup_steps={train.warmup_steps} must be below train.steps={train.steps}")
    _require(0 <= train.final_lr_ratio <= 1, f"train.final_lr_ratio must be in [0, 1], got {train.final_lr_ratio}")
    for key in ("train.adam_b1", "train.adam_b2"):
        _require(0 <= _get(cfg, key) < 1, f"{key} must be in [0, 1), got {_get(cfg, key)}")
    _choice("train.on_nonfinite", train.on_nonfinite, ("stop", "skip"))
    _require(train.loss_spike_factor == 0 or train.loss_spike_factor > 1,
             f"train.loss_spike_factor must be > 1 (or 0 to disable), got {train.loss_spike_factor}")
    _require(cfg.checkpoint.every_steps >= 0, f"checkpoint.every_steps must be >= 0, got {cfg.checkpoint.every_steps}")
    _require(cfg.checkpoint.keep >= 1, f"checkpoint.keep must be >= 1, got {cfg.checkpoint.keep}")
    source = cfg.checkpoint.load_params_from
    _require(not source or os.path.isdir(source), f"checkpoint.load_params_from={source}: no such directory")
    _require(train.eval_every >= 0, f"train.eval_every must be >= 0 (0 disables), got {train.eval_every}")

    _choice("model.family", model.family, tuple(models.FAMILIES))
    _positive(cfg, "model.vocab_size", "model.emb_dim", "model.num_layers", "model.num_heads", "model.mlp_dim",
              "model.norm_eps", "model.rope_theta", "model.init_std")
    _choice("model.param_dtype", model.param_dtype, DTYPES)
    _choice("model.compute_dtype", model.compute_dtype, DTYPES)
    _choice("model.attention", model.attention, kernels.ATTENTION)
    _require(model.attention_block >= 0 and model.attention_block % kernels.SPLASH_LANES == 0,
             f"model.attention_block={model.attention_block}: splash attention's block is a multiple of "
             f"{kernels.SPLASH_LANES} tokens (0 = the largest of {'/'.join(map(str, kernels.SPLASH_BLOCKS))} "
             "dividing train.seq_len)")
    _require(model.vocab_tiles >= 0 and (model.vocab_tiles == 0 or model.vocab_size % model.vocab_tiles == 0),
             f"model.vocab_tiles={model.vocab_tiles} must divide model.vocab_size={model.vocab_size}; give a divisor "
             "(1 = whole logits) or 0 (auto)")
    config = models.model_config(cfg.model)
    config.validate()  # the family's own checks
    _check_model_size(config)

    _validate_remat(cfg)
    from MaxOffload.parallel.logical import MESH_AXES

    for axis, mesh_axes in cfg.mesh.rules.items():
        for mesh_axis in mesh_axes:
            _require(mesh_axis in MESH_AXES, f"mesh.rules.{axis}: {mesh_axis!r} is not a mesh axis "
                                             f"({', '.join(MESH_AXES)}){suggest(str(mesh_axis), MESH_AXES)}")
    _validate_quant(cfg)
    _validate_pipeline(cfg)
    from MaxOffload.models.exchange import EXCHANGES

    _choice("mesh.exchange", cfg.mesh.exchange, tuple(EXCHANGES))
    _require(not (cfg.mesh.exchange.startswith("all_to_all") and cfg.model.get("capacity_factor")),
             f"mesh.exchange={cfg.mesh.exchange} is dropless, but model.capacity_factor="
             f"{cfg.model.get('capacity_factor')}: "
             "set model.capacity_factor=0 (model.moe_buffer_factor bounds the rows), or use mesh.exchange=all_gather")
    from MaxOffload.models.attention.context import STRATEGIES

    _choice("mesh.context_attention", cfg.mesh.context_attention, tuple(STRATEGIES))
    _require(not (cfg.mesh.context_load_balance and cfg.mesh.context_attention != "all_gather"),
             "mesh.context_load_balance=true reorders the sequence, which only mesh.context_attention=all_gather "
             "masks by position: set that, or turn load balancing off")
    from MaxOffload import hardware, xla

    _choice("xla.preset", cfg.xla.preset, tuple(xla.PRESETS))
    for flag in cfg.xla.extra_flags:
        _require(isinstance(flag, str) and re.match(r"^--xla_\w+(=.*)?$", flag),
                 f"xla.extra_flags: {flag!r} is not an XLA flag; write --xla_name=value")
    _choice("aot.target", cfg.aot.target, tuple(hardware.ACCELERATORS))
    _require(cfg.launch.restarts >= 0, f"launch.restarts must be >= 0 (0 = no restart), got {cfg.launch.restarts}")
    _require(cfg.launch.host_memory_limit_gb >= 0, "launch.host_memory_limit_gb must be >= 0 (0 = from the plan)")
    _require(0 < cfg.launch.mem_fraction <= 1, f"launch.mem_fraction must be in (0, 1], got {cfg.launch.mem_fraction}")
    _positive(cfg, "launch.gpus_per_node", "launch.nodes_per_slice", "distributed.initialization_timeout_s",
              "distributed.heartbeat_timeout_s")
    _require(cfg.distributed.straggler_window_steps >= 0,
             f"distributed.straggler_window_steps={cfg.distributed.straggler_window_steps} must be >= 0 (0: off)")
    _require(cfg.distributed.straggler_factor > 1, f"distributed.straggler_factor={cfg.distributed.straggler_factor} "
             "must be > 1 (how many times the processes' median a straggler's own time is)")
    for key in ("compile_timeout_s", "step_timeout_s", "checkpoint_timeout_s"):
        _require(cfg.distributed[key] >= 0, f"distributed.{key}={cfg.distributed[key]} must be >= 0 (0: no limit)")
    topology_problem = hardware.topology_problem(hardware.ACCELERATORS[cfg.aot.target], cfg.aot.topology,
                                                 cfg.aot.num_slices)
    _require(topology_problem is None, topology_problem)
    for kind in ("ici", "dcn"):
        for axis, size in cfg.mesh[kind].items():
            _require(size == -1 or size >= 1, f"mesh.{kind}.{axis}={size}: give a size >= 1, or -1 for the rest")

    _choice("data.source", data.source, ("text", "tokens", "synthetic"))
    for path in data.text_files:
        _require(isinstance(path, str), f"data.text_files: {path!r} is not a path; give file names")
        _require(os.path.isfile(path), f"data.text_files: {path} not found; give existing UTF-8 text files")
    _require(0 < data.eval_fraction < 1, f"data.eval_fraction must be in (0, 1), got {data.eval_fraction}")
    _require(not (data.attend_within_documents and data.source == "synthetic"),
             "data.attend_within_documents=true: synthetic rows are random tokens, not documents; use "
             "data.source=text or data.source=tokens")
    if data.source == "text":
        _require(model.vocab_size >= tokenizer.VOCAB_SIZE,
                 f"model.vocab_size={model.vocab_size} is below the byte tokenizer's {tokenizer.VOCAB_SIZE} "
                 f"tokens; set model.vocab_size>={tokenizer.VOCAB_SIZE}")
    if data.source == "tokens":
        from MaxOffload.data import tokenized

        meta = tokenized.read_meta(data.path)  # meta.json consistent with tokens.bin and documents.npy
        _require(model.vocab_size >= meta["vocab_size"],
                 f"model.vocab_size={model.vocab_size} is below the {meta['vocab_size']:,} token ids of data.path="
                 f"{data.path} ({meta['tokenizer']['name']}); set model.vocab_size>={meta['vocab_size']}")
        tokenized.check_token_ids(data.path, meta)  # one pass over tokens.bin
    prof = cfg.profile
    _choice("profile.mode", prof.mode, ("off", "xprof", "nsys"))
    _positive(cfg, "profile.start_step", "profile.num_steps")
    last = prof.start_step + prof.num_steps - 1
    _require(prof.mode == "off" or last <= train.steps,
             f"profile: the window ends at step {last} (profile.start_step={prof.start_step} + profile.num_steps="
             f"{prof.num_steps} - 1), after train.steps={train.steps}; move or shorten it")
    peak = cfg.hardware.peak_tflops_per_device
    _require(peak is None or peak > 0, f"hardware.peak_tflops_per_device must be > 0 (or None to look it up), got {peak}")


def _validate_pipeline(cfg):
    pipeline, train = cfg.mesh.pipeline, cfg.train
    _choice("mesh.pipeline.remat", pipeline.remat, ("layers", "stages", "stages_offloaded"))
    _require(pipeline.repeats >= 1, f"mesh.pipeline.repeats={pipeline.repeats} must be >= 1 (1: no virtual stages)")
    _require(pipeline.microbatches >= 0, f"mesh.pipeline.microbatches={pipeline.microbatches} must be >= 0 "
                                         "(0: train.grad_accum_steps)")
    _require(not pipeline.microbatches or (train.grad_accum_steps == 1 and not train.global_batch_size),
             f"mesh.pipeline.microbatches={pipeline.microbatches} sets the step's micro-batches, which "
             "train.grad_accum_steps / train.global_batch_size set too; set one of them")
    stage = (cfg.mesh.ici.stage, cfg.mesh.dcn.stage)
    _require(stage != (1, 1) or (pipeline.repeats == 1 and not pipeline.microbatches and pipeline.remat == "layers"),
             "mesh.pipeline.* is set but mesh.ici.stage = mesh.dcn.stage = 1: give the stage axis a size > 1, or "
             "leave mesh.pipeline alone")


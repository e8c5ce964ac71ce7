"""Every configuration key, its default and what it means: the one place they are defined.

A config file (configs/*.py) starts from `get_config()` here and changes only what
differs. `python train.py --help` prints this table.
"""
import ml_collections

from MaxOffload.models import base as model_base
from MaxOffload.offload.names import VOCABULARY
from MaxOffload.parallel.logical import DEFAULT_RULES, MESH_AXES

# section -> key -> (default, meaning). A default of None needs a type: (None, type, meaning).
SCHEMA = {
    "run": {
        "output_dir": ("runs/default", "directory for config.json, metrics.jsonl, TensorBoard events, summary.json"),
        "seed": (0, "seed for parameter initialisation and data order"),
        "overwrite": (False, "let a new run (from step 0: checkpoint.resume=false, checkpoint.enabled=false, or "
                             "nothing to resume) start in a run.output_dir that holds another run: that run's files "
                             "are first moved into run.output_dir/replaced/<time>/, never deleted"),
        "dry_run": (False, "validate, build the model abstractly, report sizes, exit without compiling"),
        "log_every": (10, "print a progress line every N steps (metrics files get every step)"),
    },
    "train": {
        "steps": (100, "number of optimizer steps"),
        "per_device_batch_size": (8.0, "sequences per device per micro-batch (per step when grad_accum_steps=1); "
                                       "a fraction where the sequence is split over context axes (0.125 on 8 "
                                       "devices: one sequence), as long as x devices it is a whole number"),
        "grad_accum_steps": (1, "micro-batches per optimizer step: their gradients are summed in float32 inside the "
                                "step (a scan), then one update; a step trains per_device_batch_size x devices x "
                                "grad_accum_steps sequences"),
        "gather_weights": ("per_micro_batch", "with grad_accum_steps > 1, where the fsdp-sharded weights are "
                                              "all-gathered: per_micro_batch (in each micro-batch's passes: least "
                                              "HBM) | per_step (once, held in HBM through the step: least traffic)"),
        "reduce_gradients": ("per_micro_batch", "with grad_accum_steps > 1 and mesh data > 1, where the gradients "
                                                "are summed over the data axis (the data-parallel replicas): "
                                                "per_micro_batch (XLA's choice: each micro-batch's) | per_step (each "
                                                "replica accumulates its own, one reduction a step: what keeps "
                                                "replicas across racks, mesh.dcn.data, off the network)"),
        "global_batch_size": (0, "sequences per optimizer step instead of grad_accum_steps (0: unset): the run "
                                 "derives grad_accum_steps = global_batch_size / (per_device_batch_size x devices), "
                                 "which must divide; set one of the two"),
        "seq_len": (256, "tokens per sequence"),
        "learning_rate": (3e-4, "peak learning rate, reached after the warmup"),
        "warmup_steps": (10, "linear warmup from 0 to learning_rate"),
        "final_lr_ratio": (0.1, "cosine decay towards learning_rate * final_lr_ratio, reached after train.steps updates"),
        "weight_decay": (0.1, "AdamW decoupled weight decay (not applied to norms, biases, embeddings)"),
        "decay_embeddings": (False, "also apply weight decay to the token embedding / unembedding"),
        "adam_b1": (0.9, "AdamW beta1"),
        "adam_b2": (0.95, "AdamW beta2"),
        "adam_eps": (1e-8, "AdamW epsilon"),
        "grad_clip_norm": (1.0, "clip gradients to this global norm (0 disables clipping)"),
        "eval_every": (50, "evaluate on the held-out split every N steps (0 disables; always at the end)"),
        "eval_batches": (4, "batches per evaluation"),
        "on_nonfinite": ("stop", "non-finite loss or gradients (the update is never applied): stop = save the last "
                                 "good state and exit 1 | skip = drop that update, count it and go on"),
        "loss_spike_factor": (3.0, "warn when a step's loss exceeds this multiple of its recent average "
                                   "(0 disables)"),
    },
    "checkpoint": {
        "enabled": (True, "save checkpoints (false: benchmarks and throwaway runs; nothing is saved or resumed, "
                          "and a preempted run exits 42 without a checkpoint)"),
        "every_steps": (0, "save asynchronously every N steps (0 = only at the end and on preemption)"),
        "keep": (3, "keep the newest K checkpoints"),
        "resume": (True, "resume from the newest complete checkpoint in <run.output_dir>/checkpoints"),
        "fallback_to_previous": (False, "if the newest checkpoint is unreadable, resume from the one before it"),
        "load_params_from": ("", "initialise the weights (parameters and model state such as router biases) from "
                                 "another run's checkpoint (run dir, its checkpoints/ or one step dir) or from "
                                 "`python -m MaxOffload.convert from-hf`'s output; ignored when resuming"),
    },
    # The keys every family shares; each family adds its own (models.register joins them: see full_schema()).
    "model": {"family": ("llama", "model family: llama | deepseek"), **model_base.keys(model_base.ModelConfig, shared=True)},
    "remat": {
        "policy": ("full", "activation policy preset: full | minimal | minimal_offloaded | qkv_proj_offloaded "
                           "| save_qkv_proj | save_out_proj | save_dot_except_mlp | save_dot_except_mlpwi "
                           "| save_dot_with_context_except_mlp | minimal_with_context | save_all | custom | auto (the planner "
                           "chooses per tensor: python -m MaxOffload.offload.planner)"),
        "tensors": {name: ("", f"remat | device | offload, or empty to follow the policy: {doc}")
                    for name, doc in VOCABULARY.items()},
        # Per-layer-group overrides: remat.groups.NAME.{layers, policy, tensors.*}; see GROUP below.
        "groups": {},
    },
    "mesh": {
        "ici": {axis: (-1 if axis == "fsdp" else 1, f"{axis} parallelism within a slice (an NVLink domain, e.g. one "
                                                     "NVL72 rack); -1 = the devices left over")
                for axis in MESH_AXES},
        "dcn": {axis: (1, f"{axis} parallelism across slices (over the data-centre network); -1 = the slices left "
                          "over") for axis in MESH_AXES},
        "rules": {axis: (list(mesh_axes), f"mesh axes that shard the logical axis {axis!r}")
                  for axis, mesh_axes in DEFAULT_RULES.items()},
        "exchange": ("all_gather", "how MoE layers' routed tokens reach their experts' devices (models/exchange.py): "
                                   "all_gather (tokens gathered over the expert axes, outputs reduce-scattered back) "
                                   "| all_to_all (each token choice to its expert's owner and back; dropless: XLA's "
                                   "ragged all-to-all on GPUs and TPUs, padded per-rank buffers on CPUs) | "
                                   "all_to_all_padded | all_to_all_ragged (that transport everywhere; ragged is "
                                   "emulated on CPUs)"),
        "context_attention": ("all_gather", "how a sequence split over the context axes attends "
                                            "(models/attention/context.py): all_gather (each shard gathers the keys "
                                            "and values; xla: masks by position; flash: its kernels per chunk of "
                                            "queries) | partitioned (xla: XLA's automatic partitioning; flash: "
                                            "tokamax's own sharding, a dense mask in its backward)"),
        "context_load_balance": (False, "lay each sequence out as 2C chunks, context shard i holding chunks i and "
                                        "2C-1-i, so every shard has the same causal attention work (needs "
                                        "context_attention=all_gather)"),
        # with mesh.ici/dcn.stage > 1 (docs/parallelism.md, parallel/pipeline.py)
        "pipeline": {
            "microbatches": (0, "micro-batches a step flowing through the pipeline stages (they are the step's "
                                "gradient accumulation: a step trains per_device_batch_size x devices x "
                                "microbatches sequences); 0 = train.grad_accum_steps (or global_batch_size's)"),
            "repeats": (1, "virtual stages per stage (circular pipeline): the pipelined layers split into stage x "
                           "repeats pieces, a micro-batch passing every stage `repeats` times; the bubble is "
                           "(stage - 1) / (repeats x microbatches + stage - 1)"),
            "remat": ("layers", "what the backward pass gets of each pipeline iteration: layers (what the "
                                "pipelined layers' remat/offload policy keeps, for all of a step's micro-batches at "
                                "once) | stages (each iteration's input alone, in HBM; the virtual stage's forward "
                                "runs again in the backward pass, under the layers' policy: a stage's activation "
                                "memory no longer grows with the micro-batches) | stages_offloaded (the same, each "
                                "iteration's input kept in pinned host memory: HBM holds none of them)"),
        },
    },
    "distributed": {
        "coordinator_address": ("", "host:port of process 0; empty = auto (Slurm) or single process"),
        "num_processes": (0, "number of processes; 0 = auto (Slurm's SLURM_NTASKS) or 1"),
        "process_id": (-1, "this process's rank; -1 = auto (Slurm's SLURM_PROCID) or 0"),
        "local_device_ids": ([], "GPUs this process drives; empty = one per process (SLURM_LOCALID) or, with one "
                                 "task per node, all visible GPUs"),
        "initialization_timeout_s": (300, "give up (with a message) if the processes have not met by then"),
        "heartbeat_timeout_s": (100, "a peer silent this long is dead: the job ends with a message, no hang (the "
                                     "watchdog names a process silent for a quarter of it: docs/faults.md)"),
        "compile_timeout_s": (3600, "the watchdog ends the job, naming the section, when compiling (or an "
                                    "evaluation) runs longer (0: no limit)"),
        "step_timeout_s": (0, "... when a training step runs longer; 0 = 20 x the median of the steps so far, at least "
                              "120 s (before 3 steps are measured: 600 s, or the compile's time if longer)"),
        "checkpoint_timeout_s": (1800, "... when waiting for a checkpoint save runs longer (0: no limit)"),
        "straggler_window_steps": (100, "every this many steps the processes compare their own time per step (the "
                                        "host's: reading the batch, dispatching the step; median and p99) and a "
                                        "slow one is named in the log (docs/faults.md); 0: off"),
        "straggler_factor": (1.5, "a process is a straggler when its median own time is over this factor x the "
                                  "processes' median (and over it by at least 5% of the step time)"),
    },
    "quant": {
        "mode": ("bf16", "weight GEMMs: bf16 | fp8 (per-tensor current scaling: e4m3 operands, e5m2 gradients; "
                         "cuBLASLt FP8 on Hopper and Blackwell) | mxfp8 (blocks of 32 with e8m0 scales; cuDNN on "
                         "Blackwell, jax >= 0.11)"),
        "parts": (["projections", "mlp", "routed_experts"], "the model parts whose GEMMs quant.mode quantizes "
                                                            "(projections | mlp | routed_experts; the embedding, "
                                                            "output head, router, norms and attention scores "
                                                            "stay bf16)"),
        "fp8_storage": ([], "activation names kept as float8_e4m3fn + a per-tensor scale when saved or offloaded "
                            "(half the bytes; the forward goes on with the dequantized value, the gradient passes "
                            "straight through), e.g. [mlpwi_0, mlpwi_1], or [offloaded]: every name the plan "
                            "offloads; any quant.mode"),
    },
    "xla": {
        "preset": ("baseline", "XLA scheduling preset: baseline | GPUs: lhs (latency hiding scheduler) | "
                               "lhs_pipelined (+ collective pipelining, loop double buffering) | "
                               "lhs_pipelined_offload (+ pipelined host offloading) | TPUs: tpu_overlap (async "
                               "collectives fused with and overlapped under compute) | tpu_overlap_offload (+ host-"
                               "aware passes); see MaxOffload/xla.py"),
        "extra_flags": ([], "more XLA_FLAGS, e.g. [--xla_gpu_enable_command_buffer=]; checked against jaxlib"),
        "ragged_decomposer": (False, "XLA:GPU's decomposition of the token all-to-all's ragged primitive "
                                     "(mesh.exchange=all_to_all) into dense all-to-alls of whole buffers: avoids "
                                     "the one-shot lowering's known crash past 32 ranks and wrong gradients on some "
                                     "builds, at the cost the aot timeline shows (docs/parallelism.md)"),
        "hlo_rematerialization": (True, "XLA's own rematerialization on GPUs: when its estimate of the step's peak "
                                        "memory is over its limit (80% of HBM less the outputs), it recomputes "
                                        "instructions of its choosing (the audit's xla_remat_flops); false leaves "
                                        "recomputation to the plan (remat.*), the aot verdict checks the fit"),
    },
    "aot": {
        "target": ("gb200", "GPU or TPU for the deviceless compile (python -m MaxOffload.aot): a key of "
                            "MaxOffload/hardware.py (h100 h200 gh200 b200 gb200 gb300 v5e v5p v6e)"),
        "topology": ("1x1x4", "the deviceless compile's devices: GPUs, slices x hosts per slice x GPUs per host "
                              "(2 NVL72 racks of 64 GPUs: 2x16x4); TPUs, one slice's chip grid (v5e/v6e 2x2, "
                              "16x16; v5p 2x2x1, 4x4x4)"),
        "num_slices": (1, "TPU targets: slices of aot.topology joined by the data-center network (multislice)"),
    },
    "launch": {
        "gpus_per_node": (4, "GPUs per node (GB200 NVL72 compute tray: 4); the launcher starts one task per GPU"),
        "nodes_per_slice": (18, "nodes per NVLink domain (NVL72: 18 trays); sets each process's slice for mesh.dcn"),
        "mem_fraction": (0.9, "XLA_PYTHON_CLIENT_MEM_FRACTION: share of HBM JAX preallocates"),
        "host_memory_limit_gb": (0, "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB: pinned host pool per process (XLA's "
                                    "default 64 is too small for offload recipes); 0 = from the aot report's host "
                                    "need + 25%, capped by host RAM per GPU"),
        "restarts": (0, "a job step that fails or hangs (a crashed or killed task, the watchdog's exit) is started "
                        "again in the same allocation, resuming from the last checkpoint, up to this many times "
                        "(launchers/slurm/nvl72.sbatch; exit 2, a mistake in the input, and 42, preempted, are not)"),
    },
    "offload": {
        "params": (False, "keep parameters in pinned host memory; each layer's weights are copied to HBM inside "
                          "the layer scan, so forward and backward hold one layer's weights at a time"),
        "optimizer_state": (False, "keep the optimizer state (Adam moments) in pinned host memory; it visits "
                                   "HBM only for the update inside the step"),
        "verify_parity": (False, "before training, check that this policy gives full remat's loss and gradients "
                                 "(python -m MaxOffload.offload.parity); stop if not"),
    },
    "data": {
        "source": ("text", "text (byte-level tokens of data.text_files) | tokens (a directory prepared by "
                           "python -m MaxOffload.data.prepare, see data.path) | synthetic (seeded random tokens)"),
        "text_files": ([], "UTF-8 text files to train on; empty = Python's own bundled documentation"),
        "path": ("", "data.source=tokens: the directory written by `python -m MaxOffload.data.prepare INPUTS... "
                     "--tokenizer byte|tokenizer.json|spm.model --out DIR` (tokens.bin, documents.npy, meta.json); "
                     "model.vocab_size must cover its vocabulary"),
        "eval_fraction": (0.05, "fraction of documents held out for evaluation (data.source=text; a prepared "
                                "directory's split is fixed by prepare --eval_fraction)"),
        "attend_within_documents": (False, "rows hold documents packed end to end, each ended by the tokenizer's "
                                           "end-of-text token (data.source=text|tokens): a token attends only to "
                                           "earlier tokens of its own document; false: to every earlier token "
                                           "of its row"),
    },
    "profile": {
        "mode": ("off", "profile a window of steps: off | xprof (jax.profiler trace in <run.output_dir>/profile, "
                        "for TensorBoard/XProf/Perfetto) | nsys (cudaProfilerStart/Stop around the window, for "
                        "`nsys profile --capture-range=cudaProfilerApi`; a no-op without a GPU)"),
        "start_step": (3, "first profiled step (1-based, as in metrics.jsonl); leave the first steps to warm up"),
        "num_steps": (2, "number of profiled steps"),
        "overlap_report": (True, "xprof: after the window, analyse the trace and print how much of the copies "
                                 "hide under compute (python -m MaxOffload.profile.overlap); also profile/overlap.json"),
    },
    "hardware": {
        "peak_tflops_per_device": (None, float, "peak TFLOP/s per device for MFU; None = look up the device kind in "
                                              "MaxOffload/hardware.py"),
    },
}


# One entry of remat.groups. `remat.groups.NAME.KEY=VALUE` on the command line creates NAME.
GROUP = {
    "layers": ("", "the layers: a range (0-7, 8-, 5; negative = from the end: -2- = the last two) or a model group "
                         "(llama: decoder; deepseek: dense, moe, and mtp for the multi-token-prediction blocks)"),
    "policy": ("", "a preset for these layers (replaces remat.policy and remat.tensors); empty = inherit"),
    "tensors": {name: ("", "remat | device | offload for these layers; empty = inherit") for name in VOCABULARY},
}


def layer_group(layers, policy="", **tensors):
    """A remat group: e.g. layer_group("0-7", "full") or layer_group("moe", moe_mlpwi_0="offload")."""
    group = _build(GROUP)
    group.layers, group.policy = layers, policy
    for name, decision in tensors.items():
        if name not in VOCABULARY:
            raise ValueError(f"unknown tensor name {name!r} in layer_group()")
        group.tensors[name] = decision
    return group


def add_layer_group(cfg, name, layers, policy="", **tensors):
    """Adds remat.groups.NAME to a (locked) config."""
    with cfg.remat.groups.unlocked():
        cfg.remat.groups[name] = layer_group(layers, policy, **tensors)


# the long-context variants of a recipe (configs/*_offload.py:SIZE_32k, SIZE_128k): tokens per sequence
LONG_CONTEXT = {"32k": 32768, "128k": 131072}


def long_context_variant(get_config, size, tokens_per_gpu, tokens_per_step=2 ** 24):
    """The long-context variant that `size` names (e.g. 405b_128k: get_config("405b") at 131,072 tokens), or None
    when it names none. Each sequence is split over mesh.ici.context so that a GPU holds `tokens_per_gpu` of its
    tokens (the flash attention per shard, keys and values gathered), one sequence per context group of GPUs
    (per_device_batch_size 1/context), the weights sharded over the context axis as well as fsdp (mesh.rules),
    and `tokens_per_step` tokens a step (train.global_batch_size, accumulated in micro-batches), each context shard
    holding two chunks of the sequence so that all do the same causal work (mesh.context_load_balance)."""
    for suffix, seq_len in LONG_CONTEXT.items():
        if size.endswith("_" + suffix):
            cfg = get_config(size[:-len(suffix) - 1])
            context = seq_len // tokens_per_gpu
            cfg.run.output_dir += "_" + suffix
            cfg.train.seq_len, cfg.mesh.ici.context = seq_len, context
            cfg.mesh.context_load_balance = True
            cfg.train.per_device_batch_size = 1 / context
            cfg.train.global_batch_size = tokens_per_step // seq_len
            for axis, mesh_axes in cfg.mesh.rules.items():  # the weights' axes, not the activations'
                if "fsdp" in mesh_axes and "context" not in mesh_axes and not axis.startswith("activation_"):
                    cfg.mesh.rules[axis] = [*mesh_axes, "context"]
            return cfg
    return None


def reset_remat(cfg, policy):
    """Sets remat.policy and drops every per-tensor setting and layer group, in place."""
    with cfg.unlocked():
        cfg.remat.policy = policy
        for name in cfg.remat.tensors:
            cfg.remat.tensors[name] = ""
        for group in list(cfg.remat.groups):
            del cfg.remat.groups[group]


def _build(schema):
    cfg = ml_collections.ConfigDict()
    for key, spec in schema.items():
        if isinstance(spec, dict):
            cfg[key] = _build(spec)
        elif len(spec) == 3:
            cfg[key] = ml_collections.config_dict.placeholder(spec[1])
        else:
            cfg[key] = spec[0]
    return cfg


def full_schema():
    """SCHEMA with cfg.model = the shared keys + every registered family's own (MaxOffload.models.FAMILIES)."""
    from MaxOffload import models

    model = dict(SCHEMA["model"], family=("llama", f"model family: {' | '.join(models.FAMILIES)}"))
    for name, family in models.FAMILIES.items():
        for key, spec in family.fields.items():
            if model.setdefault(key, spec)[0] != spec[0]:
                raise ValueError(f"model family {name!r}: model.{key} exists with the default {model[key][0]!r}")
    return dict(SCHEMA, model=model)


def get_config():
    """The defaults as a locked ConfigDict: config files may change values, not invent keys."""
    cfg = _build(full_schema())
    cfg.lock()
    return cfg


def docs(schema=None, prefix=""):
    """[(dotted key, default, meaning)] for --help and the README."""
    if schema is None:
        return docs(full_schema()) + docs(GROUP, "remat.groups.NAME.")
    rows = []
    for key, spec in schema.items():
        if isinstance(spec, dict):
            rows += docs(spec, f"{prefix}{key}.") if spec else [(prefix + key, {}, "see remat.groups.NAME.*")]
        else:
            rows.append((prefix + key, spec[0], spec[-1]))
    return rows


# The schema's tree walks (used by the loader and the validator).
def flat_keys(cfg, prefix=""):
    keys = []
    for key, value in cfg.items():
        if isinstance(value, ml_collections.ConfigDict):
            keys += flat_keys(value, f"{prefix}{key}.")
        else:
            keys.append(prefix + key)
    return keys


def get_path(cfg, key):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg

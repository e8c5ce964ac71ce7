"""Proof of placement, the library: what the real training step does with every named activation.

Per scan segment (layer group), the backward pass's residual for each tagged name, read off the traced step's
jaxpr: moved to pinned host ("offload"), kept in device memory ("device") or recomputed ("remat")
(`classify_residuals`, `activation_groups`); the CUDA lowering's pinned_host placements, one per offloaded
tensor (`cuda_host_placements`); bytes per device from the sharding rules; the report (`build_report`).
The command line over it is MaxOffload/offload/inspect.py; the planner and the aot tool use it too.
"""
import collections
import re

from MaxOffload.offload import names

_SEGMENT = re.compile(r"layers_(\d+)_(\d+)")
_PLACEMENT = re.compile(r"annotate_device_placement\(%[^)]*\).*?_xla_buffer_placement = \"pinned_host\".*?:\s*"
                        r"\(tensor<([^>]*)>\)")
_HLO_DTYPES = {"bf16": "bfloat16", "f32": "float32", "f16": "float16", "f64": "float64", "i32": "int32",
               "f8E4M3FN": "float8_e4m3fn", "ui8": "uint8"}
FP8_SCALE = ((), "float32")  # a tensor kept in FP8 (quant.fp8_storage) is offloaded with its per-tensor scale
FP8_BYTES = "uint8"  # ... its float8_e4m3fn values as their bytes (models/fp8.as_bytes)


def _is_host_put(eqn):
    return eqn.primitive.name == "device_put" and any("Host" in str(d) for d in eqn.params.get("devices", ()))


_IDENTITIES = ("reduce_precision", "copy", "copy_p", "optimization_barrier")


def _aliases(body, name_eqn):
    """ids of the vars holding the tagged value: the `name` input and output, and what identity ops
    (remat inserts reduce_precision before saving) make of them."""
    same = {id(name_eqn.invars[0]), id(name_eqn.outvars[0])}
    for eqn in body.eqns:  # eqns are in topological order
        if eqn.primitive.name in _IDENTITIES and len(eqn.invars) == 1 and id(eqn.invars[0]) in same:
            same.add(id(eqn.outvars[0]))
    return same


def classify_residuals(closed_jaxpr):
    """{segment label: {name: (kind, aval)}} read off a training step's jaxpr.

    kind, for the forward scan of each segment: "offload" (the tagged value is moved to host and
    handed to the backward pass), "device" (handed over as it is), "offload+device" (both: the
    host copy saves no HBM), "remat" (recomputed in the backward scan), "unused" (tagged, but
    the backward pass never needs it).
    """
    found = collections.defaultdict(dict)

    def forward_body(body, label):
        outputs = {id(v) for v in body.outvars}
        for eqn in body.eqns:
            if eqn.primitive.name != "name":
                continue
            same = _aliases(body, eqn)
            on_host = any(_is_host_put(c) and id(c.invars[0]) in same and id(c.outvars[0]) in outputs
                          for c in body.eqns)
            on_device = bool(same & outputs)
            kind = {(True, True): "offload+device", (True, False): "offload", (False, True): "device"}.get(
                (on_host, on_device), "unused")
            found[label].setdefault(eqn.params["name"], (kind, eqn.outvars[0].aval))

    def recomputed(jaxpr, label):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "name":
                name = eqn.params["name"]
                kind, aval = found[label].get(name, ("unused", eqn.outvars[0].aval))
                if kind == "unused":
                    found[label][name] = ("remat", aval)
            for sub in names.sub_jaxprs(eqn):
                recomputed(sub, label)

    scans = []

    def walk(jaxpr, stack):
        for eqn in jaxpr.eqns:
            here = f"{stack}/{eqn.source_info.name_stack}"
            if eqn.primitive.name == "scan" and _SEGMENT.search(here):
                scans.append((eqn, here))
            else:
                for sub in names.sub_jaxprs(eqn):
                    walk(sub, here)

    walk(closed_jaxpr.jaxpr, "")
    for eqn, stack in scans:  # forward scans first: they decide what is handed over
        if "transpose(" not in stack:
            forward_body(eqn.params["jaxpr"].jaxpr, _SEGMENT.search(stack).group(0))
    for eqn, stack in scans:
        if "transpose(" in stack:
            recomputed(eqn.params["jaxpr"].jaxpr, _SEGMENT.search(stack).group(0))
    return found


def _as_requested(name, want, got):
    """Whether the step did what was asked. Not needing a tensor at all always satisfies the request."""
    if got == "unused" or want == got:
        return True
    return want == "remat" and got == "device" and name in names.ALWAYS_KEPT


def cuda_host_placements(module_text):
    """[(shape tuple, dtype name)] of every pinned_host placement in a lowered StableHLO module."""
    placements = []
    for match in _PLACEMENT.finditer(module_text):
        *dims, dtype = match.group(1).split("x")
        placements.append((tuple(int(d) for d in dims), _HLO_DTYPES.get(dtype, dtype)))
    return placements


def bytes_per_device(aval, name, setup, staged=False):
    """Bytes of one tagged activation on one device, split as the sharding rules split its logical
    axes (dimensions an axis cannot divide evenly are counted whole); `staged`: in the pipelined stack, where the
    stage axis splits nothing (each stage holds its micro-batch whole: parallel/pipeline.py)."""
    from MaxOffload.parallel.logical import partition_spec, ways

    axes = names.ACTIVATION_AXES.get(name)
    if axes is None or len(axes) != len(aval.shape):
        axes = ("activation_batch",) + (None,) * (len(aval.shape) - 1)
    spec = partition_spec(axes, setup.rules, [a for a in setup.mesh.axis_names if not (staged and a == "stage")])
    count = 1
    for dim, entry in zip(aval.shape, spec):
        split = ways(setup.mesh, entry)
        count *= dim // split if dim % split == 0 else dim
    return count * aval.dtype.itemsize


def staged_offload(setup):
    """Whether the pipeline sends each iteration's input to the host (mesh.pipeline.remat=stages_offloaded)."""
    return setup.pipeline is not None and setup.pipeline.remat == "stages_offloaded"


def activation_groups(cfg, setup):
    """({segment label: entry}, problems, expected pinned_host placements) read off the step's jaxpr:
    per layer segment, what became of every tagged activation against what was requested; with
    mesh.pipeline.remat=stages_offloaded, the pipelined group's entry has the iterations' inputs too."""
    import jax
    import jax.numpy as jnp

    from MaxOffload.parallel import pipeline

    from MaxOffload import models

    jaxpr = jax.make_jaxpr(setup.train_step)(setup.abstract_state, setup.abstract_batch())
    found = classify_residuals(jaxpr)
    tagged = models.tagged_names(setup.model_config)
    groups, problems, expected_placements = {}, [], []
    for segment in setup.plan.segments:
        requested = dict(segment.decisions)
        seen = found.get(segment.label, {})
        # in the pipelined stack a device runs its stage's layers only, each micro-batch whole over the stage axis
        staged = setup.pipeline is not None and segment.model_group == setup.model_config.pipelined_group()
        layers = (segment.stop - segment.start) // (setup.pipeline.stages if staged else 1)
        restaged = staged and setup.pipeline.remat in ("stages", "stages_offloaded")
        entry = {"model_group": segment.model_group, "remat_group": segment.group or None,
                 "layers": [segment.start, segment.stop - 1], "offloaded": [], "saved": [], "remat": [],
                 "unused": [], "tensors": {}, "offload_bytes_per_device": 0, "missing": []}
        if restaged:
            entry["note"] = (f"mesh.pipeline.remat={setup.pipeline.remat}: the backward pass gets each pipeline "
                             f"iteration's input only{', from pinned host memory' if staged_offload(setup) else ''}; "
                             "the policy applies to the virtual stage's forward run again in the backward pass")
            if staged_offload(setup):  # each iteration's input, [rows of a micro-batch, length, emb], to the host
                aval = jax.ShapeDtypeStruct((setup.batch_rows, cfg.train.seq_len, setup.model_config.emb_dim),
                                            jnp.dtype(setup.model_config.compute_dtype))
                per_device = bytes_per_device(aval, "decoder_layer_input", setup, staged) * setup.pipeline.iterations
                entry["tensors"][pipeline.INPUT] = {"requested": "offload", "result": "offload",
                                                    "shape": list(aval.shape), "dtype": str(aval.dtype),
                                                    "bytes_per_device_per_step": per_device}
                entry["offload_bytes_per_device"] += per_device
                entry["offloaded"].append(pipeline.INPUT)
                expected_placements.append((tuple(aval.shape), str(aval.dtype)))
        for name, (kind, aval) in seen.items():
            per_device = bytes_per_device(aval, name, setup, staged) * layers
            entry["tensors"][name] = {"requested": requested[name], "result": kind, "shape": list(aval.shape),
                                      "dtype": str(aval.dtype), "bytes_per_device_per_step": per_device}
            if kind.startswith("offload"):
                entry["offload_bytes_per_device"] += per_device
                expected_placements.append((tuple(aval.shape), str(aval.dtype)))
                if str(aval.dtype) == FP8_BYTES:  # models/fp8.stored: the scale travels beside it
                    entry["offload_bytes_per_device"] += 4 * layers
                    expected_placements.append(FP8_SCALE)
            entry["offloaded" if kind.startswith("offload") else "saved" if kind == "device" else kind].append(name)
            # mesh.pipeline.remat=stages: the backward pass gets each iteration's input only; the policy decides what
            # the stage's forward, run again there, keeps for its own backward
            if not _as_requested(name, requested[name], kind) and not (restaged and kind == "remat"):
                problems.append(f"{segment.label}: {name} requested {requested[name]}, got {kind}"
                                + (" (the layer input is the scan carry; a host copy that is also kept in HBM "
                                   "saves nothing, cf. jax#23869)" if name in names.ALWAYS_KEPT else ""))
        for name, want in requested.items():
            if want != "remat" and name not in seen and name in tagged:
                entry["missing"].append(name)  # e.g. moe_* in DeepSeek's dense layers: fine if tagged elsewhere
                if not any(name in other for other in found.values()):
                    problems.append(f"{segment.label}: {name} requested {want} but the step never tags it")
        groups[segment.label] = entry
    return groups, problems, expected_placements


def build_report(cfg, setup, cpu_memory=True, lowered_text=None):
    """The offload report (a dict) for a config; see the module docstring."""
    import jax

    from MaxOffload.parallel.mesh import describe as mesh_describe
    from MaxOffload.train.step import DEVICE, HOST

    groups, problems, expected_placements = activation_groups(cfg, setup)
    if lowered_text is None:
        exported = setup.lower_train_step(lambda jitted, *args: jax.export.export(jitted, platforms=["cuda"])(*args))
        lowered_text = exported.mlir_module()
    placements = cuda_host_placements(lowered_text)
    found_placements, wanted = collections.Counter(placements), collections.Counter(expected_placements)
    state_on_host = setup.plan.state_on_host
    # host-resident state adds placements of its own (the updated state goes back to the host)
    if found_placements != wanted and not (state_on_host and not wanted - found_placements):
        problems.append(f"CUDA lowering has {len(placements)} pinned_host placements {sorted(placements)}, "
                        f"expected {len(expected_placements)} {sorted(expected_placements)}")
    host_args = len(re.findall(r'%arg\d+: tensor<[^>]*> \{mhlo\.memory_kind = "pinned_host"', lowered_text))
    report = {"config": cfg.run.output_dir, "devices": setup.mesh.size, "mesh": mesh_describe(setup.mesh),
              "micro_batches": setup.micro_batches,
              "groups": groups, "cuda_pinned_host_placements": len(placements),
              "state_host_arrays": host_args, "state_host_bytes_per_device": setup.state_bytes_per_device(HOST),
              "state_device_bytes_per_device": setup.state_bytes_per_device(DEVICE),
              "offload_bytes_per_device": sum(g["offload_bytes_per_device"] for g in groups.values()),
              "problems": problems}
    if cpu_memory:
        report["cpu_temp_bytes"] = cpu_temp_bytes(setup)
    return report


def cpu_temp_bytes(setup):
    """Compiled (XLA:CPU) temporary bytes of the step for this config's policy, full remat and save_all.

    On CPU an offloaded tensor is simply saved, so these show what saving costs in device
    memory — the HBM that offloading gives back — not the host side.
    """
    out = {}
    for label, plan in (("this config", setup.plan), ("full", setup.plan.uniform("full")),
                        ("save_all", setup.plan.uniform("save_all"))):
        compiled = setup.with_plan(plan).compile_train_step()
        out[label] = int(compiled.memory_analysis().temp_size_in_bytes)
    return out

"""The offload plan: what a run does with memory, decided once (MaxOffload/from_config.py, or the planner for
remat.policy=auto) and read, never re-derived, by the model, the train step and every report.

Per layer segment (a run of layers compiled with one policy) a decision for every tagged name; where the
parameters and the optimizer state live; the XLA scheduling preset the step (and so its copies) is compiled under
(MaxOffload/xla.py), and whether XLA's own rematerialization may add recomputation; whether the parity gate
runs before training.
"""
import dataclasses

from MaxOffload.offload import segments as segments_lib
from MaxOffload.offload.policy import OFFLOAD


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    segments: tuple  # (segments.Segment, ...) covering every layer in order
    params_on_host: bool = False
    optimizer_on_host: bool = False
    verify_parity: bool = False  # compare loss and gradients with full remat on one batch before training
    xla_preset: str = "baseline"  # xla.PRESETS: xla.preset, or the planner's choice under remat.policy=auto
    hlo_rematerialization: bool = True  # xla.hlo_rematerialization: XLA's own rematerialization pass may recompute

    @property
    def state_on_host(self):
        return self.params_on_host or self.optimizer_on_host

    @property
    def offloads_activations(self):
        """Whether any layer segment moves a tagged activation to pinned host memory."""
        return any(d == OFFLOAD for seg in self.segments for _, d in seg.decisions)

    def offloaded_names(self):
        """The tagged names some layer segment moves to pinned host memory, sorted."""
        return sorted({name for seg in self.segments for name, d in seg.decisions if d == OFFLOAD})

    def model_groups(self):
        """{model group: (start, stop)}: the model's separately scanned stacks, in global layer indices."""
        out = {}
        for seg in self.segments:
            start, stop = out.get(seg.model_group, (seg.start, seg.stop))
            out[seg.model_group] = (min(start, seg.start), max(stop, seg.stop))
        return out

    def by_stack(self):
        """{model group: ((start, stop, jax policy, label), ...)} with start/stop relative to that stack."""
        groups, out = self.model_groups(), {}
        for seg in self.segments:
            offset = groups[seg.model_group][0]
            out.setdefault(seg.model_group, []).append((seg.start - offset, seg.stop - offset, seg.policy(),
                                                        seg.label))
        return {k: tuple(v) for k, v in out.items()}

    def with_segments(self, segments):
        """This plan with other layer segments (same state placement)."""
        return dataclasses.replace(self, segments=tuple(segments))

    def uniform(self, preset):
        """This plan with every layer under `preset` (no per-tensor settings, no groups): full remat, save_all..."""
        return self.with_segments(segments_lib.uniform(preset, self.model_groups()))

    def per_group(self, chosen):
        """This plan with {model group: {name: decision}} (a planner's choice) on the layers of each group."""
        return self.with_segments(segments_lib.per_group(chosen, self.model_groups()))

"""Per-layer-group policies -> segments of the layer scan, each with one remat/offload policy.

`remat.policy` + `remat.tensors` apply to every layer. A group in `remat.groups` names
some layers — a range ("0-7", "8-", "5") or one of the model's own groups ("decoder";
DeepSeek's "dense" / "moe") — and overrides them:
  - group.policy set:   the group's preset replaces the global policy and global tensors;
  - group.policy empty: the global policy and tensors apply, then the group's tensors.
Ranges split the scan: each run of layers with the same decisions is one scanned segment.
"""
import dataclasses
import re

from MaxOffload.errors import ConfigError, suggest
from MaxOffload.offload import policy as policy_lib


@dataclasses.dataclass(frozen=True)
class Segment:
    model_group: str  # the model's scanned stack this segment belongs to
    start: int  # global layer index, inclusive
    stop: int  # exclusive
    group: str  # the remat group that set its policy, or "" for the global policy
    decisions: tuple  # ((name, decision), ...) over the vocabulary
    save_everything: bool  # plain save_all: untagged intermediates are kept too

    @property
    def label(self):
        return f"layers_{self.start}_{self.stop - 1}"

    def policy(self):
        return policy_lib.policy_from_decisions(dict(self.decisions), self.save_everything)


_RANGE = re.compile(r"^(-?\d+)(?:(-)(-?\d+)?)?$")


def parse_layers(spec, group_name, model_groups, num_layers):
    """'3' | '0-7' | '8-' | a model group name -> (start, stop). Negative numbers count from
    the end, as in Python: '-2-' is the last two layers, '-1' the last one."""
    text = spec.strip()
    where = f"remat.groups.{group_name}.layers={spec!r}"
    if text in model_groups:
        return model_groups[text]
    if not text:
        raise ConfigError(f"{where}: give a layer range such as 0-7 or 8-, or a model group "
                          f"({', '.join(model_groups)})")
    match = _RANGE.match(text)
    if not match:
        raise ConfigError(f"{where} is neither a layer range (0-7, 8-, 5, -2- for the last two) nor a model group"
                          f"{suggest(text, model_groups)}; model groups: {', '.join(model_groups)}")
    lo, dash, hi = match.groups()
    start = int(lo) + (num_layers if int(lo) < 0 else 0)
    last = (int(hi) + (num_layers if int(hi) < 0 else 0)) if hi else (num_layers - 1 if dash else start)
    if not (0 <= start < num_layers and 0 <= last < num_layers):
        raise ConfigError(f"{where} is out of range: the model has layers 0-{num_layers - 1}")
    if last < start:
        raise ConfigError(f"{where} is reversed: write the first layer first, e.g. {last}-{start}")
    return start, last + 1


def group_decisions(remat_cfg, group):
    """(decisions, save_everything) for the layers of `group` (None: layers in no group)."""
    preset, tensors = remat_cfg.policy, {k: v for k, v in remat_cfg.tensors.items() if v}
    if group is not None and group.policy:
        preset, tensors = group.policy, {}
    if group is not None:
        tensors.update({k: v for k, v in group.tensors.items() if v})
    return tuple(policy_lib.decisions(preset, tensors).items()), preset == "save_all" and not tensors


def layer_segments(remat_cfg, model_groups):
    """remat config + the model's groups {name: (start, stop)} -> [Segment] covering every layer in order."""
    num_layers = max(stop for _, stop in model_groups.values())
    owner = [None] * num_layers  # remat group name per layer
    for name, group in remat_cfg.groups.items():
        start, stop = parse_layers(group.layers, name, model_groups, num_layers)
        for layer in range(start, stop):
            if owner[layer] is not None:
                raise ConfigError(f"remat.groups.{name} and remat.groups.{owner[layer]} both claim layer {layer}; "
                                  "make their layer ranges disjoint")
            owner[layer] = name
    segments = []
    for model_group, (start, stop) in sorted(model_groups.items(), key=lambda kv: kv[1]):
        for layer in range(start, stop):
            name = owner[layer] or ""
            last = segments[-1] if segments else None
            if last and (last.model_group, last.group, last.stop) == (model_group, name, layer):
                segments[-1] = dataclasses.replace(last, stop=layer + 1)
            else:
                chosen, everything = group_decisions(remat_cfg, remat_cfg.groups[name] if name else None)
                segments.append(Segment(model_group, layer, layer + 1, name, chosen, everything))
    return segments


def uniform(preset, model_groups):
    """[Segment]: every layer under `preset`, one segment per model group."""
    chosen = tuple(policy_lib.decisions(preset, {}).items())
    return [Segment(group, start, stop, "", chosen, preset == "save_all")
            for group, (start, stop) in sorted(model_groups.items(), key=lambda kv: kv[1])]


def per_group(chosen, model_groups):
    """[Segment] for {model group: {name: decision}} on top of `custom` (everything else recomputed), exactly what
    the plan's override lines give: one group's choice is remat.tensors (every layer), several are one remat
    group per model group."""
    if len(chosen) == 1:
        (only,) = chosen.values()
        chosen, label = {g: only for g in model_groups}, (lambda g: "")
    else:
        label = lambda g: f"auto_{g}" if g in chosen else ""  # noqa: E731
    return [Segment(group, start, stop, label(group), tuple(policy_lib.decisions("custom", chosen.get(group, {})).items()),
                    False)
            for group, (start, stop) in sorted(model_groups.items(), key=lambda kv: kv[1])]

"""Routing collapse in a mixture of experts: when to warn, from the loads each report carries.

A model with experts reports, every step, each MoE layer's least loaded expert (its tokens over
the layer's mean, `load_min`) and the share of the layer's tokens its most chosen expert takes
(`top_share`), with their indices (monitoring.protocol's `StepMetrics.experts`). A layer has
collapsed when an expert starves (`load_min` < monitor.expert_collapse_load) or one expert
dominates (`top_share` >= monitor.expert_collapse_share) in monitor.expert_collapse_steps reports
in a row: one `expert_collapse` finding then, naming the layer and the experts, and none again
until that layer recovers (a report where neither holds) and collapses again. A report at a step
not after the last one (a rollback, a restart) starts every count over. Pure: values in,
findings out; the policy maps the finding to `monitor.on_expert_collapse` (warn or ignore).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from monitoring.config import ExpertCollapseSettings
from monitoring.detectors import Finding

# What the user can do about it, in every warning (docs/model.md, Mixture of experts).
REMEDY = (
    "to rebalance: model.moe.balance bias or both, a larger model.moe.bias_rate or "
    "model.moe.aux_loss_coef, or a lower learning rate"
)


@dataclass(frozen=True, kw_only=True)
class ExpertCollapse(Finding):
    """The finding `expert_collapse`. `value` and `threshold`: the least loaded expert's load and
    expert_collapse_load when one starved at the warning's report, else the most chosen expert's
    share and expert_collapse_share."""

    layer: int = 0
    starved: tuple[int, ...] = ()  # experts below expert_collapse_load in the episode's reports
    dominant: tuple[int, ...] = ()  # experts at or above expert_collapse_share in them
    steps: int = 0  # the reports in a row it took
    load_min: float = 0.0  # at the warning's report: the least loaded expert's load
    top_share: float = 0.0  # ... and the most chosen expert's share of the tokens

    @property
    def reason(self) -> str:
        parts = []
        if self.starved:
            parts.append(f"{_named(self.starved)} starved (least load {self.load_min:.3g}x the mean)")
        if self.dominant:
            parts.append(f"{_named(self.dominant)} chosen by {self.top_share:.3g} of the tokens")
        return (
            f"experts of layer {self.layer} collapsed: {' and '.join(parts)} for {self.steps} "
            f"steps in a row; {REMEDY}"
        )


def _named(experts: tuple[int, ...]) -> str:
    return ("expert " if len(experts) == 1 else "experts ") + ", ".join(map(str, experts))


@dataclass
class Episode:
    """One layer's reports in a row where an expert starved or dominated."""

    steps: int = 0
    starved: set[int] = field(default_factory=set)
    dominant: set[int] = field(default_factory=set)


@dataclass
class ExpertWatch:
    settings: ExpertCollapseSettings
    episodes: dict[int, Episode] = field(default_factory=dict)  # layer → its ongoing episode
    last_step: int | None = None

    def findings(self, step: int, layers: list[dict]) -> list[Finding]:
        """The report of `step`'s layers (`StepMetrics.experts`) in; an `expert_collapse` finding
        for each layer whose episode reaches expert_collapse_steps at this report."""
        s = self.settings
        if s.on_expert_collapse == "ignore":
            return []
        if self.last_step is not None and step <= self.last_step:
            self.episodes.clear()  # another timeline: counted afresh
        self.last_step = step
        found: list[Finding] = []
        for record in layers:
            layer = record["layer"]
            starved = record["load_min"] < s.expert_collapse_load
            dominant = record["top_share"] >= s.expert_collapse_share
            if not (starved or dominant):
                self.episodes.pop(layer, None)  # recovered: the next collapse is another episode
                continue
            episode = self.episodes.setdefault(layer, Episode())
            episode.steps += 1
            if starved:
                episode.starved.add(record["min_expert"])
            if dominant:
                episode.dominant.add(record["top_expert"])
            if episode.steps == s.expert_collapse_steps:
                found.append(self.finding(layer, record, episode, starved))
        return found

    def finding(self, layer: int, record: dict, episode: Episode, starved: bool) -> ExpertCollapse:
        s = self.settings
        value, threshold = (
            (record["load_min"], s.expert_collapse_load)
            if starved
            else (record["top_share"], s.expert_collapse_share)
        )
        return ExpertCollapse(
            "expert_collapse",
            f"experts/layer_{layer}",
            value,
            threshold,
            layer=layer,
            starved=tuple(sorted(episode.starved)),
            dominant=tuple(sorted(episode.dominant)),
            steps=episode.steps,
            load_min=record["load_min"],
            top_share=record["top_share"],
        )

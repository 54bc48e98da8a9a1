"""The monitor's and the supervisor's settings and their vocabulary: what the detectors find
(`FINDINGS`) and what a finding may do (`RESPONSES`). `ServiceConfig` is the service's (its policy,
its detectors, where it listens), `SupervisorConfig` the supervisor's (restarts, hangs). The run
config's `monitor:` section, `MonitorConfig` (`pretrain/config/schema.py`), composes them with the
trainer's own, declared by the parts that read them (`pretrain/stability/settings.py`,
`pretrain/train/settings.py`). Importable without torch, and without `pretrain`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

FINDINGS = (
    "nonfinite",
    "loss_spike",
    "grad_norm_surge",
    "divergence",
    "grad_norm_spike",
    "instability_precursor",
    "expert_collapse",
)
RESPONSES = ("ignore", "warn", "rollback", "stop")  # what a finding may do, least to most drastic
# monitor.on_expert_collapse: a collapse is a precursor, never a rollback or a stop by itself
EXPERT_COLLAPSE_RESPONSES = ("ignore", "warn")
REPEAT_STAGES = ("quarantine", "lower_lr", "stop")  # monitor.on_repeat: what a repeated rollback adds


class SettingError(ValueError):
    """A setting out of its range: one line that names the key and what it must be (the run
    config's loader passes it on as its ConfigError)."""


def check_choice(
    key: str, value: str, choices: tuple[str, ...], error: type[Exception] = SettingError
) -> None:
    if value not in choices:
        raise error(f"{key}={value!r} is not one of {', '.join(choices)}: pick one of those")


def check_positive(
    key: str, value: float | int, *, allow_zero: bool = False, error: type[Exception] = SettingError
) -> None:
    if not math.isfinite(value):
        raise error(f"{key}={value} must be a finite number")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise error(f"{key}={value} must be {bound}")


@dataclass(kw_only=True)
class SupervisorConfig:
    """The supervisor's settings (`pretrain launch`: restart a crashed or hung job from its newest
    checkpoint). Read from the run config's `monitor:` section (see `MonitorConfig`)."""

    max_restarts: int = 3  # restarts within restart_window_hours; one more and `pretrain launch` gives up
    # the window the restart budget counts over (a rate, not a total); null: the whole run
    restart_window_hours: float | None = 1.0
    hang_factor: float = 10.0  # hung: no step for this many times the longest interval between steps
    hang_min_seconds: float = 300.0  # ... and never sooner than this (covers a first checkpoint save)
    startup_seconds: float = 1800.0  # hung: no first step this long after (re)starting the job
    stop_grace_seconds: float = 30.0  # SIGTERM, then this long before SIGKILL, when stopping a job

    def check_supervisor(self) -> None:
        check_positive("monitor.max_restarts", self.max_restarts, allow_zero=True)
        if self.restart_window_hours is not None:
            check_positive("monitor.restart_window_hours", self.restart_window_hours)
        for key in ("hang_factor", "hang_min_seconds", "startup_seconds", "stop_grace_seconds"):
            check_positive(f"monitor.{key}", getattr(self, key))


@dataclass(kw_only=True)
class ExpertCollapseSettings:
    """When the service warns that a mixture of experts' routing collapsed (monitoring/experts.py;
    docs/monitoring.md, Experts): in one MoE layer, an expert whose tokens are below
    expert_collapse_load × the layer's mean load, or one expert chosen by at least
    expert_collapse_share of the layer's tokens, in expert_collapse_steps reports in a row. One
    warning per such episode; never a rollback (what rebalances is the model's balancing)."""

    on_expert_collapse: str = "warn"  # warn | ignore
    expert_collapse_load: float = 0.05  # starved: its load (tokens over the layer's mean) below this
    expert_collapse_share: float = 0.5  # dominant: this share of the layer's tokens choose one expert
    expert_collapse_steps: int = 20  # reports in a row where either holds

    def check_expert_collapse(self) -> None:
        if self.on_expert_collapse not in EXPERT_COLLAPSE_RESPONSES:
            raise SettingError(
                f"monitor.on_expert_collapse={self.on_expert_collapse!r} must be warn or ignore: an "
                "expert collapse is a warning, never a rollback by itself (it rebalances through model.moe)"
            )
        load, share, steps = self.expert_collapse_load, self.expert_collapse_share, self.expert_collapse_steps
        if not (math.isfinite(load) and 0 < load < 1):
            raise SettingError(
                f"monitor.expert_collapse_load={load} must be in (0, 1): a fraction of the mean load"
            )
        if not (math.isfinite(share) and 0 < share <= 1):
            raise SettingError(
                f"monitor.expert_collapse_share={share} must be in (0, 1]: a share of a layer's tokens"
            )
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise SettingError(f"monitor.expert_collapse_steps={steps!r} must be an integer >= 1")


@dataclass(kw_only=True)
class ServiceConfig(ExpertCollapseSettings):
    """The monitoring service's settings (`pretrain monitor`: its policy and detectors, where it
    listens). Read from the run config's `monitor:` section (see `MonitorConfig`)."""

    enabled: bool = False  # post metrics to the monitoring service and act on its answers
    host: str = "127.0.0.1"
    port: int = 0  # 0: the service picks a free port and writes it to RUN_DIR/monitor/endpoint.json
    window: int = 128  # healthy values the spike band is computed over
    warmup: int = 32  # values seen before spikes are judged
    grad_norm_sigma: float = 6.0  # band: threshold = median + sigma × 1.4826·MAD of the window
    loss_sigma: float = 6.0  # the same for the loss
    min_rel_std: float = (
        0.02  # floor for the spread, relative to the median (a flat series is not all alarms)
    )
    grad_norm_surge_ratio: float = 8.0  # above its threshold and this many times its median: a surge
    loss_spike_ratio: float = 2.0  # a loss this many times its median is a spike, however wide the band
    divergence_steps: int = 100  # loss moving average rising this many steps in a row; 0 disables
    # What each finding does (docs/monitoring.md): ignore | warn | rollback | stop
    on_nonfinite: str = "rollback"  # a NaN or Inf loss or gradient norm
    on_loss_spike: str = "rollback"  # the loss above its threshold
    on_grad_norm_surge: str = "rollback"  # the gradient norm above its threshold and surge_ratio × its median
    on_divergence: str = "rollback"  # the loss's moving average rising divergence_steps steps in a row
    on_grad_norm_spike: str = "warn"  # the gradient norm above its threshold, below surge_ratio × its median
    # a precursor (largest attention logit, output log Z or |logit|, update/weight RMS) above its band
    on_instability_precursor: str = "warn"
    precursor_sigma: float = 6.0  # its band: median + sigma × 1.4826·MAD of its last precursor_window
    precursor_window: int = 64  # measurements (one every logging.precursors_every steps)
    precursor_warmup: int = 8  # measurements before it is judged
    rollback_margin: int = 0  # go back to a checkpoint at or before (anomalous step - 1 - margin)
    lr_scale: float = 1.0  # learning rate multiplied by this at each rollback
    max_rollbacks: int = 3  # circuit breaker: rollbacks in a row without progress past the anomaly
    # When rollbacks repeat (docs/monitoring.md): a rollback whose anomaly is within repeat_window
    # steps of the previous rollback's goes one stage further along on_repeat, keeping the earlier
    # stages' measures (quarantine: its windows set aside; lower_lr: the learning rate times
    # repeat_lr_factor for repeat_lr_steps steps; stop: the run ends with a diagnosis); a rollback
    # after a quiet window starts over. Empty: off.
    on_repeat: list[str] = field(default_factory=lambda: ["quarantine", "lower_lr"])
    repeat_window: int = 100
    repeat_lr_factor: float = 0.5
    repeat_lr_steps: int = 100
    # with monitor.skip_step (pretrain/stability/settings.py): a rollback only when more than this many steps in
    # a row had their update skipped
    skip_max_consecutive: int = 3

    def check_service(self) -> None:
        if not 0 <= self.port <= 65535:
            raise SettingError(f"monitor.port={self.port} must be in [0, 65535]")
        if self.warmup < 2 or self.window < self.warmup:
            raise SettingError(
                f"monitor.warmup={self.warmup}, monitor.window={self.window}: need 2 <= warmup <= window"
            )
        for key in ("grad_norm_sigma", "loss_sigma", "lr_scale", "grad_norm_surge_ratio", "loss_spike_ratio"):
            check_positive(f"monitor.{key}", getattr(self, key))
        self.check_expert_collapse()  # (before the loop: its own, narrower choice)
        for finding in FINDINGS:
            check_choice(f"monitor.on_{finding}", getattr(self, f"on_{finding}"), RESPONSES)
        check_positive("monitor.min_rel_std", self.min_rel_std, allow_zero=True)
        check_positive("monitor.divergence_steps", self.divergence_steps, allow_zero=True)
        check_positive("monitor.rollback_margin", self.rollback_margin, allow_zero=True)
        check_positive("monitor.max_rollbacks", self.max_rollbacks)
        check_positive("monitor.precursor_sigma", self.precursor_sigma)
        if self.precursor_warmup < 2 or self.precursor_window < self.precursor_warmup:
            raise SettingError(
                f"monitor.precursor_warmup={self.precursor_warmup}, monitor.precursor_window="
                f"{self.precursor_window}: need 2 <= precursor_warmup <= precursor_window"
            )
        check_positive("monitor.skip_max_consecutive", self.skip_max_consecutive)
        check_escalation(self)


def check_escalation(config: ServiceConfig) -> None:
    """monitor.on_repeat and its settings: known stages, `stop` only last, a window and a factor."""
    stages = config.on_repeat
    if not isinstance(stages, list | tuple) or not all(isinstance(s, str) for s in stages):
        raise SettingError(
            f"monitor.on_repeat={stages!r} must be a list of stages, e.g. [quarantine,lower_lr,stop]"
        )
    for stage in stages:
        check_choice("monitor.on_repeat", stage, REPEAT_STAGES)
    if "stop" in stages[:-1]:
        raise SettingError(f"monitor.on_repeat={list(stages)}: 'stop' can only be the last stage")
    check_positive("monitor.repeat_window", config.repeat_window)
    check_positive("monitor.repeat_lr_steps", config.repeat_lr_steps)
    if not (math.isfinite(config.repeat_lr_factor) and 0 < config.repeat_lr_factor <= 1):
        raise SettingError(f"monitor.repeat_lr_factor={config.repeat_lr_factor} must be in (0, 1]")

"""The monitor's and the supervisor's settings and their vocabulary: what the detectors find
(`FINDINGS`) and what a finding may do (`RESPONSES`). `ServiceConfig` is the service's (its policy,
its detectors, where it listens), `TrainerLinkConfig` the trainer's (its requests to the service,
quarantine, skipping a bad update), `SupervisorConfig` the supervisor's (restarts, hangs);
`MonitorConfig`, the run config's `monitor:` section, is all three, flat. Owned by `monitoring/`,
read into the run config by `pretrain/config/`. Importable without torch, and without `pretrain`.
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
)
RESPONSES = ("ignore", "warn", "rollback", "stop")  # what a finding may do, least to most drastic
REPEAT_STAGES = ("quarantine", "lower_lr", "stop")  # monitor.on_repeat: what a repeated rollback adds
STRAGGLER_RESPONSES = ("warn", "replace")  # monitor.on_straggler


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
class TrainerLinkConfig:
    """The trainer's side of the monitor: its requests to the service, what a rollback does to the
    data, and skipping a bad update in place. Read from the run config's `monitor:` section (see
    `MonitorConfig`); neither the service nor its policy reads these."""

    timeout: float = 2.0  # seconds per request; the trainer goes on (and warns) when it gets no answer
    # on a rollback, the anomalous step's windows are not served again in their epoch (RUN_DIR/quarantine.jsonl)
    quarantine: bool = False
    # Skip a bad update in place (pretrain/stability/skip_step.py): a step whose loss or gradient norm is
    # non-finite or above skip_ratio × its running median (of the last skip_window) never lands
    # (the gradient norm against skip_grad_norm_ratio instead, when that is set).
    # The trainer does it, with or without the service; the service then rolls back only when
    # more than monitor.skip_max_consecutive steps in a row were skipped, or for what a skip cannot fix.
    skip_step: bool = False
    skip_ratio: float = 3.0
    skip_grad_norm_ratio: float | None = None  # the gradient norm's own ratio; None: skip_ratio
    skip_window: int = 64
    # A rank whose compute time per step is above straggler_factor × the median rank's for
    # straggler_windows logging intervals in a row is a straggler: an event and a warning (warn), or
    # also a checkpoint and a restart with a spare node in its host's place (replace).
    straggler_factor: float = 1.5
    straggler_windows: int = 3
    on_straggler: str = "warn"
    # Was it the data or the machine (docs/monitoring.md, "Replay and replica checks")? replay: a
    # step whose update did not land is run again on every rank, and a rank whose loss or gradient
    # norm changes is a machine fault (off by default: the gradient tally costs 1-7% of a step on
    # CPU). A host with machine_faults_to_exclude of them is moved off at a restart.
    replay: bool = False
    machine_faults_to_exclude: int = 2
    # The replicas compared (docs/monitoring.md, "Replay and replica checks"): every
    # consistency_every steps, before every checkpoint and after every rejected step, the weights
    # every rank holds alike are digested and compared; a rank whose copy differs is a machine
    # fault (replica_mismatch, a rollback to the newest consistent checkpoint). 0: never.
    consistency_every: int = 100

    def check_trainer_link(self) -> None:
        check_positive("monitor.timeout", self.timeout)
        if not (math.isfinite(self.skip_ratio) and self.skip_ratio > 1):
            raise SettingError(f"monitor.skip_ratio={self.skip_ratio} must be a finite number > 1")
        ratio = self.skip_grad_norm_ratio
        if ratio is not None and not (math.isfinite(ratio) and ratio > 1):
            raise SettingError(
                f"monitor.skip_grad_norm_ratio={ratio} must be a finite number > 1 (or null: skip_ratio)"
            )
        if self.skip_window < 2:
            raise SettingError(f"monitor.skip_window={self.skip_window} must be >= 2")
        if not (math.isfinite(self.straggler_factor) and self.straggler_factor > 1):
            raise SettingError(
                f"monitor.straggler_factor={self.straggler_factor} must be a finite number > 1"
            )
        check_positive("monitor.straggler_windows", self.straggler_windows)
        check_choice("monitor.on_straggler", self.on_straggler, STRAGGLER_RESPONSES)
        check_positive("monitor.machine_faults_to_exclude", self.machine_faults_to_exclude)
        if self.consistency_every < 0:
            raise SettingError(
                f"monitor.consistency_every={self.consistency_every} must be >= 0 (0: no replica check)"
            )


@dataclass(kw_only=True)
class ServiceConfig:
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
    # with monitor.skip_step (TrainerLinkConfig): a rollback only when more than this many steps in
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


@dataclass(kw_only=True)
class MonitorConfig(SupervisorConfig, TrainerLinkConfig, ServiceConfig):
    """The run config's `monitor:` section: the service's settings, the trainer's, then the
    supervisor's, as one flat section (its keys, `monitor.window`, `monitor.timeout`,
    `monitor.max_restarts`, ..., are a contract). Each owner is typed to take only its part: the
    policy and the service a `ServiceConfig`, the hang watch a `SupervisorConfig`; the trainer
    reads its `TrainerLinkConfig` part; the supervisor, which also starts the service, the whole."""

    def __post_init__(self) -> None:
        self.check_service()
        self.check_trainer_link()
        self.check_supervisor()

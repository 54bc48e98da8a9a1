"""Learning-rate schedules as pure functions of the step (1-based: the step being taken).

    cosine        linear warm-up to optim.lr, then cosine decay to min_lr_ratio · optim.lr
    wsd           warm-up, stable at optim.lr, then a linear decay over the last decay_fraction
                  of the steps to min_lr_ratio · optim.lr (Hägele et al. 2024, "warmup-stable-decay")
    inverse_sqrt  Vaswani et al.: d_model^-0.5 · min(step^-0.5, step · warmup^-1.5), multiplied by
                  optim.lr (so optim.lr = 1.0 is the paper's schedule)
    constant      warm-up, then optim.lr

`lr_at(step)` returns the learning rate itself; the trainer passes lr_at(step) / optim.lr to a
LambdaLR-style multiplier, times the step hooks' factors (the monitor's `LrScale` after a rollback).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

from pretrain.config import ScheduleConfig


def lr_at(step: int, peak_lr: float, total_steps: int, schedule: ScheduleConfig, d_model: int) -> float:
    step = max(step, 1)
    warmup = schedule.warmup_steps
    if schedule.name == "inverse_sqrt":
        return peak_lr * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
    if warmup and step <= warmup:
        return peak_lr * step / warmup
    floor = peak_lr * schedule.min_lr_ratio
    if schedule.name == "constant":
        return peak_lr
    if schedule.name == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    # wsd
    decay_steps = max(1, round(schedule.decay_fraction * total_steps))
    decay_start = total_steps - decay_steps
    if step <= decay_start:
        return peak_lr
    progress = min(1.0, (step - decay_start) / decay_steps)
    return peak_lr + (floor - peak_lr) * progress


def peak_of(lr: float, schedule: ScheduleConfig, d_model: int) -> float:
    """The highest rate a schedule reaches: optim.lr, but for inverse_sqrt, whose optim.lr is a
    multiplier (its peak is at the end of the warm-up)."""
    if schedule.name == "inverse_sqrt":
        return lr_at(max(schedule.warmup_steps, 1), lr, 1, schedule, d_model)
    return lr


def schedule_for(
    peak_lr: float, total_steps: int, schedule: ScheduleConfig, d_model: int
) -> Callable[[int], float]:
    """`lr_at` with everything but the step fixed: what the training loop calls each step."""
    return functools.partial(
        lr_at, peak_lr=peak_lr, total_steps=total_steps, schedule=schedule, d_model=d_model
    )

"""The skip guard's pure parts (pretrain/stability/skip_step.py): the running level, the verdict, the outcome
the gate reads, the checkpoint state (no process group). Inside DeepSpeed's optimizers, on
stand-ins: tests/unit/test_norm_gate.py; the real engine: tests/integration/test_skip_step.py."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from pretrain.stability.skip_step import (
    LOSS_NONFINITE,
    LOSS_SPIKE,
    NORM_NONFINITE,
    NORM_SPIKE,
    RunningLevel,
    SkipGuard,
    SkipOutcome,
    decide,
    global_mean,
)

NAN, INF = math.nan, math.inf


def pushed(level: RunningLevel, *rows) -> RunningLevel:
    for loss, norm in rows:
        values = torch.tensor([loss, norm], dtype=torch.float64)
        level.push(values, torch.isfinite(values))
    return level


def test_the_level_is_the_median_of_the_last_window_finite_values():
    level = RunningLevel(window=4)
    assert level.level().isnan().all() and level.count().tolist() == [0, 0]
    pushed(level, (5.0, 1.0), (4.0, 3.0), (NAN, 2.0))  # the NaN loss never joins
    assert level.count().tolist() == [2, 3]
    assert level.level().tolist() == [4.0, 2.0]  # (an even count: the lower middle value)
    pushed(level, (3.0, 100.0), (2.0, 4.0), (1.0, 5.0), (INF, -INF))
    # window 4: the loss's last four are 4, 3, 2, 1; the norm's 2, 100, 4, 5
    assert level.count().tolist() == [4, 4]
    assert level.level().tolist() == [2.0, 4.0]


def test_the_level_state_is_json_and_loads_exactly_into_any_window():
    level = pushed(RunningLevel(window=4), (0.1, 1 / 3), (0.2, NAN), (math.pi, 2.0**-30))
    state = json.loads(json.dumps(level.state_dict()))
    assert state == {"window": 4, "loss": [0.1, 0.2, math.pi], "grad_norm": [1 / 3, 2.0**-30]}
    same = RunningLevel(window=4)
    same.load_state_dict(state)
    assert torch.equal(same.buffer.nan_to_num(-1.0), level.buffer.nan_to_num(-1.0))
    smaller = RunningLevel(window=2)
    smaller.load_state_dict(state)  # the newest values
    assert smaller.state_dict() == {"window": 2, "loss": [0.2, math.pi], "grad_norm": [1 / 3, 2.0**-30]}
    empty = RunningLevel(window=3)
    empty.load_state_dict({})
    assert empty.count().tolist() == [0, 0]


def verdict(values, level=(4.0, 1.0), count=(5, 5), given=(True, True), min_count=3, ratios=(3.0, 3.0)):
    d = decide(
        torch.tensor(values, dtype=torch.float64),
        torch.tensor(given),
        torch.tensor(level, dtype=torch.float64),
        torch.tensor(count),
        torch.tensor(ratios, dtype=torch.float64),
        min_count,
    )
    return bool(d.skip), int(d.reasons), d.keep.tolist()


def test_the_verdict():
    assert verdict([4.5, 1.2]) == (False, 0, [True, True])
    assert verdict([12.0, 3.0]) == (False, 0, [True, True])  # exactly ratio × level: kept
    assert verdict([12.1, 1.0]) == (True, LOSS_SPIKE, [True, True])
    assert verdict([4.0, 3.1]) == (True, NORM_SPIKE, [True, True])
    assert verdict([13.0, 3.1]) == (True, LOSS_SPIKE | NORM_SPIKE, [True, True])
    assert verdict([NAN, 1.0]) == (True, LOSS_NONFINITE, [False, True])
    assert verdict([4.0, INF]) == (True, NORM_NONFINITE, [True, False])
    assert verdict([NAN, NAN]) == (True, LOSS_NONFINITE | NORM_NONFINITE, [False, False])
    assert verdict([4.0, 3.1], ratios=(3.0, 5.0)) == (False, 0, [True, True])  # its own ratio
    # Fewer than min_count values: only non-finite values skip.
    assert verdict([100.0, 100.0], count=(2, 2)) == (False, 0, [True, True])
    assert verdict([100.0, INF], count=(2, 2)) == (True, NORM_NONFINITE, [True, False])
    assert verdict([100.0, 1.0], level=(NAN, 1.0), count=(0, 5), min_count=0) == (False, 0, [True, True])
    # No loss this step: judged on the norm alone, and no loss joins the level.
    assert verdict([NAN, 1.0], given=(False, True)) == (False, 0, [False, True])
    assert verdict([NAN, 9.0], given=(False, True)) == (True, NORM_SPIKE, [False, True])


def step(guard: SkipGuard, loss, norm) -> SkipOutcome:
    if loss is not None:
        guard.set_loss(torch.tensor(loss))
    if norm is not None:  # (None: DeepSpeed skipped before computing the norm)
        guard.judge(torch.tensor(norm))
    return SkipOutcome.of(guard.outcome().tolist())


def test_the_guard_steps_skips_and_reports():
    guard = SkipGuard(ratio=3.0, window=8, min_count=3)
    first = step(guard, 5.0, 1.0)
    assert first == SkipOutcome(False, False, (), 5.0, 1.0, first.loss_level, first.grad_norm_level)
    assert math.isnan(first.loss_level) and math.isnan(first.grad_norm_level)
    assert [step(guard, 20.0, 4.0).skipped for _ in range(2)] == [False, False]  # still warming up
    spike = step(guard, 100.0, 1.0)  # levels: medians of (5, 20, 20) and (1, 4, 4)
    assert spike == SkipOutcome(True, True, ("loss_spike",), 100.0, 1.0, 20.0, 4.0)
    nan_grad = step(guard, 5.0, None)
    assert nan_grad.skipped and nan_grad.reasons == ("grad_norm_nonfinite",) and nan_grad.grad_norm == INF
    no_loss = step(guard, None, 2.0)
    assert not no_loss.skipped and math.isnan(no_loss.loss)
    assert guard.state_dict() == {
        "window": 8,
        "loss": [5.0, 20.0, 20.0, 100.0, 5.0],
        "grad_norm": [1.0, 4.0, 4.0, 1.0, 2.0],
    }


def test_with_act_off_the_guard_only_reports():
    guard = SkipGuard(ratio=3.0, window=8, min_count=1, act=False)
    step(guard, 5.0, 1.0)
    guard.set_loss(torch.tensor(100.0))
    assert not bool(guard.judge(torch.tensor(1.0)))
    outcome = SkipOutcome.of(guard.outcome().tolist())
    assert outcome.outlier and not outcome.skipped and outcome.reasons == ("loss_spike",)
    # A non-finite norm is skipped by the norm gate, whatever the guard says.
    assert step(guard, 5.0, NAN).skipped


@pytest.mark.parametrize("ratio, grad_norm_ratio", [(2.0, 5.0), (5.0, 2.0)])
def test_each_signal_is_judged_against_its_own_ratio(ratio, grad_norm_ratio):
    """SkipGuard(ratio, grad_norm_ratio): the loss against `ratio` × its level, the gradient norm
    against `grad_norm_ratio` × its level. A value 3× its level lies between the two, so it is a
    spike for the signal with the ratio 2 and not for the one with the ratio 5."""
    guard = SkipGuard(ratio=ratio, window=8, min_count=3, grad_norm_ratio=grad_norm_ratio)
    assert (guard.ratio, guard.grad_norm_ratio) == (ratio, grad_norm_ratio)
    for _ in range(3):
        assert not step(guard, 4.0, 1.0).skipped  # levels: 4 and 1
    loss_3x = step(guard, 12.0, 1.0)
    norm_3x = step(guard, 4.0, 3.0)
    assert (loss_3x.loss_level, loss_3x.grad_norm_level, norm_3x.loss_level, norm_3x.grad_norm_level) == (
        4.0,
        1.0,
        4.0,
        1.0,
    )
    assert loss_3x.skipped == (ratio < 3) and loss_3x.reasons == (("loss_spike",) if ratio < 3 else ())
    assert norm_3x.skipped == (grad_norm_ratio < 3)
    assert norm_3x.reasons == (("grad_norm_spike",) if grad_norm_ratio < 3 else ())
    # Above both ratios, each is a spike of its own signal.
    assert step(guard, 21.0, 1.0).reasons == ("loss_spike",)
    assert step(guard, 4.0, 5.5).reasons == ("grad_norm_spike",)


def test_without_a_gradient_norm_ratio_both_signals_use_the_one_ratio():
    guard = SkipGuard(ratio=2.5, window=8, min_count=3)
    assert guard.grad_norm_ratio == 2.5
    for _ in range(3):
        step(guard, 4.0, 1.0)
    assert step(guard, 4.0, 2.6).reasons == ("grad_norm_spike",)
    assert step(guard, 10.4, 1.0).reasons == ("loss_spike",)
    assert not step(guard, 9.6, 2.4).skipped


def test_the_skip_hook_names_each_reason_by_its_own_ratio(tmp_path):
    """What the hook records for a skipped step (the `update_skipped` event, the console line):
    each value against its own ratio, as the guard judged it."""
    from monitoring.protocol import UpdateSkipped, read_events
    from pretrain.train.skip_hook import SkipBadUpdates, why_skipped
    from tests.unit.fakes import ONE_PROCESS

    levels = {"loss": 4.0, "grad_norm": 1.0}
    assert why_skipped(12.0, 3.0, levels, 2.0, 5.0) == ["loss_spike"]
    assert why_skipped(12.0, 3.0, levels, 5.0, 2.0) == ["grad_norm_spike"]
    assert why_skipped(21.0, 6.0, levels, 5.0, 2.0) == ["loss_spike", "grad_norm_spike"]
    lines = []
    guard = SkipGuard(ratio=2.0, window=8, min_count=3, grad_norm_ratio=5.0)
    hook = SkipBadUpdates(guard, None, ONE_PROCESS, tmp_path, SimpleNamespace(message=lines.append))
    metrics = {
        "train/update_skipped": 1.0,
        "train/loss": 12.0,
        "train/grad_norm": 3.0,
        "train/skip_level/loss": 4.0,
        "train/skip_level/grad_norm": 1.0,
    }
    hook.after_step(7, metrics, [], 0.0)
    (event,) = [e for e in read_events(tmp_path) if isinstance(e, UpdateSkipped)]
    assert event.step == 7 and event.reasons == ["loss_spike"]
    assert lines and "update skipped (loss_spike:" in lines[0]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="ratio"):
        SkipGuard(ratio=1.0)
    with pytest.raises(ValueError, match="min_count"):
        SkipGuard(window=4, min_count=5)
    with pytest.raises(ValueError, match="window"):
        RunningLevel(window=0)


def test_global_mean_without_a_process_group_is_the_value():
    assert global_mean(torch.tensor(2.5)).item() == 2.5


def test_the_run_configs_two_ratios_reach_the_guard_each_in_its_place(tmp_path):
    """monitor.skip_ratio is the loss's ratio and monitor.skip_grad_norm_ratio the gradient norm's
    (null: the same as the loss's), as the pretraining hooks build the guard."""
    from types import SimpleNamespace

    from pretrain.config import load_config
    from pretrain.pretraining import step_hooks
    from pretrain.train.skip_hook import SkipBadUpdates
    from tests.helpers import TINY
    from tests.unit.fakes import ONE_PROCESS

    def guard(*overrides):
        settings = [f"run.dir={tmp_path}", "monitor.skip_step=true", "logging.precursors_every=0"]
        cfg = load_config(TINY, [*settings, *overrides])
        dense = SimpleNamespace(  # (no experts: no balancing hook; the replay asks its accumulation)
            module=SimpleNamespace(layers=[]), gradient_accumulation_steps=lambda: 1
        )
        parts = SimpleNamespace(env=ONE_PROCESS, engine=dense, writer=None, task=None, checkpointer=None)
        cadence = SimpleNamespace(logged=lambda step: True)
        (hook,) = [h for h in step_hooks(cfg, cadence, parts) if isinstance(h, SkipBadUpdates)]
        return hook.guard.ratio, hook.guard.grad_norm_ratio

    assert guard("monitor.skip_ratio=2", "monitor.skip_grad_norm_ratio=5") == (2.0, 5.0)
    assert guard("monitor.skip_ratio=2") == (2.0, 2.0)

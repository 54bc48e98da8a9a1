"""When rollbacks repeat (monitor.on_repeat), with real processes: a 2-process job and the
monitoring service as its own process. A spike keeps coming back two steps after each rollback's
target; the rollbacks climb the ladder — plain, quarantine, a lowered learning rate — the job
stops (train.stop_at_step) while the rate is lowered, the service is stopped and started again,
the job resumes from its checkpoint, and the next repeat stops the run with the diagnosis."""

import json
import signal

import pytest

from pretrain.config import load_config
from pretrain.optim.schedules import schedule_for
from tests.integration.runs import FAST, TINY, events, launcher, torchrun, train, train_state
from tests.integration.test_monitoring import _start_service, request

SERVICE = [
    "monitor.warmup=4",
    "monitor.window=16",
    "monitor.on_repeat=[quarantine,lower_lr,stop]",
    "monitor.repeat_window=5",
    "monitor.repeat_lr_factor=0.5",
    "monitor.repeat_lr_steps=4",
]
JOB = [
    "train.steps=20",
    "checkpoint.every=2",
    "checkpoint.keep=20",
    "eval.every=0",
    "monitor.enabled=true",
    "faults.spike_steps=[8,10,12,14]",  # each fires once: every rollback's re-run meets the next
]


def _stop(process) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)


def test_repeated_spikes_climb_the_ladder_across_a_restart_of_the_service_and_the_job(tmp_path, train_data):
    service, url, _ = _start_service(tmp_path, *SERVICE)
    try:
        first = train(torchrun(2), tmp_path, train_data, *JOB, "train.stop_at_step=13")
    finally:
        _stop(service)
    assert "reached train.stop_at_step: saved step_00000013" in first.stdout
    decided = [e for e in events(tmp_path) if e["type"] == "rollback"]
    assert [(e["step"], e["target"], e.get("stage"), e.get("lr_factor")) for e in decided] == [
        (8, "step_00000006", None, None),
        (10, "step_00000008", "quarantine", None),
        (12, "step_00000010", "lower_lr", 0.5),
    ]
    applied = [e for e in events(tmp_path) if e["type"] == "rollback_applied"]
    assert [(e["decision"], e["applied_at"]) for e in applied] == [(1, 8), (2, 10), (3, 12)]
    quarantined = [json.loads(line) for line in (tmp_path / "quarantine.jsonl").read_text().splitlines()]
    assert [(q["decision"], q["step"]) for q in quarantined] == [(2, 10), (3, 12)]  # (run: quarantine off)
    assert all(len(q["windows"]) == 4 for q in quarantined)  # 2 ranks x 2 sequences
    (lowered,) = [e for e in events(tmp_path) if e["type"] == "lr_lowered"]
    assert (lowered["step"], lowered["until"], lowered["factor"]) == (10, 14, 0.5)
    monitor = train_state(tmp_path, 13)["hooks"]["monitor"]
    assert monitor["lr"] == {"scale": 1.0, "factor": 0.5, "until": 14, "decision": 3}
    assert monitor["rollback"] == {k: v for k, v in decided[2].items() if k not in ("type", "time")}

    # A new service process (its ladder from events.jsonl) and the job resumed from step 13.
    (tmp_path / "monitor" / "endpoint.json").unlink()  # (the stopped one's: wait for the new one's)
    service, url, _ = _start_service(tmp_path, *SERVICE)
    try:
        # (DeepSpeed's launcher: it passes the ranks' exit status on, as `pretrain launch` reads it)
        second = train(launcher(2), tmp_path, train_data, *JOB, "checkpoint.resume=auto", check=False)
        status = json.loads(request(url, "/status")[1])
    finally:
        _stop(service)
    assert second.returncode == 3, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from step_00000013" in second.stdout
    (stopped,) = [e for e in events(tmp_path) if e["type"] == "repeats_stopped"]
    diagnosis = stopped["diagnosis"]
    assert stopped["step"] == 14 and [t.get("stage") for t in stopped["tried"]] == [
        None,
        "quarantine",
        "lower_lr",
    ]
    for part in (
        "rollback 1 at step 8 (loss_spike) to step_00000006;",
        "rollback 2 at step 10 (loss_spike) to step_00000008, its windows quarantined;",
        "rollback 3 at step 12 (loss_spike) to step_00000010, its windows quarantined and learning rate "
        "x0.5 for 4 steps;",
        "at step 14: stopping after monitor.on_repeat [quarantine, lower_lr, stop]",
    ):
        assert part in diagnosis, part
    assert f"monitor: {diagnosis}; stopping the job" in second.stdout
    assert status["escalation"]["stopped"] == diagnosis and status["circuit_breaker"]
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["stopped_by_monitor"] == diagnosis and not summary["completed"]
    assert not [e for e in events(tmp_path) if e["type"] == "circuit_breaker"]

    # The learning rate: the schedule's, but for steps 11-14 (the 4 after rollback 3's target),
    # halved, before and after the restart; the re-run steps' last records are the ones that went on.
    cfg = load_config(TINY, [*FAST, *JOB])
    lr_at = schedule_for(cfg.optim.lr, cfg.train.steps, cfg.schedule, cfg.model.d_model)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = {r["step"]: r for r in records}
    for step in range(1, 15):
        factor = 0.5 if 11 <= step <= 14 else 1.0
        assert last[step]["train/lr"] == pytest.approx(lr_at(step) * factor, rel=1e-12), step
    tries_of_11 = [r["train/lr"] for r in records if r["step"] == 11]  # once before rollback 3, once after
    assert len(tries_of_11) == 2 and tries_of_11[1] == pytest.approx(tries_of_11[0] * 0.5, rel=1e-12)
    assert max(r["step"] for r in records) <= 15  # stopped at the first boundary after the answer

"""The monitoring service as its own process (`python -m monitoring`), and real 2-process
training runs that report to it: spikes rolled back, a service that is down."""

import json
import math
import os
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

from tests.integration.runs import launcher, train
from tests.integration.runs import metrics as step_metrics
from tests.unit.test_monitor import fake_checkpoint, metrics


@pytest.fixture
def service(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-m", "monitoring", "--run-dir", str(tmp_path), "monitor.warmup=4", "monitor.window=16"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    endpoint = tmp_path / "monitor" / "endpoint.json"
    deadline = time.time() + 60
    while not endpoint.exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.1)
    assert endpoint.exists(), process.communicate()[0]
    url = json.loads(endpoint.read_text())["url"]
    token = (tmp_path / "monitor" / "token").read_text().strip()
    yield url, token, tmp_path
    process.terminate()
    process.wait(timeout=30)


def request(url, path, payload=None, token=None):
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url + path, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(req, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_service_binds_locally_and_guards_state_changes(service):
    url, token, run_dir = service
    assert url.startswith("http://127.0.0.1:")
    assert stat.S_IMODE(os.stat(run_dir / "monitor" / "token").st_mode) == 0o600
    body = metrics(1).to_json()
    assert request(url, "/v1/metrics", body)[0] == 401
    assert request(url, "/v1/metrics", body, token="wrong")[0] == 401
    assert request(url, "/v1/rollback", {"reason": "x"})[0] == 401
    code, text = request(url, "/v1/metrics", body, token)
    assert code == 200 and json.loads(text)["action"] == "continue"
    assert request(url, "/v1/metrics", {"step": "one"}, token)[0] == 400
    status = json.loads(request(url, "/status")[1])
    assert status["step"] == 1 and status["rollbacks"] == [] and status["circuit_breaker"] is False


def test_service_orders_rollbacks_and_reports_them(service):
    from prometheus_client.parser import text_string_to_metric_families

    url, token, run_dir = service
    fake_checkpoint(run_dir, 6)
    for step in range(1, 10):
        assert (
            json.loads(
                request(url, "/v1/metrics", metrics(step, grad=1.0 + 0.01 * step).to_json(), token)[1]
            )["action"]
            == "continue"
        )
    answer = json.loads(request(url, "/v1/metrics", metrics(10, grad=500.0).to_json(), token)[1])
    assert (
        answer["action"] == "rollback"
        and answer["tag"] == "step_00000006"
        and answer["decision"] == 1
        and answer["step"] == 10
        and isinstance(answer["seed"], int)
    )
    assert answer["bands"]["grad_norm"]["threshold"] < 500 and answer["verdict"]["level"] == "rollback"
    # Until the trainer says what became of it, later steps are not judged: the answer repeats it.
    again = json.loads(request(url, "/v1/metrics", metrics(11, grad=900.0).to_json(), token)[1])
    assert again["decision"] == 1 and again["verdict"]["level"] == "superseded"
    code, text = request(url, "/v1/rollback", {"reason": "operator says so"}, token)
    assert code == 409 and "not applied yet" in json.loads(text)["error"]
    outcome = {"decision": 1, "decided_at": 10, "applied": True, "applied_at": 11, "tag": "step_00000006"}
    assert request(url, "/v1/outcome", outcome, token)[0] == 200
    # An operator's rollback, decided at the next report.
    assert request(url, "/v1/rollback", {"reason": "operator says so"}, token)[0] == 202
    manual = json.loads(request(url, "/v1/metrics", metrics(7).to_json(), token)[1])
    assert manual["action"] == "rollback" and "operator says so" in manual["reason"] and manual["decision"] == 2
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["type"] == "step"] == [*range(1, 12), 7]
    events = [e for e in events if e["type"] != "step"]
    assert [e["type"] for e in events] == ["rollback", "rollback"]
    assert {"decision", "step", "reason", "value", "threshold", "target", "seed"} <= set(events[0])
    families = {f.name: f for f in text_string_to_metric_families(request(url, "/metrics")[1])}
    assert families["pretrain_rollbacks"].samples[0].value == 1  # applied; the second is only decided
    assert families["pretrain_rollbacks_decided"].samples[0].value == 2
    assert families["pretrain_step"].samples[0].value == 7
    status = json.loads(request(url, "/status")[1])
    assert [r["decision"] for r in status["rollbacks"]] == [1] and status["rollback_pending"]["decision"] == 2
    assert status["detectors"]["grad_norm"]["threshold"] > 0


# --------------------------------------------------------------------------- with real training runs


def test_two_spikes_are_rolled_back_and_the_run_finishes(service, train_data):
    from pretrain.data import WindowStream
    from pretrain.inference import load_trained

    _, _, run_dir = service
    result = train(launcher(2), run_dir, train_data, "train.steps=16", "checkpoint.every=4", "eval.every=0",
                   "checkpoint.keep=2", "monitor.enabled=true", "faults.spike_steps=[10,15]",
                   "logging.data_trace=true")  # fmt: skip
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    ordered = [(e["step"], e["target"]) for e in events if e["type"] == "rollback"]
    assert ordered == [(10, "step_00000008"), (15, "step_00000012")]
    assert all(e["finding"] == "loss_spike" and e["value"] > e["threshold"] for e in events if e["type"] == "rollback")
    applied = [e for e in events if e["type"] == "rollback_applied"]
    assert [e["step"] for e in applied] == [8, 12] and all(e["matches_checkpoint"] for e in applied)
    assert [e["decided_at"] for e in applied] == [10, 15]
    # Applied at the first step boundary after the answer came, and before any checkpoint.
    first, second = (e["applied_at"] for e in applied)
    assert 10 <= first <= 12 and 15 <= second <= 16
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["completed"] and summary["step"] == 16 and summary["rollbacks"] == 2
    assert "rolling back to step_00000008" in result.stdout
    last = step_metrics(run_dir)  # the re-run steps are clean: each fault fires once
    assert all(last[s]["train/loss"] < 10 for s in range(1, 17))
    assert all(torch.isfinite(p).all() for p in load_trained(run_dir).model.parameters())
    # The data position is an uninterrupted run's; the order after each target was reshuffled.
    state = json.loads((run_dir / "checkpoints" / "step_00000016" / "train_state.json").read_text())["data"]
    assert state["consumed"] == 16 * 4
    assert [start for start, _ in state["epoch_seeds"]] == [0, 8 * 4, 12 * 4]

    # The windows each rank trained on, from the trainer's own trace: the timeline that survived
    # (the last record of each step) serves every window at most once, and with the rest of the
    # epoch as the stream goes on from the final state, every window of the epoch exactly once.
    served: dict[int, list[int]] = {}  # step -> windows, all ranks, of the last try of each step
    for rank in (0, 1):
        records = [
            json.loads(line)
            for line in (run_dir / "data_trace" / f"rank_{rank:05d}.jsonl").read_text().splitlines()
        ]
        steps = [r["step"] for r in records]
        # the rolled-back steps, and only those, ran twice
        assert steps == [*range(1, first + 1), *range(9, second + 1), *range(13, 17)]
        for step, windows in {r["step"]: r["windows"] for r in records}.items():
            served.setdefault(step, []).extend(windows)
    timeline = [w for step in range(1, 17) for w in served[step]]
    assert len(timeline) == 64 and len(set(timeline)) == 64
    rest = WindowStream(train_data, 512, rank=0, world_size=1)
    rest.load_state_dict(state)
    remaining = []
    for _ in range(rest.num_windows - 64):
        next(rest)
        remaining.append(rest.last_window)
    assert sorted(timeline + remaining) == list(range(rest.num_windows))
    # The reshuffle changed the order: the re-run of step 9 did not replay the same windows.
    rank0 = [
        json.loads(line) for line in (run_dir / "data_trace" / "rank_00000.jsonl").read_text().splitlines()
    ]
    tries_of_step_9 = [r["windows"] for r in rank0 if r["step"] == 9]
    assert len(tries_of_step_9) == 2 and tries_of_step_9[0] != tries_of_step_9[1]


def test_training_goes_on_when_the_monitor_is_down_and_never_applies_a_nan(tmp_path, train_data):
    from pretrain.inference import load_trained

    result = train(launcher(2), tmp_path, train_data, "train.steps=4", "checkpoint.every=4", "eval.every=0",
                   "monitor.enabled=true", "faults.nan_steps=[2]")  # fmt: skip
    assert "monitor unreachable at step 1" in result.stderr
    assert json.loads((tmp_path / "train_summary.json").read_text())["completed"]
    steps = step_metrics(tmp_path)
    assert math.isnan(steps[2]["train/loss"]) and steps[4]["train/skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in load_trained(tmp_path).model.parameters())

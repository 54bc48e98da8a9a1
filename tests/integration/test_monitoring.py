"""The monitoring service as its own process (`python -m monitoring`), and real 2-process
training runs that report to it: spikes rolled back, a service that stalls."""

import collections
import json
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from tests.integration.runs import events, torchrun, train
from tests.integration.runs import metrics as step_metrics
from tests.unit.test_monitor import fake_checkpoint, metrics


def _start_service(run_dir, *overrides):
    process = subprocess.Popen(
        [sys.executable, "-m", "monitoring", "--run-dir", str(run_dir), *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    endpoint = run_dir / "monitor" / "endpoint.json"
    deadline = time.time() + 60
    while not endpoint.exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.1)
    assert endpoint.exists(), process.communicate()[0]
    announced = json.loads(endpoint.read_text())
    url = announced["url"]
    assert url == f"http://{announced['host']}:{announced['port']}"  # what the README says it holds
    return process, url, (run_dir / "monitor" / "token").read_text().strip()


@pytest.fixture
def service(tmp_path):
    process, url, token = _start_service(tmp_path, "monitor.warmup=4", "monitor.window=16")
    yield url, token, tmp_path
    os.kill(process.pid, signal.SIGCONT)  # (in case a test stopped it)
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
    decided = answer["rollback"]
    assert (
        answer["action"] == "rollback"
        and decided["target"] == "step_00000006"
        and decided["decision"] == 1
        and decided["step"] == 10
        and isinstance(decided["seed"], int)
    )
    assert answer["bands"]["grad_norm"]["threshold"] < 500 and answer["verdict"]["level"] == "rollback"
    # Until the trainer says what became of it, later steps are not judged: the answer repeats it.
    again = json.loads(request(url, "/v1/metrics", metrics(11, grad=900.0).to_json(), token)[1])
    assert again["rollback"] == decided and again["verdict"]["level"] == "superseded"
    code, text = request(url, "/v1/rollback", {"reason": "operator says so"}, token)
    assert code == 409 and "not applied yet" in json.loads(text)["error"]
    outcome = {"decision": 1, "decided_at": 10, "applied": True, "applied_at": 11, "tag": "step_00000006"}
    assert request(url, "/v1/outcome", outcome, token)[0] == 200
    # An operator's rollback, decided at the next report.
    assert request(url, "/v1/rollback", {"reason": "operator says so"}, token)[0] == 202
    manual = json.loads(request(url, "/v1/metrics", metrics(7).to_json(), token)[1])
    assert (
        manual["action"] == "rollback"
        and "operator says so" in manual["rollback"]["reason"]
        and manual["rollback"]["decision"] == 2
    )
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


def test_two_spikes_are_rolled_back_and_the_run_finishes_also_when_the_service_stalls(service, train_data):
    """Spikes at steps 10 and 15 of a 2-process run. For the second, the service is stopped
    (SIGSTOP) from the report of step 13 on, for 3 s (six times the client's timeout) at least
    and until the trainer has gone two steps further: training goes on meanwhile, and when the
    service is back it judges every step in order; the rollback is decided then, applied before
    the last checkpoint, and no checkpoint holding the spike is its target or is loaded."""
    from pretrain.data import WindowStream
    from pretrain.evaluation.inference import load_trained

    url, _, run_dir = service
    pid = json.loads((run_dir / "monitor" / "endpoint.json").read_text())["pid"]
    runner, done = _train_in_background(
        torchrun(2),
        run_dir,
        train_data,
        "train.steps=16",
        "checkpoint.every=4",
        "eval.every=0",
        "checkpoint.keep=2",
        "monitor.enabled=true",
        "monitor.timeout=0.5",
        "faults.spike_steps=[10,15]",
        "logging.data_trace=true",
    )
    _wait_for_step(run_dir, 13, runner)  # (reported once: on the timeline after the first rollback)
    os.kill(pid, signal.SIGSTOP)
    stalled = time.time()
    reported = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    judged = max(e["step"] for e in reported if e["type"] == "step")
    # Stopped until the trainer has written two more steps on its own (the report of the first went
    # into the stall a step before the second), then 1 s more (twice the client's timeout), and 3 s
    # at least: on a loaded machine a step can take longer than a fixed stall, which no report saw
    deadline = stalled + 600
    while max(step_metrics(run_dir), default=0) < judged + 2 and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(max(1.0, stalled + 3 - time.time()))
    os.kill(pid, signal.SIGCONT)
    runner.join(timeout=600)
    result = done["result"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "monitor unreachable" in result.stderr and "monitor reachable again" in result.stderr
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    ordered = [(e["step"], e["target"]) for e in events if e["type"] == "rollback"]
    assert ordered == [(10, "step_00000008"), (15, "step_00000012")]
    closed = [e["decision"] for e in events if e["type"] in ("rollback_applied", "rollback_cancelled")]
    assert sorted(closed) == [e["decision"] for e in events if e["type"] == "rollback"]  # none lost
    assert [e for e in events if e["type"] == "rollback"][1]["time"] > stalled + 2.5  # judged after the stall
    status = json.loads(request(url, "/status")[1])
    assert [r["decision"] for r in status["rollbacks"]] == [1, 2] and status["rollback_pending"] is None
    assert all(
        e["finding"] == "loss_spike" and e["value"] > e["threshold"]
        for e in events
        if e["type"] == "rollback"
    )
    applied = [e for e in events if e["type"] == "rollback_applied"]
    assert [e["step"] for e in applied] == [8, 12] and all(e["matches_checkpoint"] for e in applied)
    assert [e["decided_at"] for e in applied] == [10, 15]
    # Applied at the first step boundary after the answer came, and before any checkpoint.
    first, second = (e["applied_at"] for e in applied)
    assert 10 <= first <= 12 and 15 <= second <= 16
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["completed"] and summary["step"] == 16 and summary["rollbacks"] == 2
    assert summary["restarts"] == 0
    # TensorBoard's Margin charts (value, level, threshold) get their three tags at the same steps.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pretrain.reporting.metrics import tensorboard_dir

    board = EventAccumulator(str(tensorboard_dir(run_dir)), size_guidance={"scalars": 0})
    board.Reload()
    for series in ("loss", "grad_norm"):
        steps = [
            [e.step for e in board.Scalars(f"monitor/{series}_{part}")]
            for part in ("in_band", "level", "threshold")
        ]
        assert steps[0] and steps[0] == steps[1] == steps[2], (series, steps)
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


def _train_in_background(*args, **kwargs):
    done = {}
    thread = threading.Thread(target=lambda: done.setdefault("result", train(*args, check=False, **kwargs)))
    thread.start()
    return thread, done


def _wait_for_step(run_dir, step, thread, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline and thread.is_alive():
        path = run_dir / "events.jsonl"
        if path.exists() and any(e["type"] == "step" and e["step"] >= step for e in events(run_dir)):
            return
        time.sleep(0.02)
    raise AssertionError(f"step {step} was never reported")


# ------------------------------------------------------------------------------------ the fuzzer


def _fuzz_requests(token: str, n: int, seed: int = 0) -> list[bytes]:
    """Raw HTTP requests that the service must refuse (none is a valid state change)."""
    rng = random.Random(seed)
    auth = f"Authorization: Bearer {token}\r\n"
    invalid = {  # per field of a step's report, values it must refuse
        "step": [None, True, -1, 1.5, 10**400, 2**64, "x"],
        "tokens": [None, -5, 2**53, "7"],
        "loss": [None, True, "x" * 300, [], {}],
        "grad_norm": [None, False, "high", [1]],
        "lr": [None, -1, "NaN", "-inf", 10**400, []],
        "step_time": [None, -0.5, "inf", {}],
        "layer_grad_norms": [[1], "x", 5, {"a": "b"}],
        "session": ["x" * 300, 5, True, ""],
        "seq": [0, -1, "x", 1.5, True],
        "surprise": [1],
    }
    values = [None, True, -1, 0, 1.5, 10**400, "x" * 300, [], [1, {"a": 2}], {"nested": {"deep": [None]}}]

    def metrics_body():
        body = {"step": 1, "loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "step_time": 0.1, "tokens": 100}
        key = rng.choice(list(invalid))
        body[key] = rng.choice(invalid[key])
        return json.dumps(body).encode()

    def bodies():
        yield rng.choice(
            [
                b"[]",
                b'"text"',
                b"42",
                b"null",
                b"{",
                b'{"step": NaN}',
                b'{"lr": Infinity}',
                b"[" * 5000 + b"]" * 5000,
                bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))),
            ]
        )
        yield metrics_body()
        yield json.dumps({"reason": rng.choice(values), "extra": 1}).encode()
        yield json.dumps(
            {"decision": rng.choice(values), "decided_at": 1, "applied": "yes", "applied_at": 1}
        ).encode()

    requests = []
    for _ in range(n):
        path = rng.choice(
            ["/v1/metrics", "/v1/rollback", "/v1/outcome", "/v1/nothing", "/status?x=1", "/../etc"]
        )
        body = rng.choice(list(bodies()))
        kind = rng.randrange(10)
        if kind == 0:  # garbage instead of a request line
            requests.append(bytes(rng.randrange(1, 256) for _ in range(rng.randrange(1, 100))) + b"\r\n\r\n")
        elif kind == 1:  # a negative, non-numeric or huge Content-Length, or none
            length = rng.choice(["-1", "abc", "99999999999", "1e3", None])
            header = f"Content-Length: {length}\r\n" if length is not None else ""
            requests.append(f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}{header}\r\n".encode() + body)
        elif kind == 2:  # over the size limit
            requests.append(
                f"POST /v1/metrics HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 70000\r\n\r\n".encode()
                + b" " * 70000
            )
        elif kind == 3:  # chunked
            requests.append(
                f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: chunked\r\n\r\n".encode()
                + b"5\r\nhello\r\n0\r\n\r\n"
            )
        elif kind == 4:  # other methods
            method = rng.choice(["PUT", "DELETE", "PATCH", "FOO"])
            requests.append(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
        elif kind == 5:  # no token, or a wrong one, on a body that would be valid
            valid = json.dumps({"reason": "fuzz"}).encode()
            header = rng.choice(["", "Authorization: Bearer wrong\r\n", "Authorization: \xff\r\n"])
            requests.append(
                f"POST /v1/rollback HTTP/1.1\r\nHost: x\r\n{header}Content-Length: {len(valid)}\r\n\r\n".encode(
                    "latin-1"
                )
                + valid
            )
        else:  # a well-formed request with the token and a body that is not a valid message
            requests.append(
                f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
    return requests


def _send(address, raw: bytes) -> int | None:
    """The status code of the answer to one raw request (None: the connection ended unanswered)."""
    with socket.create_connection(address, timeout=10) as conn:
        conn.sendall(raw)
        conn.shutdown(socket.SHUT_WR)  # a body shorter than its Content-Length ends here
        data = b""
        while b"\r\n" not in data:
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
    parts = data.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[0].startswith(b"HTTP/") else None


def test_the_service_answers_every_malformed_request_and_the_run_is_unchanged(tmp_path, train_data):
    """The golden run (under torchrun), with the monitor on, while a fuzzer sends 2,000 malformed
    and random requests to its service: every request is answered with a 4xx, none is a traceback,
    and the run's losses, gradient norms and learning rates are bit for bit the golden ones."""
    from tests.integration.golden import OVERRIDES, assert_matches_golden, summarize

    process, url, token = _start_service(tmp_path)
    try:
        runner, done = _train_in_background(
            torchrun(2), tmp_path, train_data, *OVERRIDES, "monitor.enabled=true"
        )
        _wait_for_step(tmp_path, 1, runner)
        host, port = url.removeprefix("http://").split(":")
        codes = [_send((host, int(port)), raw) for raw in _fuzz_requests(token, 2000)]
        status = json.loads(request(url, "/status")[1])  # still serving, and still judging
        assert status["step"] > 1 and status["rollbacks_decided"] == [] and status["warnings"] == 0
        runner.join(timeout=600)
        result = done["result"]
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    finally:
        process.terminate()
        output = process.communicate(timeout=30)[0]
    assert "Traceback" not in output, output[-3000:]
    assert None not in codes and all(400 <= c <= 501 and c != 500 for c in codes), collections.Counter(codes)
    assert_matches_golden(summarize(tmp_path, train_data), steps_only=True)

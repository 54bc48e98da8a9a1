"""The monitoring service: an HTTP server in its own process, one per run directory.

    POST /v1/metrics     (token)  a StepMetrics from the trainer's rank 0 → the Action, the verdict
    POST /v1/outcome     (token)  the trainer: what became of a rollback decision (applied / cancelled)
    POST /v1/rollback    (token)  an operator's rollback request, decided at the next step (409 when
                                  there is no checkpoint to go back to)
    GET  /status                  JSON: progress and ETA, latest metrics, bands, recent verdicts,
                                  warnings, rollbacks (applied, decided, pending, cancelled), restarts
    GET  /metrics                 Prometheus text format
    GET  /                        a small self-contained HTML page of the same (no token needed)

Every request gets an answer: a malformed one a 4xx with a one-line JSON `error` (bodies are at
most MAX_BODY bytes and need a Content-Length); nothing a client sends leaves a traceback.

Requests that change state need `Authorization: Bearer TOKEN`; the token is in
RUN_DIR/monitor/token (mode 0600). The service binds to 127.0.0.1 unless told otherwise and
announces itself in RUN_DIR/monitor/endpoint.json. Every rollback and circuit-breaker trip is
appended to RUN_DIR/events.jsonl, and so is every reported step (type `step`: step, loss, grad
norm, the action answered), so the file alone tells which steps ran, and which ran again. A
service started on a run with history (a run launched again) rebuilds from that file what it
shows: decisions, rollbacks, restarts, warnings, the judged series and the bands.
"""

from __future__ import annotations

import argparse
import dataclasses
import hmac
import json
import os
import secrets
import socket
import sys
import threading
import time
import urllib.parse
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from monitoring.board import Board, total_steps_of
from monitoring.config import ServiceConfig
from monitoring.page import render_page
from monitoring.pins import CheckpointPins
from monitoring.policy import Policy, Verdict
from monitoring.prometheus import ServiceMetrics
from monitoring.protocol import (
    ENDPOINT_FILE,
    EVENTS_FILE,
    TOKEN_FILE,
    Anomaly,
    CircuitBreaker,
    Event,
    Judgement,
    Outcome,
    ProtocolError,
    RepeatsStopped,
    Restart,
    RollbackCancelled,
    RollbackDecided,
    StepJudged,
    StepMetrics,
    WarningRaised,
    append_event,
    monitor_dir,
    parse_outcome,
    parse_report,
    read_events,
    strict_json,
)
from pretrain import atomic


def ensure_token(run_dir: str | Path) -> str:
    """The run's bearer token, created once with owner-only permissions."""
    path = monitor_dir(run_dir) / TOKEN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
    os.chmod(path, 0o600)
    return path.read_text().strip()


ANSWERED = object()  # what reading a request's body returns once it has answered the request itself
MAX_BODY = 64 * 1024  # bytes: a step's report is ~300 (a few KiB with per-layer norms)


class MonitorState:
    """The service behind the HTTP handler: the policy judges, the board shows, the pins keep
    rollback targets, /metrics counts, events.jsonl records; one lock serializes requests."""

    def __init__(self, run_dir: Path, config: ServiceConfig, base_seed: int = 0):
        self.run_dir = run_dir
        self.policy = Policy(config, base_seed)
        self.pins = CheckpointPins(run_dir)
        self.board = Board(total_steps=total_steps_of(run_dir))
        self.prometheus = ServiceMetrics()
        self.registry = self.prometheus.registry
        events = read_events(run_dir)
        self.board.restore(events, self.policy.restore(events))
        self.lock = threading.Lock()
        self.watch = None  # the supervisor's HangWatch, when the job runs under `pretrain launch`
        self.job: dict | None = None  # the supervisor's view of the job
        self.append_failed = False
        self.sender: tuple[str | None, int] = (None, 0)  # the trainer's session and its last seq
        self.last_answer: dict | None = None

    # ------------------------------------------------------------- what the supervisor asks

    def supervise(self, watch) -> None:
        """The job runs under a supervisor (`pretrain launch`), whose HangWatch each reported step
        feeds."""
        with self.lock:
            self.watch = watch

    def job_started(self, attempt: int, hosts: dict | None = None) -> None:
        """The supervisor started the job (again): the hang watch starts over, /status shows it
        (`hosts`: over ssh, {"in_use", "spares", "excluded": {host: reason}})."""
        with self.lock:
            if self.watch is not None:
                self.watch.start(time.monotonic())
            self.job = {"attempt": attempt, "state": "running"} | ({"hosts": hosts} if hosts else {})

    def overdue(self) -> str | None:
        """Why the job looks hung (no step for too long), or None."""
        with self.lock:
            return self.watch.overdue(time.monotonic()) if self.watch is not None else None

    def last_step(self) -> int | None:
        """The newest step reported to this process."""
        with self.lock:
            return self.board.last.step if self.board.last else None

    def record_restart(self, event: Restart) -> None:
        """A restart of the job; with no step reported to this process yet (the supervisor's step
        is None), it is placed at the last step judged before it, from the run's history."""
        with self.lock:
            if event.step is None and self.board.series:
                event = dataclasses.replace(event, step=self.board.series[-1]["step"])
            self.board.restarts.append(event)
            self.prometheus.restarts.inc()
            self._append(event)

    # ------------------------------------------------------------- what the trainer asks

    def handle_metrics(
        self, metrics: StepMetrics, session: str | None = None, seq: int | None = None
    ) -> dict:
        with self.lock:
            repeated = self._repeated(session, seq)
            if repeated is not None:
                return repeated
            complete = self.pins.complete()
            verdict = self.policy.observe(metrics, complete)
            self.pins.keep(
                self.policy.pins(metrics.step, complete), self.policy.target(metrics.step, complete)
            )
            if self.watch is not None:
                self.watch.step(time.monotonic())
            self._record(metrics, verdict)
            judged = verdict.to_json()
            judgement = Judgement(
                step=metrics.step,
                loss=metrics.loss,
                grad_norm=metrics.grad_norm,
                level=judged["level"],
                findings=judged["findings"],
                bands=self.bands(),
                note=judged.get("note"),
            )
            answer = verdict.action.to_json() | judgement.to_json()
            if session is not None:
                self.last_answer = answer
            return answer

    def _record(self, metrics: StepMetrics, verdict: Verdict) -> None:
        """Events, the board and /metrics for one judged step."""
        for event in events_of(metrics, verdict):
            self._append(event, sync=not isinstance(event, StepJudged | WarningRaised))
        point = strict_json(
            self.policy.detector.chart_point(
                metrics.step, metrics.loss, metrics.grad_norm, verdict.level, metrics.precursors
            )
        )
        self.board.record(metrics, verdict, point)
        self.prometheus.observe(metrics, verdict, point, self.board.tokens_per_second)

    def handle_outcome(self, outcome: Outcome, session: str | None, seq: int | None) -> dict:
        with self.lock:
            repeated = self._repeated(session, seq)
            if repeated is not None:
                return {"recorded": True, "repeated": True}
            resolved = self.policy.resolve(outcome)
            self.board.resolved(outcome, resolved)
            (self.prometheus.rollbacks if outcome.applied else self.prometheus.cancelled).inc()
            answer = {"recorded": True, "pending": resolved is not None}
            if session is not None:
                self.last_answer = answer
            return answer

    def request_rollback(self, reason: str) -> str | None:
        with self.lock:
            return self.policy.request(reason, self.pins.complete())

    def _repeated(self, session: str | None, seq: int | None) -> dict | None:
        """The answer already given, when this is a report sent again (its answer was lost)."""
        if session is None or seq is None:
            return None
        if session == self.sender[0] and seq <= self.sender[1]:
            if seq == self.sender[1] and self.last_answer is not None:
                return self.last_answer
            return {"action": "continue", "repeated": True}
        self.sender = (session, seq)
        return None

    def _append(self, event: Event, sync: bool = True) -> None:
        """events.jsonl; on a full disk the service keeps serving (the answer matters more), and
        says so once."""
        try:
            append_event(self.run_dir, event, sync=sync)
            self.append_failed = False
        except OSError as exc:
            if not self.append_failed:
                print(
                    f"monitor: cannot append to {self.run_dir / EVENTS_FILE}: {exc.strerror}", file=sys.stderr
                )
            self.append_failed = True

    # ------------------------------------------------------------------------- what it shows

    def bands(self) -> dict:
        return {
            series: None
            if band is None
            else {"level": band.level, "spread": band.spread, "threshold": band.threshold}
            for series, band in self.policy.detector.bands().items()
        }

    def status(self, series: bool = False) -> dict:
        with self.lock:
            p = self.policy
            out = {"run_dir": str(self.run_dir)} | self.board.status()
            out |= {
                "detectors": self.bands(),
                "rollbacks_decided": [d.to_json() for d in p.decisions],
                "rollback_pending": p.pending.to_json() if p.pending else None,
                "circuit_breaker": p.tripped,
                "escalation": p.escalation(),
                "pinned": self.pins.pinned,
                "job": self.job,
            }
            if series:
                out["series"] = list(self.board.series)
                out["series_rolled_back"] = list(self.board.rolled_back)
            return out


def events_of(metrics: StepMetrics, verdict: Verdict) -> list[Event]:
    """What events.jsonl records of one judged step: the step itself, and what the verdict did."""
    events: list[Event] = []
    if verdict.cancelled is not None:
        events.append(RollbackCancelled(**verdict.cancelled))
    events.append(
        StepJudged(
            step=metrics.step,
            loss=metrics.loss,
            grad_norm=metrics.grad_norm,
            action=verdict.action.kind,
            level=verdict.level,
        )
    )
    reasons = "; ".join(f.reason for f in verdict.findings)
    if verdict.level == "warn":
        events.append(
            WarningRaised(step=metrics.step, reason=reasons, findings=[f.kind for f in verdict.findings])
        )
    elif verdict.decision is not None:
        events.append(RollbackDecided(**asdict(verdict.decision)))
    elif verdict.level == "rollback":  # no checkpoint to go back to
        events.append(Anomaly(step=metrics.step, note=verdict.note, reason=reasons))
    elif verdict.stopped is not None:  # monitor.on_repeat's last stage
        events.append(RepeatsStopped(step=metrics.step, **verdict.stopped))
    elif verdict.level == "stop" and verdict.findings:
        events.append(CircuitBreaker(step=metrics.step, reason=verdict.action.reason))
    return events


class MonitorHandler(BaseHTTPRequestHandler):
    """The service's requests; `make_handler` binds it to one MonitorState and token."""

    state: MonitorState
    token: str
    server_version = "pretrain-monitor/1"
    protocol_version = "HTTP/1.1"  # keep-alive: the trainer's one connection serves every step
    disable_nagle_algorithm = True  # else headers and body wait on each other (40 ms delayed ACK)
    timeout = 120  # seconds a connection may sit idle or half-sent before it is closed

    def log_message(self, format, *args):  # quiet: one line per step would flood the log
        pass

    def _send(self, code: int, body: bytes, content_type: str = "application/json") -> None:
        try:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client has gone (e.g. it timed out): it sends again
            self.close_connection = True

    def _json(self, code: int, payload: dict) -> None:
        self._send(code, json.dumps(strict_json(payload), allow_nan=False).encode())

    def _error(self, code: int, message: str, close: bool = False) -> None:
        self.close_connection = self.close_connection or close
        self._json(code, {"error": message})

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (a malformed request line, an unknown method, headers too
        long): a status line and a one-line JSON error like every other answer."""
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.0"  # (it answers a request it cannot parse without a status line)
        self._error(code, message or "bad request", close=True)

    def _authorized(self) -> bool:
        given = self.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(errors="replace"), f"Bearer {self.token}".encode())

    def do_GET(self):
        path = urllib.parse.urlsplit(self.path).path
        try:
            if path == "/status":
                self._json(200, self.state.status(series="series=1" in self.path))
            elif path == "/metrics":
                self._send(200, generate_latest(self.state.registry), CONTENT_TYPE_LATEST)
            elif path == "/":
                self._send(
                    200, render_page(self.state.status(series=True)).encode(), "text/html; charset=utf-8"
                )
            else:
                self._error(404, f"no such endpoint {path[:100]}")
        except Exception as exc:  # a bug here must not take the connection (or the service) down
            print(f"monitor: error handling GET {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
            self._error(500, f"internal error: {type(exc).__name__}")

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        if not parsed and not self.requestline.split():  # http.server drops a blank request line unanswered
            self.send_error(400, "an empty request line")
        return parsed

    def _body(self):
        """The request's JSON body, or ANSWERED after answering why not."""
        if self.headers.get("Transfer-Encoding"):
            return self._refuse(411, "send the body with a Content-Length, not chunked", close=True)
        length = self.headers.get("Content-Length")
        if length is None or not length.strip().isdigit():
            return self._refuse(
                411 if length is None else 400,
                "a POST needs a Content-Length: a non-negative integer",
                close=True,
            )
        if int(length) > MAX_BODY:
            return self._refuse(
                413, f"the body is {int(length)} bytes; at most {MAX_BODY} are accepted", close=True
            )
        raw = self.rfile.read(int(length))
        if len(raw) < int(length):
            return self._refuse(400, "the body is shorter than its Content-Length", close=True)
        try:
            return json.loads(raw or b"{}", parse_constant=_refuse_constant)
        except (ValueError, RecursionError) as exc:
            return self._refuse(400, f"the body is not JSON: {str(exc)[:100]}")

    def _refuse(self, code: int, message: str, close: bool = False):
        self._error(code, message, close)
        return ANSWERED

    def do_POST(self):
        path = urllib.parse.urlsplit(self.path).path
        if path not in ("/v1/metrics", "/v1/outcome", "/v1/rollback"):
            return self._error(404, f"no such endpoint {path[:100]}", close=True)
        if not self._authorized():
            return self._error(401, "missing or wrong bearer token (see RUN_DIR/monitor/token)", close=True)
        payload = self._body()
        if payload is ANSWERED:
            return
        try:
            if path == "/v1/metrics":
                metrics, session, seq = parse_report(payload)
                return self._json(200, self.state.handle_metrics(metrics, session, seq))
            if path == "/v1/outcome":
                outcome, session, seq = parse_outcome(payload)
                return self._json(200, self.state.handle_outcome(outcome, session, seq))
            if not isinstance(payload, dict) or set(payload) - {"reason"}:
                raise ProtocolError(
                    'a rollback request is a JSON object with an optional "reason" (a string)'
                )
            reason = payload.get("reason", "operator request")
            if not isinstance(reason, str) or len(reason) > 500:
                raise ProtocolError('"reason" must be a string of at most 500 characters')
            refused = self.state.request_rollback(f"operator: {reason}")
            if refused is not None:
                return self._error(409, refused)
            return self._json(202, {"accepted": True, "note": "decided at the next reported step"})
        except ProtocolError as exc:
            return self._error(400, str(exc)[:300])
        except Exception as exc:  # a bug here must not take the connection (or the service) down
            print(f"monitor: error handling POST {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return self._error(500, f"internal error: {type(exc).__name__}")

    def handle_one_request(self):
        try:
            super().handle_one_request()
        except (TimeoutError, ConnectionError):
            self.close_connection = True

    def finish(self):
        """A lingering close: after the last answer, read (and drop) what the client is still
        sending, briefly, so closing does not reset the connection under its answer."""
        super().finish()
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(1.0)
            drained = 0
            while drained < 4 * MAX_BODY:
                chunk = self.connection.recv(65536)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass


def make_handler(state: MonitorState, token: str) -> type[MonitorHandler]:
    return type("Handler", (MonitorHandler,), {"state": state, "token": token})


def _refuse_constant(name: str):
    raise ValueError(f'{name} is not JSON (send a non-finite loss as the string "nan" or "inf")')


def serve(
    run_dir: str | Path, config: ServiceConfig, base_seed: int = 0
) -> tuple[ThreadingHTTPServer, MonitorState]:
    """Start the server (not yet serving requests: call serve_forever) and announce its endpoint."""
    run_dir = Path(run_dir)
    token = ensure_token(run_dir)
    state = MonitorState(run_dir, config, base_seed)
    server = ThreadingHTTPServer((config.host, config.port), make_handler(state, token))
    host, port = server.server_address[:2]
    atomic.write_json(
        monitor_dir(run_dir) / ENDPOINT_FILE,
        {"url": f"http://{host}:{port}", "host": host, "port": port, "pid": os.getpid()},
    )
    return server, state


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command line of `pretrain monitor` and `python -m monitoring`."""
    parser.add_argument("--run-dir", required=True, help="the run directory to watch (run.dir)")
    parser.add_argument(
        "--config", help="run config whose monitor section sets the detector (default: defaults)"
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. monitor.grad_norm_sigma=8")


def serve_from_args(args: argparse.Namespace) -> int:
    from pretrain.config import load_config, load_defaults

    cfg = load_config(args.config, args.overrides) if args.config else load_defaults(args.overrides)
    Path(args.run_dir).mkdir(parents=True, exist_ok=True)
    run_service(args.run_dir, cfg.monitor, base_seed=cfg.run.seed)
    return 0


def run_service(run_dir: str | Path, config: ServiceConfig, base_seed: int = 0) -> None:
    server, _ = serve(run_dir, config, base_seed)
    print(
        f"monitor: listening on http://{server.server_address[0]}:{server.server_address[1]} for {run_dir}",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()

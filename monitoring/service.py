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
import collections
import dataclasses
import hmac
import json
import os
import secrets
import socket
import statistics
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from monitoring.config import ServiceConfig
from monitoring.page import render_page
from monitoring.policy import Policy
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
    Restart,
    RollbackCancelled,
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
SERIES_KEPT = 600  # judged steps kept for /status and the page
ROLLED_BACK_KEPT = 50  # judged points of abandoned timelines' rollback steps, kept for the page
RATE_STEPS = 50  # the steps /status's ETA (their median step time) and smoothed tokens/s are over


class MonitorState:
    """The policy plus what /status, /metrics and the page show; one lock serializes requests."""

    def __init__(self, run_dir: Path, config: ServiceConfig, base_seed: int = 0):
        self.run_dir = run_dir
        self.policy = Policy(config, str(run_dir), base_seed)
        events = read_events(run_dir)
        history = self.policy.restore(events)
        self.lock = threading.Lock()
        self.registry = CollectorRegistry()
        r = self.registry
        self.g_step = Gauge("pretrain_step", "last reported optimizer step", registry=r)
        self.g_loss = Gauge("pretrain_loss", "last reported training loss", registry=r)
        self.g_grad = Gauge("pretrain_grad_norm", "last reported global gradient norm", registry=r)
        self.g_lr = Gauge("pretrain_lr", "last reported learning rate", registry=r)
        self.g_tps = Gauge("pretrain_tokens_per_second", "tokens per second, all ranks", registry=r)
        self.g_band = Gauge("pretrain_spike_threshold", "detector threshold", ["series"], registry=r)
        self.c_findings = Counter(
            "pretrain_anomalies", "findings of the detector", ["series", "rule"], registry=r
        )
        self.c_warnings = Counter("pretrain_warnings", "steps that warned", registry=r)
        self.c_skipped = Counter(
            "pretrain_updates_skipped", "steps whose update the trainer skipped in place", registry=r
        )
        self.c_decided = Counter("pretrain_rollbacks_decided", "rollbacks decided", registry=r)
        self.c_rollbacks = Counter("pretrain_rollbacks", "rollbacks applied by the trainer", registry=r)
        self.c_cancelled = Counter(
            "pretrain_rollbacks_cancelled", "rollbacks decided, then cancelled", registry=r
        )
        self.c_restarts = Counter("pretrain_restarts", "restarts of a crashed or hung job", registry=r)
        self.restarts: list[Restart] = [e for e in events if isinstance(e, Restart)]  # earlier launches' too
        self.watch = None  # the supervisor's HangWatch, when the job runs under `pretrain launch`
        self.job: dict | None = None  # the supervisor's view of the job
        self.append_failed = False
        self.sender: tuple[str | None, int] = (None, 0)  # the trainer's session and its last seq
        self.last_answer: dict | None = None
        self.series: collections.deque[dict] = collections.deque(maxlen=SERIES_KEPT)
        self.rolled_back: collections.deque[dict] = collections.deque(maxlen=ROLLED_BACK_KEPT)
        for judged in history:
            self._chart(judged)
        self.step_times: collections.deque[float] = collections.deque(maxlen=RATE_STEPS)
        self.tokens_per_second: float | None = None  # the last step's
        # (tokens, seconds) of the last steps whose tokens are known (not the first after a rollback)
        self.step_tokens: collections.deque[tuple[int, float]] = collections.deque(maxlen=RATE_STEPS)
        self.total_steps: int | None = _total_steps(run_dir)  # until the trainer says
        self.started = time.time()

    # ------------------------------------------------------------- what the supervisor asks

    def supervise(self, watch) -> None:
        """The job runs under a supervisor (`pretrain launch`), whose HangWatch each reported step
        feeds."""
        with self.lock:
            self.watch = watch

    def job_started(self, attempt: int) -> None:
        """The supervisor started the job (again): the hang watch starts over, /status shows it."""
        with self.lock:
            if self.watch is not None:
                self.watch.start(time.monotonic())
            self.job = {"attempt": attempt, "state": "running"}

    def overdue(self) -> str | None:
        """Why the job looks hung (no step for too long), or None."""
        with self.lock:
            return self.watch.overdue(time.monotonic()) if self.watch is not None else None

    def last_step(self) -> int | None:
        """The newest step reported to this process."""
        with self.lock:
            return self.policy.last.step if self.policy.last else None

    def record_restart(self, event: Restart) -> None:
        """A restart of the job; with no step reported to this process yet (the supervisor's step
        is None), it is placed at the last step judged before it, from the run's history."""
        with self.lock:
            if event.step is None and self.series:
                event = dataclasses.replace(event, step=self.series[-1]["step"])
            self.restarts.append(event)
            self.c_restarts.inc()
            self._append(event)

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

    def handle_metrics(
        self, metrics: StepMetrics, session: str | None = None, seq: int | None = None
    ) -> dict:
        with self.lock:
            repeated = self._repeated(session, seq)
            if repeated is not None:
                return repeated
            verdict = self.policy.observe(metrics)
            if self.watch is not None:
                self.watch.step(time.monotonic())
            self._record(metrics, verdict)
            judged = verdict.to_json()
            judgement = Judgement(
                metrics.step,
                metrics.loss,
                metrics.grad_norm,
                judged["level"],
                judged["findings"],
                self.bands(),
                judged.get("note"),
            )
            answer = verdict.action.to_json() | judgement.to_json()
            if session is not None:
                self.last_answer = answer
            return answer

    def _record(self, metrics: StepMetrics, verdict) -> None:
        """Events, counters and gauges for one judged step."""
        if verdict.cancelled is not None:
            self.c_cancelled.inc()
            self._append(RollbackCancelled(**verdict.cancelled))
        self._append(
            StepJudged(
                step=metrics.step,
                loss=metrics.loss,
                grad_norm=metrics.grad_norm,
                action=verdict.action.kind,
                level=verdict.level,
            ),
            sync=False,
        )
        for finding in verdict.findings:
            self.c_findings.labels(finding.series, finding.kind).inc()
        if metrics.update_skipped:
            self.c_skipped.inc()
        if verdict.level == "warn":
            self.c_warnings.inc()
            self._append(
                WarningRaised(
                    step=metrics.step,
                    reason="; ".join(f.reason for f in verdict.findings),
                    findings=[f.kind for f in verdict.findings],
                ),
                sync=False,
            )
        elif verdict.decision is not None:
            self.c_decided.inc()
            self._append(verdict.decision.event())
        elif verdict.level == "rollback":  # no checkpoint to go back to
            self._append(
                Anomaly(
                    step=metrics.step, note=verdict.note, reason="; ".join(f.reason for f in verdict.findings)
                )
            )
        elif verdict.stopped is not None:  # monitor.on_repeat's last stage
            self._append(verdict.stopped)
        elif verdict.level == "stop" and verdict.findings:
            self._append(CircuitBreaker(step=metrics.step, reason=verdict.action.reason))
        self.g_step.set(metrics.step)
        for gauge, value in (
            (self.g_loss, metrics.loss),
            (self.g_grad, metrics.grad_norm),
            (self.g_lr, metrics.lr),
        ):
            gauge.set(value)
        previous = self.policy.recent[-2] if len(self.policy.recent) > 1 else None
        if metrics.step_time > 0:
            self.step_times.append(metrics.step_time)
            if (
                previous is not None
                and previous.get("tokens") is not None
                and metrics.tokens > previous["tokens"]
            ):
                tokens = metrics.tokens - previous["tokens"]
                self.tokens_per_second = tokens / metrics.step_time
                self.step_tokens.append((tokens, metrics.step_time))
                self.g_tps.set(self.tokens_per_second)
        self.policy.recent[-1]["tokens"] = metrics.tokens
        if metrics.total_steps is not None:
            self.total_steps = metrics.total_steps
        point = self.policy.detector.chart_point(
            metrics.step, metrics.loss, metrics.grad_norm, verdict.level, metrics.precursors
        )
        for series in ("loss", "grad_norm"):
            if f"{series}_threshold" in point:
                self.g_band.labels(series).set(point[f"{series}_threshold"])
        self._chart(strict_json(point))

    def _chart(self, point: dict) -> None:
        """The judged series the page draws is the timeline that goes on: a step judged again (after
        a rollback or a restart went back) replaces the abandoned points from that step on. Of
        those, the points a rollback was decided at are kept aside, so that the chart still shows
        the value that was judged and rolled back."""
        while self.series and self.series[-1]["step"] >= point["step"]:
            abandoned = self.series.pop()
            if abandoned.get("level") == "rollback":
                self.rolled_back.append(abandoned)
        self.series.append(point)

    def handle_outcome(self, outcome: Outcome, session: str | None, seq: int | None) -> dict:
        with self.lock:
            repeated = self._repeated(session, seq)
            if repeated is not None:
                return {"recorded": True, "repeated": True}
            known = self.policy.resolve(outcome)
            (self.c_rollbacks if outcome.applied else self.c_cancelled).inc()
            answer = {"recorded": True, "pending": known}
            if session is not None:
                self.last_answer = answer
            return answer

    def request_rollback(self, reason: str) -> str | None:
        with self.lock:
            return self.policy.request(reason)

    def bands(self) -> dict:
        return {
            series: None
            if band is None
            else {"level": band.level, "spread": band.spread, "threshold": band.threshold}
            for series, band in self.policy.detector.bands().items()
        }

    def recent_tokens_per_second(self) -> float | None:
        """The last RATE_STEPS measured steps' tokens over their summed step times (the console's
        tok/s and `tokens_per_second` are one step's)."""
        seconds = sum(s for _, s in self.step_tokens)
        return sum(t for t, _ in self.step_tokens) / seconds if seconds > 0 else None

    def status(self, series: bool = False) -> dict:
        with self.lock:
            p = self.policy
            last = p.last
            eta = None
            if last is not None and self.total_steps and self.step_times:
                eta = max(self.total_steps - last.step, 0) * statistics.median(self.step_times)
            out = {
                "run_dir": str(self.run_dir),
                "step": last.step if last else (self.series[-1]["step"] if self.series else None),
                "total_steps": self.total_steps,
                "tokens_per_second": self.tokens_per_second,
                "tokens_per_second_last_50_steps": self.recent_tokens_per_second(),
                "eta_seconds": eta,
                "latest": last.to_json() if last else None,
                "detectors": self.bands(),
                "warnings": p.warnings,
                "warnings_recent": list(p.warned),
                "updates_skipped": len(p.skipped),
                "updates_skipped_recent": p.skipped[-20:],
                "rollbacks": list(p.applied),
                "rollbacks_decided": [d.event().to_json() for d in p.decisions],
                "rollback_pending": p.pending.event().to_json() if p.pending else None,
                "rollbacks_cancelled": list(p.cancelled),
                "recent": [dict(v) for v in p.recent],
                "circuit_breaker": p.tripped,
                "escalation": p.escalation(),
                "pinned": p.pinned_tag,
                "restarts": [r.to_json() for r in self.restarts],
                "job": self.job,
            }
            if series:
                out["series"] = list(self.series)
                out["series_rolled_back"] = list(self.rolled_back)
            return out


def _total_steps(run_dir: Path) -> int | None:
    """train.steps of the run's last start (RUN_DIR/run.json), if there is one."""
    try:
        steps = json.loads((run_dir / "run.json").read_text())["config"].get("train.steps")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return steps if isinstance(steps, int) else None


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

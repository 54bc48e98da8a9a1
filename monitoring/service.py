"""The monitoring service: an HTTP server in its own process, one per run directory.

    POST /v1/metrics     (token)  a StepMetrics from the trainer's rank 0 → the Action for this step
    POST /v1/rollback    (token)  an operator's rollback request, carried out at the next step
    GET  /status                  JSON: step, latest metrics, detector bands, rollbacks, circuit breaker
    GET  /metrics                 Prometheus text format

Requests that change state need `Authorization: Bearer TOKEN`; the token is in
RUN_DIR/monitor/token (mode 0600). The service binds to 127.0.0.1 unless told otherwise and
announces itself in RUN_DIR/monitor/endpoint.json. Every rollback and circuit-breaker trip is
appended to RUN_DIR/events.jsonl, and so is every reported step (type `step`: step, loss, grad
norm, the action answered), so the file alone tells which steps ran, and which ran again.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import secrets
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from monitoring.policy import Policy
from monitoring.protocol import (
    ENDPOINT_FILE,
    EVENTS_FILE,
    TOKEN_FILE,
    ProtocolError,
    StepMetrics,
    append_event,
    monitor_dir,
)
from pretrain import atomic
from pretrain.config import MonitorConfig


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


class MonitorState:
    """The policy plus what /status and /metrics show; one lock serializes requests."""

    def __init__(self, run_dir: Path, config: MonitorConfig, base_seed: int = 0):
        self.run_dir = run_dir
        self.policy = Policy(config, str(run_dir), base_seed)
        self.lock = threading.Lock()
        self.registry = CollectorRegistry()
        self.g_step = Gauge("pretrain_step", "last reported optimizer step", registry=self.registry)
        self.g_loss = Gauge("pretrain_loss", "last reported training loss", registry=self.registry)
        self.g_grad = Gauge(
            "pretrain_grad_norm", "last reported global gradient norm", registry=self.registry
        )
        self.g_lr = Gauge("pretrain_lr", "last reported learning rate", registry=self.registry)
        self.g_tps = Gauge(
            "pretrain_tokens_per_second", "tokens per second, all ranks", registry=self.registry
        )
        self.g_band = Gauge(
            "pretrain_spike_threshold", "detector threshold", ["series"], registry=self.registry
        )
        self.c_anomalies = Counter(
            "pretrain_anomalies", "anomalies detected", ["series", "rule"], registry=self.registry
        )
        self.c_rollbacks = Counter("pretrain_rollbacks", "rollbacks ordered", registry=self.registry)
        self.c_restarts = Counter(
            "pretrain_restarts", "restarts of a crashed or hung job", registry=self.registry
        )
        self.restarts: list[dict] = []
        self.watch = None  # the supervisor's HangWatch, when the job runs under `pretrain launch`
        self.job: dict | None = None  # the supervisor's view of the job
        self.append_failed = False

    def record_restart(self, event: dict) -> None:
        with self.lock:
            self.restarts.append(event)
            self.c_restarts.inc()
            self._append(event)

    def _append(self, event: dict, sync: bool = True) -> None:
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

    def handle_metrics(self, metrics: StepMetrics) -> dict:
        with self.lock:
            action, incident = self.policy.observe(metrics)
            if self.watch is not None:
                self.watch.step(time.monotonic())
            self._append({"type": "step", "step": metrics.step, "loss": metrics.loss,
                          "grad_norm": metrics.grad_norm, "action": action.kind}, sync=False)  # fmt: skip
            self.g_step.set(metrics.step)
            for gauge, value in (
                (self.g_loss, metrics.loss),
                (self.g_grad, metrics.grad_norm),
                (self.g_lr, metrics.lr),
            ):
                gauge.set(value)
            if metrics.step_time > 0:
                self.g_tps.set(metrics.tokens / max(metrics.step, 1) / metrics.step_time)
            bands = self.bands()
            for series, band in bands.items():
                if band is not None:
                    self.g_band.labels(series).set(band["threshold"])
            if incident is not None:
                self.c_anomalies.labels(incident.series, incident.verdict.rule).inc()
            if action.kind == "rollback":
                self.c_rollbacks.inc()
                self._append({"type": "rollback", **self.policy.rollbacks[-1]})
            elif action.kind == "stop" and incident is not None:
                self._append({"type": "circuit_breaker", "step": metrics.step, "reason": action.reason})
            return action.to_json() | {"bands": bands}

    def bands(self) -> dict:
        out = {}
        for series, detector in (("grad_norm", self.policy.grad_norm), ("loss", self.policy.loss)):
            band = detector.band()
            out[series] = (
                None if band is None else {"mean": band.mean, "std": band.std, "threshold": band.threshold}
            )
        return out

    def status(self) -> dict:
        with self.lock:
            last = self.policy.last
            return {
                "step": last.step if last else None,
                "latest": last.to_json() if last else None,
                "detectors": self.bands(),
                "rollbacks": list(self.policy.rollbacks),
                "circuit_breaker": self.policy.tripped,
                "pinned": self.policy.pinned_tag,
                "restarts": list(self.restarts),
                "job": self.job,
            }


def make_handler(state: MonitorState, token: str):
    class Handler(BaseHTTPRequestHandler):
        server_version = "pretrain-monitor/1"
        protocol_version = "HTTP/1.1"  # keep-alive: the trainer's one connection serves every step
        disable_nagle_algorithm = True  # else headers and body wait on each other (40 ms delayed ACK)

        def log_message(self, format, *args):  # quiet: one line per step would flood the log
            pass

        def _send(self, code: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, payload: dict) -> None:
            self._send(code, json.dumps(payload).encode())

        def _authorized(self) -> bool:
            given = self.headers.get("Authorization", "")
            return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())

        def do_GET(self):
            if self.path == "/status":
                self._json(200, state.status())
            elif self.path == "/metrics":
                self._send(200, generate_latest(state.registry), CONTENT_TYPE_LATEST)
            else:
                self._json(404, {"error": f"no such endpoint {self.path}"})

        def do_POST(self):
            if self.path not in ("/v1/metrics", "/v1/rollback"):
                return self._json(404, {"error": f"no such endpoint {self.path}"})
            if not self._authorized():
                return self._json(401, {"error": "missing or wrong bearer token (see RUN_DIR/monitor/token)"})
            try:
                length = int(self.headers.get("Content-Length", "0"))
                payload = json.loads(self.rfile.read(length) or b"{}")
            except (ValueError, json.JSONDecodeError):
                return self._json(400, {"error": "the body is not JSON"})
            if self.path == "/v1/metrics":
                try:
                    metrics = StepMetrics.from_json(payload)
                except ProtocolError as exc:
                    return self._json(400, {"error": str(exc)})
                return self._json(200, state.handle_metrics(metrics))
            with state.lock:
                state.policy.manual = str(payload.get("reason", "operator request"))
            return self._json(
                202, {"accepted": True, "note": "the rollback happens at the next reported step"}
            )

    return Handler


def serve(
    run_dir: str | Path, config: MonitorConfig, base_seed: int = 0
) -> tuple[ThreadingHTTPServer, MonitorState]:
    """Start the server (not yet serving requests: call serve_forever) and announce its endpoint."""
    run_dir = Path(run_dir)
    token = ensure_token(run_dir)
    state = MonitorState(run_dir, config, base_seed)
    server = ThreadingHTTPServer((config.host, config.port), make_handler(state, token))
    host, port = server.server_address[:2]
    atomic.write_json(
        monitor_dir(run_dir) / ENDPOINT_FILE, {"url": f"http://{host}:{port}", "pid": os.getpid()}
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


def run_service(run_dir: str | Path, config: MonitorConfig, base_seed: int = 0) -> None:
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

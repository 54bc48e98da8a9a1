"""The trainer's side of the wire to the monitoring service: report each step, share the answer.

Rank 0 hands each step's metrics to a `Reporter`, whose thread posts them to the service (its
address and token are read from RUN_DIR/monitor/) while the next step computes: reporting never
makes a step wait. The service's answers arrive in that thread; an action (rollback or stop) is
shared with every rank at the next step boundary, inside the one all-reduce the step already
makes, so all ranks act at the same boundary, one step after the report that caused it at the
earliest. When the service is slow or unreachable, training goes on and the reports wait, in
order, to be judged when it is back (re-sent with the same `session` and `seq`, so nothing is
judged twice). NaN/Inf steps are never applied to the weights either way: DeepSpeed's bf16
overflow check skips them. Applying a rollback is `pretrain/train/rollback.py`'s.
"""

from __future__ import annotations

import collections
import http.client
import json
import secrets
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import torch

from monitoring.protocol import (
    CONTINUE,
    ENDPOINT_FILE,
    PRECURSORS,
    TOKEN_FILE,
    Action,
    Judgement,
    Outcome,
    ProtocolError,
    StepMetrics,
    monitor_dir,
    split_answer,
)
from pretrain.parallel.distributed import DistEnv, broadcast, broadcast_json

MAX_WAITING = 1_000_000  # reports kept for a service that is away (~300 bytes each)


class Refused(ValueError):
    """The service answered 4xx: the message will never be accepted, so it is dropped."""


class MonitorClient:
    """One keep-alive HTTP connection to the service; every call may raise (the Reporter retries)."""

    def __init__(self, run_dir: str | Path, timeout: float = 2.0):
        self.monitor_dir = monitor_dir(run_dir)
        self.timeout = timeout
        self.token: str | None = None
        self.connection: http.client.HTTPConnection | None = None

    def post(self, path: str, payload: dict) -> dict:
        if self.connection is None:
            endpoint = json.loads((self.monitor_dir / ENDPOINT_FILE).read_text())
            self.token = (self.monitor_dir / TOKEN_FILE).read_text().strip()
            address = urllib.parse.urlsplit(endpoint["url"])
            self.connection = http.client.HTTPConnection(address.hostname, address.port, timeout=self.timeout)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"}
        body = json.dumps(payload).encode()
        try:
            try:
                self.connection.request("POST", path, body=body, headers=headers)
                response = self.connection.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # The service closed the kept-alive connection while it was idle: connect again
                # (a report it had already judged is answered, not judged again).
                self.connection.close()
                self.connection.request("POST", path, body=body, headers=headers)
                response = self.connection.getresponse()
            answer = json.loads(response.read())
        except BaseException:
            self.close()
            raise
        if 400 <= response.status < 500 and response.status not in (401, 404, 408, 429):
            raise Refused(f"HTTP {response.status}: {answer.get('error', answer)}")
        if response.status != 200:
            self.close()
            raise ValueError(f"HTTP {response.status}: {answer.get('error', answer)}")
        return answer

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
        self.connection = None


class Reporter:
    """Rank 0: a thread that posts queued reports and outcomes to the service in order, each until
    it is answered, and keeps the answers for the training loop to pick up without waiting."""

    def __init__(self, run_dir: str | Path, timeout: float = 2.0):
        self.client = MonitorClient(run_dir, timeout)
        self.session = secrets.token_hex(8)
        self._seq = 0
        self._outbox: collections.deque[tuple[str, dict, int | None]] = collections.deque()
        self._answers: list[Judgement] = []  # what answered reports say of their steps, for TensorBoard
        self._action: Action | None = None  # the newest rollback or stop not yet taken
        self._resolved = 0  # the newest rollback decision acted on here
        self._cond = threading.Condition()
        self._closed = False
        self.unreachable_since: int | None = None  # the step whose report first went unanswered
        self._thread = threading.Thread(target=self._run, name="monitor-reporter", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the training loop's side

    def report(self, metrics: StepMetrics) -> None:
        self._post("/v1/metrics", metrics.to_json(), metrics.step)

    def outcome(self, outcome: Outcome) -> None:
        if outcome.decision is not None:  # (not the trainer's own rollback: the service's pending one)
            with self._cond:
                self._resolved = max(self._resolved, outcome.decision)
                if self._action is not None and self._action.rollback is not None:
                    self._action = None  # answers to reports sent before it was applied repeat it
        self._post("/v1/outcome", outcome.to_json(), None)

    def pending(self) -> bool:
        with self._cond:
            return self._action is not None

    def take(self) -> Action | None:
        with self._cond:
            action, self._action = self._action, None
            return action

    def answered(self) -> list[Judgement]:
        """What the answers received since the last call say of their steps."""
        with self._cond:
            answers, self._answers = self._answers, []
            return answers

    def waiting(self) -> int:
        with self._cond:
            return len(self._outbox)

    def drain(self, timeout: float) -> bool:
        """Wait until every report is answered (at most `timeout` seconds); whether it was."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._outbox and time.monotonic() < deadline:
                self._cond.wait(min(0.05, max(deadline - time.monotonic(), 0)))
            return not self._outbox

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self.client.close()

    # ------------------------------------------------------------------------------ the thread

    def _post(self, path: str, payload: dict, step: int | None) -> None:
        with self._cond:
            self._seq += 1
            if len(self._outbox) >= MAX_WAITING:
                dropped = self._outbox.popleft()
                print(
                    f"warning: the monitor has been away for {MAX_WAITING} reports; the oldest "
                    f"({dropped[2]}) will not be judged",
                    file=sys.stderr,
                    flush=True,
                )
            self._outbox.append((path, payload | {"session": self.session, "seq": self._seq}, step))
            self._cond.notify_all()

    def _run(self) -> None:
        backoff = 0.0
        while True:
            with self._cond:
                while not self._outbox and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                path, payload, step = self._outbox[0]
            try:
                answer = self.client.post(path, payload)
            except Refused as exc:
                print(
                    f"warning: the monitor refused a report ({exc}); it is dropped",
                    file=sys.stderr,
                    flush=True,
                )
                answer = None
            except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
                self._unreachable(step, exc)
                backoff = min(max(2 * backoff, 0.05), 2.0)
                with self._cond:
                    self._cond.wait(backoff)  # (close() wakes it)
                continue
            backoff = 0.0
            with self._cond:
                self._outbox.popleft()
                waiting = len(self._outbox)
                if answer is not None and path == "/v1/metrics":
                    self._take_answer(answer)
                self._cond.notify_all()
            if self.unreachable_since is not None and waiting == 0:
                print(
                    f"monitor reachable again: every step since {self.unreachable_since} judged",
                    file=sys.stderr,
                    flush=True,
                )
                self.unreachable_since = None

    def _take_answer(self, answer: dict) -> None:
        try:
            action, judgement = split_answer(answer)
        except (ProtocolError, TypeError) as exc:
            print(f"warning: the monitor answered {answer!r:.200}: {exc}", file=sys.stderr, flush=True)
            return
        self._answers.append(judgement)
        if action.kind == "stop":
            self._action = action
        elif (
            action.rollback is not None
            and action.rollback.decision > self._resolved
            and (self._action is None or self._action.kind != "stop")
        ):
            self._action = action  # (answers to reports sent before it was applied repeat it)

    def _unreachable(self, step: int | None, exc: Exception) -> None:
        if self.unreachable_since is None:
            self.unreachable_since = step if step is not None else -1
            print(
                f"warning: monitor unreachable at step {step} ({exc}); training goes on and its steps "
                "will be judged when it is back",
                file=sys.stderr,
                flush=True,
            )


def broadcast_action(action: Action | None, device) -> Action:
    """Rank 0's action on every rank (a collective): its JSON, the same as the service's answer."""
    payload = broadcast_json(action.to_json() if action is not None else None, device)
    return Action.from_json(payload) if payload is not None else CONTINUE


class MonitorLink:
    """Every rank holds one; rank 0's also holds the reporter."""

    def __init__(
        self, run_dir: str | Path, timeout: float, env: DistEnv, device, total_steps: int | None = None
    ):
        self.reporter = Reporter(run_dir, timeout) if env.is_main else None
        self.total_steps = total_steps
        self.timeout = timeout
        self.device = device
        self.run_dir = Path(run_dir)
        self.ranks: tuple[int, list[dict]] | None = None  # (step, StepMetrics.ranks) for that step's report
        self.experts: tuple[int, list[dict]] | None = None  # (step, StepMetrics.experts) likewise

    def note_ranks(self, step: int, ranks: list[dict]) -> None:
        """Rank 0, before the report of logging step `step`: every rank's forward time over the
        straggler window that ends there (the straggler hook's), which that report carries."""
        self.ranks = (step, ranks)

    def note_experts(self, step: int, layers: list[dict]) -> None:
        """Before the report of step `step`: its MoE layers' loads (the experts' hook's), which
        that report carries."""
        self.experts = (step, layers)

    def report(self, step: int, metrics: dict[str, float | None], tokens: int) -> None:
        """Rank 0 hands the step's metrics (the trainer's `train/*` values) to the reporter; no wait."""
        if self.reporter is None:
            return
        ranks = self.ranks[1] if self.ranks is not None and self.ranks[0] == step else []
        experts = self.experts[1] if self.experts is not None and self.experts[0] == step else []
        grad_norm = metrics["train/grad_norm"]
        layers = {
            k.removeprefix("train/grad_norm/"): v
            for k, v in metrics.items()
            if k.startswith("train/grad_norm/")
        }
        self.reporter.report(
            StepMetrics(
                step=step,
                loss=metrics["train/loss"],
                grad_norm=grad_norm if grad_norm is not None else float("nan"),
                lr=metrics["train/lr"],
                step_time=metrics["train/step_time"],
                tokens=tokens,
                layer_grad_norms=layers,
                total_steps=self.total_steps,
                update_skipped=bool(metrics.get("train/update_skipped")),
                precursors={k: metrics[f"stability/{k}"] for k in PRECURSORS if f"stability/{k}" in metrics},
                ranks=ranks,
                experts=experts,
            )
        )

    def pending(self) -> float:
        """1.0 on rank 0 when an action waits (summed into the step's all-reduce), else 0.0."""
        return float(self.reporter is not None and self.reporter.pending())

    def take(self) -> Action:
        """Every rank, after the all-reduce said an action waits: rank 0's action (a collective)."""
        return broadcast_action(self.reporter.take() if self.reporter else None, self.device)

    def verdict(
        self, wait: bool = True, last: bool = False, going_on: str = "saving the checkpoint"
    ) -> Action:
        """Every rank, before a checkpoint is saved or an evaluation runs: wait until every
        reported step is judged (at most `timeout` seconds, ten times that before the run's last
        checkpoint, after which no later step would bring the answer; with `wait` false, not at
        all), then rank 0's action, if any (a collective). So a checkpoint holds, and an evaluation
        sees, only judged steps, unless the service is away (`going_on`: what then goes ahead)."""
        patience = (10 if last else 1) * self.timeout
        if self.reporter is not None and wait and not self.reporter.drain(patience):
            print(
                f"warning: the monitor has not judged the last {self.reporter.waiting()} step(s) in "
                f"{patience:g} s; {going_on} all the same",
                file=sys.stderr,
                flush=True,
            )
        flag = torch.tensor([self.pending()], dtype=torch.float64, device=self.device)
        broadcast(flag, src=0)
        return self.take() if flag.item() > 0 else CONTINUE

    def outcome(self, outcome: Outcome) -> None:
        """Rank 0: tell the service what became of a rollback."""
        if self.reporter is not None:
            self.reporter.outcome(outcome)

    def judged(self) -> list[Judgement]:
        """Rank 0: what the service's answers since the last call say of the steps they judged."""
        return self.reporter.answered() if self.reporter is not None else []

    def close(self) -> None:
        if self.reporter is not None:
            self.reporter.close()

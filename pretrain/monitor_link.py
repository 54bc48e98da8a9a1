"""The trainer's side of the monitoring service: report each step, share the answer, apply it.

Rank 0 posts the step's metrics to the service (its address and token are read from
RUN_DIR/monitor/) and gets an `Action` back; every rank receives that action by broadcast, so all
act at the same step boundary. When the service cannot be reached the trainer goes on: the client
warns once, answers `continue`, and tries again (re-reading the endpoint, so a restarted service
is found) at the next step. NaN/Inf steps are never applied to the weights either way: DeepSpeed's
bf16 overflow check skips them. A rollback is applied here too: load the target (verified first;
an older intact one if it is corrupt), move the abandoned timeline aside, record
`rollback_applied` (with whether the loaded weights, fp32 master weights included, match the
digests saved with them), reshuffle the rest of the epoch.
"""

from __future__ import annotations

import http.client
import json
import sys
import urllib.parse
from pathlib import Path
from typing import Protocol

import torch

from monitoring.protocol import (
    ACTIONS,
    CONTINUE,
    ENDPOINT_FILE,
    TOKEN_FILE,
    Action,
    ProtocolError,
    StepMetrics,
    append_event,
    monitor_dir,
)
from pretrain.checkpoint import abandon_after, step_of, tag_for, trim_abandoned
from pretrain.checkpoint.checkpointer import Checkpointer, TrainState
from pretrain.distributed import DistEnv, barrier, broadcast


class MonitorClient:
    """Rank 0's HTTP client of the service, one keep-alive connection for every step."""

    def __init__(self, run_dir: str | Path, timeout: float = 2.0):
        self.monitor_dir = monitor_dir(run_dir)
        self.timeout = timeout
        self.token: str | None = None
        self.connection: http.client.HTTPConnection | None = None  # kept alive between steps
        self.unreachable_since: int | None = None
        self.last_response: dict = {}

    def _connect(self) -> None:
        endpoint = json.loads((self.monitor_dir / ENDPOINT_FILE).read_text())
        self.token = (self.monitor_dir / TOKEN_FILE).read_text().strip()
        address = urllib.parse.urlsplit(endpoint["url"])
        self.connection = http.client.HTTPConnection(address.hostname, address.port, timeout=self.timeout)

    def _post(self, path: str, payload: dict) -> dict:
        body = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"}
        self.connection.request("POST", path, body=body, headers=headers)
        response = self.connection.getresponse()
        answer = json.loads(response.read())
        if response.status != 200:
            raise ValueError(f"HTTP {response.status}: {answer.get('error', answer)}")
        return answer

    def report(self, metrics: StepMetrics) -> Action:
        try:
            if self.connection is None:
                self._connect()
            self.last_response = self._post("/v1/metrics", metrics.to_json())
            action = Action.from_json({k: v for k, v in self.last_response.items() if k != "bands"})
        except (OSError, http.client.HTTPException, ValueError, KeyError, ProtocolError) as exc:
            if self.unreachable_since is None:
                self.unreachable_since = metrics.step
                print(f"warning: monitor unreachable at step {metrics.step} ({exc}); training goes on and "
                      "will reconnect", file=sys.stderr, flush=True)  # fmt: skip
            if self.connection is not None:
                self.connection.close()
            self.connection = None
            return CONTINUE
        if self.unreachable_since is not None:
            print(f"monitor reachable again at step {metrics.step}", file=sys.stderr, flush=True)
            self.unreachable_since = None
        return action

    def band(self, series: str) -> float | None:
        band = (self.last_response.get("bands") or {}).get(series)
        return band["threshold"] if band else None


def broadcast_action(action: Action | None, device) -> Action:
    """Rank 0's action to every rank, as four numbers: (kind, target step, seed, lr scale)."""
    packed = torch.zeros(4, dtype=torch.float64, device=device)
    if action is not None:
        target = step_of(action.tag) if action.tag else 0
        packed = torch.tensor(
            [ACTIONS.index(action.kind), target, action.seed or 0, action.lr_scale],
            dtype=torch.float64,
            device=device,
        )
    broadcast(packed, src=0)
    kind = ACTIONS[int(packed[0].item())]
    if kind == "rollback":
        return Action("rollback", tag=tag_for(int(packed[1].item())), seed=int(packed[2].item()),
                      lr_scale=float(packed[3].item()), reason=action.reason if action else None)  # fmt: skip
    if kind == "stop":
        return Action("stop", reason=(action.reason if action else None) or "stopped by the monitor")
    return CONTINUE


class MonitorLink:
    """Every rank holds one; rank 0's also holds the client. `judge` is a collective."""

    def __init__(self, run_dir: str | Path, timeout: float, env: DistEnv, device):
        self.client = MonitorClient(run_dir, timeout) if env.is_main else None
        self.device = device

    def judge(self, step: int, metrics: dict[str, float | None], tokens: int) -> Action:
        """Rank 0 reports the step's metrics (the trainer's `train/*` values); every rank returns
        the service's answer to it."""
        answer = None
        if self.client is not None:
            grad_norm = metrics["train/grad_norm"]
            layers = {
                k.removeprefix("train/grad_norm/"): v
                for k, v in metrics.items()
                if k.startswith("train/grad_norm/")
            }
            report = StepMetrics(step, metrics["train/loss"], grad_norm if grad_norm is not None else float("nan"),
                                 metrics["train/lr"], metrics["train/step_time"], tokens, layers)  # fmt: skip
            answer = self.client.report(report)
        return broadcast_action(answer, self.device)

    def thresholds(self) -> dict[str, float | None]:
        """The detector bands of the last answer, for TensorBoard (rank 0; None elsewhere)."""
        if self.client is None:
            return {}
        return {
            "monitor/grad_norm_threshold": self.client.band("grad_norm"),
            "monitor/loss_threshold": self.client.band("loss"),
        }


class Rewindable(Protocol):
    """A task's data position, as a rollback needs it."""

    def pause(self) -> None: ...
    def load_state_dict(self, state: dict) -> None: ...
    def reshuffle(self, seed: int) -> None: ...


def apply_rollback(action: Action, engine, task: Rewindable, checkpointer: Checkpointer) -> TrainState | None:
    """Every rank: load the target checkpoint (or, if its files do not verify, the next older intact
    one), put the data stream at its position, reshuffle the rest of the epoch with the new seed,
    and carry on with the scaled learning rate. Newer checkpoints belong to the abandoned timeline
    and move aside. None when no intact checkpoint is left to go back to (the rollback is
    cancelled, with an event, and training goes on)."""
    task.pause()
    loaded = checkpointer.load(engine, action.tag)
    run_dir = checkpointer.run_dir
    if loaded is None:
        if checkpointer.env.is_main:
            append_event(run_dir, {"type": "rollback_cancelled", "step": step_of(action.tag), "tag": action.tag,
                                   "reason": f"no intact checkpoint at or before {action.tag}"})  # fmt: skip
        return None
    saved, matches = loaded
    barrier()  # every rank has read the target before newer checkpoints move away
    if checkpointer.env.is_main:
        abandoned = abandon_after(run_dir, saved["step"])
        trim_abandoned(run_dir)
        append_event(run_dir, {"type": "rollback_applied", "step": saved["step"], "tag": tag_for(saved["step"]),
                               "requested": action.tag, "seed": action.seed, "matches_checkpoint": matches,
                               "abandoned": abandoned})  # fmt: skip
    task.load_state_dict(saved["data"])
    task.reshuffle(action.seed)
    return TrainState(step=saved["step"], tokens=saved["tokens"], lr_scale=action.lr_scale)

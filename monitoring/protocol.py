"""What the trainer (rank 0) and the monitoring service share: the messages, the monitor's files
in the run directory, and the events file. The trainer imports nothing else from `monitoring`.

Trainer → service, once per optimizer step: a `StepMetrics`.
Service → trainer, in the answer: an `Action` (`continue`; `rollback` to a checkpoint with a new
data seed and an lr scale; or `stop`, when the circuit breaker trips), which rank 0 broadcasts so
every rank acts at the same step boundary. Both are plain JSON so either side can be replaced or
inspected with curl. Unknown fields are refused, so a typo never passes silently.

    RUN_DIR/events.jsonl            append-only, one JSON object per line with `type` and `step`
    RUN_DIR/monitor/endpoint.json   where the service listens ({"url": ..., "pid": ...})
    RUN_DIR/monitor/token           the bearer token for requests that change state (mode 0600)
    RUN_DIR/monitor/supervisor.json the supervisor's view of the job (`pretrain launch`)
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

PROTOCOL_VERSION = 1
ACTIONS = ("continue", "rollback", "stop")  # what the service may answer; their order is the wire code

MONITOR_DIR = "monitor"
ENDPOINT_FILE = "endpoint.json"
TOKEN_FILE = "token"
SUPERVISOR_FILE = "supervisor.json"
EVENTS_FILE = "events.jsonl"


def monitor_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / MONITOR_DIR


def append_event(run_dir: str | Path, event: dict, *, sync: bool = True) -> None:
    """events.jsonl: append-only, one JSON object per line with at least `type` and `step`.
    `sync`: fsync, for the rare events (rollbacks, restarts) that must survive a crash."""
    event = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in event.items()}
    with open(Path(run_dir) / EVENTS_FILE, "a") as f:
        f.write(json.dumps({"time": time.time(), **event}, allow_nan=False) + "\n")
        f.flush()
        if sync:
            os.fsync(f.fileno())


def read_events(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / EVENTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


class ProtocolError(ValueError):
    """A message that does not follow this protocol."""


def _number(payload: dict, key: str, *, optional: bool = False) -> float | None:
    value = payload.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(f"{key!r} must be a number, got {value!r}")
    return float(value)


def _nonfinite_to_json(value: float | None) -> Any:
    # JSON has no NaN/Inf; a NaN loss is exactly what the monitor must see, so spell it as a string.
    if value is not None and not math.isfinite(value):
        return str(value)
    return value


def _json_to_float(value: Any) -> Any:
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf"):
        return float(value)
    return value


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time: float  # seconds for this optimizer step
    tokens: int  # tokens consumed so far, all ranks
    layer_grad_norms: dict[str, float] = field(default_factory=dict)  # per layer group, when measured

    def to_json(self) -> dict[str, Any]:
        payload = asdict(self)
        payload["loss"] = _nonfinite_to_json(self.loss)
        payload["grad_norm"] = _nonfinite_to_json(self.grad_norm)
        payload["layer_grad_norms"] = {k: _nonfinite_to_json(v) for k, v in self.layer_grad_norms.items()}
        return payload

    @classmethod
    def from_json(cls, payload: Any) -> StepMetrics:
        if not isinstance(payload, dict):
            raise ProtocolError("metrics must be a JSON object")
        unknown = set(payload) - {f.name for f in fields(cls)}
        if unknown:
            raise ProtocolError(f"unknown metric fields {sorted(unknown)}")
        payload = {k: _json_to_float(v) for k, v in payload.items()}
        step, tokens = payload.get("step"), payload.get("tokens")
        for key, value in (("step", step), ("tokens", tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ProtocolError(f"{key!r} must be a non-negative integer, got {value!r}")
        layers = payload.get("layer_grad_norms") or {}
        if not isinstance(layers, dict):
            raise ProtocolError("'layer_grad_norms' must be an object of name → number")
        layers = {
            str(k): _number({f"layer_grad_norms.{k}": _json_to_float(v)}, f"layer_grad_norms.{k}")
            for k, v in layers.items()
        }
        return cls(
            step=step,
            loss=_number(payload, "loss"),
            grad_norm=_number(payload, "grad_norm"),
            lr=_number(payload, "lr"),
            step_time=_number(payload, "step_time"),
            tokens=tokens,
            layer_grad_norms=layers,
        )


@dataclass(frozen=True)
class Action:
    """`continue`, or `rollback` to checkpoint `tag` with data seed `seed` and lr scaled by `lr_scale`,
    or `stop`. On the wire the kind is the field `action`."""

    kind: str = "continue"
    tag: str | None = None
    seed: int | None = None
    lr_scale: float = 1.0
    reason: str | None = None

    def __post_init__(self) -> None:
        for name, types in (("tag", str), ("seed", int), ("reason", str)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
                raise ProtocolError(f"{name!r} must be a {types.__name__}, got {value!r}")
        if isinstance(self.lr_scale, bool) or not isinstance(self.lr_scale, int | float):
            raise ProtocolError(f"'lr_scale' must be a number, got {self.lr_scale!r}")
        if self.kind not in ACTIONS:
            raise ProtocolError(f"unknown action {self.kind!r}")
        if self.kind == "rollback" and (not self.tag or self.seed is None):
            raise ProtocolError("a rollback needs a checkpoint 'tag' and a data 'seed'")
        if not self.lr_scale > 0:
            raise ProtocolError(f"'lr_scale' must be positive, got {self.lr_scale}")

    def to_json(self) -> dict[str, Any]:
        fields_ = {k: v for k, v in asdict(self).items() if v is not None and k != "kind"}
        return {"action": self.kind, **fields_}

    @classmethod
    def from_json(cls, payload: Any) -> Action:
        if not isinstance(payload, dict):
            raise ProtocolError("an action must be a JSON object")
        unknown = set(payload) - {"action", "tag", "seed", "lr_scale", "reason"}
        if unknown:
            raise ProtocolError(f"unknown action fields {sorted(unknown)}")
        fields_ = {k: v for k, v in payload.items() if k != "action"}
        return cls(kind=payload.get("action", "continue"), **fields_)


CONTINUE = Action()

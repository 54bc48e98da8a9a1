"""What the trainer (rank 0) and the monitoring service share: the messages, the monitor's files
in the run directory, and the events file. The trainer imports nothing else from `monitoring`.

Trainer → service, once per optimizer step: a `StepMetrics` (POST /v1/metrics), sent from a
background thread while the next step computes, in order, and sent again until answered (with
`session` and `seq`, so the service answers a repeated report without judging it twice).
Service → trainer, in the answer: an `Action` (`continue`; `rollback`, carrying the decision's
one record, a `Rollback`; or `stop`, with its reason), which rank 0 shares with every rank at the
next step boundary so all act at the same one. Trainer → service, once a rollback was acted on: an
`Outcome` (POST /v1/outcome): applied, or cancelled with a reason. All plain JSON, so either side
can be replaced or inspected with curl. Unknown fields are refused, so a typo never passes silently.

    RUN_DIR/events.jsonl            append-only, one JSON object per line with `type` and `step`:
                                    the `Event` types at the end of this module, written and read
                                    by `append_event` and `read_events`
    RUN_DIR/monitor/endpoint.json   where the service listens ({"url", "host", "port", "pid"})
    RUN_DIR/monitor/token           the bearer token for requests that change state (mode 0600)
    RUN_DIR/monitor/supervisor.json the supervisor's view of the job (`pretrain launch`)
    RUN_DIR/monitor/hosts.json      its host set over ssh: in use, spares, excluded, lost
    RUN_DIR/monitor/replace.json    a host the trainer asks to be moved off (`MoveOff`: a straggler,
                                    machine faults), and the supervisor's answer when it cannot
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, get_type_hints

MAX_INT = 2**53  # integers beyond this are not exact in JSON readers (and are no real step or count)
ACTIONS = ("continue", "rollback", "stop")  # what the service may answer; their order is the wire code
# The instability precursors a report may carry (the trainer's `stability/<name>`, measured every
# logging.precursors_every steps), each graded by the service against its own band.
PRECURSORS = ("attn_logit_max", "logit_lse_max", "logit_abs_max", "update_ratio_max")
# The report of a logging step that ends a straggler window carries each rank's forward seconds
# per step over it (`StepMetrics.ranks`): every rank of a job up to this many, else the slowest.
MAX_RANKS_REPORTED = 64
RANK_KEYS = ("rank", "host", "step_seconds", "factor", "straggler")
# A model with experts: each step's report carries, per MoE layer, its least loaded expert (its
# tokens over the layer's mean) and the share of the layer's tokens its most chosen expert takes
# (`StepMetrics.experts`), judged by monitoring/experts.py.
EXPERT_KEYS = ("layer", "load_min", "min_expert", "top_share", "top_expert")
MAX_EXPERT_LAYERS = 1024

MONITOR_DIR = "monitor"
ENDPOINT_FILE = "endpoint.json"
TOKEN_FILE = "token"
SUPERVISOR_FILE = "supervisor.json"
# RUN_DIR/monitor/hosts.json: the supervisor's host set over ssh ({"in_use", "spares", "excluded":
# {host: reason}, "lost": [host, ...]}), rewritten at each start (launch/slurm.sbatch reads it to
# leave a lost node out of a requeued job).
HOSTS_FILE = "hosts.json"
REPLACE_FILE = "replace.json"  # RUN_DIR/monitor/: a `MoveOff`
EVENTS_FILE = "events.jsonl"
# RUN_DIR/train_summary.json, written by rank 0 when the loop ends: `"completed": true` once the
# last step is trained and its checkpoint saved (the supervisor reads it: a finished run whose
# processes are slow to exit is not a hung one).
SUMMARY_FILE = "train_summary.json"


def monitor_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / MONITOR_DIR


def strict_json(value: Any) -> Any:
    """`value` with every non-finite float spelled as a string ("nan", "inf"): JSON has no NaN, and
    a NaN loss is exactly what the monitor must see."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value


class ProtocolError(ValueError):
    """A message that does not follow this protocol."""


def _number(payload: dict, key: str, *, optional: bool = False) -> float | None:
    value = payload.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(f"{key!r} must be a number, got {str(value)[:40]}")
    try:
        return float(value)
    except OverflowError:
        raise ProtocolError(f"{key!r} is out of range") from None


def _json_to_float(value: Any) -> Any:
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf"):
        return float(value)
    return value


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time: float  # seconds for this optimizer step
    tokens: int  # tokens consumed so far, all ranks
    layer_grad_norms: dict[str, float] = field(default_factory=dict)  # per layer group, when measured
    total_steps: int | None = None  # the run's last step (for progress and ETA)
    update_skipped: bool = False  # the trainer skipped this step's update in place (monitor.skip_step)
    precursors: dict[str, float] = field(default_factory=dict)  # PRECURSORS measured at this step
    # at the logging step that ends a straggler window: each rank's {rank, host, step_seconds (its
    # median forward seconds per step over the window), factor (over the other ranks' median),
    # straggler (true: named at this step)}
    ranks: list[dict[str, Any]] = field(default_factory=list)
    # with experts: per MoE layer {layer, load_min, min_expert, top_share, top_expert} (EXPERT_KEYS)
    experts: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return strict_json(asdict(self))

    @classmethod
    def from_json(cls, payload: Any) -> StepMetrics:
        payload = {k: _json_to_float(v) for k, v in _object(payload, "metric", fields(cls)).items()}
        step, tokens = payload.get("step"), payload.get("tokens")
        for key, value in (("step", step), ("tokens", tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_INT:
                raise ProtocolError(f"{key!r} must be an integer in [0, 2^53), got {value!r}")
        for key in ("lr", "step_time"):  # the trainer's own numbers: never NaN, never negative
            value = _number(payload, key)
            if not (math.isfinite(value) and value >= 0):
                raise ProtocolError(f"{key!r} must be a finite number >= 0, got {value!r}")
        layers = payload.get("layer_grad_norms") or {}
        if not isinstance(layers, dict) or len(layers) > 4096 or any(len(str(k)) > 200 for k in layers):
            raise ProtocolError("'layer_grad_norms' must be an object of at most 4096 name → number")
        layers = {
            str(k): _number({f"layer_grad_norms.{k}": _json_to_float(v)}, f"layer_grad_norms.{k}")
            for k, v in layers.items()
        }
        total = payload.get("total_steps")
        if total is not None and (
            isinstance(total, bool) or not isinstance(total, int) or not 0 <= total < MAX_INT
        ):
            raise ProtocolError(f"'total_steps' must be an integer in [0, 2^53), got {total!r}")
        precursors = payload.get("precursors") or {}
        if not isinstance(precursors, dict) or not set(precursors) <= set(PRECURSORS):
            raise ProtocolError(f"'precursors' must be an object with keys among {', '.join(PRECURSORS)}")
        precursors = {
            k: _number({f"precursors.{k}": _json_to_float(v)}, f"precursors.{k}")
            for k, v in precursors.items()
        }
        skipped = payload.get("update_skipped", False)
        if not isinstance(skipped, bool):
            raise ProtocolError(f"'update_skipped' must be true or false, got {skipped!r}")
        return cls(
            experts=_expert_loads(payload.get("experts") or []),
            ranks=_rank_times(payload.get("ranks") or []),
            precursors=precursors,
            update_skipped=skipped,
            total_steps=total,
            step=step,
            loss=_number(payload, "loss"),
            grad_norm=_number(payload, "grad_norm"),
            lr=_number(payload, "lr"),
            step_time=_number(payload, "step_time"),
            tokens=tokens,
            layer_grad_norms=layers,
        )


def _rank_times(ranks: Any) -> list[dict[str, Any]]:
    """StepMetrics.ranks, checked: at most MAX_RANKS_REPORTED objects of RANK_KEYS, each with a
    rank, a host and its seconds."""
    if not isinstance(ranks, list) or len(ranks) > MAX_RANKS_REPORTED:
        raise ProtocolError(f"'ranks' must be a list of at most {MAX_RANKS_REPORTED} objects")
    checked = []
    for entry in ranks:
        entry = _object(entry, "rank", RANK_KEYS)
        rank, host = entry.get("rank"), entry.get("host")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < MAX_INT:
            raise ProtocolError(f"'ranks.rank' must be an integer in [0, 2^53), got {rank!r}")
        if not isinstance(host, str) or not 0 < len(host) <= 255:
            raise ProtocolError(f"'ranks.host' must be a host name of 1 to 255 characters, got {host!r:.80}")
        numbers = {}
        for key in ("step_seconds", "factor"):
            value = _number(entry, key, optional=key == "factor")
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ProtocolError(f"'ranks.{key}' must be a finite number >= 0, got {value!r}")
            if value is not None:
                numbers[key] = value
        straggler = entry.get("straggler", False)
        if not isinstance(straggler, bool):
            raise ProtocolError(f"'ranks.straggler' must be true or false, got {straggler!r}")
        checked.append({"rank": rank, "host": host, **numbers} | ({"straggler": True} if straggler else {}))
    return checked


def _expert_loads(layers: Any) -> list[dict[str, Any]]:
    """StepMetrics.experts, checked: at most MAX_EXPERT_LAYERS objects of every EXPERT_KEYS, the
    layer and expert indices non-negative integers, the load and share finite numbers >= 0."""
    if not isinstance(layers, list) or len(layers) > MAX_EXPERT_LAYERS:
        raise ProtocolError(f"'experts' must be a list of at most {MAX_EXPERT_LAYERS} objects")
    checked = []
    for entry in layers:
        entry = _object(entry, "experts", EXPERT_KEYS)
        record = {}
        for key in EXPERT_KEYS:
            value, number = entry.get(key), key in ("load_min", "top_share")
            if number:
                value = _number(entry, key)
                ok = math.isfinite(value) and value >= 0
            else:
                ok = not isinstance(value, bool) and isinstance(value, int) and 0 <= value < MAX_INT
            if not ok:
                kind = "a finite number" if number else "an integer"
                raise ProtocolError(f"'experts.{key}' must be {kind} >= 0, got {value!r:.80}")
            record[key] = value
        checked.append(record)
    return checked


def _object(payload: Any, what: str, names) -> dict:
    """`payload`, a JSON object with no key but `names` (field names, or dataclass fields)."""
    if not isinstance(payload, dict):
        raise ProtocolError(f"{what} must be a JSON object")
    unknown = set(payload) - {getattr(n, "name", n) for n in names}
    if unknown:
        raise ProtocolError(f"unknown {what} fields {sorted(unknown)}")
    return payload


def _sender(payload: Any, what: str) -> tuple[dict, str | None, int | None]:
    if not isinstance(payload, dict):
        raise ProtocolError(f"{what} must be a JSON object")
    payload = dict(payload)
    session, seq = payload.pop("session", None), payload.pop("seq", None)
    if session is not None and not (isinstance(session, str) and 0 < len(session) <= 64):
        raise ProtocolError(f"'session' must be a short string, got {session!r}")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or not 0 < seq < MAX_INT):
        raise ProtocolError(f"'seq' must be a positive integer, got {seq!r}")
    return payload, session, seq


def parse_report(payload: Any) -> tuple[StepMetrics, str | None, int | None]:
    """A POST /v1/metrics body: the step's metrics, and the sender's `session` and `seq` (optional:
    a report without them, e.g. from curl, is judged every time it is sent)."""
    payload, session, seq = _sender(payload, "metrics")
    return StepMetrics.from_json(payload), session, seq


def parse_outcome(payload: Any) -> tuple[Outcome, str | None, int | None]:
    """A POST /v1/outcome body, with the sender's `session` and `seq` like a report."""
    payload, session, seq = _sender(payload, "an outcome")
    return Outcome.from_json(payload), session, seq


@dataclass(frozen=True, kw_only=True)
class Rollback:
    """A rollback decision, and the one record of it, whoever decides it: the service's policy (the
    answer to a report carries it, `Action`, and rank 0 broadcasts it to every rank) or the
    trainer's replica check (`decision` None, `finding` "replica_mismatch"). `pretrain/train/
    rollback.py` applies every one; the `rollback` event and the checkpoints saved after it is
    applied (train_state.json `hooks.monitor`) keep it. Each of those is derived from these
    fields, so a new field is declared here and nowhere else."""

    decision: int | None  # the service's number for it (1, 2, ...); None: the trainer's (replica check)
    step: int  # the anomalous step it was decided at
    target: str  # the checkpoint to go back to: the newest complete one before the anomalous update
    seed: int | None  # the data stream's new shuffle seed; None: the same order (the data is innocent)
    lr_scale: float = 1.0  # the learning rate's scale from the target on (monitor.lr_scale ** rollbacks)
    reason: str = ""
    finding: str = ""  # the finding's kind (`operator` for an operator's request)
    value: float | None = None  # the finding's value and threshold, when it has them
    threshold: float | None = None
    # monitor.on_repeat (None when off): how many rollbacks in a row this one repeats (0: none
    # within monitor.repeat_window steps), the stage it reached, and what that stage adds: set the
    # anomalous step's windows aside; the learning rate times `lr_factor` for the `lr_factor_steps`
    # steps after the target.
    repeat: int | None = None
    stage: str | None = None
    quarantine: bool | None = None
    lr_factor: float | None = None
    lr_factor_steps: int | None = None

    def __post_init__(self) -> None:
        check_types(self, type(self))
        if not self.lr_scale > 0:
            raise ProtocolError(f"'lr_scale' must be positive, got {self.lr_scale}")
        if self.lr_factor is not None and not 0 < self.lr_factor <= 1:
            raise ProtocolError(f"'lr_factor' must be a number in (0, 1], got {self.lr_factor!r}")
        if self.lr_factor_steps is not None and not 0 < self.lr_factor_steps < MAX_INT:
            raise ProtocolError(f"'lr_factor_steps' must be a positive integer, got {self.lr_factor_steps!r}")
        if (self.lr_factor is None) != (self.lr_factor_steps is None):
            raise ProtocolError("'lr_factor' and 'lr_factor_steps' come together")

    def to_json(self) -> dict[str, Any]:
        """Its fields, the optional ones that are None left out (non-finite values spelled as
        strings): `from_json` reads it back, the trainer's own decisions included."""
        values = {f.name: (getattr(self, f.name), f.default is MISSING) for f in fields(Rollback)}
        return strict_json({k: v for k, (v, required) in values.items() if required or v is not None})

    @classmethod
    def from_json(cls, payload: Any) -> Rollback:
        payload = _object(payload, "rollback", fields(cls))
        try:
            return cls(**{k: _json_to_float(v) for k, v in payload.items()})
        except TypeError as exc:  # a field missing
            raise ProtocolError(f"a rollback is incomplete: {exc}") from None

    @classmethod
    def of(cls, record: Rollback) -> Rollback:
        """The record of a `Rollback` or of anything built on one (the `rollback` event)."""
        return cls(**{f.name: getattr(record, f.name) for f in fields(cls)})


def check_types(record: Any, cls: type) -> None:
    """Every field of `cls` in `record` has its declared type (an int is no bool; a float may be
    an int; None only where the declaration allows it)."""
    names = {f.name for f in fields(cls)}
    for name, hint in get_type_hints(cls).items():
        if name not in names:
            continue
        value, allowed = getattr(record, name), getattr(hint, "__args__", (hint,))
        types = [t for t in allowed if t is not type(None)]
        if value is None and len(types) < len(allowed):
            continue
        if float in types and isinstance(value, int) and not isinstance(value, bool):
            continue
        if not any(isinstance(value, t) and (t is bool or not isinstance(value, bool)) for t in types):
            kinds = " or ".join(t.__name__ for t in types) + (" or null" if len(types) < len(allowed) else "")
            raise ProtocolError(f"{name!r} must be a {kinds}, got {value!r}")


@dataclass(frozen=True)
class Action:
    """The service's answer to a report: `continue`, `rollback` (with its `Rollback` record) or
    `stop` (with its `reason`). On the wire: {"action": kind, "reason"?, "rollback"?: {...}}."""

    kind: str = "continue"
    reason: str | None = None  # why the job must stop (a rollback's reason is its record's)
    rollback: Rollback | None = None

    def __post_init__(self) -> None:
        if self.kind not in ACTIONS:
            raise ProtocolError(f"unknown action {self.kind!r}")
        if (self.kind == "rollback") != (self.rollback is not None):
            raise ProtocolError("a rollback action, and only one, carries its 'rollback' record")
        if self.reason is not None and not isinstance(self.reason, str):
            raise ProtocolError(f"'reason' must be a string, got {self.reason!r}")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"action": self.kind}
        if self.reason is not None:
            out["reason"] = self.reason
        if self.rollback is not None:
            out["rollback"] = self.rollback.to_json()
        return out

    @classmethod
    def from_json(cls, payload: Any) -> Action:
        payload = _object(payload, "action", ("action", "reason", "rollback"))
        rollback = payload.get("rollback")
        return cls(
            payload.get("action", "continue"),
            payload.get("reason"),
            Rollback.from_json(rollback) if rollback is not None else None,
        )


CONTINUE = Action()


@dataclass(frozen=True, kw_only=True)
class Judgement:
    """What an answer to a step's metrics says besides its `Action` (the rest of the same JSON
    object): the values the service judged, its verdict's `level` (warmup, ok, warn, skipped,
    rollback, stop, superseded) and findings, and each series' band (None while it warms up). The
    trainer charts it (TensorBoard's `monitor/*`)."""

    step: int
    loss: float
    grad_norm: float
    level: str
    findings: list[dict] = field(default_factory=list)
    bands: dict[str, dict | None] = field(default_factory=dict)  # series → {level, spread, threshold}
    note: str | None = None

    FIELDS: ClassVar[tuple[str, ...]] = ("judged", "verdict", "bands")  # its keys in an answer

    def to_json(self) -> dict[str, Any]:
        verdict = {"level": self.level, "findings": self.findings} | (
            {"note": self.note} if self.note else {}
        )
        judged = {"step": self.step, "loss": self.loss, "grad_norm": self.grad_norm}
        return strict_json({"judged": judged, "verdict": verdict, "bands": self.bands})

    @classmethod
    def from_answer(cls, answer: dict[str, Any]) -> Judgement:
        try:
            judged, verdict = answer["judged"], answer["verdict"]
            return cls(
                step=int(judged["step"]),
                loss=float(_json_to_float(judged["loss"])),
                grad_norm=float(_json_to_float(judged["grad_norm"])),
                level=str(verdict["level"]),
                findings=list(verdict.get("findings") or []),
                bands=dict(answer.get("bands") or {}),
                note=verdict.get("note"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"an answer's judgement is malformed: {exc!r}") from None


def split_answer(answer: dict[str, Any]) -> tuple[Action, Judgement]:
    """An answer to a step's metrics: the action to take and what the step was judged to be."""
    if not isinstance(answer, dict):
        raise ProtocolError("an answer must be a JSON object")
    action = Action.from_json({k: v for k, v in answer.items() if k not in Judgement.FIELDS})
    return action, Judgement.from_answer(answer)


@dataclass(frozen=True)
class Outcome:
    """What became of rollback `decision` (decided at step `decided_at`; None: the trainer's own):
    `applied` at the step boundary after step `applied_at`, to checkpoint `tag`; or cancelled,
    with a `reason`."""

    decision: int | None
    decided_at: int
    applied: bool
    applied_at: int
    tag: str | None = None
    reason: str | None = None

    def __post_init__(self) -> None:
        check_types(self, Outcome)
        for key in ("decision", "decided_at", "applied_at"):
            if getattr(self, key) is not None and not 0 <= getattr(self, key) < MAX_INT:
                raise ProtocolError(f"{key!r} must be a non-negative integer, got {getattr(self, key)!r}")

    def to_json(self) -> dict[str, Any]:
        """Its fields, `tag` and `reason` left out when None (`decision` is there: null for the
        trainer's own rollback)."""
        return {k: v for k, v in asdict(self).items() if v is not None or k == "decision"}

    @classmethod
    def from_json(cls, payload: Any) -> Outcome:
        try:
            return cls(**_object(payload, "outcome", fields(cls)))
        except TypeError as exc:  # a field missing
            raise ProtocolError(f"an outcome is incomplete: {exc}") from None


MOVE_OFF_CAUSES = ("straggler", "machine_faults")  # why the trainer asks to move a host off


@dataclass(frozen=True, kw_only=True)
class MoveOff:
    """RUN_DIR/monitor/replace.json: a host the trainer asks to be moved off, whatever the cause: a
    straggler (monitor.on_straggler=replace) or machine faults (monitor.machine_faults_to_exclude).
    Rank 0 writes it (`pretrain/train/move_off.py`; atomically) before every rank exits with
    ExitCode.REPLACE_NODE; the supervisor restarts the job without that host (`hosts.py`). When it
    cannot (no spare, no fewer nodes allowed, no host set), it writes the record back with `kept`,
    why not, and the job's later starts only warn: asking again would restart it forever."""

    host: str  # the host as its rank names itself (the supervisor maps `rank` to the hostfile's name)
    rank: int  # one rank it holds
    step: int  # the step saved before the exit
    reason: str
    cause: str  # MOVE_OFF_CAUSES
    kept: str | None = None  # the supervisor's answer: why the host could not be moved off

    def __post_init__(self) -> None:
        check_types(self, MoveOff)
        if self.cause not in MOVE_OFF_CAUSES:
            raise ProtocolError(f"'cause' must be one of {', '.join(MOVE_OFF_CAUSES)}, got {self.cause!r}")
        if not (0 <= self.rank < MAX_INT and 0 <= self.step < MAX_INT):
            raise ProtocolError(
                f"'rank' and 'step' must be non-negative integers, got {self.rank}, {self.step}"
            )

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, payload: Any) -> MoveOff:
        try:
            return cls(**_object(payload, "move-off request", fields(cls)))
        except TypeError as exc:  # a field missing
            raise ProtocolError(f"a move-off request is incomplete: {exc}") from None

    @classmethod
    def read(cls, run_dir: str | Path) -> MoveOff | None:
        """RUN_DIR/monitor/replace.json, or None when there is none or it cannot be read."""
        try:
            return cls.from_json(json.loads((monitor_dir(run_dir) / REPLACE_FILE).read_text()))
        except (OSError, ValueError):  # (a ProtocolError is a ValueError)
            return None


# ------------------------------------------------------------------------------------ events.jsonl

_now = time.time  # (a field below is called `time`)


@dataclass(frozen=True, kw_only=True)
class Event:
    """One line of RUN_DIR/events.jsonl. Each kind of event is a subclass with its `type` (the
    line's `type` key) and its fields; `time` is when it was appended. Every writer builds one of
    these and every reader gets them back from `read_events`, so a field is named in one place.
    Fields listed in `OMITTED_WHEN_NONE` are left out of the line when they are None."""

    type: ClassVar[str] = ""
    OMITTED_WHEN_NONE: ClassVar[tuple[str, ...]] = ()
    KEYS: ClassVar[dict[str, str]] = {}  # a field whose key in the line is another (a Python keyword)
    step: int | None
    time: float = field(default_factory=_now)

    def to_json(self) -> dict[str, Any]:
        payload = {"type": self.type}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in self.OMITTED_WHEN_NONE:
                continue
            payload[self.KEYS.get(f.name, f.name)] = value
        return payload

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> Event:
        """The event of a line; a line of an unknown type (a newer version's) is an `OtherEvent`.
        Unknown keys of a known type are dropped: a reader never fails on an older or newer line."""
        kind = EVENT_TYPES.get(payload.get("type", ""))
        other = OtherEvent(step=payload.get("step"), time=payload.get("time") or 0.0, payload=payload)
        if kind is None:
            return other
        names = {f.name for f in fields(kind)}
        fields_of = {kind.KEYS.get(name, name): name for name in names}
        try:
            return kind(**{fields_of[k]: _json_to_float(v) for k, v in payload.items() if k in fields_of})
        except (TypeError, ProtocolError):  # a field missing or malformed: kept whole, like an unknown type
            return other


@dataclass(frozen=True, kw_only=True)
class OtherEvent(Event):
    """A line whose type this version does not know, kept whole."""

    payload: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return dict(self.payload)


@dataclass(frozen=True, kw_only=True)
class StepJudged(Event):
    """The service judged a reported step (not fsynced: there is one per step)."""

    type: ClassVar[str] = "step"
    loss: float
    grad_norm: float
    action: str
    level: str


@dataclass(frozen=True, kw_only=True)
class WarningRaised(Event):
    """A step judged `warn`: its findings' kinds and reasons."""

    type: ClassVar[str] = "warning"
    reason: str
    findings: list[str]


@dataclass(frozen=True, kw_only=True)
class Anomaly(Event):
    """A step that called for a rollback with no checkpoint to go back to."""

    type: ClassVar[str] = "anomaly"
    note: str | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class RollbackDecided(Event, Rollback):
    """A rollback was decided, by the service or by the trainer's replica check (`decision` null):
    its `Rollback` record, `step` the anomalous one."""

    type: ClassVar[str] = "rollback"
    OMITTED_WHEN_NONE: ClassVar[tuple[str, ...]] = (
        "repeat",
        "stage",
        "quarantine",
        "lr_factor",
        "lr_factor_steps",
    )


@dataclass(frozen=True, kw_only=True)
class _Evidence:
    """The anomalous step's windows and their documents (or why they cannot be named)."""

    windows: list[int] | None = None
    documents: list[dict] | None = None
    documents_unavailable: str | None = None


_EVIDENCE = ("windows", "documents", "documents_unavailable")


@dataclass(frozen=True, kw_only=True)
class RollbackApplied(_Evidence, Event):
    """The trainer loaded checkpoint `tag` (its step is `step`) for rollback `decision`."""

    type: ClassVar[str] = "rollback_applied"
    OMITTED_WHEN_NONE: ClassVar[tuple[str, ...]] = _EVIDENCE
    tag: str
    requested: str
    seed: int | None
    decision: int | None
    decided_at: int | None
    applied_at: int
    matches_checkpoint: bool | None
    abandoned: list[str]


@dataclass(frozen=True, kw_only=True)
class RollbackCancelled(_Evidence, Event):
    """Rollback `decision` will not be applied: by the service (the trainer showed it went on: with
    the `target`), or by the trainer (no intact checkpoint at or before `tag`)."""

    type: ClassVar[str] = "rollback_cancelled"
    OMITTED_WHEN_NONE: ClassVar[tuple[str, ...]] = (
        *_EVIDENCE,
        "target",
        "tag",
        "decided_at",
        "applied_at",
    )
    decision: int | None
    reason: str
    target: str | None = None
    tag: str | None = None
    decided_at: int | None = None
    applied_at: int | None = None


@dataclass(frozen=True, kw_only=True)
class UpdateSkipped(Event):
    """The trainer skipped step `step`'s update in place (`monitor.skip_step`): it never landed on
    any rank. `reasons`: loss_nonfinite, grad_norm_nonfinite, loss_spike, grad_norm_spike; the
    levels are the running medians the step was judged against (None while they warm up)."""

    type: ClassVar[str] = "update_skipped"
    loss: float
    grad_norm: float
    reasons: list[str]
    loss_level: float | None
    grad_norm_level: float | None


@dataclass(frozen=True, kw_only=True)
class RepeatsStopped(Event):
    """Rollbacks kept repeating through every stage of monitor.on_repeat: the service answers
    `stop`. `tried`: the rollbacks of the chain, oldest first (each a `Rollback` record);
    `diagnosis`: the same in one line."""

    type: ClassVar[str] = "repeats_stopped"
    reason: str
    diagnosis: str
    tried: list[dict]


@dataclass(frozen=True, kw_only=True)
class LrLowered(Event):
    """The trainer lowered the learning rate for rollback `decision` (monitor.on_repeat's
    `lower_lr`): the schedule's value times `factor` from step `step` + 1 through step `until`."""

    type: ClassVar[str] = "lr_lowered"
    decision: int | None
    factor: float
    until: int


@dataclass(frozen=True, kw_only=True)
class LrRestored(Event):
    """The lowered learning rate (times `factor`, until step `step` - 1) is the schedule's again."""

    type: ClassVar[str] = "lr_restored"
    decision: int | None
    factor: float


@dataclass(frozen=True, kw_only=True)
class CircuitBreaker(Event):
    """Too many rollbacks: the service answers `stop`."""

    type: ClassVar[str] = "circuit_breaker"
    reason: str | None


@dataclass(frozen=True, kw_only=True)
class Restart(Event):
    """The supervisor started the job again (`step`: the last one judged before it, if known)."""

    type: ClassVar[str] = "restart"
    reason: str
    restart: int
    max_restarts: int
    resume_from: str | None


@dataclass(frozen=True, kw_only=True)
class NodeLost(Event):
    """A node of the running job was lost (its launcher exited, its ssh stopped answering): the job
    stops and starts again without it. `ranks`: the ranks it held."""

    type: ClassVar[str] = "node_lost"
    host: str
    ranks: list[int]
    reason: str


@dataclass(frozen=True, kw_only=True)
class NodeExcluded(Event):
    """A host left out of the next start: its check failed (ssh, Python, the run directory, GPUs)
    or it straggled. `ranks`: those it held in the job before, if any."""

    type: ClassVar[str] = "node_excluded"
    host: str
    ranks: list[int]
    reason: str


@dataclass(frozen=True, kw_only=True)
class NodeReplaced(Event):
    """A spare host takes a lost or excluded one's place (the same world size)."""

    type: ClassVar[str] = "node_replaced"
    old: str
    new: str


@dataclass(frozen=True, kw_only=True)
class WorldResized(Event):
    """The job starts again on fewer nodes (no healthy spare, `--min-nodes`): the world size `from`
    → `to` processes, the global batch kept by `accumulation` micro-batches per step."""

    type: ClassVar[str] = "world_resized"
    KEYS: ClassVar[dict[str, str]] = {"previous": "from", "size": "to"}  # field → its key in the line
    previous: int
    size: int
    accumulation: int


@dataclass(frozen=True, kw_only=True)
class Straggler(Event):
    """Rank `rank` on `host` took `factor` × the median rank's compute time per step for
    monitor.straggler_windows logging intervals in a row, up to step `step`."""

    type: ClassVar[str] = "straggler"
    rank: int
    host: str
    factor: float


@dataclass(frozen=True, kw_only=True)
class MachineFault(Event):
    """Step `step`'s update did not land, and replaying its micro-batches gave other values on
    `ranks` (on `hosts`): a machine computed one of the passes wrong, not the data (no quarantine;
    the update stays skipped). `first` and `replay`: each of those ranks' [loss, gradient norm]
    (its own, before the reduction) in the step and in its replay (monitor.replay)."""

    type: ClassVar[str] = "machine_fault"
    ranks: list[int]
    hosts: list[str]
    first: list[list[float]]
    replay: list[list[float]]


@dataclass(frozen=True, kw_only=True)
class ReplicaMismatch(Event):
    """At step `step` the weights every rank should hold alike differed: `ranks` (on `hosts`) hold
    a copy that is not the one the optimizer's fp32 master weights give (or, where those cannot be
    read, the minority's), in the parameters `tensors`. A machine fault: the run goes back to
    `rolled_back_to`, the newest checkpoint whose replicas were consistent (None: none was, and
    the job stops), and nothing is quarantined (monitor.consistency_every)."""

    type: ClassVar[str] = "replica_mismatch"
    ranks: list[int]
    hosts: list[str]
    tensors: list[str]
    rolled_back_to: str | None


@dataclass(frozen=True, kw_only=True)
class JobStopped(Event):
    """The supervisor gave up on the job: why, what was saved and how to go on."""

    type: ClassVar[str] = "job_stopped"
    saved: str | None
    why: str
    resume: str


@dataclass(frozen=True, kw_only=True)
class CheckpointCorrupt(Event):
    """A checkpoint failed verification and was moved aside."""

    type: ClassVar[str] = "checkpoint_corrupt"
    tag: str
    reason: str
    moved_to: str


@dataclass(frozen=True, kw_only=True)
class StopRequested(Event):
    """A rank was asked to stop (a signal, a lost supervisor); checkpoint `saved` holds the state."""

    type: ClassVar[str] = "stop_requested"
    saved: str
    requested_by: list


EVENT_TYPES: dict[str, type[Event]] = {
    kind.type: kind
    for kind in (
        StepJudged,
        WarningRaised,
        Anomaly,
        RollbackDecided,
        RollbackApplied,
        RollbackCancelled,
        UpdateSkipped,
        RepeatsStopped,
        LrLowered,
        LrRestored,
        CircuitBreaker,
        Restart,
        NodeLost,
        NodeExcluded,
        NodeReplaced,
        WorldResized,
        Straggler,
        MachineFault,
        ReplicaMismatch,
        JobStopped,
        CheckpointCorrupt,
        StopRequested,
    )
}


def append_event(run_dir: str | Path, event: Event, *, sync: bool = True) -> None:
    """events.jsonl: append-only, one JSON object per line with at least `type` and `step`.
    `sync`: fsync, for the rare events (rollbacks, restarts) that must survive a crash."""
    if not isinstance(event, Event):
        raise TypeError(f"an event must be a monitoring.protocol.Event, got {type(event).__name__}")
    with open(Path(run_dir) / EVENTS_FILE, "a") as f:
        f.write(json.dumps(strict_json(event.to_json()), allow_nan=False) + "\n")
        f.flush()
        if sync:
            os.fsync(f.fileno())


def read_events(run_dir: str | Path) -> list[Event]:
    """Every event of the run, in order (a torn last line, from a crash mid-write, is left out)."""
    path = Path(run_dir) / EVENTS_FILE
    if not path.is_file():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            payload = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(payload, dict):
            events.append(Event.from_json(payload))
    return events

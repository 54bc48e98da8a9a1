"""The text behind a window id: its corpus, its token range, the documents it holds and where each
came from (the document index `pretrain data prepare` writes), and the start of its text.

    provenance = Provenance(cfg.data.sources(), seq_len)
    provenance.window(1234)       # {"window", "source", "tokens", "documents": [...], "text"}
    provenance.documents([...])   # the distinct documents of many windows: {"source", "origin", "record"}

Window ids are the mixture's (pretrain/data/mixture.py): the data trace, rollback events and the
quarantine name windows by them. Used by `pretrain data inspect`, by rollbacks (their events carry
the anomalous step's documents) and by the quarantine.

`injected_at` says which loss faults were injected into a step (pretrain/stability/faults.py): a spike there
is the injection's, not its documents', and `pretrain data inspect` says so before naming them.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from pretrain.data.mixture import MixtureStream
from pretrain.data.shards import DocumentIndex
from pretrain.errors import UserError
from pretrain.run_dir import FIRED_FILE
from pretrain.tokenizer import Tokenizer, load_run_tokenizer

TEXT_CHARS = 160  # of a window's text shown
# The faults injected into a step's loss (pretrain/stability/faults.py), in the order FaultInjector picks the
# one a step gets: the setting that asks for it, its factor's setting, what it is called, what it scales.
LOSS_FAULTS = {
    "nan": ("faults.nan_steps", None, "the NaN loss", None),
    "spike": ("faults.spike_steps", "faults.spike_factor", "the loss spike", "the loss"),
    "grad_spike": (
        "faults.grad_spike_steps",
        "faults.grad_spike_factor",
        "the gradient spike",
        "the gradients",
    ),
}


class Provenance:
    def __init__(
        self, sources: list[tuple[str, str | Path, float]], seq_len: int, tokenizer: str | None = None
    ):
        self.mixture = MixtureStream(sources, seq_len)
        self.seq_len = seq_len
        self.named_tokenizer = (
            tokenizer  # the run's data.tokenizer; unset: each corpus's own, beside its shards
        )

    def window(self, window: int, text: bool = True) -> dict:
        """Where window `window` comes from: its corpus, its tokens [first, last) in the corpus's
        train split, the documents overlapping it, and (with `text`) the start of its text."""
        source, index = self.mixture.locate(window)
        stream = self.mixture.streams[source]
        shard, start = stream.locate(index)
        first = int(stream.shards.tokens[:shard].sum()) + start
        out = {
            "window": window,
            "source": self.mixture.names[source],
            "tokens": [first, first + self.seq_len + 1],
        }
        out["documents"] = self._index(source).overlapping(first, first + self.seq_len + 1)
        if text:
            out["text"] = self._tokenizer(source).decode(stream.read(index).tolist())[:TEXT_CHARS]
        return out

    def documents(self, windows: list[int]) -> list[dict]:
        """The distinct documents the windows hold, in the order they first appear."""
        seen, out = set(), []
        for window in windows:
            described = self.window(window, text=False)
            for doc in described["documents"]:
                key = (described["source"], doc["origin"], doc["record"])
                if key not in seen:
                    seen.add(key)
                    out.append({"source": key[0], "origin": key[1], "record": key[2]})
        return out

    @functools.cache  # noqa: B019 (one Provenance per run or command)
    def _index(self, source: int) -> DocumentIndex:
        stream = self.mixture.streams[source]
        return DocumentIndex(stream.shards.data_dir, "train", stream.shards.manifest)

    @functools.cache  # noqa: B019
    def _tokenizer(self, source: int) -> Tokenizer:
        return load_run_tokenizer(self.named_tokenizer, self.mixture.streams[source].shards.data_dir)


def documents_or_reason(provenance: Provenance | None, windows: list[int]) -> dict:
    """{"documents": [...]} for an event, or {"documents_unavailable": why} (a version 1 dataset,
    a damaged index): naming the documents must never stop a rollback."""
    if provenance is None:
        return {"documents_unavailable": "no data trace for that step"}
    try:
        return {"documents": provenance.documents(windows)}
    except (UserError, OSError, ValueError) as exc:
        return {"documents_unavailable": str(exc)}


def trained_at(run_dir: Path, step: int) -> list[dict]:
    """Each time step `step` was trained (a rollback or a restart trains it again): {"attempt",
    "windows": {rank: [ids]}} from RUN_DIR/data_trace/rank_*.jsonl, the first attempt first."""
    files = sorted((run_dir / "data_trace").glob("rank_*.jsonl"))
    if not files:
        raise UserError(
            f"{run_dir} has no data trace (data_trace/rank_*.jsonl): the run had logging.data_trace=false"
        )
    attempts: list[dict] = []
    for path in files:
        rank = int(path.stem.split("_")[1])
        lines = [line for line in path.read_text().splitlines() if f'"step": {step}' in line]
        records = [r for r in map(json.loads, lines) if r.get("step") == step]  # (a cheap filter first)
        for attempt, record in enumerate(records):
            while len(attempts) <= attempt:
                attempts.append({"attempt": len(attempts) + 1, "windows": {}})
            attempts[attempt]["windows"][rank] = [int(w) for w in record["windows"] if w is not None]
    return attempts


def injected_at(run_dir: Path, config: dict, step: int, attempts: int = 1) -> list[dict]:
    """The loss fault injected into step `step`, as [{"fault", "setting", "factor", "line"}] (or []):
    the one RUN_DIR/faults_fired.json records as fired there ("spike:45"); without that file (gone,
    or a run from before it), the one the run's recorded config (run.json's flat keys) asks for
    there. A fault fires once, the first time its step is trained: of `attempts` (a rollback or a
    restart trains the step again), the first."""
    try:
        fired = set(json.loads((run_dir / FIRED_FILE).read_text()))
        wanted = [fault for fault in LOSS_FAULTS if f"{fault}:{step}" in fired]
    except (OSError, ValueError, TypeError):
        wanted = [
            fault for fault, (setting, *_) in LOSS_FAULTS.items() if step in (config.get(setting) or [])
        ]
    if not wanted:
        return []
    fault = wanted[0]  # a step gets one loss fault
    setting, factor_key, called, scaled = LOSS_FAULTS[fault]
    factor = config.get(factor_key) if factor_key else None
    what = f"{setting}, {scaled} × {factor:g}" if factor is not None else setting
    first = ", in the first attempt" if attempts > 1 else ""
    line = f"step {step}: {called} was injected ({what}{first}): the documents below are not its cause"
    return [{"fault": fault, "setting": setting, "factor": factor, "line": line}]

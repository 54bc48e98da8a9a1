"""Checkpoints in the background (`checkpoint.async_save`): the loop waits only while the state is
copied off the training buffers; the files, their sha256 for the manifest, the weights digests and
the completion marker are written by a thread on each rank.

    in the loop, every rank     DeepSpeed's `save_checkpoint` runs as it always does (its barriers,
                                its tag check, its directories), through a checkpoint engine whose
                                `save` copies the state dict it is handed (`snapshot`) instead of
                                writing it; the RNG states and the tensors the weights digests read
                                are copied too. Each storage is copied to host memory once and views
                                stay views of the copy, so the file written later is the one a
                                synchronous save writes, byte for byte.
    thread, every rank          writes its files with DeepSpeed's own checkpoint engine, hashes them,
                                digests its weights, then records it all in .saved_rank_NNNNN.json
                                (or what went wrong); the copy is freed.
    thread, rank 0              waits for every rank's record, writes train_state.json (every rank's
                                weights digest in it), run_config.json and the tokenizer, then the
                                completion marker — its manifest takes each rank's hashes of its own
                                files and hashes the rest — then moves `latest` and applies retention.
    at the next wait            (Checkpointer.wait: the next save, a load for a rollback, the run's
                                last save — its end, a stop, SIGTERM) every rank waits for its own
                                files, the ranks agree (one all-reduce) whether any failed, rank 0
                                waits for the marker, and they agree on that too: a failed
                                background save counts against `checkpoint.save_retries` as a
                                synchronous one does, one save later.

So a checkpoint has its marker only once every rank's every byte is written and hashed; until then
nothing loads it, pins it, rolls back to it or names it in `latest` (they all go by the marker), and
a process killed meanwhile leaves the previous checkpoint the newest intact one. At most one save is
in flight: the next one waits for it. At the process's exit a save still in flight is finished
without the collectives: every rank writes its files, and rank 0 marks the checkpoint complete if
every rank's record comes within twice the time its own files took (plus 5 s): a rank that is gone
(the job failed) never writes one, and the checkpoint stays incomplete.

Why not DeepSpeed's or torch's own:
- DeepSpeed's DecoupledCheckpointEngine (`checkpoint.writer.decoupled` in its JSON) hands the live
  state dicts to a writer process, not a copy, so it must commit (wait for every file) before the
  next optimizer step changes them (`engine.step` calls `_commit_decoupled_checkpoint`): the loop
  still waits for whatever the writes take beyond one forward and backward pass, and nothing there
  hashes the files or writes our marker. Its FastCheckpointEngine writes faster (DeepNVMe), but in
  the loop. What this module takes from DeepSpeed is the interface: a `CheckpointEngine` whose
  `save` copies, with DeepSpeed's own engine writing the copies.
- torch.distributed.checkpoint.async_save stages to host memory and writes in a thread, but in its
  own format (.distcp shards and .metadata): resuming (DeepSpeed's `load_checkpoint`), the universal
  conversion, zero_to_fp32, export and the golden run's weight digests all read DeepSpeed's files.

The copy costs host memory: as much as the files this rank writes (its ZeRO optimizer shard, and
on rank 0 the model's weights), from the save until its files are written.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pretrain import atomic
from pretrain.checkpoint import layout, retention, rng

RECORD_PREFIX = ".saved_rank_"
POLL_SECONDS = 0.05


def record_file(rank: int) -> str:
    """What rank `rank` wrote of a background save (hidden: never part of the manifest)."""
    return f"{RECORD_PREFIX}{rank:05d}.json"


# ----------------------------------------------------------------------------- the copy


def snapshot(state, storages: dict | None = None):
    """A copy of `state` (dicts, lists, tuples, tensors, other picklable objects) that later changes
    to the training buffers do not reach. Every tensor storage is copied to host memory once
    (`storages`, shared between calls, maps each original storage to its copy), and a tensor
    becomes the same view of the copy, so what shared a storage still does and torch.save writes
    the same bytes. Every other object is deep-copied."""
    memo: dict[int, object] = {}
    _copy_tensors(state, {} if storages is None else storages, memo)
    return copy.deepcopy(state, memo)


def _copy_tensors(item, storages: dict, memo: dict) -> None:
    """The tensors in `item` into `memo` (id → copy), for deepcopy to take. (A module-level function:
    a recursive closure would be a reference cycle holding `memo`, and so every copy, until the
    cyclic garbage collector happened to run.)"""
    if torch.is_tensor(item):
        memo[id(item)] = copy_tensor(item, storages)
    elif isinstance(item, dict):
        for value in item.values():
            _copy_tensors(value, storages, memo)
    elif isinstance(item, list | tuple):
        for value in item:
            _copy_tensors(value, storages, memo)


def copy_tensor(tensor: torch.Tensor, storages: dict) -> torch.Tensor:
    """`tensor` as the same view of a host copy of its storage (copied once per storage)."""
    storage = tensor.untyped_storage()
    copied = storages.get(storage._cdata)
    if copied is None:
        copied = storage.clone() if storage.device.type == "cpu" else storage.cpu()
        storages[storage._cdata] = copied
    out = torch.empty(0, dtype=tensor.dtype).set_(
        copied, tensor.storage_offset(), tensor.size(), tensor.stride()
    )
    if tensor.requires_grad:
        out.requires_grad_(True)
    if isinstance(tensor, torch.nn.Parameter):
        out = torch.nn.Parameter(out, requires_grad=tensor.requires_grad)
    return out


def digest_of(tensors: list[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes, in order (`checkpointer.weights_digest`); hashed where they
    lie (a CPU tensor is not copied)."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def params_digest_of(named: list[tuple[str, torch.Tensor]]) -> str:
    """sha256 of named parameters as `checkpointer.params_digest` takes them (as fp32)."""
    digest = hashlib.sha256()
    for name, param in named:
        digest.update(name.encode())
        digest.update(param.detach().float().cpu().contiguous().view(-1).numpy())
    return digest.hexdigest()


_ENGINE_CLASS = None


def capturing_engine(inner, storages: dict):
    """A DeepSpeed checkpoint engine that copies each state dict DeepSpeed hands it (`captured`:
    (path, copy) pairs) and writes nothing; everything else is `inner`'s, the engine that writes
    the copies later."""
    global _ENGINE_CLASS
    if _ENGINE_CLASS is None:
        from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

        class CapturingEngine(CheckpointEngine):
            def __init__(self, inner, storages: dict):
                super().__init__(None)
                self.inner, self.storages = inner, storages
                self.name = f"capturing ({getattr(inner, 'name', None)})"
                self.captured: list[tuple[str, object]] = []

            def create(self, info) -> None:
                self.inner.create(info)

            def save(self, state_dict, path: str) -> None:
                self.captured.append((path, snapshot(state_dict, self.storages)))

            def makedirs(self, path, exist_ok=False) -> None:
                self.inner.makedirs(path, exist_ok=exist_ok)

            def load(self, path: str, map_location=None):
                return self.inner.load(path, map_location)

            def commit(self, info) -> bool:
                return True  # (the background writer's marker says when the files are ready)

            def is_data_parallel_writer(self, dp_rank) -> bool:
                return self.inner.is_data_parallel_writer(dp_rank)

            def preserves_storage_sharing(self) -> bool:
                return self.inner.preserves_storage_sharing()

        _ENGINE_CLASS = CapturingEngine
    return _ENGINE_CLASS(inner, storages)


def can_capture(engine) -> str | None:
    """None if `engine`'s saves can be copied in the loop and written later, else why not."""
    inner = getattr(engine, "checkpoint_engine", None)
    if inner is None or not hasattr(inner, "save"):
        return "the engine saves without a DeepSpeed checkpoint engine to copy through"
    if inner.is_decoupled():
        return "DeepSpeed's decoupled checkpoint writer is configured, which writes in its own process"
    return None


# ----------------------------------------------------------------------------- the save


@dataclass(kw_only=True)
class BackgroundSave:
    """One save in flight: what was copied in the loop, and the thread writing it."""

    directory: Path
    rank: int
    world_size: int
    step: int
    last: bool
    writer: object  # the DeepSpeed checkpoint engine that writes the copies (`save(state, path)`)
    captured: list  # (path, copied state dict)
    rng_state: dict
    held: list  # the copied tensors weights_digest reads
    params: list | None  # rank 0: the copied (name, parameter) pairs params_digest reads (None: ZeRO-3)
    storages: dict  # every copied storage (freed, in place, once the files are written)
    main_files: dict  # rank 0: train_state.json's content but the digests, run_config, tokenizer path
    pause: float = 0.0  # faults.slow_save_step: seconds to pause after the first file
    started: float = field(default_factory=time.perf_counter)  # as the save began, in the loop
    copied_in: float = 0.0  # seconds the loop spent copying
    wrote_in: float = 0.0  # seconds this rank's thread took for its files
    problem: str | None = None  # this rank's files could not be written
    outcome: str | None = None  # rank 0: the checkpoint could not be completed
    written: threading.Event = field(default_factory=threading.Event)  # this rank's part is done
    abort: threading.Event = field(default_factory=threading.Event)  # rank 0: stop waiting for records
    thread: threading.Thread | None = None

    @property
    def tag(self) -> str:
        return self.directory.name

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name=f"checkpoint-{self.tag}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        lowest_priority()
        began = time.perf_counter()
        try:
            self.problem = self._write_own()
        except BaseException as exc:  # (never out of the thread unrecorded)
            self.problem = failure(exc)
        finally:
            for held in (self.captured, self.held, self.params or [], self.storages):
                held.clear()  # free the copy (in place: whatever else still holds these)
            self.wrote_in = time.perf_counter() - began
            self.written.set()
        if self.rank != 0 or self.problem is not None:
            return
        try:
            self.outcome = self._complete()
        except BaseException as exc:
            self.outcome = failure(exc)

    def _write_own(self) -> str | None:
        """Every rank: its files, their hashes and its weights digest, recorded in its record
        file; what went wrong, or None."""
        record: dict = {}
        try:
            written = []
            for index, (path, state) in enumerate(self.captured):
                self.writer.save(state, path)
                written.append(Path(path))
                if index == 0:
                    self._pause()
            if not self.captured:
                self._pause()
            rng_path = self.directory / rng.rng_file(self.rank)
            atomic.write_json(rng_path, self.rng_state)
            written.append(rng_path)
            record["files"] = {str(p.relative_to(self.directory)): layout.file_entry(p) for p in written}
            record["weights_sha256"] = digest_of(self.held)
            if self.rank == 0:
                record["params_sha256"] = None if self.params is None else params_digest_of(self.params)
        except Exception as exc:  # (torch reports a full disk as a RuntimeError)
            record = {"problem": failure(exc)}
        atomic.write_json(self.directory / record_file(self.rank), record)
        return record.get("problem")

    def _pause(self) -> None:
        if self.pause > 0:
            if self.rank == 0:
                say(f"faults: pausing the save of {self.tag} for {self.pause:g} s (faults.slow_save_step)")
            time.sleep(self.pause)

    def _complete(self) -> str | None:
        """Rank 0, once every rank's record is there: our files, the marker, `latest`, retention."""
        records = self._records()
        if records is None:
            return "another rank's write failed"
        for rank, record in enumerate(records):
            if "problem" in record:
                return record["problem"] if rank == 0 else f"rank {rank}: {record['problem']}"
        train_state = dict(self.main_files["train_state"])
        train_state["params_sha256"] = records[0]["params_sha256"]
        train_state["weights_sha256"] = [record["weights_sha256"] for record in records]
        atomic.write_json(self.directory / layout.TRAIN_STATE, train_state)
        atomic.write_json(self.directory / layout.RUN_CONFIG, self.main_files["run_config"])
        shutil.copyfile(self.main_files["tokenizer"], self.directory / self.main_files["tokenizer_name"])
        hashed = {name: entry for record in records for name, entry in record["files"].items()}
        info = {"tag": self.tag, "step": self.step, "world_size": self.world_size}
        layout.mark_complete(self.directory, info, hashed)
        run_dir = self.directory.parent.parent
        layout.set_latest(run_dir, self.tag)
        retention.apply_retention(run_dir, self.main_files["keep"])
        for rank in range(self.world_size):
            (self.directory / record_file(rank)).unlink(missing_ok=True)
        if self.main_files.get("mirror") is not None:  # checkpoint.mirror: uploaded by its own thread
            self.main_files["mirror"].submit(self.tag)
        if not self.last:
            say(
                f"checkpoint {self.tag} saved in the background (training waited {self.copied_in:.2f} s "
                f"to copy it; complete {time.perf_counter() - self.started:.1f} s after the save began)"
            )
        return None

    def _records(self) -> list[dict] | None:
        """Rank 0: every rank's record, in rank order, once all are written; None if told to stop
        waiting (a rank failed before it could write one)."""
        records: dict[int, dict] = {}
        while len(records) < self.world_size:
            for rank in range(self.world_size):
                path = self.directory / record_file(rank)
                if rank not in records and path.is_file():
                    records[rank] = json.loads(path.read_text())
            if len(records) < self.world_size and self.abort.wait(POLL_SECONDS):
                return None
        return [records[rank] for rank in range(self.world_size)]


def lowest_priority() -> None:
    """This thread at nice 19 (Linux sets it per thread): where training keeps every host core
    busy (a CPU run), the writer takes what training leaves, rather than slowing its steps."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def failure(exc: BaseException) -> str:
    """What went wrong, in one line: an OS error's own words, else the exception's first line."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def say(line: str) -> None:
    print(line, file=sys.stdout, flush=True)

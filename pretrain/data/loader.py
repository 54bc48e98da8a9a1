"""Micro-batches from a WindowStream or MixtureStream, assembled ahead of time so the accelerator never waits.

A background thread stacks `batch_size` windows into (B, seq_len + 1) tensors (pinned when the
target is a CUDA device) and keeps up to `prefetch` of them ready; the consumer splits each into
inputs and targets and copies them with `non_blocking=True`. The loader's state is the stream
state as of the last batch handed out, not of the batches prefetched, so a checkpoint resumes
exactly where training was.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import torch

from pretrain.data.mixture import MixtureStream
from pretrain.data.stream import WindowStream

_DONE = object()


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, T) → (B, T): the index of each token's document within its window. The token after an
    EOS starts a document; the EOS itself ends the one before."""
    eos = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(eos, dim=1, dtype=torch.int32) - eos


class BatchLoader:
    def __init__(
        self,
        stream: WindowStream | MixtureStream,
        batch_size: int,
        device: torch.device | str = "cpu",
        prefetch: int = 4,
    ):
        self.stream, self.batch_size, self.device = stream, batch_size, torch.device(device)
        self.pin = self.device.type == "cuda"
        self.prefetch = prefetch
        self._state = stream.state_dict()
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.last_windows: list[int | None] = []  # window indices of the last batch handed out

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._thread is None:
            self._start()
        item = self._queue.get()
        if item is _DONE:
            self._thread = None
            raise StopIteration
        if isinstance(item, BaseException):
            self._thread.join()  # it has put its last item
            self._thread = None
            # The thread had read ahead of the batches handed out: rewind, so a retry loses nothing.
            if self.stream.shuffle:
                self.stream.load_state_dict(self._state)
            raise item
        batch, self._state, self.last_windows = item
        batch = batch.to(self.device, non_blocking=self.pin)
        return batch[:, :-1], batch[:, 1:]  # inputs, targets: (B, seq_len) each

    def _start(self) -> None:
        self._stop.clear()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(target=self._produce, name="batch-prefetch", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            windows = iter(self.stream)
            while not self._stop.is_set():
                rows, read = [], []
                for _ in range(self.batch_size):
                    rows.append(next(windows, None))
                    read.append(self.stream.last_window)
                ids = read if self.stream.shuffle else [None] * len(read)
                if rows[-1] is None:  # a finite (validation) pass ran out: drop the partial batch
                    break
                batch = torch.stack(rows)
                if int(batch.max()) >= self.stream.vocab_size:  # one reduction per batch
                    row = int(torch.nonzero(batch.amax(dim=1) >= self.stream.vocab_size)[0, 0])
                    self.stream.check_ids(read[row], batch[row])
                if self.pin:
                    batch = batch.pin_memory()
                item = (batch, self.stream.state_dict() if self.stream.shuffle else None, ids)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
            self._queue.put(_DONE)
        except BaseException as exc:  # handed to the consumer, raised there
            self._queue.put(exc)

    def close(self) -> None:
        """Stop prefetching; the stream is left where the last handed-out batch left it."""
        if self._thread is not None:
            self._stop.set()
            while self._thread.is_alive():
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    self._thread.join(timeout=0.05)
            self._thread = None
        if self.stream.shuffle:
            self.stream.load_state_dict(self._state)

    def reshuffle(self, seed: int) -> None:
        """Serve the rest of the epoch, from the last batch handed out, in an order keyed by `seed`
        (see WindowStream.reshuffle); the prefetched batches are dropped."""
        self.close()  # leaves the stream at the last batch handed out
        self.stream.reshuffle(seed)
        self._state = self.stream.state_dict()

    def quarantine(self, entries) -> None:
        """Never serve these (window id, epoch) in that epoch (see MixtureStream.quarantine), from
        the last batch handed out on; the prefetched batches are dropped."""
        self.close()
        self.stream.quarantine(entries)
        self._state = self.stream.state_dict()

    def state_dict(self) -> dict:
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.stream.load_state_dict(state)
        self._state = self.stream.state_dict()

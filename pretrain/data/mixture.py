"""MixtureStream: windows from several prepared corpora, interleaved by weight, in an order that
does not depend on the number of ranks.

Sources. Each source is a WindowStream of one rank (its own keyed order and its own epochs, so a
small source repeats, upsampled, while a large one is still in its first epoch). Source i's window
j has the global id offset_i + j, where offset_i counts the windows of the sources before it: ids
name a window of the mixture in the data trace, `pretrain data inspect` and the quarantine.

Interleaving. Global position g (0, 1, 2, ...) takes its window from the source with the largest
deficit (g + 1)·w_i − served_i (ties: the source listed first), where w_i are the normalized
weights and served_i counts the windows source i has given so far. The rule is deterministic and
needs no table; over every prefix of n windows, |served_i − n·w_i| < 1 for each source (checked by
the unit tests for up to 6 sources and random weights).

Ranks. Positions are dealt in rounds of world_size: rank r takes position round·W + r. Every rank
walks the whole round (cheap: a few integer operations per position; only its own window is read),
so the state after each window is the same on every rank and means the same thing at any world
size: a 2-process run and a 1-process run consume the same windows in the same global order.

Quarantine. `quarantine([(id, epoch), ...])` marks windows that must not be served in that epoch of
their source: when one comes up it is passed over (its source moves on; the deficit rule counts
only windows served). Entries of epochs already over are dropped.

State. {"seed", "served", "sources": {name: {"served", "stream": WindowStream state}},
"quarantine": [[id, epoch], ...]}: small JSON, identical on every rank at a step boundary.
A mixture of one source keys its stream with the run seed itself and its state is that stream's
state (plus "quarantine" when one is set), so `data.dir` runs keep the order and the checkpoint
state they had before mixtures existed.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pretrain.config.schema import check_mixture
from pretrain.data.stream import WindowStream
from pretrain.data.views import local_dataset
from pretrain.errors import UserError


def source_seed(seed: int, name: str, sources: int) -> int:
    """The seed of one source's order: the run's seed for a mixture of one, else a digest of both."""
    if sources == 1:
        return operator.index(seed)
    digest = hashlib.blake2b(repr((operator.index(seed), name)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def check_sources(
    sources: list[tuple[str, str | Path, float]],
    cache_dir: str | Path | None = None,
    cache_gib: float | None = None,
) -> list[tuple[str, Path, float]]:
    """The sources as the stream keeps them, once `pretrain.config.check_mixture` (the run config's
    own check of `data.mixture`) finds nothing wrong with them: a URL becomes its local view in the
    cache (`storage.local_dataset`)."""
    check_mixture(sources, error=UserError)
    return [
        (name, local_dataset(directory, cache_dir, cache_gib), float(weight))
        for name, directory, weight in sources
    ]


class MixtureStream:
    shuffle = True  # (the BatchLoader asks: a training stream, with state)

    def __init__(
        self,
        sources: list[tuple[str, str | Path, float]],
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        *,
        cache_dir: str | Path | None = None,
        cache_gib: float | None = None,
    ):
        """`cache_dir`, `cache_gib`: where sources given as URLs are cached, and its bound
        (`data.cache_dir`, `data.cache_gib`)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        checked = check_sources(sources, cache_dir, cache_gib)
        self.names = [name for name, _, _ in checked]
        total = sum(weight for _, _, weight in checked)
        self.weights = [weight / total for _, _, weight in checked]
        self.seq_len, self.rank, self.world_size = seq_len, rank, world_size
        self._seed = operator.index(seed)
        self.streams = [
            WindowStream(directory, seq_len, seed=source_seed(self._seed, name, len(checked)))
            for name, directory, _ in checked
        ]
        tokenizers = {s.shards.manifest["tokenizer"]["sha256"] for s in self.streams}
        if len(tokenizers) > 1:
            shas = ", ".join(
                f"{n}: {s.shards.manifest['tokenizer']['sha256'][:12]}…"
                for n, s in zip(self.names, self.streams, strict=True)
            )
            raise UserError(
                f"the mixture's sources were prepared with different tokenizers ({shas}): "
                "prepare every source with the same tokenizer"
            )
        self.vocab_size = self.streams[0].vocab_size
        sizes = [s.num_windows for s in self.streams]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_windows = int(self.offsets[-1])
        self._served = 0  # global positions dealt so far (all ranks)
        self._counts = [0] * len(self.streams)  # of them, windows from each source
        self._quarantine: set[tuple[int, int]] = set()
        self.last_window: int | None = None  # global id of the window `next()` served last
        self.last_round: list[tuple[int, int]] = []  # (id, source epoch) of each rank's window, last round

    # ----------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        self.last_round = [self._draw() for _ in range(self.world_size)]
        self.last_window = self.last_round[self.rank][0]
        return self.read(self.last_window)

    def _draw(self) -> tuple[int, int]:
        """The next global position's window: (id, epoch of its source)."""
        g = self._served + 1
        i = max(range(len(self.weights)), key=lambda j: (g * self.weights[j] - self._counts[j], -j))
        stream, offset = self.streams[i], int(self.offsets[i])
        while True:
            window = offset + stream.next_window()
            if (window, stream.last_epoch) not in self._quarantine:
                break
        self._counts[i] += 1
        self._served += 1
        return window, stream.last_epoch

    def locate(self, window: int) -> tuple[int, int]:
        """(source index, window index within the source) of global id `window`."""
        if not 0 <= window < self.num_windows:
            raise ValueError(f"window id {window} is not in [0, {self.num_windows})")
        source = int(np.searchsorted(self.offsets, window, side="right")) - 1
        return source, window - int(self.offsets[source])

    def read(self, window: int) -> torch.Tensor:
        source, index = self.locate(window)
        return self.streams[source].read(index)

    def check_ids(self, window: int, tokens: torch.Tensor) -> None:
        source, index = self.locate(window)
        self.streams[source].check_ids(index, tokens)

    def source_counts(self) -> dict[str, int]:
        """Windows of the global stream (all ranks together) each source has served since the run
        began: the same on every rank, restored on resume."""
        return dict(zip(self.names, self._counts, strict=True))

    def windows(self, count: int) -> list[tuple[int, int]]:
        """The next `count` global positions' (id, epoch), without moving this stream: what the
        ranks will read, all of them."""
        state = self.state_dict()
        try:
            return [self._draw() for _ in range(count)]
        finally:
            self.load_state_dict(state)

    # ----------------------------------------------------------------- quarantine

    def quarantine(self, entries) -> None:
        """Never serve window `id` in epoch `epoch` of its source, for each (id, epoch)."""
        for window, epoch in entries:
            self.locate(int(window))  # an id of this mixture
            self._quarantine.add((int(window), int(epoch)))
        self._drop_expired()

    def quarantined(self) -> list[list[int]]:
        return [list(entry) for entry in sorted(self._quarantine)]

    def _drop_expired(self) -> None:
        epochs = [s.state_dict()["epoch"] for s in self.streams]
        self._quarantine = {(w, e) for w, e in self._quarantine if e >= epochs[self.locate(w)[0]]}

    # ----------------------------------------------------------------- state

    def state_dict(self) -> dict:
        """JSON-serializable; identical on every rank after each window; world-size independent."""
        self._drop_expired()
        # One corpus: the WindowStream's own state (the stream-state contract of docs/architecture.md).
        if len(self.streams) == 1:
            state = self.streams[0].state_dict()
            return state | ({"quarantine": self.quarantined()} if self._quarantine else {})
        return {
            "seed": self._seed,
            "served": self._served,
            "sources": {
                name: {"served": count, "stream": stream.state_dict()}
                for name, count, stream in zip(self.names, self._counts, self.streams, strict=True)
            },
            "quarantine": self.quarantined(),
        }

    def load_state_dict(self, state: dict) -> None:
        if "fingerprint" in state and len(self.streams) == 1:  # a WindowStream's state (data.dir runs)
            state = self._from_window_state(state)
        if not isinstance(state, dict) or not {"seed", "served", "sources", "quarantine"} <= set(state):
            raise UserError(
                "the data state was not written by MixtureStream.state_dict(): resume from another checkpoint"
            )
        if sorted(state["sources"]) != sorted(self.names):
            raise UserError(
                f"the data state holds sources {sorted(state['sources'])}, this run mixes {sorted(self.names)}: "
                "resume with the sources the run was trained on (or start a new run)"
            )
        for stream, name in zip(self.streams, self.names, strict=True):
            stream.load_state_dict(state["sources"][name]["stream"])
        self._counts = [int(state["sources"][name]["served"]) for name in self.names]
        self._served = int(state["served"])
        self._seed = operator.index(state["seed"])
        self._quarantine = set()
        self.quarantine(state["quarantine"])

    def _from_window_state(self, state: dict) -> dict:
        # (with a quarantine, windows passed over count as served: one corpus has no shares to keep)
        served = int(state["epoch"]) * self.streams[0].num_windows + int(state["consumed"])
        return {
            "seed": state["seed"],
            "served": served,
            "quarantine": state.get("quarantine", []),
            "sources": {self.names[0]: {"served": served, "stream": state}},
        }

    def reshuffle(self, seed: int) -> None:
        """Serve the rest of each source's current epoch in a new order keyed by `seed` (none lost,
        none repeated) and key later epochs by it. Call on every rank at the same step boundary."""
        self._seed = operator.index(seed)
        for stream, name in zip(self.streams, self.names, strict=True):
            stream.reshuffle(source_seed(self._seed, name, len(self.streams)))

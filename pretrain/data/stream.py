"""WindowStream: windows of seq_len + 1 tokens from memory-mapped shards, in a keyed order that
does not depend on the number of ranks.

Windows. Shard s holds floor((tokens_s - 1) / seq_len) windows; window j of a shard covers tokens
[j·seq_len, j·seq_len + seq_len + 1), so consecutive windows share one token (the last target of
one is the first input of the next) and a window may cross document boundaries. The windows of
all shards are numbered 0..N-1.

Order. Training epochs are a keyed bijection of [0, N) (pretrain.data.permutation), keyed by
(seed, epoch): no permutation is ever stored. The global stream is epoch 0's order, then epoch
1's, and so on; global position G goes to rank G mod world_size. So every window is served once
per epoch across all ranks, each rank's share of any world_size-aligned batch is disjoint, and
the ranks of a W-process run together consume exactly the windows, in the same global order, of
a 1-process run.

State. {fingerprint, seq_len, seed, epoch, consumed, epoch_seeds}: `consumed` counts global
windows of the current epoch, so the state is the same on every rank and means the same thing
at any world size. `reshuffle(seed)` re-keys the rest of the current epoch: the windows not yet
consumed are served in a new order, none lost and none repeated (each reshuffle adds one
[start, seed] pair to `epoch_seeds`); later epochs use the new seed.

Seeds may be any integer type (np.int64 included): they are keyed, and stored in the state, as
plain ints, so the order and the JSON state do not depend on the type.

The validation split is served in file order, one pass per `iter()`, each rank taking every
world_size-th window (the last N mod world_size windows are left out so ranks stay in step);
`next()` on a validation stream itself is a TypeError.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pretrain.data.permutation import permute, round_keys
from pretrain.data.shards import ShardSet, fingerprint, windows_per_shard
from pretrain.data.storage import describe
from pretrain.data.views import local_dataset
from pretrain.errors import DataError, UserError

BLOCK = 1024  # window indices computed per vectorized batch


class WindowStream:
    def __init__(
        self,
        data_dir: str | Path,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        split: str = "train",
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if seq_len < 1:
            raise ValueError(f"seq_len {seq_len} must be positive")
        data_dir = local_dataset(data_dir)  # (a URL: its view, in the default cache)
        self.shards = ShardSet.open(data_dir, split)
        self.seq_len, self.rank, self.world_size, self.split = seq_len, rank, world_size, split
        self.fingerprint = fingerprint(self.shards.manifest)
        self.vocab_size = int(self.shards.manifest["tokenizer"]["vocab_size"])  # every id must be below it
        per_shard = windows_per_shard(self.shards.tokens, seq_len)
        self._shard_starts = np.concatenate([[0], np.cumsum(per_shard)]).astype(np.int64)
        self.num_windows = int(self._shard_starts[-1])
        if self.num_windows < world_size:
            total = int(self.shards.tokens.sum())
            raise UserError(
                f"the {split} split of {describe(data_dir)} has {total} tokens: {self.num_windows} windows of "
                f"{seq_len + 1} tokens, fewer than the {world_size} ranks; lower data.seq_len or add data"
            )
        self.shuffle = split == "train"
        seed = operator.index(seed)  # a plain int: np.int64(3) would not serialize to JSON
        # Anchor: the global state at the last (re)start; `_local` windows yielded by this rank since.
        self._seed = seed
        self._epoch = 0
        self._consumed = 0
        self._epoch_seeds: list[tuple[int, int]] = [(0, seed)]
        self._local = 0
        self._block: np.ndarray | None = None  # window indices for local counts [_block_at, _block_at + len)
        self._block_at = 0
        self.last_window: int | None = None  # index of the window __next__ served last
        self.last_epoch: int | None = None  # and the epoch it was served in

    # ----------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self.shuffle:
            return self
        return self._validation_pass()

    def __next__(self) -> torch.Tensor:
        if not self.shuffle:
            # It would silently serve the shuffled order: validation is a fixed pass.
            raise TypeError("the validation stream is iterated with iter(): one pass per call")
        return self.read(self.next_window())

    def next_window(self) -> int:
        """Advance like `next()`, without reading: the index of the window served (also
        `last_window`), whose epoch is `last_epoch`."""
        offset = self._local - self._block_at
        if self._block is None or offset >= len(self._block):
            self._fill_block()
            offset = self._local - self._block_at
        self.last_epoch = (
            self._epoch + (self._consumed + self.rank + self._local * self.world_size) // self.num_windows
        )
        self.last_window = int(self._block[offset])
        self._local += 1
        return self.last_window

    def read(self, window: int) -> torch.Tensor:
        """Window `window` (of N) as a 1-D int64 tensor of seq_len + 1 tokens."""
        shard, start = self.locate(window)
        tokens = self.shards.shard(shard)[start : start + self.seq_len + 1]
        return torch.from_numpy(tokens.astype(np.int64))

    def locate(self, window: int) -> tuple[int, int]:
        """(shard index, first token's offset in it) of window `window`."""
        shard = int(np.searchsorted(self._shard_starts, window, side="right")) - 1
        return shard, (window - int(self._shard_starts[shard])) * self.seq_len

    def check_ids(self, window: int, tokens: torch.Tensor) -> None:
        """Bad input, not a crash: ids at or above the vocabulary size mean a corrupt shard."""
        bad = torch.nonzero(tokens >= self.vocab_size)
        if len(bad):
            shard, start = self.locate(window)
            offset = start + int(bad[0, 0])
            raise DataError(
                f"{self.shards.files[shard]} holds token id {int(tokens[bad[0, 0]])} at token offset {offset}, "
                f"but the vocabulary has {self.vocab_size} pieces: the shard is corrupt; run "
                f"`pretrain data verify {describe(self.shards.data_dir)}` and prepare the dataset again"
            )

    def _validation_pass(self) -> Iterator[torch.Tensor]:
        per_rank = self.num_windows // self.world_size
        self.shards.prefetch(range(len(self.shards.tokens)))  # (file order: the pass reads them in turn)
        for k in range(per_rank):
            self.last_window = self.rank + k * self.world_size
            yield self.read(self.last_window)

    def _fill_block(self) -> None:
        self._reanchor()
        locals_ = self._local + np.arange(BLOCK, dtype=np.int64)
        positions = (
            self._consumed + self.rank + locals_ * self.world_size
        )  # global, may run into later epochs
        epochs_ahead, within = np.divmod(positions, self.num_windows)
        block = np.empty(BLOCK, dtype=np.int64)
        for ahead in np.unique(epochs_ahead):
            mask = epochs_ahead == ahead
            seeds = self._epoch_seeds if ahead == 0 else [(0, self._seed)]
            block[mask] = self._order(self._epoch + int(ahead), within[mask], seeds)
        self._block, self._block_at = block, self._local
        if self.shards.remote:  # the shards of these windows, in the order they are first needed
            shards = np.searchsorted(self._shard_starts, block, side="right") - 1
            _, first = np.unique(shards, return_index=True)
            self.shards.prefetch(shards[np.sort(first)])

    def _order(self, epoch: int, positions: np.ndarray, epoch_seeds: list[tuple[int, int]]) -> np.ndarray:
        """Window index at each position of `epoch` (the composition of its base order and reshuffles)."""
        n = self.num_windows
        g = positions.astype(np.int64)
        for start, seed in reversed(epoch_seeds[1:]):
            later = g >= start
            if later.any():
                g[later] = start + permute(
                    g[later] - start, n - start, round_keys("reshuffle", seed, epoch, start)
                )
        return permute(g, n, round_keys("epoch", epoch_seeds[0][1], epoch))

    def _reanchor(self) -> None:
        """Fold the windows yielded since the anchor into (epoch, consumed)."""
        total = self._consumed + self._local * self.world_size
        if total >= self.num_windows:
            self._epoch += total // self.num_windows
            self._consumed = total % self.num_windows
            self._epoch_seeds = [(0, self._seed)]
        else:
            self._consumed = total
        self._block_at -= self._local
        self._local = 0

    # ----------------------------------------------------------------- state

    def state_dict(self) -> dict:
        """JSON-serializable; identical on every rank at a step boundary; world-size independent."""
        self._reanchor()
        return {
            "fingerprint": self.fingerprint,
            "seq_len": self.seq_len,
            "seed": self._seed,
            "epoch": self._epoch,
            "consumed": self._consumed,
            "epoch_seeds": [list(pair) for pair in self._epoch_seeds],
        }

    def load_state_dict(self, state: dict) -> None:
        if not self.shuffle:
            raise ValueError(
                "the validation stream has no state: it starts from the beginning on every iter()"
            )
        missing = {"fingerprint", "seq_len", "seed", "epoch", "consumed", "epoch_seeds"} - set(state)
        if missing:
            raise UserError(
                f"stream state lacks {sorted(missing)}: it was not written by WindowStream.state_dict()"
            )
        if state["fingerprint"] != self.fingerprint:
            raise UserError(
                f"the stream state belongs to corpus {state['fingerprint']}, but {describe(self.shards.data_dir)} is corpus "
                f"{self.fingerprint}: resume with the data the run was trained on (or start a new run)"
            )
        if state["seq_len"] != self.seq_len:
            raise UserError(
                f"the stream state is for seq_len {state['seq_len']}, this stream uses {self.seq_len}: "
                "keep data.seq_len when resuming"
            )
        if not 0 <= state["consumed"] < self.num_windows or state["epoch"] < 0:
            raise UserError(
                f"stream state position epoch={state['epoch']} consumed={state['consumed']} is out of range"
            )
        seeds = [(int(start), operator.index(seed)) for start, seed in state["epoch_seeds"]]
        if not seeds or seeds[0][0] != 0 or any(a[0] >= b[0] for a, b in itertools.pairwise(seeds)):
            raise UserError("stream state 'epoch_seeds' must start at 0 and increase")
        self._seed, self._epoch, self._consumed = (
            operator.index(state["seed"]),
            int(state["epoch"]),
            int(state["consumed"]),
        )
        self._epoch_seeds = seeds
        self._local, self._block, self._block_at = 0, None, 0

    def reshuffle(self, seed: int) -> None:
        """Serve the rest of the current epoch in a new order keyed by `seed` (none lost, none repeated),
        and key later epochs by `seed`. Call on every rank at the same step boundary."""
        if not self.shuffle:
            raise ValueError("the validation stream is not shuffled")
        seed = operator.index(seed)
        self._reanchor()
        if self._consumed == 0:
            self._epoch_seeds = [(0, seed)]
        elif self._epoch_seeds[-1][0] == self._consumed:
            self._epoch_seeds[-1] = (self._consumed, seed)
        else:
            self._epoch_seeds.append((self._consumed, seed))
        self._seed = seed
        self._block = None

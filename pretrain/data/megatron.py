"""A corpus tokenized for Megatron-LM or GPT-NeoX (PREFIX.bin + PREFIX.idx) as a `data prepare` source.

`pretrain data prepare --source PREFIX --format megatron` converts the ids into our shards as they
are: nothing is detokenized or tokenized again. The memory-mapped index their `preprocess_data.py`
writes (Megatron-LM's megatron/core/datasets/indexed_dataset.py, GPT-NeoX's
megatron/data/indexed_dataset.py), all little-endian:

    9 bytes   b"MMIDIDX\\x00\\x00"
    uint64    version, 1
    uint8     the token dtype's code (DTYPES)
    uint64    S, the number of sequences
    uint64    D, the number of document boundaries (documents + 1)
    int32[S]  each sequence's length in tokens
    int64[S]  each sequence's byte offset in PREFIX.bin (the lengths' running sum × the dtype's size)
    int64[D]  document boundaries: 0, then the index of the sequence after each document's last
              (Megatron's `document_indices`: document d is sequences [idx[d], idx[d + 1]))
    (int8[S]  sequence modes: only in a multimodal dataset, which is refused here)

PREFIX.bin is the sequences' tokens back to back. A document is its sequences (the sentences, with
--split-sentences) concatenated. Each document becomes one of ours: its ids, then EOS, exactly as
`prepare` writes a text document; one that already ends with EOS (written with --append-eod) gets no
second one. A document without tokens, or holding only EOS, is blank text: it is skipped and counted
(`stats.skipped_blank_documents`), and the hold-out counts the documents kept, as for text. Each
document's origin is `megatron:PREFIX` (resolved) and its record the document's index in that
prefix's index, counting skipped ones, so `pretrain data inspect` names it.

Dtype codes 6 and 7 are the two floats, swapped between the projects (Megatron-LM: 6 float64,
7 float32; GPT-NeoX today: 6 float32, 7 float64; its older code wrote float64 under both): the size
of PREFIX.bin against the index's token count says which. Float ids must be whole numbers.

Every refusal (a missing half of the pair, a bad header, an unknown version or dtype code, an index
or .bin whose size does not match the header's counts, pointers or boundaries out of order, an id
outside the vocabulary) is a UserError naming the file and what to do; the structure is checked
when the source is opened, before anything is written, and ids as they are converted (`prepare`
removes its staging directory then).
"""

from __future__ import annotations

import glob
import hashlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from pretrain.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
OLD_MAGIC = b"TNTIDX\x00\x00"  # Megatron's older "lazy"/"cached" index: not memory-mapped, not read here
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document boundaries: 34 bytes
DTYPES = {
    1: np.dtype("u1"),
    2: np.dtype("i1"),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f8"),  # Megatron-LM; GPT-NeoX: float32 (see FLOAT_CODES)
    7: np.dtype("<f4"),  # Megatron-LM; GPT-NeoX: float64
    8: np.dtype("<u2"),
}
FLOAT_CODES = (6, 7)
DTYPE_NAMES = ", ".join(f"{code} {dtype.name}" for code, dtype in DTYPES.items())
CHECK_ROWS = 1 << 22  # index rows checked at a time: memory stays flat for any index
BATCH_TOKENS = 1 << 22  # tokens converted at a time
BATCH_DOCS = 1 << 15
SUFFIXES = (".bin", ".idx")
REDO = "copy the pair again, or write it again with preprocess_data.py"


@dataclass
class IndexedDataset:
    """One PREFIX.bin + PREFIX.idx, checked when opened (header, sizes, pointers, boundaries)."""

    prefix: Path
    code: int = field(init=False)
    dtype: np.dtype = field(init=False)
    sequences: int = field(init=False)
    documents: int = field(init=False)  # Megatron's documents: the boundaries less one
    tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.prefix = Path(self.prefix)
        self.bin, self.idx = (Path(f"{self.prefix}{suffix}") for suffix in SUFFIXES)
        self._check_pair()
        with open(self.idx, "rb") as f:
            head = f.read(HEADER.size)
        if head.startswith(OLD_MAGIC):
            raise UserError(
                f"{self.idx} is Megatron's older 'lazy'/'cached' index (TNTIDX), not the memory-mapped one "
                "(MMIDIDX): write it again with preprocess_data.py --dataset-impl mmap"
            )
        if not head.startswith(MAGIC):
            if MAGIC.startswith(head):
                raise UserError(f"{self.idx} is truncated ({len(head)} bytes, no header): {REDO}")
            raise UserError(
                f"{self.idx} is not a Megatron indexed dataset index (it starts {head[:9]!r}, not {MAGIC!r}): "
                "pass the prefix of a .bin/.idx pair written by Megatron-LM's or GPT-NeoX's preprocess_data.py"
            )
        if len(head) < HEADER.size:
            raise UserError(
                f"{self.idx} is truncated ({len(head)} bytes, shorter than the {HEADER.size}-byte header): {REDO}"
            )
        _, version, self.code, self.sequences, boundaries = HEADER.unpack(head)
        if version != VERSION:
            raise UserError(
                f"{self.idx} has index version {version}; this reader knows version {VERSION} (Megatron-LM, "
                "GPT-NeoX): write it again with a current preprocess_data.py"
            )
        if self.code not in DTYPES:
            raise UserError(
                f"{self.idx} has token dtype code {self.code}, not one the format defines ({DTYPE_NAMES}): "
                f"the header is damaged; {REDO}"
            )
        if boundaries == 0:
            raise UserError(f"{self.idx} has no document boundaries (not even the first, 0): {REDO}")
        self.documents = boundaries - 1
        self._check_index_size(boundaries)
        self.lengths = self._array(HEADER.size, "<i4", self.sequences)
        self.pointers = self._array(HEADER.size + 4 * self.sequences, "<i8", self.sequences)
        self.boundaries = self._array(HEADER.size + 12 * self.sequences, "<i8", boundaries)
        self.dtype, end = self._dtype_and_end()
        self.tokens = end // self.dtype.itemsize
        size = self.bin.stat().st_size
        if size != end:
            what = "truncated" if size < end else "longer than its index says"
            raise UserError(
                f"{self.bin} holds {size:,} bytes, {self.idx.name} says {self.tokens:,} tokens of "
                f"{self.dtype.name} ({end:,} bytes): the .bin is {what}, or the two are not one pair; {REDO}"
            )
        self._check_boundaries()
        self._file = None

    @property
    def origin(self) -> str:
        return f"megatron:{self.prefix.resolve()}"

    def _check_pair(self) -> None:
        missing = [path for path in (self.bin, self.idx) if not path.is_file()]
        if len(missing) == 2:
            raise UserError(
                f"{self.prefix}: neither {self.bin.name} nor {self.idx.name} exists: pass the prefix a Megatron "
                "dataset's .bin and .idx share (e.g. data/corpus_text_document)"
            )
        if missing:
            other = self.idx if missing[0] == self.bin else self.bin
            raise UserError(
                f"{missing[0]} is missing beside {other}: a Megatron dataset is the pair; copy both"
            )

    def _check_index_size(self, boundaries: int) -> None:
        need = HEADER.size + 12 * self.sequences + 8 * boundaries
        size = self.idx.stat().st_size
        if size == need + self.sequences and self.sequences:
            raise UserError(
                f"{self.idx} holds sequence modes (a multimodal dataset): only text token datasets are read"
            )
        if size != need:
            what = "truncated" if size < need else "longer than its header says (damaged)"
            raise UserError(
                f"{self.idx} holds {size:,} bytes, its header's {self.sequences:,} sequences and "
                f"{boundaries:,} document boundaries need {need:,}: it is {what}; {REDO}"
            )

    def _dtype_and_end(self) -> tuple[np.dtype, int]:
        """The token dtype and where PREFIX.bin ends by the index. For a float code, the float whose
        size the pointers (or, where they cannot tell, the .bin's size) agree with."""
        dtype = DTYPES[self.code]
        if self.code not in FLOAT_CODES:
            return dtype, self._pointers_end(dtype.itemsize)
        found, refused = [], None
        for candidate in (dtype, np.dtype("<f4" if dtype.itemsize == 8 else "<f8")):
            try:
                found.append((candidate, self._pointers_end(candidate.itemsize)))
            except UserError as exc:
                refused = refused or exc
        if not found:
            raise refused
        size = self.bin.stat().st_size
        return next((pair for pair in found if pair[1] == size), found[0])

    def _array(self, offset: int, dtype: str, count: int) -> np.ndarray:
        if count == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(self.idx, dtype=dtype, mode="r", offset=offset, shape=(count,))

    def _pointers_end(self, itemsize: int) -> int:
        """Sequence i starts where i - 1 ends, the first at 0: where the last one ends, in bytes."""
        position = 0
        for start in range(0, self.sequences, CHECK_ROWS):
            lengths = np.asarray(self.lengths[start : start + CHECK_ROWS], dtype=np.int64)
            pointers = np.asarray(self.pointers[start : start + CHECK_ROWS])
            if (lengths < 0).any():
                row = start + int(np.argmax(lengths < 0))
                raise UserError(
                    f"{self.idx}: sequence {row:,} has a negative length: the index is damaged; {REDO}"
                )
            expected = position + np.concatenate([[0], np.cumsum(lengths[:-1] * itemsize)])
            if (pointers != expected).any():
                row = int(np.argmax(pointers != expected))
                raise UserError(
                    f"{self.idx}: sequence {start + row:,} starts at byte {int(pointers[row]):,} of "
                    f"{self.bin.name}, where the lengths before it put it at {int(expected[row]):,}: "
                    f"the index is damaged; {REDO}"
                )
            position = int(expected[-1] + lengths[-1] * itemsize)
        return position

    def _check_boundaries(self) -> None:
        """0 first, never decreasing, the sequence count last."""
        b = self.boundaries
        if int(b[0]) != 0 or int(b[-1]) != self.sequences:
            raise UserError(
                f"{self.idx}: the document boundaries run from {int(b[0]):,} to {int(b[-1]):,}, not from 0 to the "
                f"{self.sequences:,} sequences: the index is damaged; {REDO}"
            )
        for start in range(0, len(b) - 1, CHECK_ROWS):
            part = np.asarray(b[start : start + CHECK_ROWS + 1])
            if (np.diff(part) < 0).any():
                row = start + int(np.argmax(np.diff(part) < 0))
                raise UserError(
                    f"{self.idx}: document {row:,} ends before it starts (boundaries out of order): "
                    f"the index is damaged; {REDO}"
                )

    def document_starts(self, first: int, last: int) -> np.ndarray:
        """The token offset in PREFIX.bin of documents first..last (last may be `documents`: the end)."""
        sequences = np.asarray(self.boundaries[first : last + 1])
        if self.sequences == 0:
            return np.zeros(len(sequences), dtype=np.int64)
        pointers = np.asarray(self.pointers[np.minimum(sequences, self.sequences - 1)])
        return np.where(sequences < self.sequences, pointers // self.dtype.itemsize, self.tokens)

    def read(self, start: int, end: int) -> np.ndarray:
        """Tokens [start, end) of PREFIX.bin, in the file's dtype (read, not mapped: the memory a
        conversion holds is its batch, whatever the file's size)."""
        if end <= start:
            return np.zeros(0, dtype=self.dtype)
        if self._file is None:
            self._file = open(self.bin, "rb")  # noqa: SIM115 (closed in close())
        self._file.seek(start * self.dtype.itemsize)
        tokens = np.fromfile(self._file, dtype=self.dtype, count=end - start)
        if len(tokens) != end - start:  # the file changed since it was checked
            raise UserError(f"{self.bin} ended at token {start + len(tokens):,}, before {end:,}: {REDO}")
        return tokens

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def dataset_prefixes(specs: list[str]) -> list[Path]:
    """The prefixes `--source` names: PREFIX, PREFIX.bin or PREFIX.idx, a glob of those, or a
    directory (every pair in it), in order, each glob's and directory's sorted."""
    prefixes: list[Path] = []
    for spec in specs:
        if glob.has_magic(spec) or Path(spec).is_dir():
            pattern = str(Path(spec) / "*") if Path(spec).is_dir() else spec
            found = {
                _strip(p) for p in glob.glob(pattern) + glob.glob(pattern + ".idx") if p.endswith(SUFFIXES)
            }
            if not found:
                raise UserError(f"no Megatron dataset (.bin + .idx) matches {spec!r}: check the path")
            prefixes += [Path(p) for p in sorted(found)]
        else:
            prefixes.append(Path(_strip(spec)))
    return prefixes


def _strip(path: str) -> str:
    return path[: -len(".bin")] if path.endswith(SUFFIXES) else path


@dataclass
class MegatronSource:
    """Megatron indexed datasets, in order; `prepare` takes it where it takes a `Source`."""

    datasets: list[IndexedDataset]
    kind: str = "megatron"
    text_field: None = None  # (the recipe's: ids have no text field)

    @property
    def description(self) -> str:
        return "megatron:" + ",".join(str(d.prefix.resolve()) for d in self.datasets)

    @property
    def files(self) -> list[Path]:
        return [path for d in self.datasets for path in (d.bin, d.idx)]

    @property
    def documents(self) -> int:
        return sum(d.documents for d in self.datasets)

    def stat_digest(self) -> str:
        """Each file's resolved path, size and mtime_ns: the recipe changes when either file does."""
        digest = hashlib.sha256()
        for path in self.files:
            stat = path.stat()
            digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        return digest.hexdigest()


def resolve_megatron_source(specs: list[str] | str) -> MegatronSource:
    """Open (and check) every dataset `--source` names, before anything is written."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    if not specs:
        raise UserError("no source given: pass --source PREFIX (of PREFIX.bin + PREFIX.idx)")
    return MegatronSource([IndexedDataset(prefix) for prefix in dataset_prefixes(specs)])


# --------------------------------------------------------------------------- conversion


class Converted(NamedTuple):
    """What `prepare`'s writing loop reads of a batch: per text, its split and origin."""

    held_out: list[bool]
    origins: list[tuple[int, int] | None]  # (origin index, record) where a document starts


def converted(
    source: MegatronSource, tokenizer, val_fraction: float, stats: dict, origins: dict[str, int]
) -> Iterator[tuple[tuple, Converted]]:
    """(train tokens, validation tokens, #train docs, #validation docs, tokens of each text) and the
    batch's splits and origins, as `prepare`'s tokenizing step yields them, straight from the ids."""
    from pretrain.data.shards import token_dtype

    out = _Output(tokenizer.eos_id, tokenizer.vocab_size, token_dtype(tokenizer.vocab_size), val_fraction)
    stats.setdefault("skipped_blank_documents", 0)
    stats.setdefault("documents_ending_in_eos", 0)
    for dataset in source.datasets:
        try:
            yield from _converted_dataset(
                dataset, origins.setdefault(dataset.origin, len(origins)), out, stats
            )
        finally:
            dataset.close()


def _converted_dataset(dataset: IndexedDataset, where: int, out: _Output, stats: dict) -> Iterator:
    first = 0
    while first < dataset.documents:
        starts = dataset.document_starts(first, min(first + BATCH_DOCS, dataset.documents))
        # Documents up to BATCH_TOKENS tokens in all; at least one (a longer one goes in pieces).
        count = max(int(np.searchsorted(starts, starts[0] + BATCH_TOKENS, side="right")) - 1, 1)
        starts = starts[: count + 1]
        if starts[-1] - starts[0] > BATCH_TOKENS:
            yield from out.long_document(dataset, where, first, int(starts[0]), int(starts[1]), stats)
        else:
            yield out.documents(dataset, where, first, starts, stats)
        first += count


@dataclass
class _Output:
    eos: int
    vocab_size: int
    dtype: np.dtype
    val_fraction: float
    kept: int = 0  # documents kept so far: the hold-out counts them, as for text

    def _held_out(self, count: int) -> np.ndarray:
        index = self.kept + np.arange(count, dtype=np.int64)
        self.kept += count
        return np.floor((index + 1) * self.val_fraction) > np.floor(index * self.val_fraction)

    def _checked(
        self, dataset: IndexedDataset, raw: np.ndarray, start: int, first: int, starts
    ) -> np.ndarray:
        """`raw` (tokens from `start` in PREFIX.bin) as our dtype; an id that is negative, not whole, or
        not below the vocabulary size is refused, naming its document."""
        bad = None
        if raw.dtype.kind == "f":
            with np.errstate(invalid="ignore"):  # NaN and infinities: refused just below
                ids = raw.astype(np.int64)
            wrong = ~(ids == raw)  # NaN, infinities and fractions
            if wrong.any():
                bad = int(np.argmax(wrong))
        else:
            ids = raw
        if len(ids) and (int(ids.max()) >= self.vocab_size or (ids.dtype.kind == "i" and int(ids.min()) < 0)):
            outside = (ids >= self.vocab_size) | (ids < 0)
            position = int(np.argmax(outside))
            bad = position if bad is None else min(bad, position)
        if bad is not None:
            doc = first + int(np.searchsorted(starts, start + bad, side="right")) - 1
            offset = start + bad - int(starts[doc - first])
            raise UserError(
                f"{dataset.bin}: document {doc:,} holds id {raw[bad].item()!r} at token {offset:,}, not a whole "
                f"number from 0 to below the vocabulary size {self.vocab_size:,} of the tokenizer: pass --tokenizer "
                "the tokenizer whose vocabulary the ids came from"
            )
        return ids.astype(self.dtype)

    def documents(self, dataset: IndexedDataset, where: int, first: int, starts: np.ndarray, stats: dict):
        raw = dataset.read(int(starts[0]), int(starts[-1]))
        tokens = self._checked(dataset, raw, int(starts[0]), first, starts)
        lengths = np.diff(starts)
        last = tokens[np.maximum(starts[1:] - starts[0] - 1, 0)] if len(tokens) else np.zeros(len(lengths))
        has_eos = (lengths > 0) & (last == self.eos)
        keep = (lengths > 0) & ~((lengths == 1) & has_eos)  # blank: no tokens, or EOS alone
        stats["skipped_blank_documents"] += int((~keep).sum())
        stats["documents_ending_in_eos"] += int((keep & has_eos).sum())
        body = tokens[np.repeat(keep, lengths)]
        kept_lengths, need_eos = lengths[keep], ~has_eos[keep]
        body = np.insert(body, np.cumsum(kept_lengths)[need_eos], self.eos)
        out_lengths = kept_lengths + need_eos
        held = self._held_out(len(out_lengths))
        in_val = np.repeat(held, out_lengths)
        result = (body[~in_val], body[in_val], int((~held).sum()), int(held.sum()), out_lengths.tolist())
        records = (first + np.flatnonzero(keep)).tolist()
        return result, Converted(held.tolist(), [(where, record) for record in records])

    def long_document(self, dataset: IndexedDataset, where: int, doc: int, start: int, end: int, stats: dict):
        """One document longer than BATCH_TOKENS, in pieces (the first carries its origin)."""
        held = bool(self._held_out(1)[0])
        last = self._checked(dataset, dataset.read(end - 1, end), end - 1, doc, np.array([start]))
        has_eos = int(last[0]) == self.eos
        stats["documents_ending_in_eos"] += int(has_eos)
        for piece in range(start, end, BATCH_TOKENS):
            tokens = self._checked(
                dataset, dataset.read(piece, min(piece + BATCH_TOKENS, end)), piece, doc, [start]
            )
            final = piece + BATCH_TOKENS >= end
            if final and not has_eos:
                tokens = np.append(tokens, np.array([self.eos], dtype=self.dtype))
            empty = np.zeros(0, dtype=self.dtype)
            split = (empty, tokens) if held else (tokens, empty)
            counts = (0, int(final)) if held else (int(final), 0)
            origin = (where, doc) if piece == start else None
            yield (*split, *counts, [len(tokens)]), Converted([held], [origin])

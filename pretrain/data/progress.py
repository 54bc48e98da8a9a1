"""How `pretrain data prepare` shows how far it is: in a terminal, a bar over the corpus's
documents (count, percentage, rate, ETA) with the tokens so far; elsewhere (a log file, CI, a
batch job) plain lines, one per stage and one per tenth of the corpus (or per minute when its size
is unknown), so a log tells the same story without carriage returns.

The total is counted before tokenizing where that is cheap: a text file is one document, a JSON
Lines file one per non-blank line (compressed: decompressed to count), a Parquet file the rows its
footer records, an empty file none. A JSON array file or a Hub dataset has no cheap count: the bar
then shows counts and rates without a percentage.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from pretrain.data.sources import (
    PARQUET_SUFFIXES,
    TEXT_SUFFIXES,
    Source,
    content_suffix,
    decompression_errors,
    open_file,
)

LINE_EVERY_SECONDS = 60.0


def count_documents(source: Source) -> int | None:
    """The number of records `source.records()` yields, or None when it cannot be known cheaply."""
    if source.kind != "files":
        return None
    total, empty = 0, set(source.empty_files)
    for path in source.files:
        if path in empty:
            continue
        suffix = content_suffix(path)
        if suffix in TEXT_SUFFIXES:
            total += 1
        elif suffix == ".jsonl":
            try:
                total += _non_blank_lines(path)
            except decompression_errors():  # damaged past the part checked: reading it says so, in one line
                return None
        elif suffix in PARQUET_SUFFIXES:
            import pyarrow.parquet as pq

            total += pq.ParquetFile(path).metadata.num_rows
        else:
            return None
    return total


def _non_blank_lines(path) -> int:
    count = 0
    with open_file(path) as f:
        for line in f:
            count += bool(line.strip())
    return count


class Progress:
    """Documents read and tokens written while a corpus is tokenized (or, already token ids, as a
    Megatron corpus is, converted: `converting=True`)."""

    def __init__(
        self, total: int | None, enabled: bool = True, stream: TextIO | None = None, converting: bool = False
    ):
        self.total, self.enabled = total, enabled
        self.doing, self.done = ("converting", "converted") if converting else ("tokenizing", "tokenized")
        self.stream = stream or sys.stderr
        self.documents = self.tokens = 0
        self.started = time.monotonic()
        self._next_line_at = self.started + LINE_EVERY_SECONDS
        self._next_tenth = 1
        self.bar = None
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            large = total is None or total >= 10_000  # 12.3k docs; below that, exact counts
            self.bar = tqdm(
                desc=self.doing,
                total=total,
                unit="doc",
                unit_scale=large,
                file=self.stream,
                dynamic_ncols=True,
            )
        elif enabled:
            size = f"{total:,} documents" if total is not None else "documents (count unknown)"
            self._line(f"{self.doing} {size}")

    def wrote(self, tokens: int, documents: int) -> None:
        """A batch written: its tokens and the documents it finished. Counted here, not as
        documents are read: the workers' read-ahead (2 batches per worker) had the first line say
        54% of a corpus of 206 large documents before any was tokenized."""
        self.tokens += tokens
        self.documents += documents
        if self.bar is not None:
            self.bar.update(documents)
            self.bar.set_postfix_str(f"{self.tokens:,} tokens", refresh=False)
        elif self.enabled:
            self._maybe_line()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            elapsed = time.monotonic() - self.started
            self._line(
                f"{self.done} {self.documents:,} documents into {self.tokens:,} tokens in {elapsed:.1f} s"
            )

    def _maybe_line(self) -> None:
        now = time.monotonic()
        if self.total:
            if self.documents * 10 < self._next_tenth * self.total or self.documents >= self.total:
                return
            self._next_tenth = self.documents * 10 // self.total + 1
            rate = self.documents / max(now - self.started, 1e-9)
            left = (self.total - self.documents) / max(rate, 1e-9)
            self._line(
                f"{self.doing}: {100 * self.documents // self.total}% ({self.documents:,} of "
                f"{self.total:,} documents, {self.tokens:,} tokens, {_clock(left)} left)"
            )
        elif now >= self._next_line_at:
            self._next_line_at = now + LINE_EVERY_SECONDS
            self._line(f"{self.doing}: {self.documents:,} documents, {self.tokens:,} tokens")

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"

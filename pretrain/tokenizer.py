"""SentencePiece tokenizers: training with byte fallback, loading, and the fixed special ids.

Every tokenizer this project trains has the same special ids, so code never has to ask:

    unk = 0   bos = 1   eos = 2   pad = 3

Byte fallback is on, so any UTF-8 text encodes and nothing maps to unk. Normalization is the
identity (no NFKC, whitespace kept as written), so decode(encode(text)) == text for any string.
No dummy prefix ("▁") is put before each encoded text, so the encodings of consecutive pieces of a
text, concatenated, decode to the text: `prepare` relies on that to tokenize huge documents in pieces.
Training reads sentences (non-empty lines) from an iterator and samples at most
`sample_sentences` of them, so corpora larger than memory work.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

from pretrain import atomic
from pretrain.errors import UserError

SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}
MODEL_FILE = "tokenizer.model"
META_FILE = "tokenizer_meta.json"
MIN_VOCAB_SIZE = 320  # 4 specials + 256 byte pieces + some room for merges
MAX_SENTENCE_BYTES = 16384  # longer lines are cut into pieces of this size for training


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Tokenizer:
    """A loaded SentencePiece model plus what the rest of the project needs to know about it."""

    processor: spm.SentencePieceProcessor
    path: Path
    sha256: str

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Load from a tokenizer directory or a `tokenizer.model` file."""
        path = Path(path)
        model = path / MODEL_FILE if path.is_dir() else path
        if not model.is_file():
            raise UserError(
                f"no tokenizer at {path}: expected {MODEL_FILE} (train one with `pretrain tokenizer train`)"
            )
        processor = spm.SentencePieceProcessor()
        try:
            processor.load(str(model))
        except (OSError, RuntimeError):
            raise UserError(
                f"{model} is not a SentencePiece model: retrain it with `pretrain tokenizer train`"
            ) from None
        return cls(processor=processor, path=model, sha256=sha256_file(model))

    @property
    def vocab_size(self) -> int:
        return self.processor.get_piece_size()

    @property
    def eos_id(self) -> int:
        return self.processor.eos_id()

    @property
    def bos_id(self) -> int:
        return self.processor.bos_id()

    @property
    def pad_id(self) -> int:
        return self.processor.pad_id()

    @property
    def adds_dummy_prefix(self) -> bool:
        """True for models trained before add_dummy_prefix=False (each encode starts with "▁")."""
        return self.decode(self.encode("a") * 2) != "aa"

    def encode(self, text: str) -> list[int]:
        return self.processor.encode(text)

    def encode_batch(self, texts: list[str], threads: int = 1) -> list[list[int]]:
        """One thread by default: callers that want parallelism run several processes."""
        return self.processor.encode(texts, num_threads=threads)

    def encode_document(self, text: str) -> list[int]:
        """EOS, then the text. `prepare` ends every document with EOS, so in training EOS means "a
        new document starts here": prompts, probes and fine-tuning examples start the same way."""
        return [self.eos_id, *self.encode(text)]

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        return [[self.eos_id, *ids] for ids in self.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.processor.decode(list(ids))

    def meta(self) -> dict:
        return {
            "vocab_size": self.vocab_size,
            "special_ids": {name: getattr(self.processor, name)() for name in SPECIAL_IDS},
            "sha256": self.sha256,
        }


def training_sentences(documents: Iterable[str]) -> Iterator[str]:
    """Non-empty lines of each document, long ones cut to MAX_SENTENCE_BYTES (SentencePiece skips longer)."""
    for doc in documents:
        for line in doc.split("\n"):
            if not line.strip():
                continue
            data = line.encode("utf-8", errors="replace")
            if len(data) <= MAX_SENTENCE_BYTES:
                yield line
                continue
            for start in range(0, len(data), MAX_SENTENCE_BYTES):
                yield data[start : start + MAX_SENTENCE_BYTES].decode("utf-8", errors="ignore")


def train_tokenizer(
    documents: Iterable[str],
    out_dir: str | Path,
    vocab_size: int,
    model_type: str = "bpe",
    sample_sentences: int = 2_000_000,
) -> Tokenizer:
    """Train a SentencePiece model on `documents`; write tokenizer.model + tokenizer_meta.json."""
    if model_type not in ("bpe", "unigram"):
        raise UserError(f"--model-type {model_type!r}: choose bpe or unigram")
    if vocab_size < MIN_VOCAB_SIZE:
        raise UserError(
            f"--vocab-size {vocab_size} is too small: byte fallback needs at least {MIN_VOCAB_SIZE}"
        )
    out_dir = Path(out_dir)
    sentences = training_sentences(documents)
    first = next(sentences, None)
    if first is None:
        raise UserError("the tokenizer corpus is empty: no non-blank text was found in the input")
    model = io.BytesIO()

    def all_sentences() -> Iterator[str]:
        yield first
        yield from sentences

    spm.set_random_generator_seed(0)  # the sentence sample, and so the tokenizer, is reproducible
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=all_sentences(),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,  # any UTF-8 encodes; nothing becomes unk
            character_coverage=0.9995,  # rarer characters fall back to bytes
            normalization_rule_name="identity",  # decode(encode(x)) == x
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,  # encode(a) + encode(b) decodes to a + b (see the module docstring)
            allow_whitespace_only_pieces=True,  # indentation in code becomes few tokens
            split_digits=True,
            input_sentence_size=sample_sentences,  # reservoir-sample this many sentences
            shuffle_input_sentence=True,
            max_sentence_length=MAX_SENTENCE_BYTES,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
            **SPECIAL_IDS,
        )
    except RuntimeError as exc:
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else "training failed"
        if "Vocabulary size" in message or "vocab_size" in message:
            limit = re.search(r"<= ?(\d+)", message)
            at_most = f" to at most {limit.group(1)}" if limit else ""
            raise UserError(
                f"--vocab-size {vocab_size} is too large for this corpus: lower it{at_most}"
            ) from None
        raise UserError(f"SentencePiece training failed: {message}") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes(out_dir / MODEL_FILE, model.getvalue())
    tokenizer = Tokenizer.load(out_dir)
    atomic.write_json(out_dir / META_FILE, tokenizer.meta() | {"model_type": model_type})
    return tokenizer


def train_tokenizer_on(
    specs: list[str],
    out_dir: str | Path,
    vocab_size: int,
    model_type: str = "bpe",
    sample_sentences: int = 2_000_000,
    text_field: str = "text",
    overwrite: bool = False,
    announce=print,
) -> Tokenizer:
    """`pretrain tokenizer train`: a tokenizer trained on sources (files, globs, a Hub dataset,
    builtin:pydoc); an existing one in `out_dir` is replaced only with `overwrite`."""
    from pretrain.data.sources import resolve_source

    out_dir = Path(out_dir)
    if (out_dir / MODEL_FILE).exists() and not overwrite:
        raise UserError(f"{out_dir / MODEL_FILE} exists: choose another --out, or pass --overwrite")
    source = resolve_source(specs, text_field=text_field)
    announce(f"training a {model_type} tokenizer of {vocab_size} pieces on {source.description}")
    return train_tokenizer(source.documents(), out_dir, vocab_size, model_type, sample_sentences)

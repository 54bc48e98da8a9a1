"""Tokenizers: SentencePiece models trained here, and any Hugging Face `tokenizer.json`.

Every SentencePiece tokenizer this project trains has the same special ids, so code never has to ask:

    unk = 0   bos = 1   eos = 2   pad = 3

Byte fallback is on, so any UTF-8 text encodes and nothing maps to unk. Normalization is the
identity (no NFKC, whitespace kept as written), so decode(encode(text)) == text for any string.
No dummy prefix ("▁") is put before each encoded text, so the encodings of consecutive pieces of a
text, concatenated, decode to the text: `prepare` relies on that to tokenize huge documents in pieces.
Training reads sentences (non-empty lines) from an iterator and samples at most
`sample_sentences` of them, so corpora larger than memory work.

A Hugging Face tokenizer (a `tokenizer.json` the `tokenizers` library saved: GPT-2's, GPT-NeoX's,
Llama 3's, or one trained with that library) is used as it is, through that library: its ids are
`encode(text, add_special_tokens=False)`'s (our documents start with EOS instead of the tokenizer's
post-processor template), with two settings of ours: special tokens written in a text are text
(`encode_special_tokens`, as "</s>" is to our SentencePiece models and as transformers'
`split_special_tokens` does), and the file's own truncation and padding are off. Its special
tokens come, for each of eos/bos/pad, from the first of: the caller (`data prepare --eos-token`
...); beside a file named tokenizer.json, our tokenizer_meta.json (written wherever we copy one:
beside shards, into checkpoints), a tokenizer_config.json or special_tokens_map.json, a model's
config.json (ids); the file's post-processor (a template's token before the text is bos, after it
eos); a well-known name among its added tokens (KNOWN_TOKENS); for eos, its only special token.
Without an EOS the tokenizer is refused: every document ends with one.

Where a tokenizer is named by a directory, tokenizer.model is taken when present (a Hugging Face
Llama directory often holds both), else tokenizer.json. A prepared dataset and a checkpoint keep a
copy of the file under that name (and, for a tokenizer.json, tokenizer_meta.json with its special
tokens); its sha256 is the file's.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sentencepiece as spm

from pretrain import atomic
from pretrain.errors import UserError

SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}
MODEL_FILE = "tokenizer.model"  # a SentencePiece model
HF_FILE = "tokenizer.json"  # a Hugging Face tokenizer (the `tokenizers` library's format)
TOKENIZER_FILES = (MODEL_FILE, HF_FILE)  # in a directory, the first one present is its tokenizer
META_FILE = "tokenizer_meta.json"
MIN_VOCAB_SIZE = 320  # 4 specials + 256 byte pieces + some room for merges
MAX_SENTENCE_BYTES = 16384  # longer lines are cut into pieces of this size for training

ROLES = ("eos", "bos", "pad")
NAMED = "named"  # (where a special token came from: the caller)  # the special tokens a Hugging Face tokenizer is asked for
# Well-known names of each role among a tokenizer.json's added tokens, in the order they are tried.
KNOWN_TOKENS = {
    "eos": ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]"),
    "bos": ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "<|bos|>", "[BOS]"),
    "pad": ("<pad>", "<|pad|>", "<|padding|>", "[PAD]", "<|finetune_right_pad_id|>"),
}
# Files beside a tokenizer.json that may name its special tokens (HF_CONFIG_FILES) or their ids.
HF_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
MODEL_CONFIG_FILE = "config.json"


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _is_json(path: Path) -> bool:
    """A tokenizer.json, by name or content (a SentencePiece model is a binary protobuf)."""
    if path.suffix.lower() == ".json":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(64).lstrip().startswith(b"{")
    except OSError:  # (a copy of a missing file fails where it is made, as it always did)
        return False


def find_tokenizer_file(path: str | Path) -> Path:
    """The tokenizer file `path` names: itself, or in a directory tokenizer.model, else tokenizer.json."""
    path = Path(path)
    if path.is_dir():
        for name in TOKENIZER_FILES:
            if (path / name).is_file():
                return path / name
    elif path.is_file():
        return path
    raise UserError(
        f"no tokenizer at {path}: expected {MODEL_FILE} (SentencePiece: train one with `pretrain tokenizer "
        f"train`) or a Hugging Face {HF_FILE}, or a directory holding one"
    )


def stored_name(path: str | Path) -> str:
    """The name a copy of this tokenizer file takes beside shards and in checkpoints."""
    return HF_FILE if _is_json(Path(path)) else MODEL_FILE


def tokenizer_in(data_dir: str | Path) -> Path:
    """The tokenizer file of a prepared dataset (its manifest says which; older ones: tokenizer.model)."""
    data_dir = Path(data_dir)
    try:
        name = json.loads((data_dir / "manifest.json").read_text())["tokenizer"].get("file", MODEL_FILE)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        name = (
            HF_FILE if not (data_dir / MODEL_FILE).exists() and (data_dir / HF_FILE).is_file() else MODEL_FILE
        )
    return data_dir / name


def run_tokenizer(named: str | Path | None, data_dir: str | Path) -> Path:
    """A run's tokenizer file: the one `data.tokenizer` names (a file, or a directory holding one),
    else the one prepared beside the shards in `data_dir`."""
    return find_tokenizer_file(named) if named else tokenizer_in(data_dir)


def run_special_tokens(path: str | Path, data_dir: str | Path) -> dict | None:
    """A Hugging Face tokenizer's special tokens as the shards in `data_dir` were made with (their
    manifest: read from the file or named at `data prepare`), whichever copy of it the run names;
    None for a SentencePiece model, whose special tokens are fixed."""
    if stored_name(path) != HF_FILE:
        return None
    try:
        tokens = json.loads((Path(data_dir) / "manifest.json").read_text()).get("tokenizer_special_tokens")
    except (OSError, ValueError, AttributeError):
        return None
    return tokens if isinstance(tokens, dict) else None


def load_run_tokenizer(named: str | Path | None, data_dir: str | Path) -> Tokenizer:
    """The run's tokenizer (`run_tokenizer`) with the special tokens its shards were made with."""
    path = run_tokenizer(named, data_dir)
    return Tokenizer.load(path, run_special_tokens(path, data_dir))


def check_beside(data_dir: str | Path, manifest: dict, named: str | Path | None = None) -> None:
    """The run's tokenizer (`data.tokenizer`, or the one beside the shards) must be the one the
    shards were made with."""
    if named:
        path = find_tokenizer_file(named)
        what, fix = f"data.tokenizer={named}", "name the tokenizer they were prepared with"
    else:
        path = Path(data_dir) / manifest["tokenizer"].get("file", MODEL_FILE)
        if not path.is_file():
            raise UserError(
                f"{path} is missing: prepare the dataset again (or name its tokenizer in data.tokenizer)"
            )
        what, fix = str(path), "restore it"
    digest = sha256_file(path)
    if digest != manifest["tokenizer"]["sha256"]:
        raise UserError(
            f"{what} is not the tokenizer the shards in {data_dir} were made with (sha256 {digest[:12]}…, "
            f"their manifest says {manifest['tokenizer']['sha256'][:12]}…): {fix}, or prepare the dataset "
            "again with this tokenizer"
        )


def copy_tokenizer(path: str | Path, directory: str | Path, special_tokens: dict | None = None) -> None:
    """Into a checkpoint: the tokenizer file under its usual name (`stored_name`), and
    `write_special_tokens`."""
    shutil.copyfile(path, Path(directory) / stored_name(path))
    write_special_tokens(path, directory, special_tokens)


def write_special_tokens(path: str | Path, directory: str | Path, special_tokens: dict | None = None) -> None:
    """Beside a copy of a Hugging Face tokenizer in `directory`: tokenizer_meta.json, the special
    tokens it is used with (`special_tokens`, else those read beside `path` or from the file).
    Nothing for a SentencePiece model (its checkpoints hold it alone, as always)."""
    path = Path(path)
    if stored_name(path) == HF_FILE:
        stat = path.stat()
        named = tuple(sorted((special_tokens or {}).items()))
        atomic.write_json(
            Path(directory) / META_FILE, _meta_of(str(path), stat.st_mtime_ns, stat.st_size, named)
        )


@functools.lru_cache(maxsize=8)
def _meta_of(path: str, mtime_ns: int, size: int, named: tuple) -> dict:  # (a changed file is read again)
    return Tokenizer.load(path, dict(named)).meta()


def _visible(text: str) -> str:
    """Whitespace that would be invisible in a label drawn as ↵ ⇥ ␍, and a blank label as ␣s."""
    text = text.replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍")
    return "␣" * len(text) if not text.strip(" ") else text


class Tokenizer:
    """A loaded tokenizer: a SentencePiece model (`SentencePieceTokenizer`) or a Hugging Face
    tokenizer.json (`HFTokenizer`), with what the rest of the project needs to know about it."""

    path: Path
    sha256: str
    kind: str = ""

    @classmethod
    def load(cls, path: str | Path, special_tokens: dict[str, str | None] | None = None) -> Tokenizer:
        """Load from a tokenizer directory, a `tokenizer.model` or a `tokenizer.json`.
        `special_tokens` ({"eos": "<|endoftext|>", ...}) names a Hugging Face tokenizer's special tokens."""
        named = {role: token for role, token in (special_tokens or {}).items() if token is not None}
        model = find_tokenizer_file(path)
        if _is_json(model):
            return HFTokenizer.from_file(model, named)
        if named:
            raise UserError(
                f"{', '.join(f'--{role}-token' for role in named)}: {model} is a SentencePiece model, whose "
                "special tokens are fixed; these name a Hugging Face tokenizer.json's"
            )
        return SentencePieceTokenizer.from_file(model)

    @property
    def file_name(self) -> str:
        """Its name beside shards and in checkpoints."""
        return MODEL_FILE

    @property
    def named_tokens(self) -> dict[str, str]:
        """The special tokens the caller named (`load(special_tokens=...)`)."""
        return {}

    @property
    def encodes_in_pieces(self) -> bool:
        """Whether the encodings of consecutive pieces of a text, concatenated, are the text's."""
        return False

    # The rest of the interface, each tokenizer's own:
    vocab_size: int
    eos_id: int
    bos_id: int  # -1: none
    pad_id: int  # -1: none

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str], threads: int = 1) -> list[list[int]]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def meta(self) -> dict:
        raise NotImplementedError

    def piece_labels(self, ids: Iterable[int]) -> list[str]:
        raise NotImplementedError

    def encode_document(self, text: str) -> list[int]:
        """EOS, then the text. `prepare` ends every document with EOS, so in training EOS means "a
        new document starts here": prompts, probes and fine-tuning examples start the same way."""
        return [self.eos_id, *self.encode(text)]

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        return [[self.eos_id, *ids] for ids in self.encode_batch(texts)]


@dataclass(frozen=True)
class SentencePieceTokenizer(Tokenizer):
    """A loaded SentencePiece model."""

    processor: spm.SentencePieceProcessor
    path: Path
    sha256: str
    kind: str = "sentencepiece"

    @classmethod
    def from_file(cls, model: Path) -> SentencePieceTokenizer:
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

    @property
    def encodes_in_pieces(self) -> bool:
        return not self.adds_dummy_prefix

    def encode(self, text: str) -> list[int]:
        return self.processor.encode(text)

    def encode_batch(self, texts: list[str], threads: int = 1) -> list[list[int]]:
        """One thread by default: callers that want parallelism run several processes."""
        return self.processor.encode(texts, num_threads=threads)

    def decode(self, ids: Iterable[int]) -> str:
        return self.processor.decode(list(ids))

    def meta(self) -> dict:
        return {
            "vocab_size": self.vocab_size,
            "special_ids": {name: getattr(self.processor, name)() for name in SPECIAL_IDS},
            "sha256": self.sha256,
        }

    def piece_labels(self, ids: Iterable[int]) -> list[str]:
        """One readable label per token: its piece with "▁" as a space, ASCII byte pieces as their
        character, and whitespace that would be invisible drawn as ↵ ⇥ ␣."""
        processor = self.processor
        labels = []
        for i in map(int, ids):
            piece = processor.id_to_piece(i)
            if processor.is_control(i) or processor.is_unknown(i):
                labels.append(piece)  # <s>, </s>, <pad>, <unk>
                continue
            if processor.is_byte(i):
                char = chr(int(piece[3:5], 16))  # "<0x0A>"
                if ord(char) >= 0x80 or not (char.isprintable() or char in "\n\t\r"):
                    labels.append(piece)  # part of a multi-byte character, or a control byte: shown as is
                    continue
                piece = char
            labels.append(_visible(piece.replace("▁", " ")))
        return labels


# --------------------------------------------------------------------------- Hugging Face


def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's bytes_to_unicode), character → byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_OF = _byte_decoder()


def _uses(component: Any, kind: str) -> bool:
    """Whether a tokenizer.json component (normalizer, decoder, ...) is or holds one of this type."""
    if isinstance(component, dict):
        return component.get("type") == kind or any(_uses(v, kind) for v in component.values())
    if isinstance(component, list):
        return any(_uses(v, kind) for v in component)
    return False


def _template_tokens(processor: Any) -> dict[str, str]:
    """bos/eos a post-processor adds around a single text: a template's first special token before
    the text and first after it; Roberta's and Bert's cls and sep."""
    if not isinstance(processor, dict):
        return {}
    kind = processor.get("type")
    if kind == "Sequence":
        found: dict[str, str] = {}
        for inner in processor.get("processors") or []:
            found = _template_tokens(inner) | found
        return found
    if kind in ("RobertaProcessing", "BertProcessing"):
        cls, sep = processor.get("cls"), processor.get("sep")
        return {
            role: value[0]
            for role, value in (("bos", cls), ("eos", sep))
            if isinstance(value, list) and value
        }
    if kind != "TemplateProcessing":
        return {}
    single = processor.get("single") or []
    texts = [i for i, part in enumerate(single) if "Sequence" in part]
    if not texts:
        return {}
    specials = [(i, part["SpecialToken"]["id"]) for i, part in enumerate(single) if "SpecialToken" in part]
    before = [token for i, token in specials if i < texts[0]]
    after = [token for i, token in specials if i > texts[-1]]
    return ({"bos": before[0]} if before else {}) | ({"eos": after[0]} if after else {})


def _token_name(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise UserError(f"{path} is not readable JSON: fix it or remove it") from None
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer.json, run by the `tokenizers` library."""

    backend: Any  # tokenizers.Tokenizer
    path: Path
    sha256: str
    size: int  # 1 + the largest id
    tokens: dict[str, str | None]  # the special token of each role (ROLES), or None
    named: dict[str, str] = field(default_factory=dict)  # those the caller named
    byte_level: bool = False  # a byte-level BPE (GPT-2's): tokens spell bytes
    unk_token: str | None = None  # the model's unknown token, if it has one
    kind: str = "huggingface"

    @classmethod
    def from_file(cls, path: Path, named: dict[str, str]) -> HFTokenizer:
        import tokenizers

        data = path.read_bytes()
        problem = None
        try:
            spec = json.loads(data)
            if not isinstance(spec, dict) or "model" not in spec:
                problem = "JSON without a tokenizer model"
            else:
                backend = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except ValueError as exc:  # (json's errors and UnicodeDecodeError)
            problem = f"not JSON: {exc}"
        except Exception as exc:  # the tokenizers library raises plain Exceptions
            problem = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if problem is not None:
            raise UserError(
                f"{path} is not a Hugging Face tokenizer.json ({problem}): pass a tokenizer.json the "
                "tokenizers library saved (tokenizer.save), or a directory holding one"
            )
        backend.no_truncation()  # the file's own truncation and padding would change our ids
        backend.no_padding()
        backend.encode_special_tokens = True  # "<|endoftext|>" in a text is text (see the module docstring)
        vocab = backend.get_vocab(with_added_tokens=True)
        if not vocab:
            raise UserError(f"{path} has an empty vocabulary: pass a trained tokenizer.json")
        tokens = _special_tokens(path, spec, backend, vocab, named)
        unk = spec["model"].get("unk_token") if isinstance(spec["model"], dict) else None
        return cls(
            backend=backend,
            path=path,
            sha256=hashlib.sha256(data).hexdigest(),
            size=max(vocab.values()) + 1,
            tokens=tokens,
            named=dict(named),
            byte_level=_uses(spec.get("decoder"), "ByteLevel"),
            unk_token=unk if isinstance(unk, str) and unk in vocab else None,
        )

    @property
    def file_name(self) -> str:
        return HF_FILE

    @property
    def named_tokens(self) -> dict[str, str]:
        return dict(self.named)

    def _id(self, role: str) -> int:
        token = self.tokens.get(role)
        return -1 if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.size

    @property
    def eos_id(self) -> int:
        return self._id("eos")

    @property
    def bos_id(self) -> int:
        return self._id("bos")

    @property
    def pad_id(self) -> int:
        return self._id("pad")

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], threads: int = 1) -> list[list[int]]:
        """The tokenizers library encodes a batch on its own threads (TOKENIZERS_PARALLELISM=false:
        one); `threads` is SentencePiece's."""
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode(list(map(int, ids)), skip_special_tokens=True)

    def meta(self) -> dict:
        return {
            "kind": self.kind,
            "file": HF_FILE,
            "vocab_size": self.vocab_size,
            "special_tokens": dict(self.tokens),
            "special_ids": {f"{role}_id": self._id(role) for role in ROLES},
            "sha256": self.sha256,
        }

    def piece_labels(self, ids: Iterable[int]) -> list[str]:
        """One readable label per token: its text (a byte-level token's bytes as UTF-8, a part of a
        character as <0xXX> bytes; "▁" as a space), special tokens as they are, whitespace visible."""
        specials = {token for token in self.tokens.values() if token is not None}
        specials |= {t.content for t in self.backend.get_added_tokens_decoder().values() if t.special}
        labels = []
        for i in map(int, ids):
            token = self.backend.id_to_token(i)
            if token is None or token in specials:
                labels.append(token if token is not None else f"<{i}>")
                continue
            if self.byte_level and all(c in BYTE_OF for c in token):
                raw = bytes(BYTE_OF[c] for c in token)
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    labels.append("".join(f"<0x{b:02X}>" for b in raw))
                    continue
            else:
                text = token.replace("▁", " ")
            labels.append(_visible(text))
        return labels


def _special_tokens(
    path: Path, spec: dict, backend, vocab: dict[str, int], named: dict[str, str]
) -> dict[str, str | None]:
    """The eos/bos/pad tokens of a tokenizer.json (see the module docstring); refused without an EOS."""
    unknown = [role for role in named if role not in ROLES]
    if unknown:
        raise UserError(f"special tokens {unknown}: name only {', '.join(ROLES)}")
    sources: list[tuple[str, dict[str, str]]] = [(NAMED, dict(named))]
    if path.name == HF_FILE:  # files beside it belong to it only when it has the usual name
        sources += _beside(path, backend)
    sources.append((f"{path}'s post-processor", _template_tokens(spec.get("post_processor"))))
    added = [t for t in spec.get("added_tokens") or [] if isinstance(t, dict) and t.get("content") in vocab]
    known = {}
    for role, names in KNOWN_TOKENS.items():
        found = [n for n in names if any(t["content"] == n for t in added)]
        if found:
            known[role] = found[0]
    sources.append((f"{path}'s added tokens", known))
    tokens: dict[str, str | None] = {}
    for role in ROLES:
        for where, offered in sources:
            token = offered.get(role)
            if token is None:
                continue
            if token not in vocab:
                raise UserError(
                    f"{f'--{role}-token' if where == NAMED else where}: {role} token {token!r} is not a token of {path}: name one "
                    "of its tokens"
                )
            tokens[role] = token
            break
        else:
            tokens[role] = None
    if tokens["eos"] is None:
        specials = [t["content"] for t in added if t.get("special")]
        others = [t for t in specials if t not in (tokens["bos"], tokens["pad"])]
        if len(others) == 1:
            tokens["eos"] = others[0]
    if tokens["eos"] is None:
        raise UserError(
            f"{path}: cannot tell which token ends a document (no eos_token beside it in a tokenizer_config.json, "
            "no end-of-text token in its post-processor or among its added tokens): name it with "
            "`pretrain data prepare --eos-token TOKEN`"
        )
    return tokens


def _beside(path: Path, backend) -> list[tuple[str, dict[str, str]]]:
    """What the files beside a tokenizer.json say its special tokens are, most specific first."""
    directory, found = path.parent, []
    meta = directory / META_FILE
    if meta.is_file():
        data = _read_json(meta)
        if data.get("kind") == "huggingface" and data.get("sha256") == sha256_file(path):
            tokens = data.get("special_tokens") or {}
            found.append((str(meta), {role: tokens.get(role) for role in ROLES if tokens.get(role)}))
    for name in HF_CONFIG_FILES:
        if (directory / name).is_file():
            data = _read_json(directory / name)
            offered = {role: _token_name(data.get(f"{role}_token")) for role in ROLES}
            found.append((str(directory / name), {r: t for r, t in offered.items() if t is not None}))
    if (directory / MODEL_CONFIG_FILE).is_file():
        data, offered = _read_json(directory / MODEL_CONFIG_FILE), {}
        for role in ROLES:
            value = data.get(f"{role}_token_id")
            value = value[0] if isinstance(value, list) and value else value
            if isinstance(value, int) and not isinstance(value, bool):
                token = backend.id_to_token(value)
                if token is not None:
                    offered[role] = token
        found.append((str(directory / MODEL_CONFIG_FILE), offered))
    return found


# --------------------------------------------------------------------------- training


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

"""`export-hf` directories against SentencePiece and our own commands: the tokenizer files give our
ids and text in transformers' AutoTokenizer and LlamaTokenizerFast, and `generate`, `eval` and
`attention` on an export equal the same commands on the model it came from."""

import io
import json
import pydoc_data.topics
import random
import re
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from pretrain.errors import UserError
from pretrain.evaluation.attention_maps import DATA_ELEMENT_ID, attention_maps, piece_labels
from pretrain.evaluation.inference import (
    EXPORT_RUN_CONFIG,
    Trained,
    export_trained,
    load_trained,
    perplexity,
    sample_text,
)
from pretrain.model.hf import save_hf, save_hf_tokenizer
from pretrain.tokenizer import SPECIAL_IDS, Tokenizer
from tests.conftest import random_weights_model

transformers = pytest.importorskip("transformers")  # in the `dev` extra; CI installs it

SEQ_LEN = 32  # the training window the stand-in checkpoint records
RUN_CONFIG = {"data": {"seq_len": SEQ_LEN, "document_masking": False}}
TOKENIZER_CLASSES = ["AutoTokenizer", "LlamaTokenizerFast"]


def varied_texts(seed: int = 0) -> list[str]:
    """A few hundred strings of every kind a tokenizer meets: prose, code (spaces and tabs),
    whitespace runs, leading and trailing whitespace, newlines, digits, CJK, emoji, accents (precomposed
    and combining), characters absent from the vocabulary (byte fallback), control characters,
    text that looks like special pieces, and the empty string."""
    rng = random.Random(seed)
    topics = pydoc_data.topics.topics
    prose = "\n\n".join(topics[k] for k in sorted(topics)[:40])
    code = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    texts = [""]
    for source, count in ((prose, 60), (code, 40), (code.replace("    ", "\t"), 30)):
        for _ in range(count):
            start = rng.randrange(len(source))
            texts.append(source[start : start + rng.randint(1, 300)])
    blanks = [" ", "  ", "\t", "\n", "\r\n", " \t", "\n\n\n", "\u3000", "\xa0"]
    for _ in range(40):
        word = rng.choice(["x", "def f():", "the list", "中文", "é"])
        texts.append(rng.choice(blanks) * rng.randint(1, 9) + word + rng.choice(blanks) * rng.randint(0, 9))
    unicode = [
        "日本語のテキスト",
        "中文分词测试",
        "한국어 문장",
        "Ελληνικά",
        "русский текст",
        "עברית",
        "العربية",
        "café naïve façade",
        "cafe\u0301 nai\u0308ve",
        "😀👍🏽👨‍👩‍👧 🇫🇷",
        "∑∫√∞ ≠ ≤",
        "Ωmega ☃ ♞ ✓",
    ]
    texts += unicode + [" ".join(rng.sample(unicode, 3)) for _ in range(20)]
    texts += [str(rng.randint(0, 10 ** rng.randint(1, 15))) for _ in range(15)]
    texts += ["3.14159", "1,000,000", "x = 0x1F + 1e-9", "2024-01-31T12:00:00Z"]
    rare = [chr(c) for c in (*range(0x2C00, 0x2C5F), *range(0x1F300, 0x1F3FF), *range(0x10000, 0x1007F))]
    texts += ["".join(rng.choices(rare, k=rng.randint(1, 12))) for _ in range(30)]
    texts += [
        "".join(chr(rng.randrange(0x20000, 0x2A6DF)) for _ in range(5)) for _ in range(10)
    ]  # CJK ext. B
    texts += ["\x00", "a\x00b", "\x07\x1b[0m", "\x7f", "\ufeffBOM", "line\u2028separator", "\U0010fffd"]
    texts += ["<s>", "</s>", "<pad>", "<unk>", "<s>hi</s>", "<0x41>", "▁", "▁▁x ▁", "a</s>b<s>"]
    alphabet = list("abcxyz ABC 0123456789 \t\n_-=()[]{}:.,'\"#é中😀▁<>/s")
    texts += ["".join(rng.choices(alphabet, k=rng.randint(1, 60))) for _ in range(40)]
    return texts


@pytest.fixture(scope="module")
def texts():
    return varied_texts()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tokenizer_dir) -> Trained:
    """A stand-in for a loaded checkpoint: a small random-weights model with the session tokenizer."""
    tokenizer = Tokenizer.load(tokenizer_dir)
    model = random_weights_model(qkv_scale=5, vocab_size=tokenizer.vocab_size, max_seq_len=64).eval()
    directory = tmp_path_factory.mktemp("run") / "checkpoints" / "step_00000010"
    return Trained(model, tokenizer, RUN_CONFIG, directory)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, trained) -> Path:
    return export_trained(trained, tmp_path_factory.mktemp("export") / "hf")


def load_tokenizer(cls_name: str, directory: Path):
    return getattr(transformers, cls_name).from_pretrained(directory)


# --------------------------------------------------------------------------- tokenizer


def test_the_export_writes_every_file_readable_like_any_other(exported, tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("")  # the mode open() gives under this umask (0644 under the usual 022)
    names = sorted(p.name for p in exported.iterdir())
    assert names == sorted(
        [
            "config.json",
            "model.safetensors",
            "tokenizer.model",
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "generation_config.json",
            EXPORT_RUN_CONFIG,
        ]
    )
    modes = {name: (exported / name).stat().st_mode & 0o777 for name in names}
    assert modes == dict.fromkeys(names, plain.stat().st_mode & 0o777)
    assert json.loads((exported / EXPORT_RUN_CONFIG).read_text())["run_config"] == RUN_CONFIG


@pytest.mark.parametrize("cls_name", TOKENIZER_CLASSES)
def test_transformers_tokenizers_give_our_ids_and_text(exported, trained, texts, cls_name):
    ours, theirs = trained.tokenizer, load_tokenizer(cls_name, exported)
    assert len(texts) > 300
    ids = theirs(texts, add_special_tokens=False)["input_ids"]
    expected = ours.encode_batch(texts)
    assert [t for t, a, b in zip(texts, ids, expected, strict=True) if a != b] == []
    assert theirs.batch_decode(expected) == [ours.decode(i) for i in expected]
    # With special tokens, a text is a document as our model sees it in training: EOS first.
    documents = theirs(texts)["input_ids"]
    assert documents == [ours.encode_document(t) for t in texts]
    assert theirs.batch_decode(documents, skip_special_tokens=True) == [ours.decode(i) for i in documents]
    assert theirs("a", "b")["input_ids"] == [ours.eos_id, *ours.encode("a"), ours.eos_id, *ours.encode("b")]


@pytest.mark.parametrize("cls_name", TOKENIZER_CLASSES)
def test_transformers_tokenizers_have_our_special_tokens(exported, trained, cls_name):
    ours, theirs = trained.tokenizer, load_tokenizer(cls_name, exported)
    processor = ours.processor
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id, theirs.unk_token_id) == (
        ours.bos_id,
        ours.eos_id,
        ours.pad_id,
        processor.unk_id(),
    )
    assert [theirs.bos_token, theirs.eos_token, theirs.pad_token, theirs.unk_token] == [
        processor.id_to_piece(SPECIAL_IDS[key]) for key in ("bos_id", "eos_id", "pad_id", "unk_id")
    ]
    assert len(theirs) == ours.vocab_size
    assert theirs.model_max_length == trained.model.cfg.max_seq_len


def test_generation_config_and_model_config_carry_our_special_ids(exported, trained):
    tok = trained.tokenizer
    config = transformers.GenerationConfig.from_pretrained(exported)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tok.bos_id,
        tok.eos_id,
        tok.pad_id,
    )
    model_config = transformers.AutoConfig.from_pretrained(exported)
    assert (model_config.bos_token_id, model_config.eos_token_id, model_config.pad_token_id) == (
        tok.bos_id,
        tok.eos_id,
        tok.pad_id,
    )


def sentencepiece_tokenizer(directory: Path, **options) -> Tokenizer:
    """A SentencePiece model trained with our settings but `options`, on a few pydoc topics."""
    topics = pydoc_data.topics.topics
    lines = [line for k in sorted(topics)[:20] for line in topics[k].split("\n") if line.strip()]
    model = io.BytesIO()
    settings = (
        dict(
            vocab_size=400,
            model_type="bpe",
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            minloglevel=2,
            **SPECIAL_IDS,
        )
        | options
    )
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, **settings)
    directory.mkdir(parents=True)
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    return Tokenizer.load(directory)


def test_a_tokenizer_with_a_dummy_prefix_is_exact_in_auto_tokenizer(tmp_path, texts):
    """Older tokenizers put ▁ before every text, even one that starts with a space."""
    ours = sentencepiece_tokenizer(tmp_path / "tok", add_dummy_prefix=True)
    assert ours.adds_dummy_prefix
    save_hf_tokenizer(ours, tmp_path / "hf", 64)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    pieces = "".join(ours.processor.id_to_piece(ours.encode(" a")))
    assert pieces == "▁▁a"  # LlamaTokenizerFast would give ▁a: it prepends only where no space is
    assert theirs(texts, add_special_tokens=False)["input_ids"] == ours.encode_batch(texts)
    expected = ours.encode_batch(texts)
    assert theirs.batch_decode(expected) == [ours.decode(i) for i in expected]


def test_tokenizers_a_tokenizer_json_cannot_reproduce_are_refused(tmp_path, trained):
    unigram = sentencepiece_tokenizer(tmp_path / "unigram", model_type="unigram")
    with pytest.raises(UserError, match="unigram model"):
        save_hf_tokenizer(unigram, tmp_path / "hf", 64)
    trimmed = sentencepiece_tokenizer(tmp_path / "nfkc", normalization_rule_name="nmt_nfkc")
    with pytest.raises(UserError, match=r"normalizes text \(nmt_nfkc\)"):
        export_trained(Trained(trained.model, trimmed, {}, tmp_path), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # refused before anything was written


# --------------------------------------------------------------------------- our commands on an export


def test_load_trained_reads_the_export_back(exported, trained):
    loaded = load_trained(exported)
    assert loaded.directory == exported and loaded.run_config == RUN_CONFIG
    assert loaded.tokenizer.sha256 == trained.tokenizer.sha256
    for (name, a), (_, b) in zip(
        trained.model.state_dict().items(), loaded.model.state_dict().items(), strict=True
    ):
        assert a.equal(b), name


def test_eval_on_the_export_equals_eval_on_the_checkpoint(exported, trained, train_data, cli):
    result = cli("eval", "--checkpoint", exported, "--data", train_data, "--json", "--max-batches", "2")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    expected = perplexity(trained, train_data, max_batches=2)
    assert (report["loss"], report["tokens"]) == (expected["loss"], expected["tokens"])
    assert report["tokens"] == 2 * 8 * SEQ_LEN  # the windows of the checkpoint's data.seq_len


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_generate_on_the_export_equals_generate_on_the_checkpoint(exported, trained, cli, temperature):
    prompt = "The list\n\tdef f(x):"
    result = cli(
        "generate",
        "--checkpoint",
        exported,
        "--prompt",
        prompt,
        "--max-new-tokens",
        "16",
        "--temperature",
        temperature,
        "--seed",
        "3",
    )
    assert result.returncode == 0, result.stderr
    expected = sample_text(trained, prompt, 16, float(temperature), 50, 0.95, 3)
    assert result.stdout == prompt + expected + "\n" and expected


def embedded_data(page: str) -> dict:
    found = re.search(rf'<script type="application/json" id="{DATA_ELEMENT_ID}">(.*?)</script>', page, re.S)
    return json.loads(found[1])


def test_attention_on_the_export_equals_attention_on_the_checkpoint(exported, trained, cli, tmp_path):
    text = "def main():\n\treturn 0  # café"
    result = cli("attention", "--checkpoint", exported, "--text", text, "--out", tmp_path / "maps")
    assert result.returncode == 0, result.stderr
    data = embedded_data((tmp_path / "maps.html").read_text(encoding="utf-8"))
    ids = trained.tokenizer.encode_document(text)
    expected = attention_maps(trained.model, ids).numpy()
    assert data["tokens"] == piece_labels(trained.tokenizer, ids)
    assert np.array_equal(np.array(data["attention"]), np.round(expected, 4))


def test_a_llama_directory_from_elsewhere_works_with_our_tokenizer(tmp_path, trained, train_data, cli):
    """transformers' own save_pretrained output, plus a tokenizer.model: no run config, so eval
    windows are the model's context (at most 2048 tokens)."""
    config = transformers.LlamaConfig(
        vocab_size=trained.tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=48,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    (tmp_path / "llama" / "tokenizer.model").write_bytes(trained.tokenizer.path.read_bytes())
    result = cli(
        "eval", "--checkpoint", tmp_path / "llama", "--data", train_data, "--json", "--max-batches", "1"
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tokens"] == 8 * 48
    result = cli("generate", "--checkpoint", tmp_path / "llama", "--prompt", "x", "--max-new-tokens", "3")
    assert result.returncode == 0 and result.stdout.startswith("x")


def test_a_directory_without_a_tokenizer_is_one_clear_line(exported, tmp_path, cli):
    bare = tmp_path / "bare"
    shutil.copytree(exported, bare)
    (bare / "tokenizer.model").unlink()
    (bare / "tokenizer.json").unlink()  # (alone, it is a Hugging Face tokenizer: test_hf_tokenizer.py)
    for command in (["generate", "--prompt", "x"], ["attention", "--text", "x", "--out", tmp_path / "a"]):
        result = cli(command[0], "--checkpoint", bare, *command[1:])
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.strip().splitlines() == [result.stderr.strip()]
        assert "has no tokenizer.model or tokenizer.json" in result.stderr and "export-hf" in result.stderr
    save_hf(random_weights_model(), tmp_path / "no_tokenizer")  # weights only
    with pytest.raises(UserError, match="has no tokenizer.model or tokenizer.json"):
        load_trained(tmp_path / "no_tokenizer")

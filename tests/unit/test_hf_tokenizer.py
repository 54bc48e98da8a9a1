"""A Hugging Face tokenizer (a tokenizer.json) wherever a SentencePiece model is accepted: `data
prepare` (text and Megatron corpora), training (its samples and attention probe), checkpoints,
`generate`, `eval` (and the harness adapter), `attention`, `export-hf` and fine-tuning.

Two tokenizers are trained here with the `tokenizers` library (no Hub): a BPE over SentencePiece-style
"▁" words whose end-of-document token has no well-known name (so it must be named: --eos-token),
and a byte-level BPE as GPT-2's, with <|endoftext|>. Every id is checked against that library's
own encoding (special tokens written in a text are text: `encode_special_tokens`), and the export
against transformers' AutoTokenizer and PreTrainedTokenizerFast."""

from __future__ import annotations

import json
import math
import pydoc_data.topics
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain.cli import main
from pretrain.config import load_config, load_finetune_config
from pretrain.data import resolve_source
from pretrain.data.shards import read_manifest
from pretrain.errors import UserError
from pretrain.evaluation.inference import Trained, export_trained, generate, perplexity, sample_text
from pretrain.tokenizer import HF_FILE, META_FILE, MODEL_FILE, HFTokenizer, Tokenizer, sha256_file
from tests.helpers import FAST, TINY, assert_one_line_error
from tests.unit.fakes import ONE_PROCESS, finetuning_trainer, pretraining_trainer
from tests.unit.test_hf_export import embedded_data, varied_texts

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

KINDS = ("bpe", "byte_level")
DOC_TOKEN = "<|doc|>"  # the BPE's end of document: no well-known name, so `--eos-token` names it
NAMED = {"bpe": ["--eos-token", DOC_TOKEN], "byte_level": []}
EXPECTED = {  # the special tokens each ends up with
    "bpe": {"eos": DOC_TOKEN, "bos": "<s>", "pad": "<pad>"},  # bos: its post-processor's template
    "byte_level": {"eos": "<|endoftext|>", "bos": None, "pad": None},  # a well-known name
}
VOCAB = 600
MODEL_VOCAB = 640  # model.vocab_size: at least the tokenizer's
PROMPT = "The list\n\tdef f(x):  # café"


def topics() -> list[str]:
    return [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]


def train_hf_tokenizer(kind: str, directory: Path) -> Path:
    """A tokenizer.json trained with the `tokenizers` library on the pydoc topics, saved in `directory`."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    if kind == "bpe":
        tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        specials = ["<unk>", "<s>", "<pad>", DOC_TOKEN]
        trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False)
        tok.train_from_iterator(topics(), trainer)
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    else:  # GPT-2's pipeline
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(topics(), trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / HF_FILE))
    return directory


def reference(path: Path):
    """The tokenizers library's own tokenizer, as ours runs it: special tokens in a text are text."""
    tok = tokenizers.Tokenizer.from_file(str(path if path.suffix == ".json" else path / HF_FILE))
    tok.encode_special_tokens = True
    return tok


def library_ids(ref, text: str) -> list[int]:
    return ref.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_tokenizers")
    return {kind: train_hf_tokenizer(kind, root / kind) for kind in KINDS}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The pydoc topics, then documents of every kind of text (test_hf_export.varied_texts)."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    texts = varied_texts(1)
    documents = topics() + ["\n".join(texts[i : i + 25]) for i in range(0, len(texts), 25)]
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in documents))
    return path


@pytest.fixture(scope="module", params=KINDS)
def prepared(request, hf_dirs, corpus, tmp_path_factory) -> tuple[str, Path]:
    """(kind, data dir): the corpus prepared with `pretrain data prepare` and that tokenizer."""
    kind = request.param
    out = tmp_path_factory.mktemp(f"data_{kind}") / "data"
    args = ["data", "prepare", "--source", corpus, "--tokenizer", hf_dirs[kind], "--out", out, *NAMED[kind]]
    code = main([str(a) for a in [*args, "--val-fraction", "0.1", "--workers", "1", "--no-progress"]])
    assert code == 0
    return kind, out


@pytest.fixture(scope="module")
def run(prepared, tmp_path_factory):
    """Two training steps in this process (a FakeEngine), evaluating, sampling and probing at step 2."""
    kind, data_dir = prepared
    run_dir = tmp_path_factory.mktemp(f"run_{kind}") / "run"
    cfg = load_config(
        TINY,
        [
            *FAST,
            f"model.vocab_size={MODEL_VOCAB}",
            f"run.dir={run_dir}",
            f"data.dir={data_dir}",
            "train.steps=2",
            "eval.every=2",
            "eval.batches=1",
            "checkpoint.every=2",
            'eval.attention_probe="def f(x) return x"',
            f"eval.sample_prompts=[{json.dumps(PROMPT)}]",
            "eval.sample_tokens=8",
        ],
    )
    trainer = pretraining_trainer(cfg)
    summary = trainer.train()
    assert summary["completed"] and summary["step"] == 2
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    run_config = json.loads((checkpoint / "run_config.json").read_text())
    trained = Trained(trainer.engine.module.eval(), Tokenizer.load(checkpoint), run_config, checkpoint)
    return kind, data_dir, trainer, trained


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> Path:
    kind, _, _, trained = run
    return export_trained(trained, tmp_path_factory.mktemp(f"export_{kind}") / "hf")


# --------------------------------------------------------------------------- the tokenizer


@pytest.mark.parametrize("kind", KINDS)
def test_ids_and_text_are_the_tokenizers_librarys_own_on_varied_text(hf_dirs, kind):
    ours = Tokenizer.load(hf_dirs[kind], {"eos": DOC_TOKEN} if kind == "bpe" else None)
    ref = reference(hf_dirs[kind])
    plain = tokenizers.Tokenizer.from_file(str(hf_dirs[kind] / HF_FILE))  # special tokens in text: specials
    texts = [*varied_texts(), "a<|endoftext|>b</s><s>", f"x {DOC_TOKEN} y", "  \t\n" * 40, "x" * 5000]
    assert isinstance(ours, HFTokenizer) and ours.vocab_size == VOCAB
    alphabet = set("".join(topics()))
    for text in texts:
        ids = ours.encode(text)
        assert ids == library_ids(ref, text), repr(text)
        if not any(token in text for token in ("<|endoftext|>", "<s>", "<pad>", "<unk>", DOC_TOKEN)):
            assert ids == plain.encode(text, add_special_tokens=False).ids, repr(text)
        assert ours.encode_document(text) == [ours.eos_id, *ids]
        assert ours.eos_id not in ids  # a special token written in a text does not end a document
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        # decode(encode(x)) == x; the BPE has no byte fallback, and its decoder drops a leading "▁"
        if kind == "byte_level" or (set(text) <= alphabet and not text.startswith(" ")):
            assert ours.decode(ids) == text, repr(text)
    assert ours.encode_batch(texts) == [library_ids(ref, t) for t in texts]
    assert ours.encode_documents(texts[:5]) == [[ours.eos_id, *library_ids(ref, t)] for t in texts[:5]]
    assert ours.sha256 == sha256_file(hf_dirs[kind] / HF_FILE)
    labels = ours.piece_labels(ours.encode_document("def f():\n\treturn 'é😀'"))
    assert labels[0] == EXPECTED[kind]["eos"] and any("↵" in label for label in labels) and all(labels)


def test_special_tokens_come_from_the_caller_the_files_beside_it_or_the_tokenizer(hf_dirs, tmp_path):
    bl = Tokenizer.load(hf_dirs["byte_level"] / HF_FILE)
    assert bl.tokens == EXPECTED["byte_level"] and (bl.eos_id, bl.bos_id, bl.pad_id) == (0, -1, -1)
    bpe = Tokenizer.load(hf_dirs["bpe"], {"eos": DOC_TOKEN})
    assert bpe.tokens == EXPECTED["bpe"]
    assert (bpe.eos_id, bpe.bos_id, bpe.pad_id) == tuple(
        bpe.backend.token_to_id(t) for t in EXPECTED["bpe"].values()
    )
    beside = tmp_path / "beside"
    beside.mkdir()
    (beside / HF_FILE).write_bytes((hf_dirs["bpe"] / HF_FILE).read_bytes())
    (beside / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": DOC_TOKEN}, "pad_token": None})
    )
    assert Tokenizer.load(beside).tokens == EXPECTED["bpe"]  # eos from tokenizer_config.json
    assert (
        Tokenizer.load(beside, {"eos": "<pad>", "pad": None}).tokens["eos"] == "<pad>"
    )  # the caller's first
    (beside / "tokenizer_config.json").unlink()
    (beside / "config.json").write_text(json.dumps({"eos_token_id": [bpe.eos_id, 0], "bos_token_id": None}))
    assert Tokenizer.load(beside).tokens == EXPECTED["bpe"]  # a model's config.json: ids
    with pytest.raises(UserError, match=r"^--eos-token: eos token '<\|nope\|>' is not a token of"):
        Tokenizer.load(hf_dirs["bpe"], {"eos": "<|nope|>"})
    with pytest.raises(UserError, match="cannot tell which token ends a document.*--eos-token TOKEN"):
        Tokenizer.load(hf_dirs["bpe"])  # two unnamed specials (<unk>, <|doc|>): which one?


def test_a_tokenizer_without_an_eos_is_refused_until_one_is_named(hf_dirs, corpus, tmp_path, cli):
    args = ["data", "prepare", "--source", corpus, "--tokenizer", hf_dirs["bpe"], "--val-fraction", "0.1"]
    result = cli(*args, "--out", tmp_path / "out")
    assert_one_line_error(result, "cannot tell which token ends a document", "--eos-token")
    assert not (tmp_path / "out").exists()
    result = cli(*args, "--out", tmp_path / "out", "--eos-token", DOC_TOKEN, "--no-progress")
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(tmp_path / "out")
    assert manifest["tokenizer"]["eos_id"] == Tokenizer.load(hf_dirs["bpe"], {"eos": DOC_TOKEN}).eos_id
    # Another EOS is another dataset: the special tokens are part of the recipe.
    result = cli(*args, "--out", tmp_path / "out", "--eos-token", "<pad>", "--no-progress")
    assert_one_line_error(result, "already holds a different dataset")


@pytest.mark.parametrize(
    "case", ["missing", "not_json", "json_not_a_tokenizer", "truncated", "directory_of_garbage", "sp_named"]
)
def test_a_bad_tokenizer_is_one_line_and_exit_2(case, hf_dirs, corpus, tokenizer_dir, tmp_path, cli):
    path, extra, fragment = tmp_path / "tok.json", [], "is not a Hugging Face tokenizer.json"
    if case == "missing":
        path, fragment = tmp_path / "nothing-here", "no tokenizer at"
    elif case == "not_json":
        path.write_text("hello")
    elif case == "json_not_a_tokenizer":
        path.write_text(json.dumps({"vocab": {"a": 0}, "merges": []}))
    elif case == "truncated":
        data = (hf_dirs["byte_level"] / HF_FILE).read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif case == "directory_of_garbage":
        path = tmp_path / "dir"
        path.mkdir()
        (path / HF_FILE).write_bytes(b"\x00\x01 not json")
    else:  # a SentencePiece model has fixed special tokens
        path, extra, fragment = tokenizer_dir, ["--eos-token", "</s>"], "is a SentencePiece model"
    out = tmp_path / "out"
    result = cli("data", "prepare", "--source", corpus, "--tokenizer", path, "--out", out, *extra)
    assert_one_line_error(result, fragment)
    assert not out.exists()


# --------------------------------------------------------------------------- data prepare


def expected_splits(documents: list[str], ref, eos: int, val_fraction: float) -> dict[str, list[int]]:
    """What prepare must write: each document's ids, by the tokenizers library, then EOS; held out
    evenly by position."""
    split: dict[str, list[int]] = {"train": [], "validation": []}
    kept = 0
    for doc in documents:
        if not doc.strip():
            continue
        held = math.floor((kept + 1) * val_fraction) > math.floor(kept * val_fraction)
        kept += 1
        split["validation" if held else "train"] += [*library_ids(ref, doc), eos]
    return split


def read_split(data_dir: Path, manifest: dict, split: str) -> list[int]:
    dtype = np.dtype(manifest["dtype"])
    return np.concatenate(
        [np.fromfile(data_dir / s["file"], dtype=dtype) for s in manifest["splits"][split]["shards"]]
    ).tolist()


def test_prepare_writes_the_tokenizers_ids_and_keeps_it_unchanged_beside_the_shards(
    prepared, hf_dirs, corpus
):
    kind, data_dir = prepared
    manifest = read_manifest(data_dir)
    source = hf_dirs[kind] / HF_FILE
    assert (data_dir / HF_FILE).read_bytes() == source.read_bytes() and not (data_dir / MODEL_FILE).exists()
    entry = manifest["tokenizer"]
    assert entry["file"] == HF_FILE and entry["sha256"] == sha256_file(source) == manifest["tokenizer_sha256"]
    assert entry["vocab_size"] == VOCAB and manifest["dtype"] == "<u2"
    meta = json.loads((data_dir / META_FILE).read_text())
    assert meta["special_tokens"] == EXPECTED[kind] == manifest["tokenizer_special_tokens"]
    ref = reference(source)
    eos = ref.token_to_id(EXPECTED[kind]["eos"])
    assert entry["eos_id"] == eos == Tokenizer.load(data_dir).eos_id  # (named at prepare: from its meta)
    expected = expected_splits(list(resolve_source(str(corpus)).documents()), ref, eos, 0.1)
    for split in ("train", "validation"):
        assert read_split(data_dir, manifest, split) == expected[split], split


# --------------------------------------------------------------------------- training and checkpoints


def test_training_samples_and_probes_with_it_and_checkpoints_carry_it(run, hf_dirs):
    kind, data_dir, trainer, trained = run
    task = trainer.task
    assert task._tokenizer.sha256 == read_manifest(data_dir)["tokenizer"]["sha256"]
    assert task._tokenizer.tokens == EXPECTED[kind]
    ((prompt, text),) = task.samples(trainer.engine, 2)
    assert prompt == PROMPT and isinstance(text, str)
    assert task.probe(trainer.engine, 2) is not None
    checkpoint = trained.directory
    assert (checkpoint / HF_FILE).read_bytes() == (hf_dirs[kind] / HF_FILE).read_bytes()
    assert not (checkpoint / MODEL_FILE).exists()
    assert json.loads((checkpoint / META_FILE).read_text())["special_tokens"] == EXPECTED[kind]
    assert trained.tokenizer.tokens == EXPECTED[kind]  # read back from the checkpoint
    identity = json.loads((checkpoint.parent.parent / "run.json").read_text())["identity"]
    assert identity["tokenizer.sha256"] == sha256_file(hf_dirs[kind] / HF_FILE)


def test_data_tokenizer_names_the_runs_tokenizer_with_the_shards_special_tokens(
    prepared, hf_dirs, tmp_path, cli
):
    """`data.tokenizer` names the tokenizer (here the trained file's own directory, without the
    special tokens `data prepare` was told): training needs no copy beside the shards, uses the
    special tokens the shards were made with (the BPE's end of document was named at prepare), and
    its checkpoints carry the file unchanged with them. Another tokenizer, or none, is refused."""
    import shutil

    kind, prepared_dir = prepared
    data_dir = Path(shutil.copytree(prepared_dir, tmp_path / "data"))
    (data_dir / HF_FILE).unlink()
    (data_dir / META_FILE).unlink()
    run_dir = tmp_path / "run"
    common = [*FAST, f"model.vocab_size={MODEL_VOCAB}", f"run.dir={run_dir}", f"data.dir={data_dir}"]
    cfg = load_config(
        TINY,
        [*common, f"data.tokenizer={hf_dirs[kind]}", "train.steps=1", "eval.every=0", "checkpoint.every=1"],
    )
    trainer = pretraining_trainer(cfg)
    assert trainer.train()["completed"]
    assert trainer.task._tokenizer.tokens == EXPECTED[kind]
    checkpoint = run_dir / "checkpoints" / "step_00000001"
    assert (checkpoint / HF_FILE).read_bytes() == (hf_dirs[kind] / HF_FILE).read_bytes()
    assert json.loads((checkpoint / META_FILE).read_text())["special_tokens"] == EXPECTED[kind]
    assert Tokenizer.load(checkpoint).eos_id == read_manifest(data_dir)["tokenizer"]["eos_id"]

    other = hf_dirs[next(k for k in KINDS if k != kind)]
    refused = cli(
        "train", "--config", TINY, *common, f"data.tokenizer={other}", "run.dir=" + str(tmp_path / "r2")
    )
    assert_one_line_error(refused, f"data.tokenizer={other} is not the tokenizer the shards in", "prepare")
    missing = cli("train", "--config", TINY, *common, f"data.tokenizer={tmp_path / 'nowhere'}")
    assert_one_line_error(missing, "no tokenizer at")
    beside = cli(
        "train", "--config", TINY, *common, "run.dir=" + str(tmp_path / "r3")
    )  # (none named, none beside)
    assert_one_line_error(beside, f"{data_dir / HF_FILE} is missing", "data.tokenizer")
    assert not (tmp_path / "r2").exists() and not (tmp_path / "r3").exists()


def test_generate_decodes_what_the_model_wrote_with_the_tokenizers_library(run):
    kind, _, _, trained = run
    tok, ref = trained.tokenizer, reference(trained.tokenizer.path)
    prompt_ids = tok.encode_document(PROMPT)
    assert prompt_ids == [ref.token_to_id(EXPECTED[kind]["eos"]), *library_ids(ref, PROMPT)]
    ids = generate(trained.model, prompt_ids, 12, 0.0, None, None, tok.eos_id, torch.Generator())
    assert sample_text(trained, PROMPT, 12, 0.0, None, None) == ref.decode(ids, skip_special_tokens=True)


def test_the_harness_adapter_scores_the_tokenizers_ids(run):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from pretrain.evaluation.harness import PretrainLM

    _, _, _, trained = run
    ref = reference(trained.tokenizer.path)
    context, continuation = "Question: what binds names?\nAnswer:", " assignment statements"
    ((logprob, _),) = PretrainLM(trained, 2).loglikelihood(
        [Instance("loglikelihood", {}, (context, continuation), 0)]
    )
    ids = [trained.tokenizer.eos_id, *library_ids(ref, context + continuation)]
    first = 1 + len(library_ids(ref, context))
    assert ids[1:first] == library_ids(ref, context)  # (the continuation's ids follow the context's here)
    with torch.no_grad():
        logits = trained.model(torch.tensor([ids[:-1]])).logits[0].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[first - 1 :, 0].sum()
    assert logprob == pytest.approx(expected.item(), abs=1e-4)


# --------------------------------------------------------------------------- export-hf


def test_export_writes_it_unchanged_and_transformers_gives_the_same_ids(exported, run, hf_dirs):
    kind, _, _, trained = run
    tok = trained.tokenizer
    assert (exported / HF_FILE).read_bytes() == (hf_dirs[kind] / HF_FILE).read_bytes()
    assert not (exported / MODEL_FILE).exists()
    config = json.loads((exported / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["split_special_tokens"] is True
    assert config["eos_token"] == EXPECTED[kind]["eos"]
    generation = json.loads((exported / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.eos_id
    texts = [*varied_texts(2), "a<|endoftext|>b</s>", f"x {DOC_TOKEN} y"]
    for cls in ("AutoTokenizer", "PreTrainedTokenizerFast"):
        theirs = getattr(transformers, cls).from_pretrained(exported)
        assert theirs.eos_token == EXPECTED[kind]["eos"] and theirs.eos_token_id == tok.eos_id
        for text in texts:
            ids = theirs(text, add_special_tokens=False).input_ids
            assert ids == tok.encode(text), (cls, text)
            assert theirs.decode(ids, skip_special_tokens=True) == tok.decode(ids)
    assert Tokenizer.load(exported).tokens["eos"] == EXPECTED[kind]["eos"]


def test_generate_eval_and_attention_on_the_export(exported, run, cli, tmp_path):
    _, data_dir, _, trained = run
    result = cli(
        "generate", "--checkpoint", exported, "--prompt", PROMPT, "--max-new-tokens", "8", "--seed", "3"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == PROMPT + sample_text(trained, PROMPT, 8, 0.8, 50, 0.95, 3) + "\n"
    result = cli("eval", "--checkpoint", exported, "--data", data_dir, "--json", "--max-batches", "1")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["loss"] == perplexity(trained, data_dir, max_batches=1)["loss"]
    text = "def main():\n\treturn 0  # café 😀"
    result = cli("attention", "--checkpoint", exported, "--text", text, "--out", tmp_path / "maps")
    assert result.returncode == 0, result.stderr
    data = embedded_data((tmp_path / "maps.html").read_text(encoding="utf-8"))
    assert data["tokens"] == trained.tokenizer.piece_labels(trained.tokenizer.encode_document(text))


# --------------------------------------------------------------------------- fine-tuning, Megatron, async


def test_fine_tuning_from_the_export_tokenizes_with_it(exported, run, hf_dirs, tmp_path):
    from tests.finetune_data import SFT, write_jsonl

    kind, _, _, trained = run
    rows = [{"prompt": f"repeat {w} =>", "completion": f" {w} 😀"} for w in ("list", "class", "module", "ab")]
    train = write_jsonl(tmp_path / "train.jsonl", rows * 4)
    cfg = load_finetune_config(
        SFT,
        [
            f"finetune.init={exported}",
            f"run.dir={tmp_path / 'run'}",
            f"data.train={train}",
            "train.steps=2",
            "train.micro_batch_size=4",
            "checkpoint.every=2",
            "logging.every=1",
        ],
    )
    trainer = finetuning_trainer(cfg)
    eos, ref = trained.tokenizer.eos_id, reference(hf_dirs[kind])
    first = trainer.task.train.ids[0]
    assert first == [eos, *library_ids(ref, rows[0]["prompt"]), *library_ids(ref, rows[0]["completion"]), eos]
    assert trainer.train()["completed"]
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    assert (checkpoint / HF_FILE).read_bytes() == (hf_dirs[kind] / HF_FILE).read_bytes()
    assert Tokenizer.load(checkpoint).tokens["eos"] == EXPECTED[kind]["eos"]
    identity = json.loads((tmp_path / "run" / "run.json").read_text())["identity"]
    assert identity["tokenizer.sha256"] == sha256_file(hf_dirs[kind] / HF_FILE)


def test_a_megatron_corpus_tokenized_with_it_converts_as_it_is(hf_dirs, tmp_path, cli):
    """GPT-NeoX's preprocess_data.py with its HF tokenizer and --append-eod: each document's ids
    then <|endoftext|>; converted, no second EOS is added and no id changes."""
    from tests.unit.test_megatron_source import write_megatron

    ref = reference(hf_dirs["byte_level"])
    eos = ref.token_to_id("<|endoftext|>")
    documents = [[[*library_ids(ref, doc), eos]] for doc in topics()[:20]]
    prefix = write_megatron(tmp_path / "neox" / "corpus_text_document", documents, 8)  # uint16
    out = tmp_path / "out"
    result = cli(
        "data", "prepare", "--source", prefix, "--format", "megatron", "--tokenizer", hf_dirs["byte_level"],
        "--out", out, "--val-fraction", "0.1", "--no-progress",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(out)
    assert manifest["tokenizer"]["file"] == HF_FILE and (out / HF_FILE).is_file()
    written = read_split(out, manifest, "train") + read_split(out, manifest, "validation")
    assert sorted(written) == sorted(t for d in documents for s in d for t in s)
    assert manifest["stats"]["documents_ending_in_eos"] == 20


@pytest.mark.parametrize("in_background", [False, True])
def test_checkpoints_carry_it_saved_in_the_loop_or_in_the_background(prepared, in_background, tmp_path):
    from pretrain import checkpoint as ck
    from pretrain.checkpoint.checkpointer import Checkpointer, TrainState
    from pretrain.config import CheckpointConfig
    from tests.conftest import random_weights_model
    from tests.unit.test_async_checkpoint import WriterEngine

    kind, data_dir = prepared
    model = random_weights_model()
    engine = WriterEngine(model, torch.optim.AdamW(model.parameters()))
    saver = Checkpointer(
        tmp_path / "run",
        ONE_PROCESS,
        CheckpointConfig(keep=2, async_save=in_background),
        run_config={},
        tokenizer=data_dir / HF_FILE,
        config_hash="0123456789abcdef",
    )
    assert saver.in_background == in_background
    saver.save(engine, TrainState(1), {"consumed": 1})
    if in_background:
        assert saver.wait() == "step_00000001"
    checkpoint = ck.checkpoints_dir(tmp_path / "run") / "step_00000001"
    assert ck.verify(checkpoint) is None
    assert (checkpoint / HF_FILE).read_bytes() == (data_dir / HF_FILE).read_bytes()
    assert Tokenizer.load(checkpoint).tokens == EXPECTED[kind]


def test_sentencepiece_datasets_and_checkpoints_are_as_before(train_data, tokenizer_dir, tmp_path):
    """No new manifest keys and no new checkpoint file for a SentencePiece model."""
    from pretrain.tokenizer import copy_tokenizer

    manifest = read_manifest(train_data)
    assert set(manifest["tokenizer"]) == {"sha256", "vocab_size", "eos_id"}
    assert "tokenizer_special_tokens" not in manifest
    copy_tokenizer(train_data / MODEL_FILE, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [MODEL_FILE]
    assert Tokenizer.load(train_data).kind == "sentencepiece"

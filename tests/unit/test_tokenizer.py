import json

import pytest

from pretrain.errors import UserError
from pretrain.tokenizer import SPECIAL_IDS, Tokenizer, sha256_file, train_tokenizer

HARD_TEXT = " two  spaces\n\ttab\r\nCRLF \x00 NUL, é, 日本語, 🤗, \u200b zero-width, trailing "


def test_special_ids_and_meta(tokenizer_dir):
    tok = Tokenizer.load(tokenizer_dir)
    assert (tok.processor.unk_id(), tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2, 3)
    assert tok.vocab_size == 512
    meta = json.loads((tokenizer_dir / "tokenizer_meta.json").read_text())
    assert meta["vocab_size"] == 512 and meta["special_ids"] == SPECIAL_IDS
    assert meta["sha256"] == sha256_file(tokenizer_dir / "tokenizer.model") == tok.sha256


def test_any_text_round_trips_without_unk(tokenizer_dir):
    tok = Tokenizer.load(tokenizer_dir / "tokenizer.model")
    for text in (HARD_TEXT, "x" * 20000, "def f(x):\n    return x  # comment\n", ""):
        ids = tok.encode(text)
        assert 0 not in ids, "nothing may map to unk (byte fallback)"
        assert tok.decode(ids) == text
    assert tok.encode_batch(["a b", HARD_TEXT]) == [tok.encode("a b"), tok.encode(HARD_TEXT)]


def test_training_is_reproducible_and_unigram_works(tmp_path):
    import pydoc_data.topics

    docs = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)[:30]]
    a = train_tokenizer(docs, tmp_path / "a", vocab_size=400)
    b = train_tokenizer(docs, tmp_path / "b", vocab_size=400)
    assert a.sha256 == b.sha256
    uni = train_tokenizer(docs, tmp_path / "u", vocab_size=400, model_type="unigram")
    assert uni.decode(uni.encode(HARD_TEXT)) == HARD_TEXT


def test_bad_training_input(tmp_path):
    with pytest.raises(UserError, match="empty"):
        train_tokenizer(["", "  \n "], tmp_path / "t", vocab_size=512)
    with pytest.raises(UserError, match="too small"):
        train_tokenizer(["text"], tmp_path / "t", vocab_size=100)
    with pytest.raises(UserError, match=r"too large for this corpus: lower it to at most \d+"):
        train_tokenizer(["tiny corpus"], tmp_path / "t", vocab_size=5000)
    assert not (tmp_path / "t" / "tokenizer.model").exists()


def test_load_refusals(tmp_path):
    with pytest.raises(UserError, match="no tokenizer"):
        Tokenizer.load(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(UserError, match="not a SentencePiece model"):
        Tokenizer.load(tmp_path)


def test_pieces_encoded_separately_decode_to_the_whole(tokenizer_dir):
    tok = Tokenizer.load(tokenizer_dir)
    assert not tok.adds_dummy_prefix
    pieces = ["first line\n", "second", " line, then", "\n  indented"]
    assert tok.decode([i for piece in pieces for i in tok.encode(piece)]) == "".join(pieces)


def test_written_files_get_the_usual_permissions(tmp_path, tokenizer_dir):
    import os

    from pretrain import atomic

    umask = os.umask(0o022)
    os.umask(umask)
    atomic.write_text(tmp_path / "note.txt", "hello")
    assert (tmp_path / "note.txt").stat().st_mode & 0o777 == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["note.txt"]  # no temporary file left
    for name in ("tokenizer.model", "tokenizer_meta.json"):  # written by train_tokenizer
        assert (tokenizer_dir / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


def test_a_document_starts_with_eos_as_in_training(tokenizer_dir):
    tok = Tokenizer.load(tokenizer_dir)
    assert tok.encode_document("def f(x):") == [tok.eos_id, *tok.encode("def f(x):")]
    assert tok.encode_documents(["a b", ""]) == [[tok.eos_id, *tok.encode("a b")], [tok.eos_id]]

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from matplotlib.image import imread

from pretrain.errors import UserError
from pretrain.evaluation.attention_maps import (
    DATA_ELEMENT_ID,
    attention_maps,
    grid_figure,
    grid_image,
    piece_labels,
    save_grid_png,
    save_head_view_html,
)
from pretrain.model.transformer import Transformer
from pretrain.tokenizer import Tokenizer
from tests.conftest import random_weights_model


def random_model(**overrides) -> Transformer:
    """Attention far from uniform, so a wrong head order, scale or position would show."""
    return random_weights_model(qkv_scale=25, **overrides)


def fake_maps(n_layers: int, n_heads: int, T: int, seed: int = 0) -> np.ndarray:
    scores = torch.randn(n_layers, n_heads, T, T, generator=torch.Generator().manual_seed(seed))
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1).numpy()


# --------------------------------------------------------------------------- maps


def test_maps_are_causal_probabilities():
    model = random_model().train()
    ids = torch.randint(0, 97, (20,)).tolist()
    maps = attention_maps(model, ids)
    assert maps.shape == (2, 4, 20, 20) and maps.dtype == torch.float32
    assert torch.allclose(maps.sum(-1), torch.ones(2, 4, 20), atol=1e-5)
    assert (maps.triu(1) == 0).all()
    assert maps.max() > 0.5  # far from uniform: a meaningful comparison below
    assert model.training  # the mode it was called in is restored
    assert torch.equal(attention_maps(model, torch.tensor(ids)), maps)


@pytest.mark.parametrize("n_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_maps_match_transformers_llama(tmp_path, n_kv_heads):
    transformers = pytest.importorskip("transformers")
    from pretrain.model.hf import save_hf

    ours = random_model(n_kv_heads=n_kv_heads, rope_theta=500000.0).eval()
    save_hf(ours, tmp_path)
    theirs = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = torch.randint(0, 97, (30,))
    with torch.no_grad():
        expected = torch.stack(theirs(ids[None], output_attentions=True).attentions)[:, 0]
    assert expected.shape == (2, 4, 30, 30)
    assert (attention_maps(ours, ids) - expected).abs().max().item() <= 1e-5


def test_bad_input_is_refused():
    model = random_model()
    for empty in ([], torch.tensor([], dtype=torch.long)):
        with pytest.raises(UserError, match="no tokens"):
            attention_maps(model, empty)
    with pytest.raises(UserError, match="65 tokens exceed the model's max_seq_len=64"):
        attention_maps(model, [5] * 65)
    assert attention_maps(model, [5] * 64).shape[-1] == 64


def test_piece_labels(tokenizer_dir):
    tokenizer = Tokenizer.load(tokenizer_dir)
    text = "def f(x):\n\treturn  $x"
    ids = [tokenizer.eos_id, *tokenizer.encode(text)]
    labels = piece_labels(tokenizer, ids)
    assert len(labels) == len(ids)
    assert labels[0] == "</s>"
    assert "↵" in labels and "⇥" in labels and "$" in labels
    assert not any("▁" in label for label in labels)
    # Apart from the marker and the visible whitespace, the labels spell the text.
    spelled = "".join(labels[1:]).replace("↵", "\n").replace("⇥", "\t").replace("␣", " ")
    assert spelled == text


# --------------------------------------------------------------------------- PNG grid


def test_grid_has_one_subplot_per_layer_and_head():
    n_layers, n_heads, T = 3, 2, 6
    labels = [f"t{i}" for i in range(T)]
    fig = grid_figure(fake_maps(n_layers, n_heads, T), labels, title="a $title$")
    assert isinstance(fig, Figure)
    assert len(fig.axes) == n_layers * n_heads
    for index, ax in enumerate(fig.axes):
        rows, cols, start, _ = ax.get_subplotspec().get_geometry()
        assert (rows, cols) == (n_layers, n_heads)
        layer, head = divmod(start, n_heads)
        assert index == start
        assert ax.get_title() == (f"head {head}" if layer == 0 else "")
        assert ax.get_ylabel() == (f"layer {layer}" if head == 0 else "")
        # Token labels only on the outer subplots: keys along the bottom row, queries down the first column.
        x_labels = [t.get_text() for t in ax.get_xticklabels()]
        y_labels = [t.get_text() for t in ax.get_yticklabels()]
        assert x_labels == (labels if layer == n_layers - 1 else [])
        assert y_labels == (labels if head == 0 else [])


def test_long_sequences_thin_their_labels():
    labels = [f"t{i}" for i in range(199)] + ["a very long token label"]
    ax = grid_figure(fake_maps(1, 1, 200), labels).axes[0]
    shown = [t.get_text() for t in ax.get_xticklabels()]
    step = int(ax.get_xticks()[1])
    assert 5 < len(shown) < 100 and shown == labels[:-1:step]
    assert grid_figure(fake_maps(1, 1, 3), ["a", "b", labels[-1]]).axes[0].get_xticklabels()[
        2
    ].get_text() == ("a very long…")


def test_png_is_written_and_matches_grid_image(tmp_path):
    maps, labels = fake_maps(2, 3, 5), ["a", "b", "$c", "d", "<e>"]
    path = save_grid_png(maps, labels, tmp_path / "sub" / "grid.png", title="test")
    assert path == tmp_path / "sub" / "grid.png"
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert [p.name for p in path.parent.iterdir()] == ["grid.png"]  # no temporary file left
    image = grid_image(maps, labels, title="test")
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
    assert imread(path).shape[:2] == image.shape[:2]
    assert image.min() < 100  # something was drawn on the white page
    bigger = grid_image(fake_maps(4, 6, 5), labels)
    assert bigger.shape[0] > image.shape[0] and bigger.shape[1] > image.shape[1]


def test_png_write_is_atomic(tmp_path, monkeypatch):
    def crash(self, path, **kwargs):
        Path(path).write_bytes(b"\x89PNG\r\n\x1a\n half")
        raise RuntimeError("killed while writing")

    monkeypatch.setattr(Figure, "savefig", crash)
    with pytest.raises(RuntimeError, match="killed"):
        save_grid_png(fake_maps(1, 1, 3), ["a", "b", "c"], tmp_path / "grid.png")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- HTML head view


def embedded_data(page: str) -> dict:
    match = re.search(
        rf'<script type="application/json" id="{DATA_ELEMENT_ID}">(.*?)</script>', page, re.DOTALL
    )
    assert match is not None
    return json.loads(match[1])


def test_head_view_html(tmp_path):
    maps = fake_maps(2, 3, 4)
    labels = ["</s>", "<script>alert(1)</script>", "a & b", "__DATA__"]
    title = "<b>run</b> __TITLE__"
    path = save_head_view_html(maps, labels, tmp_path / "sub" / "view.html", title=title)
    assert path == tmp_path / "sub" / "view.html"
    assert [p.name for p in path.parent.iterdir()] == ["view.html"]
    page = path.read_text(encoding="utf-8")
    data = embedded_data(page)
    assert data["tokens"] == labels and data["title"] == title
    assert np.allclose(np.array(data["attention"]), maps, atol=1e-4, rtol=0)
    # Token and title text never appears as markup: no injected element, no early </script>.
    assert "<script>alert" not in page and "<b>" not in page
    assert page.count("<script") == 2 and page.count("</script>") == 2
    assert "<title>&lt;b&gt;run&lt;/b&gt; __TITLE__</title>" in page
    # Self-contained: nothing to fetch.
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"<(link|img|iframe)\b|\bsrc\s*=", page)


def test_head_view_of_a_model(tmp_path):
    model = random_model()
    maps = attention_maps(model, list(range(10, 22)))
    path = save_head_view_html(maps, [str(i) for i in range(12)], tmp_path / "view.html")
    data = embedded_data(path.read_text(encoding="utf-8"))
    assert np.array(data["attention"]).shape == (2, 4, 12, 12)
    assert np.allclose(np.array(data["attention"]), maps.numpy(), atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- render


def test_render_writes_both_views(tmp_path, tokenizer_dir, monkeypatch):
    """The wiring of `render`, with a random model standing in for a checkpoint (loading real ones is
    tested with the CLI)."""
    import pretrain.evaluation.inference
    from pretrain.evaluation.attention_maps import render

    tokenizer = Tokenizer.load(tokenizer_dir)
    model = random_model(vocab_size=tokenizer.vocab_size).eval()
    trained = pretrain.evaluation.inference.Trained(model, tokenizer, {}, tmp_path / "step_00000010")
    loaded = []
    monkeypatch.setattr(
        pretrain.evaluation.inference, "load_trained", lambda path: loaded.append(path) or trained
    )
    text = "def f(x):\n\treturn x"
    result = render("run", text, str(tmp_path / "out" / "attn"))
    n = 1 + len(tokenizer.encode(text))  # after the EOS that starts every document
    assert loaded == ["run"]
    assert result == {
        "png": str(tmp_path / "out" / "attn.png"),
        "html": str(tmp_path / "out" / "attn.html"),
        "tokens": n,
        "layers": 2,
        "heads": 4,
    }
    assert imread(result["png"]).ndim == 3
    data = embedded_data((tmp_path / "out" / "attn.html").read_text(encoding="utf-8"))
    assert data["tokens"][0] == "</s>" and len(data["tokens"]) == n
    assert np.array(data["attention"]).shape == (2, 4, n, n)
    with pytest.raises(UserError, match="text is empty"):
        render("run", "", str(tmp_path / "empty"))
    with pytest.raises(UserError, match="exceed the model's max_seq_len=64"):
        render("run", "word " * 100, str(tmp_path / "long"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_render_refuses_a_missing_checkpoint(tmp_path):
    from pretrain.evaluation.attention_maps import render

    with pytest.raises(UserError, match="does not exist"):
        render(str(tmp_path / "nowhere"), "text", str(tmp_path / "attn"))
    assert list(tmp_path.iterdir()) == []

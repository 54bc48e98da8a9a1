"""Attention maps of a trained model for one text, drawn two ways (a self-contained BertViz-style view).

- a PNG grid (`save_grid_png`, or `grid_image` as an RGB array for TensorBoard): one heatmap per
  (layer, head), rows = layers, columns = heads; query tokens down the y axis, key tokens along x;
- one HTML file (`save_head_view_html`) with an interactive head view: pick a layer, click head
  swatches to select heads; lines from each query token (left) to each key token (right) are as
  opaque as the attention weight, one colour per head; hover a token to see only its lines.
  Everything is inline (no network): the weights are embedded as JSON.

`render` does it all for a checkpoint (or a Hugging Face directory: `load_trained`) and a text.
Maps are (L layers, H heads, T queries, T keys), softmax probabilities; the model is causal, so
everything above the diagonal is 0.
"""

from __future__ import annotations

import html
import json
import math
import re
from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pretrain import atomic
from pretrain.errors import UserError
from pretrain.model.transformer import Transformer
from pretrain.tokenizer import Tokenizer

MAX_FIGURE_PIXELS = 8192  # per side: big models get a lower dpi rather than a gigapixel PNG
LABEL_FONT_SIZE = 7  # points
MAX_LABEL_CHARS = 12  # longer token labels are cut in the PNG (the HTML shows them whole)
HTML_DECIMALS = 4  # weights are rounded to this in the HTML's JSON

Maps = torch.Tensor | np.ndarray  # (layers, heads, T, T), as attention_maps returns


def attention_maps(model: Transformer, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
    """(L, H, T, T) float32 attention probabilities of one sequence, on the CPU."""
    tokens = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    limit = model.cfg.max_seq_len
    if tokens.numel() == 0:
        raise UserError("no tokens to visualize: give a non-empty text")
    if tokens.numel() > limit:
        raise UserError(f"{tokens.numel()} tokens exceed the model's max_seq_len={limit}: shorten the text")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            device = next(model.parameters()).device
            attentions = model(tokens[None].to(device), need_weights=True).attentions  # L × (1, H, T, T)
    finally:
        model.train(was_training)
    return torch.stack(attentions)[:, 0].float().cpu()


def piece_labels(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """One readable label per token (`Tokenizer.piece_labels`): a SentencePiece piece with "▁" as a
    space, ASCII byte pieces as their character; a Hugging Face token's text (a byte-level token's
    bytes); whitespace that would be invisible drawn as ↵ ⇥ ␣."""
    return tokenizer.piece_labels(ids)


# --------------------------------------------------------------------------- PNG grid


def _checked(maps: Maps, labels: list[str]) -> np.ndarray:
    maps = np.asarray(maps, dtype=np.float32)
    if maps.ndim != 4 or maps.shape[2] != maps.shape[3] or maps.shape[2] != len(labels):
        raise ValueError(f"maps of shape {maps.shape} do not fit (layers, heads, T, T) with T={len(labels)}")
    return maps


def grid_figure(maps: Maps, labels: list[str], title: str | None = None) -> Figure:
    """The (layer, head) grid of heatmaps as a matplotlib Figure (no pyplot, no display).

    Margins are computed in inches rather than by a layout engine, and only the outer subplots get
    ticks: both would otherwise take minutes for a 32 × 32 grid."""
    maps = _checked(maps, labels)
    n_layers, n_heads, T, _ = maps.shape
    cell = min(max(0.6 + 0.1 * T, 1.2), 5.0)  # inches per subplot: room for labels when T is large
    # Show at most as many labels as fit at LABEL_FONT_SIZE, each cut to MAX_LABEL_CHARS.
    step = math.ceil(T / max(1, int(cell * 72 / (LABEL_FONT_SIZE * 1.3))))
    ticks = list(range(0, T, step))
    shown = [t if len(t) <= MAX_LABEL_CHARS else t[: MAX_LABEL_CHARS - 1] + "…" for t in labels[::step]]
    label_space = 0.1 + max(map(len, shown)) * LABEL_FONT_SIZE * 0.65 / 72  # inches
    left, right, top, bottom, gap = 0.4 + label_space, 0.2, 0.9, 0.1 + label_space, 0.15
    width = left + right + n_heads * cell + (n_heads - 1) * gap
    height = top + bottom + n_layers * cell + (n_layers - 1) * gap
    dpi = min(100.0, MAX_FIGURE_PIXELS / max(width, height))
    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    spacing = dict(
        left=left / width,
        right=1 - right / width,
        top=1 - top / height,
        bottom=bottom / height,
        wspace=gap / cell,
        hspace=gap / cell,
    )
    axes = fig.subplots(n_layers, n_heads, squeeze=False, gridspec_kw=spacing)
    for layer in range(n_layers):
        for head in range(n_heads):
            ax = axes[layer, head]
            ax.imshow(
                maps[layer, head], vmin=0.0, vmax=1.0, cmap="Blues", interpolation="nearest", aspect="auto"
            )
            # Token labels only on the outer subplots: keys along the bottom row, queries down the first column.
            ax.set_xticks(ticks if layer == n_layers - 1 else [])
            ax.set_yticks(ticks if head == 0 else [])
            if layer == n_layers - 1:
                ax.set_xticklabels(shown, rotation=90, fontsize=LABEL_FONT_SIZE, parse_math=False)
            if head == 0:
                ax.set_yticklabels(shown, fontsize=LABEL_FONT_SIZE, parse_math=False)  # "$" is not mathtext
            ax.tick_params(length=2)
            if layer == 0:
                ax.set_title(f"head {head}", fontsize=9)
            if head == 0:
                ax.set_ylabel(f"layer {layer}", fontsize=9)
    caption = "each map: query token (from) down, key token (to) across; pale 0 → dark blue 1"
    fig.suptitle(
        f"{title}\n{caption}" if title else caption,
        y=1 - 0.1 / height,
        va="top",
        fontsize=10,
        parse_math=False,
    )
    return fig


def save_grid_png(maps: Maps, labels: list[str], path: str | Path, title: str | None = None) -> Path:
    """Write the grid as a PNG, atomically (a crash leaves no half-written file)."""
    path = Path(path)
    fig = grid_figure(maps, labels, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=fig.dpi)
    return path


def grid_image(maps: Maps, labels: list[str], title: str | None = None) -> np.ndarray:
    """The grid as an (H, W, 3) uint8 array, e.g. for SummaryWriter.add_image(..., dataformats="HWC")."""
    fig = grid_figure(maps, labels, title)
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


# --------------------------------------------------------------------------- HTML head view

DATA_ELEMENT_ID = "attention-data"

HEAD_VIEW_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>__TITLE__</title>
<style>
  body { font-family: sans-serif; margin: 16px; color: #222; }
  #controls { display: flex; gap: 16px; align-items: center; flex-wrap: wrap; margin-bottom: 8px; }
  .swatch { display: inline-block; width: 18px; height: 18px; margin-right: 3px; cursor: pointer;
            border: 2px solid #fff; border-radius: 3px; vertical-align: middle; }
  .swatch.off { opacity: 0.15; }
  .hint { color: #777; font-size: 12px; }
  svg text { font-family: monospace; font-size: 13px; white-space: pre; cursor: default; }
</style>
</head>
<body>
<h3 id="title"></h3>
<div id="controls">
  <label>Layer <select id="layer"></select></label>
  <span>Heads <span id="heads"></span></span>
  <span class="hint">click a head to toggle it, double-click to show it alone; hover a token to see its lines</span>
</div>
<svg id="view"></svg>
<script type="application/json" id="__DATA_ID__">__DATA__</script>
<script>
"use strict";
const data = JSON.parse(document.getElementById("__DATA_ID__").textContent);
const nLayers = data.attention.length, nHeads = data.attention[0].length, T = data.tokens.length;
const ROW = 22, TOP = 12, LEFT_X = 10, GAP = 260, MIN_WEIGHT = 0.003;
const svg = document.getElementById("view");
const svgNS = svg.namespaceURI;  // the SVG namespace, without writing a URL into the page
const color = h => `hsl(${Math.round(360 * h / nHeads)}, 75%, 42%)`;
let layer = 0, selected = new Set([...Array(nHeads).keys()]), focus = null;  // focus: {side, index}

document.getElementById("title").textContent = data.title;
const layerSelect = document.getElementById("layer");
for (let l = 0; l < nLayers; l++) layerSelect.add(new Option(String(l), String(l)));
layerSelect.onchange = () => { layer = Number(layerSelect.value); draw(); };

const swatches = [];
for (let h = 0; h < nHeads; h++) {
  const s = document.createElement("span");
  s.className = "swatch";
  s.style.background = color(h);
  s.title = "head " + h;
  s.onclick = () => { selected.has(h) ? selected.delete(h) : selected.add(h); draw(); };
  s.ondblclick = () => { selected = new Set([h]); draw(); };
  document.getElementById("heads").appendChild(s);
  swatches.push(s);
}

function element(name, attributes) {
  const e = document.createElementNS(svgNS, name);
  for (const [k, v] of Object.entries(attributes)) e.setAttribute(k, v);
  return e;
}

// Token text is set with textContent, never parsed as markup.
function tokenColumn(side, x, anchor) {
  const texts = [];
  data.tokens.forEach((token, i) => {
    const t = element("text", {x: x, y: TOP + i * ROW + 14, "text-anchor": anchor});
    t.textContent = token;
    t.onmouseenter = () => { focus = {side: side, index: i}; draw(); };
    t.onmouseleave = () => { focus = null; draw(); };
    svg.appendChild(t);
    texts.push(t);
  });
  return texts;
}

const labelWidth = Math.max(40, ...data.tokens.map(t => t.length * 8 + 10));
const lineX1 = LEFT_X + labelWidth, lineX2 = lineX1 + GAP;
svg.setAttribute("width", lineX2 + labelWidth + 20);
svg.setAttribute("height", TOP * 2 + T * ROW);
const lines = element("g", {});
svg.appendChild(lines);
const leftTexts = tokenColumn("from", lineX1 - 6, "end");
const rightTexts = tokenColumn("to", lineX2 + 6, "start");

function draw() {
  swatches.forEach((s, h) => s.classList.toggle("off", !selected.has(h)));
  lines.replaceChildren();
  const fromWeight = new Array(T).fill(0), toWeight = new Array(T).fill(0);
  for (const h of selected) {
    const map = data.attention[layer][h];
    for (let i = 0; i < T; i++) {
      if (focus && focus.side === "from" && focus.index !== i) continue;
      for (let j = 0; j < T; j++) {
        if (focus && focus.side === "to" && focus.index !== j) continue;
        const w = map[i][j];
        if (w < MIN_WEIGHT) continue;
        fromWeight[i] = Math.max(fromWeight[i], w);
        toWeight[j] = Math.max(toWeight[j], w);
        lines.appendChild(element("line", {
          x1: lineX1, y1: TOP + i * ROW + 10, x2: lineX2, y2: TOP + j * ROW + 10,
          stroke: color(h), "stroke-width": 2, "stroke-opacity": w,
        }));
      }
    }
  }
  // With a token in focus, the other column's tokens are shaded by the weight they get.
  leftTexts.forEach((t, i) => t.setAttribute("fill-opacity", focus && focus.side === "to" ? 0.25 + 0.75 * fromWeight[i] : 1));
  rightTexts.forEach((t, j) => t.setAttribute("fill-opacity", focus && focus.side === "from" ? 0.25 + 0.75 * toWeight[j] : 1));
}
draw();
</script>
</body>
</html>
"""


def head_view_json(maps: Maps, labels: list[str], title: str | None = None) -> str:
    """The data the page embeds: {"title", "tokens", "attention": [layer][head][query][key]}, made safe
    to sit inside a <script> element (<, > and & as \\u escapes, which JSON.parse reads back)."""
    maps = _checked(maps, labels)
    data = {"title": title or "", "tokens": list(labels), "attention": np.round(maps, HTML_DECIMALS).tolist()}
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def save_head_view_html(maps: Maps, labels: list[str], path: str | Path, title: str | None = None) -> Path:
    """Write the interactive head view as one self-contained HTML file, atomically."""
    path = Path(path)
    values = {
        "TITLE": html.escape(title or "attention head view"),
        "DATA_ID": DATA_ELEMENT_ID,
        "DATA": head_view_json(maps, labels, title),
    }
    # One pass, so a placeholder-like string inside the title or the tokens is never substituted.
    page = re.sub(r"__(TITLE|DATA_ID|DATA)__", lambda m: values[m[1]], HEAD_VIEW_PAGE)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, page)
    return path


# --------------------------------------------------------------------------- end to end


def render(checkpoint: str, text: str, out_prefix: str) -> dict:
    """Attention maps of `text` under a checkpoint or a Hugging Face directory (whatever
    `load_trained` reads), as out_prefix.png and out_prefix.html."""
    from pretrain.evaluation.inference import load_trained  # checkpoint machinery: only needed here

    if not text:
        raise UserError("the text is empty: give some text to visualize")
    trained = load_trained(checkpoint)
    tokenizer = trained.tokenizer
    ids = tokenizer.encode_document(text)
    maps = attention_maps(trained.model, ids)
    labels = piece_labels(tokenizer, ids)
    title = f"{trained.directory}: {len(ids)} tokens"
    png = save_grid_png(maps, labels, f"{out_prefix}.png", title)
    page = save_head_view_html(maps, labels, f"{out_prefix}.html", title)
    n_layers, n_heads = maps.shape[:2]
    return {"png": str(png), "html": str(page), "tokens": len(ids), "layers": n_layers, "heads": n_heads}

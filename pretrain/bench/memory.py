"""`pretrain bench memory`: the memory plan's activation model (`pretrain/planning/memory.py`) against the
peak memory of one forward and backward pass, measured, for small models on this machine.

Each shape is built in bf16 (as DeepSpeed trains), every parameter's gradient dropped as soon as it
is accumulated (DeepSpeed moves it into its buckets at that point), and one pass of a random batch
measured: on a CPU, the peak of what torch's allocator holds, from its profiler's memory events
(`Total Allocated`); on a GPU, `torch.cuda.max_memory_allocated` above the weights. The model's
figure takes the LM head's chunk of the device the pass ran on (`pretrain/model/loss.py`).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from pretrain.config import ModelConfig
from pretrain.model.loss import chunk_rows
from pretrain.model.transformer import Transformer
from pretrain.parallel.engine import apply_activation_checkpointing
from pretrain.planning.memory import activation_bytes

# (name, model shape): grouped-query and multi-head attention, an explicit d_ff, one and several
# LM-head chunks; each at 2 and 4 layers, 2 × 512 tokens, checkpointing off and on
SHAPES = (
    ("gqa 8/2, V 512", {"d_model": 256, "n_heads": 8, "n_kv_heads": 2, "vocab_size": 512}),
    ("mha 6, d_ff 2048", {"d_model": 384, "n_heads": 6, "d_ff": 2048, "vocab_size": 512}),
    ("mqa 4/1, V 4096", {"d_model": 256, "n_heads": 4, "n_kv_heads": 1, "vocab_size": 4096}),
)
BATCH, SEQ_LEN = 2, 512


def measured_peak(
    cfg: ModelConfig, batch: int, seq_len: int, checkpointing: bool, device: str = "cpu"
) -> int:
    """Peak bytes above the weights during one forward and backward pass in bf16."""
    torch.manual_seed(0)
    model = Transformer(cfg).to(device=device, dtype=torch.bfloat16)
    if checkpointing:
        apply_activation_checkpointing(model)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model(tokens, tokens).loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        model(tokens, tokens).loss.backward()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    return max(e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]")


def run(as_json: bool = False) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for name, shape in SHAPES:
        for layers in (2, 4):
            cfg = ModelConfig(**shape, n_layers=layers, max_seq_len=SEQ_LEN)
            for checkpointing in (False, True):
                measured = measured_peak(cfg, BATCH, SEQ_LEN, checkpointing, device)
                chunk = chunk_rows(cfg.vocab_size, torch.device(device)) * cfg.vocab_size
                model = activation_bytes(cfg, BATCH * SEQ_LEN, checkpointing, chunk_logits=chunk)
                rows.append(
                    {
                        "shape": name,
                        "layers": layers,
                        "checkpointing": checkpointing,
                        "measured_bytes": measured,
                        "model_bytes": model,
                        "error": model / measured - 1,
                    }
                )
    if as_json:
        print(json.dumps({"device": device, "batch": BATCH, "seq_len": SEQ_LEN, "rows": rows}))
        return
    print(
        f"activation peak, {BATCH} x {SEQ_LEN} tokens in bf16 on {device}: measured against the plan's model"
    )
    for r in rows:
        print(
            f"  {r['shape']:<18} L={r['layers']} checkpointing {'on ' if r['checkpointing'] else 'off'} "
            f"{r['measured_bytes'] / 2**20:8.2f} MiB  model {r['model_bytes'] / 2**20:8.2f} MiB  {100 * r['error']:+5.1f}%"
        )

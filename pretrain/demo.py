"""`pretrain demo`: a short single-process CPU training run of the tiny model, with no download.

It trains `configs/train/tiny.yaml`'s model on the UTF-8 bytes of the local Python installation's
documentation (`pydoc_data.topics`), reports the held-out loss before and after, and exports the
result as a Hugging Face Llama directory. It is a smoke run of the model, config and export path;
the DeepSpeed training loop replaces it as the demo once it exists.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from pretrain.config import config_dir, load_config
from pretrain.errors import UserError
from pretrain.hf import save_hf
from pretrain.model import Transformer


def pydoc_bytes() -> torch.Tensor:
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def sample_windows(
    tokens: torch.Tensor, seq_len: int, batch: int, generator: torch.Generator
) -> torch.Tensor:
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=generator)
    return torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])  # (B, T+1)


@torch.no_grad()
def held_out_loss(model: Transformer, tokens: torch.Tensor, seq_len: int) -> float:
    model.eval()
    n = (len(tokens) - 1) // seq_len
    windows = torch.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
    losses = [model(w[:, :-1], w[:, 1:]).loss.item() for w in windows.split(8)]
    model.train()
    return sum(losses) / len(losses)


def run_demo(out_dir: str = "runs/demo", steps: int = 60) -> dict:
    if steps < 1:
        raise UserError(f"--steps {steps} must be at least 1")
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise UserError(f"--out {out_dir} is a file: pass a directory")
    cfg = load_config(config_dir() / "train" / "tiny.yaml", [f"run.dir={out_dir}"])
    torch.manual_seed(cfg.run.seed)
    generator = torch.Generator().manual_seed(cfg.run.seed)
    tokens = pydoc_bytes()
    split = int(0.95 * len(tokens))
    train_tokens, val_tokens = tokens[:split], tokens[split:]
    seq_len, batch = cfg.data.seq_len, cfg.train.micro_batch_size

    model = Transformer(cfg.model)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2)
    )
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"demo: tiny model ({n_params / 1e6:.2f}M params), {steps} steps of {batch}×{seq_len} tokens "
        f"on {len(train_tokens) / 1e3:.0f}k bytes of Python docs"
    )
    before = held_out_loss(model, val_tokens, seq_len)
    print(f"held-out loss before: {before:.3f} (ln 256 = {math.log(256):.3f} is a uniform guess over bytes)")
    start = time.perf_counter()
    for step in range(1, steps + 1):
        window = sample_windows(train_tokens, seq_len, batch, generator)
        loss = model(window[:, :-1], window[:, 1:]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps:
            rate = step * batch * seq_len / (time.perf_counter() - start)
            print(f"step {step:>4}/{steps}  loss {loss.item():.3f}  {rate:,.0f} tokens/s")
    after = held_out_loss(model, val_tokens, seq_len)
    print(f"held-out loss after:  {after:.3f}")
    hf_dir = save_hf(model, Path(out_dir) / "hf")
    print(
        f"exported a Hugging Face Llama model to {hf_dir} "
        f"(load with transformers.LlamaForCausalLM.from_pretrained('{hf_dir}'))"
    )
    return {"loss_before": before, "loss_after": after, "hf_dir": str(hf_dir)}

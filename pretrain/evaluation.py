"""Held-out evaluation during pretraining, and the attention probe and samples drawn at each
evaluation.

All are collectives: every rank runs its share of the forward passes (ZeRO-3 gathers parameters
collectively), and the totals are summed over ranks.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from pretrain.data import BatchLoader, WindowStream
from pretrain.data.loader import document_ids
from pretrain.distributed import DistEnv, all_reduce_sum
from pretrain.errors import UserError
from pretrain.tokenizer import Tokenizer


@torch.no_grad()
def validation_loss(
    engine,
    data_dir: Path,
    seq_len: int,
    micro_batch_size: int,
    batches: int,
    env: DistEnv,
    eos_id: int | None = None,
) -> dict[str, float]:
    """Mean loss (and perplexity) over the first `batches` micro-batches of every rank's share of
    the validation split; with `eos_id`, attention kept inside each document (document masking)."""
    stream = WindowStream(data_dir, seq_len, env.rank, env.world_size, split="validation")
    loader = BatchLoader(stream, micro_batch_size, engine.device)
    engine.eval()
    totals = torch.zeros(2, device=engine.device)  # loss sum, batches
    try:
        for batch_index, (inputs, targets) in enumerate(loader):
            if batch_index == batches:
                break
            masking = {"document_ids": document_ids(inputs, eos_id)} if eos_id is not None else {}
            loss = engine(inputs, targets, **masking).loss
            totals += torch.stack([loss.float(), torch.ones((), device=engine.device)])
    finally:
        loader.close()
        engine.train()
    all_reduce_sum(totals)
    if totals[1].item() == 0:
        raise UserError(
            f"the validation split of {data_dir} has fewer than train.micro_batch_size={micro_batch_size} "
            "windows per rank: prepare with a larger --val-fraction, or set eval.every=0"
        )
    loss = (totals[0] / totals[1]).item()
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


def attention_probe(
    engine, tokenizer: Tokenizer, text: str, max_seq_len: int, step: int, is_main: bool
) -> np.ndarray | None:
    """The (layers × heads) attention grid of `text` as an RGB image on rank 0 (None elsewhere);
    every rank runs the forward."""
    from pretrain.attention import attention_maps, grid_image, piece_labels

    ids = tokenizer.encode_document(text)[:max_seq_len]
    maps = attention_maps(engine.module, ids)
    if not is_main:
        return None
    return grid_image(maps, piece_labels(tokenizer, ids), f"step {step}")


@torch.no_grad()
def continuations(
    engine, tokenizer: Tokenizer, prompts: list[str], max_new_tokens: int, temperature: float, step: int
) -> list[str]:
    """What the model writes after each prompt (a new document; KV cache), greedy at temperature 0,
    else sampled with a generator seeded by the step and the prompt's index. Every rank decodes the
    same tokens (same weights, same seeds), so ZeRO-3's collective parameter gathers stay in step."""
    from pretrain.inference import continuation

    model = engine.module
    model.eval()
    texts = []
    try:
        for index, prompt in enumerate(prompts):
            generator = torch.Generator(device=engine.device).manual_seed(step * 1009 + index)
            texts.append(
                continuation(model, tokenizer, prompt, max_new_tokens, temperature, 50, 0.95, generator)
            )
    finally:
        model.train()
    return texts

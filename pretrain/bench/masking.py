"""`pretrain bench masking CONFIG`: the training step with document masking against without.

The same model (from a preset or a run config's model section), the same random batch, forward +
backward + an AdamW step, once with `document_ids` (documents of random lengths, mean
`document_tokens`, packed into each window as the loader packs them) and once without. After
warm-up the two alternate step by step, in the order A B B A, so drift on a shared machine falls
on both; the figures are medians. The kernel is the one training uses on this device: a dense
boolean mask for SDPA on CPU, a FlexAttention block mask on CUDA; unmasked is SDPA's causal path
(flash attention on GPUs).
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from pretrain.bench.train import BenchSettings, load_run_config
from pretrain.errors import UserError
from pretrain.model.transformer import Transformer


def packed_document_ids(
    batch: int, seq_len: int, mean_tokens: float, generator: torch.Generator
) -> torch.Tensor:
    """(batch, seq_len) document ids of documents with geometric lengths of mean `mean_tokens`."""
    p = min(1.0, 1.0 / mean_tokens)
    starts = torch.rand(batch, seq_len, generator=generator) < p
    starts[:, 0] = False
    return torch.cumsum(starts.int(), dim=1)


def run(
    config: str,
    seq_len: int | None = None,
    micro_batch_size: int | None = None,
    document_tokens: float = 512.0,
    steps: int = 10,
    warmup: int = 2,
    dtype: str = "bf16",
    as_json: bool = False,
) -> dict:
    if document_tokens < 1 or steps < 1 or (micro_batch_size is not None and micro_batch_size < 1):
        raise UserError("--document-tokens, --steps and --micro-batch-size must be at least 1")
    run_cfg = load_run_config(config, BenchSettings(seq_len=seq_len, micro_batch_size=micro_batch_size))
    cfg, seq_len, micro_batch_size = run_cfg.model, run_cfg.data.seq_len, run_cfg.train.micro_batch_size
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = Transformer(cfg).to(device=device, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch_size, seq_len + 1), generator=generator).to(device)
    ids = packed_document_ids(micro_batch_size, seq_len, document_tokens, generator).to(device)
    arms = {"unmasked": None, "masked": ids}

    def step(document_ids) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(tokens[:, :-1], tokens[:, 1:], document_ids=document_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    medians = _interleaved_medians(step, arms, warmup, steps)
    documents = float((ids[:, -1] + 1).float().mean())
    result = {
        "config": config,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": dtype,
        "seq_len": seq_len,
        "micro_batch_size": micro_batch_size,
        "documents_per_window": documents,
        "step_seconds_unmasked": medians["unmasked"],
        "step_seconds_masked": medians["masked"],
        "masked_over_unmasked": medians["masked"] / medians["unmasked"],
        "torch": torch.__version__,
    }
    if as_json:
        print(json.dumps(result))
    else:
        _print_masking(result, steps)
    return result


def _interleaved_medians(step, arms: dict, warmup: int, steps: int) -> dict[str, float]:
    """Each arm's median step time, the arms alternating in order (A B, B A, ...) so that a
    machine's drift falls on both."""
    for _ in range(warmup):
        for document_ids in arms.values():
            step(document_ids)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for i in range(steps):
        order = list(arms) if i % 2 == 0 else list(reversed(arms))
        for name in order:
            times[name].append(step(arms[name]))
    return {name: statistics.median(values) for name, values in times.items()}


def _print_masking(result: dict, steps: int) -> None:
    print(
        f"{result['config']} on {result['device']}, {result['dtype']}, {result['micro_batch_size']} x "
        f"{result['seq_len']} tokens, {result['documents_per_window']:.1f} documents per window "
        f"(median of {steps} steps each):"
    )
    print(f"  unmasked (causal):      {result['step_seconds_unmasked'] * 1e3:8.1f} ms")
    print(f"  document masking:       {result['step_seconds_masked'] * 1e3:8.1f} ms")
    print(f"  masked / unmasked:      {result['masked_over_unmasked']:8.3f}")

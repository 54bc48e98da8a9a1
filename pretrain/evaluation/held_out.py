"""Held-out evaluation during pretraining, and the attention probe and samples drawn at each
evaluation.

All are collectives: every rank runs its share of the forward passes (ZeRO-3 gathers parameters
collectively), and the totals are summed over ranks.

What the held-out loss reads: rank r of W takes the validation windows r, r + W, r + 2W, ... in
file order and evaluates the first `eval.batches` whole micro-batches (train.micro_batch_size
windows) of them, in bf16; so the first eval.batches × micro-batch × W windows of the split (fewer
when the split is smaller), and the loss is the mean over those micro-batches. `RunEvaluation`
recovers this from a checkpoint, and `run_validation_loss` computes it in one process, rank by
rank (`pretrain eval --as-run`), giving the number the run logged.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from monitoring.protocol import SUMMARY_FILE
from pretrain.checkpoint.layout import TRAIN_STATE
from pretrain.data import BatchLoader, WindowStream
from pretrain.data.loader import document_ids
from pretrain.errors import UserError
from pretrain.parallel.distributed import DistEnv, all_reduce_sum
from pretrain.parallel.sequence import SequenceShard
from pretrain.tokenizer import Tokenizer


def rank_totals(
    forward,
    data_dir: Path,
    seq_len: int,
    micro_batch_size: int,
    batches: int,
    rank: int,
    world_size: int,
    device,
    eos_id: int | None = None,
) -> torch.Tensor:
    """[loss sum, micro-batches] over the first `batches` micro-batches of rank `rank`'s share of
    the validation split (a partial micro-batch is left out); `forward` is the engine or the model."""
    stream = WindowStream(data_dir, seq_len, rank, world_size, split="validation")
    loader = BatchLoader(stream, micro_batch_size, device)
    totals = torch.zeros(2, device=device)
    try:
        for batch_index, (inputs, targets) in enumerate(loader):
            if batch_index == batches:
                break
            masking = {"document_ids": document_ids(inputs, eos_id)} if eos_id is not None else {}
            loss = forward(inputs, targets, **masking).loss
            totals += torch.stack([loss.float(), torch.ones((), device=device)])
    finally:
        loader.close()
    return totals


@torch.no_grad()
def validation_loss(
    engine,
    data_dir: Path,
    seq_len: int,
    micro_batch_size: int,
    batches: int,
    env: DistEnv,
    eos_id: int | None = None,
    shard: SequenceShard | None = None,
) -> dict[str, float]:
    """Mean loss (and perplexity) over the first `batches` micro-batches of every rank's share of
    the validation split; with `eos_id`, attention kept inside each document (document masking).
    With `shard` (parallel.sequence), the share is its data-parallel rank's, each rank of its group
    passing the model its shard of each window (every rank then holds the windows' mean)."""
    shard = shard or SequenceShard.of(env.rank, env.world_size, 1)
    engine.eval()
    try:
        totals = rank_totals(
            shard.calling(engine),
            data_dir,
            seq_len,
            micro_batch_size,
            batches,
            shard.data_rank,
            shard.data_world,
            engine.device,
            eos_id,
        )
    finally:
        engine.train()
    all_reduce_sum(totals)
    if totals[1].item() == 0:
        raise UserError(
            f"the validation split of {data_dir} has fewer than train.micro_batch_size={micro_batch_size} "
            "windows per rank: prepare with a larger --val-fraction, or set eval.every=0"
        )
    loss = (totals[0] / totals[1]).item()
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


@dataclass(frozen=True)
class RunEvaluation:
    """How a pretraining run evaluated, from one of its checkpoints: what `validation_loss` read."""

    step: int
    seq_len: int
    micro_batch_size: int
    batches: int  # eval.batches, per rank
    world_size: int  # data-parallel ranks of the job that saved the checkpoint (and evaluated at its step)
    document_masking: bool
    fingerprints: dict[str, str]  # corpus name → fingerprint (data.dir alone is "data")

    @classmethod
    def of(cls, directory: Path, run_config: dict) -> RunEvaluation | None:
        """From a checkpoint directory of ours and its run_config.json; None for a fine-tune or a
        directory without train_state.json (a Hugging Face export)."""
        state_path = Path(directory) / TRAIN_STATE
        if "finetune" in run_config or not state_path.is_file():
            return None
        state = json.loads(state_path.read_text())
        data = state["data"]
        fingerprints = (
            {name: source["stream"]["fingerprint"] for name, source in data["sources"].items()}
            if "sources" in data
            else {"data": data["fingerprint"]}
        )
        return cls(
            state["step"],
            run_config["data"]["seq_len"],
            run_config["train"]["micro_batch_size"],
            run_config["eval"]["batches"],
            state["world_size"] // (run_config.get("parallel") or {}).get("sequence", 1),
            bool(run_config["data"].get("document_masking")),
            fingerprints,
        )

    def windows(self, num_windows: int) -> int:
        """Of a validation split of `num_windows` windows, how many the run's evaluation reads."""
        per_rank = num_windows // self.world_size
        return min(self.batches, per_rank // self.micro_batch_size) * self.micro_batch_size * self.world_size

    def describe(self) -> str:
        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        masking = ", document masking" if self.document_masking else ""
        return (
            f"eval.batches={self.batches} × train.micro_batch_size={self.micro_batch_size} × {ranks}{masking}"
        )

    def metric(self, fingerprint: str) -> str | None:
        """What the run logged for the corpus of this fingerprint (`eval/loss`, or `eval/loss/NAME`
        of a mixture's corpus); None when the run did not evaluate that corpus."""
        names = [name for name, known in self.fingerprints.items() if known == fingerprint]
        if not names:
            return None
        return "eval/loss" if len(self.fingerprints) == 1 else f"eval/loss/{names[0]}"

    def metric_of(self, fingerprint: str, data_dir: Path) -> str:
        """The metric of the run's corpus `data_dir` is (by fingerprint); refused when it is none."""
        metric = self.metric(fingerprint)
        if metric is None:
            raise UserError(
                f"{data_dir} (corpus {fingerprint}) is not a corpus the run evaluated "
                f"({', '.join(f'{n}: {f}' for n, f in self.fingerprints.items())}): pass the run's data.dir"
            )
        return metric

    def logged(self, directory: Path, metric: str) -> float | None:
        """The value of `metric` the run logged at this checkpoint's step, from
        RUN_DIR/train_summary.json when it holds that evaluation."""
        try:
            summary = json.loads((Path(directory).parent.parent / SUMMARY_FILE).read_text())
        except (OSError, ValueError):
            return None
        key = metric.removeprefix("eval/")
        return next((e.get(key) for e in summary.get("eval", []) if e.get("step") == self.step), None)


@torch.no_grad()
def run_validation_loss(model, data_dir: Path, run: RunEvaluation, eos_id: int | None) -> dict:
    """The held-out loss the run's evaluation computes on `data_dir` with `model`, in this process:
    each rank's micro-batches in turn, their totals summed as the ranks' all-reduce sums them.
    Give it the model in bf16, as the engine held it, for the run's number."""
    device = next(model.parameters()).device
    totals = torch.zeros(2, device=device)
    for rank in range(run.world_size):
        totals += rank_totals(
            model,
            data_dir,
            run.seq_len,
            run.micro_batch_size,
            run.batches,
            rank,
            run.world_size,
            device,
            eos_id,
        )
    if totals[1].item() == 0:
        raise UserError(
            f"the validation split of {data_dir} has fewer than train.micro_batch_size={run.micro_batch_size} "
            f"windows per rank for {run.world_size} rank(s): the run could not have evaluated on it"
        )
    loss = (totals[0] / totals[1]).item()
    windows = int(totals[1].item()) * run.micro_batch_size
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "windows": windows,
        "tokens": windows * run.seq_len,
    }


def attention_probe(
    engine, tokenizer: Tokenizer, text: str, max_seq_len: int, step: int, is_main: bool
) -> np.ndarray | None:
    """The (layers × heads) attention grid of `text` as an RGB image on rank 0 (None elsewhere);
    every rank runs the forward."""
    from pretrain.evaluation.attention_maps import attention_maps, grid_image, piece_labels

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
    from pretrain.evaluation.inference import continuation

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

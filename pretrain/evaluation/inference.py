"""Using trained checkpoints without DeepSpeed engines: load, evaluate perplexity, sample, export.

`load_trained` consolidates any ZeRO stage's shards into fp32 weights with DeepSpeed's own
`zero_to_fp32` tool and rebuilds the model from the checkpoint's run_config.json; the tokenizer
comes from the checkpoint directory too (a SentencePiece tokenizer.model, or a Hugging Face
tokenizer.json). It takes a Hugging Face Llama directory as well (one `export_hf` wrote, or any with
safetensors weights and a tokenizer.model or tokenizer.json), so every command that reads a
checkpoint reads those.
"""

from __future__ import annotations

import functools
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from pretrain import atomic, checkpoint
from pretrain.config import ModelConfig
from pretrain.data import WindowStream, read_manifest
from pretrain.errors import UserError
from pretrain.model.transformer import KVCache, Transformer
from pretrain.reporting.console import silenced_stdout, verbose
from pretrain.tokenizer import HF_FILE, MODEL_FILE, Tokenizer

EXPORT_RUN_CONFIG = "pretrain_run.json"  # in an export: its checkpoint, and the data settings eval reads
# Eval windows of a model without a training seq_len are at most this long (DataConfig's default).
DEFAULT_WINDOW = 2048


@dataclass
class Trained:
    model: Transformer
    tokenizer: Tokenizer
    run_config: dict
    directory: Path


def read_checkpoint(path: str | Path) -> tuple[Path, dict, dict[str, torch.Tensor]]:
    """A complete checkpoint (or a run directory's newest): its directory, run_config.json, and
    the fp32 weights consolidated from any ZeRO stage's shards."""
    directory = checkpoint.find_checkpoint(path)
    run_config = json.loads((directory / checkpoint.RUN_CONFIG).read_text())
    if json.loads((directory / checkpoint.TRAIN_STATE).read_text()).get("expert_parallel", 1) > 1:
        return directory, run_config, split_experts_weights(directory)
    with silenced_stdout():  # DeepSpeed reports its progress on stdout
        from deepspeed.utils import zero_to_fp32

        if not verbose():  # and a "Loading checkpoint shards" bar on stderr
            zero_to_fp32.tqdm = functools.partial(tqdm, disable=True)
        state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
            str(directory.parent), tag=directory.name
        )
    return directory, run_config, state


def split_experts_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The fp32 weights of a checkpoint whose experts were split across ranks (`parallel.expert`),
    whole: each rank's file holds its own experts, which zero_to_fp32 cannot put together (it
    merges every group over all ranks); DeepSpeed's universal conversion can (with ours for the
    experts: pretrain/checkpoint/universal.py), into a temporary directory."""
    from pretrain.checkpoint import universal

    with tempfile.TemporaryDirectory() as folder, silenced_stdout():
        universal.convert(directory, Path(folder) / directory.name)
        return universal.universal_weights(Path(folder) / directory.name)


def task_of(run_config: dict) -> str:
    """`pretrain` for pretraining checkpoints, else the fine-tuning task (classification, sft)."""
    return (run_config.get("finetune") or {}).get("task", "pretrain")


def is_hf_directory(path: str | Path) -> bool:
    """A Hugging Face model directory (config.json), not a run or a checkpoint of ours."""
    path = Path(path)
    return (
        (path / "config.json").is_file()
        and not (path / checkpoint.RUN_CONFIG).exists()
        and not (path / "checkpoints").is_dir()
    )


def load_trained(path: str | Path, dtype: torch.dtype = torch.float32) -> Trained:
    """A language-model checkpoint (pretrained, or fine-tuned with sft) as an eval-mode model on the CPU;
    or a Hugging Face Llama directory (`load_hf_directory`)."""
    if is_hf_directory(path):
        return load_hf_directory(path, dtype)
    directory, run_config, state = read_checkpoint(path)
    if task_of(run_config) == "classification":
        raise UserError(
            f"{directory} is a classification fine-tune (no language-model head): "
            "use `pretrain predict`, or the checkpoint it was fine-tuned from"
        )
    model = Transformer.from_state_dict(ModelConfig(**run_config["model"]), state, dtype)
    return Trained(model.eval(), Tokenizer.load(directory), run_config, directory)


def load_hf_directory(path: str | Path, dtype: torch.dtype = torch.float32) -> Trained:
    """A Hugging Face Llama directory with its tokenizer (a SentencePiece tokenizer.model, else a
    tokenizer.json). Its run_config is what `export_hf` kept of the checkpoint's (EXPORT_RUN_CONFIG),
    or {} for a model from elsewhere."""
    from pretrain.model.hf import load_hf

    directory = Path(path)
    if not any((directory / name).is_file() for name in (MODEL_FILE, HF_FILE)):
        raise UserError(
            f"{directory} has no {MODEL_FILE} or {HF_FILE}: our commands tokenize with the model's own "
            f"tokenizer; copy the model's {MODEL_FILE} (SentencePiece) or {HF_FILE} there "
            "(`pretrain export-hf` writes one)"
        )
    tokenizer = Tokenizer.load(directory)
    model = load_hf(directory, dtype)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise UserError(
            f"{tokenizer.path} has {tokenizer.vocab_size} pieces but the model embeds "
            f"{model.cfg.vocab_size}: put the tokenizer the model was trained with there"
        )
    export_info = directory / EXPORT_RUN_CONFIG
    run_config = json.loads(export_info.read_text())["run_config"] if export_info.is_file() else {}
    return Trained(model.eval(), tokenizer, run_config, directory)


def window_length(trained: Trained) -> int:
    """Tokens per eval window: the training run's data.seq_len, else (a fine-tune, or a Hugging Face
    model from elsewhere) the model's context capped at DEFAULT_WINDOW."""
    seq_len = (trained.run_config.get("data") or {}).get("seq_len")
    return seq_len or min(trained.model.cfg.max_seq_len, DEFAULT_WINDOW)


@torch.no_grad()
def perplexity(
    trained: Trained, data_dir: str | Path, batch_size: int = 8, max_batches: int | None = None
) -> dict:
    """Mean next-token loss and perplexity over the validation split of a prepared corpus."""
    manifest = read_manifest(data_dir)
    if manifest["tokenizer"]["sha256"] != trained.tokenizer.sha256:
        raise UserError(
            f"{data_dir} was tokenized with a different tokenizer than {trained.directory}: "
            f"evaluate on data prepared with the checkpoint's {trained.tokenizer.file_name}"
        )
    seq_len = window_length(trained)
    windows = iter(WindowStream(data_dir, seq_len, split="validation"))
    total, count, batches = 0.0, 0, 0
    while max_batches is None or batches < max_batches:
        rows = [w for _, w in zip(range(batch_size), windows, strict=False)]
        if not rows:
            break
        batch = torch.stack(rows)
        loss = trained.model(batch[:, :-1], batch[:, 1:]).loss
        total += loss.item() * batch[:, 1:].numel()
        count += batch[:, 1:].numel()
        batches += 1
    if count == 0:
        raise UserError(f"the validation split of {data_dir} holds no window of {seq_len + 1} tokens")
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count, "checkpoint": str(trained.directory)}


def continue_text(
    checkpoint_path: str | Path,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = 0.95,
    seed: int = 0,
) -> str:
    """`pretrain generate`: the text a checkpoint (or Hugging Face directory) writes after `prompt`."""
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens} must be at least 1")
    return sample_text(load_trained(checkpoint_path), prompt, max_new_tokens, temperature, top_k, top_p, seed)


def sample_text(
    trained: Trained,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = 0.95,
    seed: int = 0,
) -> str:
    """The text a loaded model writes after `prompt`, which starts a new document."""
    generator = torch.Generator().manual_seed(seed)
    return continuation(
        trained.model, trained.tokenizer, prompt, max_new_tokens, temperature, top_k, top_p, generator
    )


def continuation(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator,
) -> str:
    """What `model` writes after `prompt` (a new document), until EOS or `max_new_tokens`."""
    ids = generate(
        model,
        tokenizer.encode_document(prompt),
        max_new_tokens,
        temperature,
        top_k,
        top_p,
        tokenizer.eos_id,
        generator,
    )
    return tokenizer.decode(ids)


def export_hf(checkpoint_path: str | Path, out: str | Path, dtype: str = "float32") -> tuple[Path, Path]:
    """`pretrain export-hf`: a checkpoint as a Hugging Face Llama directory; returns (checkpoint, out)."""
    trained = load_trained(checkpoint_path)
    return trained.directory, export_trained(trained, out, dtype)


def export_trained(trained: Trained, out: str | Path, dtype: str = "float32") -> Path:
    """Write config.json and model.safetensors (`save_hf`), the tokenizer files and
    generation_config.json (`save_hf_tokenizer`), and EXPORT_RUN_CONFIG: the source checkpoint and
    the part of its run config our commands read back, so `eval` on the export equals `eval` on it."""
    from pretrain.model import hf

    tok = trained.tokenizer
    hf.check_llama_compatible(trained.model.cfg)  # both checks before anything is written
    hf.check_tokenizer_exportable(tok)
    directory = hf.save_hf(trained.model, out, token_ids=hf.hf_token_ids(tok), dtype=getattr(torch, dtype))
    hf.save_hf_tokenizer(tok, directory, trained.model.cfg.max_seq_len)
    masking = bool((trained.run_config.get("data") or {}).get("document_masking", False))
    kept = {"data": {"seq_len": window_length(trained), "document_masking": masking}}  # what eval reads
    atomic.write_json(
        directory / EXPORT_RUN_CONFIG, {"exported_from": str(trained.directory), "run_config": kept}
    )
    return directory


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = 0.95,
    stop_id: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Sample a continuation with a KV cache: one prefill, then one token per forward."""
    if not prompt_ids:
        raise UserError("the prompt is empty")
    limit = model.cfg.max_seq_len
    if len(prompt_ids) >= limit:
        prompt_ids = prompt_ids[-(limit - 1) :]
    max_new_tokens = min(max_new_tokens, limit - len(prompt_ids))
    device = next(model.parameters()).device
    cache = KVCache(model.cfg, 1, len(prompt_ids) + max_new_tokens, next(model.parameters()).dtype, device)
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache).logits[:, -1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = sample_token(logits[0].float(), temperature, top_k, top_p, generator)
        if token == stop_id:
            break
        out.append(token)
        logits = model(torch.tensor([[token]], device=device), cache=cache).logits[:, -1]
    return out


def sample_token(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, generator=None
) -> int:
    """Greedy at temperature 0; otherwise softmax(logits / T) restricted to the top k tokens and
    to the smallest set whose probability reaches top_p."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))

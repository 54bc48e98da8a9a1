"""`finetune.init` (and pretraining's `checkpoint.init`): the model a run starts from, checked
against its tokenizer before any weights are read."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pretrain import checkpoint
from pretrain.config import ModelConfig, ScheduleConfig
from pretrain.errors import UserError
from pretrain.evaluation.inference import task_of
from pretrain.model.transformer import Transformer
from pretrain.optim.schedules import peak_of
from pretrain.tokenizer import HF_FILE, MODEL_FILE, Tokenizer

# The learning rate fine-tuning takes when optim.lr is unset: a tenth of the checkpoint's pretraining
# peak (measured: the demo model, pretrained at 3e-3, classifies four kinds of fortune at 0.58 / 0.66
# / 0.61 validation accuracy after 3 epochs at 1e-4 / 3e-4 / 1e-3, docs/finetuning.md), and a rate
# for a Hugging Face directory, which does not record its pretraining's.
LR_FRACTION = 0.1
HF_LR = 1e-4


@dataclass
class InitialModel:
    """`finetune.init` before its weights are read: enough to check the data against it."""

    directory: Path
    kind: str  # "hf" | "checkpoint"
    model_cfg: ModelConfig
    tokenizer: Tokenizer
    trained_lr: float | None = None  # a checkpoint of ours: the (peak) rate its run trained at
    fine_tuned: bool = False  # ... and that run was a fine-tuning run

    def learning_rate(self) -> tuple[float, str]:
        """The fine-tuning rate when optim.lr is unset, and where it comes from."""
        if self.trained_lr is None:
            return HF_LR, "a Hugging Face directory does not record its pretraining rate"
        if self.fine_tuned:
            return self.trained_lr, "the rate it was fine-tuned at"
        return LR_FRACTION * self.trained_lr, f"a tenth of its pretraining peak, {self.trained_lr:.1e}"

    @property
    def source(self) -> str:
        return f"{'Hugging Face model' if self.kind == 'hf' else 'checkpoint'} {self.directory}"

    def load_model(self, model_cfg: ModelConfig | None = None) -> Transformer:
        """The model with these weights, as `model_cfg` describes it when given: the same shapes,
        another context (`checkpoint.init`: max_seq_len, rope_theta, rope_scaling); else its own."""
        cfg = model_cfg or self.model_cfg
        if self.kind == "hf":
            from pretrain.model.hf import read_llama_weights

            return Transformer.from_state_dict(cfg, read_llama_weights(self.directory, self.model_cfg))
        from pretrain.evaluation.inference import read_checkpoint, task_of

        _, run_config, state = read_checkpoint(self.directory)
        if task_of(run_config) == "classification":  # its backbone, without the old head
            state = {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
        return Transformer.from_state_dict(cfg, state)


def trained_peak(run_config: dict, d_model: int) -> float | None:
    """The peak learning rate a run of ours trained at, from its recorded config (None if absent)."""
    lr = (run_config.get("optim") or {}).get("lr")
    if lr is None:
        return None
    schedule = ScheduleConfig(**run_config["schedule"]) if "schedule" in run_config else ScheduleConfig()
    return peak_of(lr, schedule, d_model)


def find_initial(path: str) -> InitialModel:
    """A Hugging Face Llama directory (config.json), or a checkpoint of ours."""
    directory = Path(path)
    if (directory / "config.json").is_file():
        from pretrain.model.hf import model_config_from_llama

        if not any((directory / name).is_file() for name in (MODEL_FILE, HF_FILE)):
            raise UserError(
                f"{directory} has no {MODEL_FILE} or {HF_FILE}: fine-tuning tokenizes with the model's own "
                "tokenizer; copy it there (`pretrain export-hf` does)"
            )
        cfg = model_config_from_llama(json.loads((directory / "config.json").read_text()), str(directory))
        initial = InitialModel(directory, "hf", cfg, Tokenizer.load(directory))
    else:
        found = checkpoint.find_checkpoint(directory)
        run_config = json.loads((found / checkpoint.RUN_CONFIG).read_text())
        cfg = ModelConfig(**run_config["model"])
        if (run_config.get("finetune") or {}).get("task") == "classification" and not cfg.tie_embeddings:
            raise UserError(
                f"{found} is a classification fine-tune without a language-model head: start from its init"
            )
        initial = InitialModel(
            found,
            "checkpoint",
            cfg,
            Tokenizer.load(found),
            trained_lr=trained_peak(run_config, cfg.d_model),
            fine_tuned=task_of(run_config) != "pretrain",
        )
    if initial.tokenizer.vocab_size > cfg.vocab_size:
        raise UserError(
            f"tokenizer/vocabulary mismatch: {initial.tokenizer.path} has {initial.tokenizer.vocab_size} pieces "
            f"but the model in {path} embeds {cfg.vocab_size}: use the tokenizer the model was trained with"
        )
    return initial

"""A decoder with a classification head, GPT-1 style: a linear layer on the final hidden state
of each sequence's last token (the end-of-sequence token that closes every example).

The language-model head is dropped: fine-tuning trains the backbone and the head only, and a
classification checkpoint holds `backbone.*` (the decoder without `lm_head`) and `score.weight`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config import ModelConfig
from pretrain.model.transformer import Transformer


class ClassifierOutput(NamedTuple):
    logits: torch.Tensor  # (B, num_labels), fp32
    loss: torch.Tensor | None


class SequenceClassifier(nn.Module):
    def __init__(self, backbone: Transformer, num_labels: int, init_std: float | None = None):
        super().__init__()
        backbone.lm_head = nn.Identity()  # unused; a tied head's weight stays as the embeddings
        self.backbone = backbone
        self.score = nn.Linear(backbone.cfg.d_model, num_labels, bias=False)
        nn.init.normal_(self.score.weight, std=init_std or backbone.cfg.init_std)

    @property
    def layers(self) -> nn.ModuleList:  # for activation checkpointing and compile, as on the decoder
        return self.backbone.layers

    def forward(
        self, tokens: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor | None = None
    ) -> ClassifierOutput:
        """tokens (B, T), right-padded; lengths (B,) the real lengths; labels (B,) class ids."""
        hidden, _ = self.backbone.hidden_states(tokens)
        last = hidden[torch.arange(tokens.shape[0], device=tokens.device), lengths - 1]  # (B, d)
        logits = self.score(last).float()
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return ClassifierOutput(logits, loss)

    @classmethod
    def from_state_dict(
        cls,
        cfg: ModelConfig,
        num_labels: int,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
    ) -> SequenceClassifier:
        """Rebuild a fine-tuned classifier from its consolidated weights."""
        with torch.device("meta"):
            model = cls(Transformer(cfg), num_labels)
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True, strict=True)
        model.backbone.init_buffers()
        return model

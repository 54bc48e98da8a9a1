"""A decoder with a classification head: a linear layer on the final hidden states of each
sequence, pooled: their mean over the sequence's tokens (`mean`), or the last token's, the
end-of-sequence token that closes every example (`last`, GPT-1's).

The language-model head is dropped: fine-tuning trains the backbone and the head only, and a
classification checkpoint holds `backbone.*` (the decoder without `lm_head`) and `score.weight`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config import POOLINGS, ModelConfig
from pretrain.model.transformer import Transformer


class ClassifierOutput(NamedTuple):
    logits: torch.Tensor  # (B, num_labels), fp32
    loss: torch.Tensor | None


class SequenceClassifier(nn.Module):
    def __init__(
        self, backbone: Transformer, num_labels: int, init_std: float | None = None, pooling: str = "last"
    ):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {pooling!r}")
        backbone.lm_head = nn.Identity()  # unused; a tied head's weight stays as the embeddings
        self.backbone = backbone
        self.pooling = pooling
        self.score = nn.Linear(backbone.cfg.d_model, num_labels, bias=False)
        nn.init.normal_(self.score.weight, std=init_std or backbone.cfg.init_std)

    @property
    def layers(self) -> nn.ModuleList:  # for activation checkpointing and compile, as on the decoder
        return self.backbone.layers

    def forward(
        self, tokens: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor | None = None
    ) -> ClassifierOutput:
        """tokens (B, T), right-padded; lengths (B,) the real lengths; labels (B,) class ids."""
        logits = self.score(self.features(tokens, lengths)).float()
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return ClassifierOutput(logits, loss)

    def features(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """What the head reads: (B, d) in the hidden states' dtype (a mean summed in fp32)."""
        hidden, _ = self.backbone.hidden_states(tokens)  # (B, T, d)
        if self.pooling == "last":
            return hidden[torch.arange(tokens.shape[0], device=tokens.device), lengths - 1]
        real = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < lengths[:, None]  # (B, T)
        total = (hidden.float() * real[..., None]).sum(dim=1)
        return (total / lengths[:, None]).to(hidden.dtype)

    @classmethod
    def from_state_dict(
        cls,
        cfg: ModelConfig,
        num_labels: int,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        pooling: str = "last",
    ) -> SequenceClassifier:
        """Rebuild a fine-tuned classifier from its consolidated weights (`pooling`: its run's)."""
        with torch.device("meta"):
            model = cls(Transformer(cfg), num_labels, pooling=pooling)
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True, strict=True)
        model.backbone.init_buffers()
        return model

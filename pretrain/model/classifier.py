"""A decoder with a classification head: a linear layer on the final hidden states of each
sequence, pooled: their mean over the sequence's tokens (`mean`), or the last token's, the
end-of-sequence token that closes every example (`last`, GPT-1's).

With `lm_loss_weight` λ > 0 the training loss is GPT-1's (Radford et al. 2018, sec. 3.2): the
classification loss plus λ × the language model's next-token loss over the example's own tokens,
which keeps the features predictive of the text while the head fits a small training split; the
language-model head stays and trains. With λ = 0 it is dropped: a classification checkpoint holds
`backbone.*` (without `lm_head`) and `score.weight`, and prediction never reads `lm_head`.

With `blend` (finetune.bag_of_words), a forward given a prior — log-probabilities of each label
that the caller computed from the text, a bag of words' log P(label | text) — answers
t × the head's logits + a × the prior, (t, a) the `blend` buffer that evaluation fits
(`pretrain/finetune/blend.py`) and checkpoints keep; training passes no prior: the network learns
alone.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config import POOLINGS, ModelConfig
from pretrain.model.loss import IGNORE_INDEX
from pretrain.model.transformer import Transformer


class ClassifierOutput(NamedTuple):
    logits: torch.Tensor  # (B, num_labels), fp32
    loss: torch.Tensor | None
    # the head's alone (B, num_labels): `logits` too, unless a prior was blended in
    network_logits: torch.Tensor | None = None


class SequenceClassifier(nn.Module):
    def __init__(
        self,
        backbone: Transformer,
        num_labels: int,
        init_std: float | None = None,
        pooling: str = "last",
        lm_loss_weight: float = 0.0,
        blend: bool = False,
    ):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {pooling!r}")
        if not lm_loss_weight:
            backbone.lm_head = nn.Identity()  # unused; a tied head's weight stays as the embeddings
        self.backbone = backbone
        self.pooling = pooling
        self.lm_loss_weight = lm_loss_weight
        self.score = nn.Linear(backbone.cfg.d_model, num_labels, bias=False)
        nn.init.normal_(self.score.weight, std=init_std or backbone.cfg.init_std)
        # (t, a): the network alone until an evaluation fits them
        if blend:
            self.register_buffer("blend", torch.tensor([1.0, 0.0]))
        else:
            self.blend = None

    @property
    def layers(self) -> nn.ModuleList:  # for activation checkpointing and compile, as on the decoder
        return self.backbone.layers

    def forward(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        labels: torch.Tensor | None = None,
        prior: torch.Tensor | None = None,
    ) -> ClassifierOutput:
        """tokens (B, T), right-padded; lengths (B,) the real lengths; labels (B,) class ids; prior
        (B, num_labels) log-probabilities, to blend with (`blend`). The loss, given labels:
        cross-entropy, plus λ × `language_model_loss` while training."""
        hidden, _ = self.backbone.hidden_states(tokens)  # (B, T, d)
        network = logits = self.score(self.pool(hidden, lengths)).float()
        if prior is not None:
            if self.blend is None:
                raise ValueError("this classifier blends no prior (built without blend)")
            scale, weight = self.blend.float()
            logits = scale * network + weight * prior.float()
        if labels is None:
            return ClassifierOutput(logits, None, network)
        loss = F.cross_entropy(logits, labels)
        if self.lm_loss_weight and self.training:
            loss = loss + self.lm_loss_weight * self.language_model_loss(hidden, tokens, lengths)
        return ClassifierOutput(logits, loss, network)

    def language_model_loss(
        self, hidden: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """The mean next-token loss over each example's real tokens (the padding left out)."""
        targets = tokens[:, 1:].clone()
        positions = torch.arange(targets.shape[1], device=tokens.device)[None, :]
        targets[positions >= lengths[:, None] - 1] = IGNORE_INDEX
        return self.backbone.lm_head(hidden[:, :-1], targets, kernel=self.backbone.loss_kernel)

    def features(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """What the head reads: (B, d) in the hidden states' dtype (a mean summed in fp32)."""
        hidden, _ = self.backbone.hidden_states(tokens)  # (B, T, d)
        return self.pool(hidden, lengths)

    def pool(self, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The final hidden states (B, T, d) → one vector per example, as `pooling` says."""
        if self.pooling == "last":
            return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
        real = torch.arange(hidden.shape[1], device=hidden.device)[None, :] < lengths[:, None]  # (B, T)
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
        """Rebuild a fine-tuned classifier from its consolidated weights (`pooling`: its run's; a
        `blend` among them: it blends a prior); the language-model head a run with
        `lm_loss_weight` > 0 trained is not needed to predict."""
        with torch.device("meta"):
            model = cls(Transformer(cfg), num_labels, pooling=pooling, blend="blend" in state)
        kept = {k: v.to(dtype) for k, v in state.items() if not k.startswith("backbone.lm_head.")}
        model.load_state_dict(kept, assign=True, strict=True)
        model.backbone.init_buffers()
        return model

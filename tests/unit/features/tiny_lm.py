"""A tiny causal language model for the feature tests (no downloads, runs in milliseconds).

Position t sees tokens 0..t only (a causal prefix mean), predicts token t+1, and computes the
shifted cross-entropy itself when given ``labels`` (the Hugging Face causal-LM convention),
normalised by ``num_items_in_batch`` when the Trainer passes it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer_runtime.features.losses import shifted_causal_lm_loss

VOCAB = 11
PAD = 0


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mix = nn.Linear(2 * dim, dim)
        self.calls = 0  # forward executions (recomputation under checkpointing adds more)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        # Causal context: mean of positions 0..t.
        steps = torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype).view(1, -1, 1)
        prefix = h.cumsum(dim=1) / steps
        return h + torch.tanh(self.mix(torch.cat([h, prefix], dim=-1)))


class TinyCausalLM(nn.Module):
    def __init__(self, dim: int = 8, layers: int = 2, vocab: int = VOCAB, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        self.activation_checkpointing = False
        self.checkpoint_kwargs: dict[str, Any] = {}

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: Any = None) -> None:
        self.activation_checkpointing = True
        self.checkpoint_kwargs = dict(gradient_checkpointing_kwargs or {})

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                kwargs = {"use_reentrant": False, **self.checkpoint_kwargs}
                h = checkpoint(block, h, **kwargs)
            else:
                h = block(h)
        logits = self.head(h)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = shifted_causal_lm_loss(logits, labels, num_items_in_batch)
        return out


class TinyClassifier(nn.Module):
    """Sequence classifier (labels not shifted); used for label smoothing tests."""

    def __init__(self, dim: int = 6, classes: int = 4) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Embedding(VOCAB, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.head(self.embed(input_ids).mean(dim=1))
        if labels is None:
            return {"logits": logits}
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def make_batches(
    n_batches: int, batch_size: int, lengths: list[int], seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """Right-padded batches; ``lengths`` cycles over samples so label counts are uneven."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    seq = max(lengths)
    k = 0
    for _ in range(n_batches):
        ids = torch.full((batch_size, seq), PAD, dtype=torch.long)
        labels = torch.full((batch_size, seq), -100, dtype=torch.long)
        mask = torch.zeros((batch_size, seq), dtype=torch.long)
        for row in range(batch_size):
            n = lengths[k % len(lengths)]
            k += 1
            tokens = torch.randint(1, VOCAB, (n,), generator=gen)
            ids[row, :n] = tokens
            labels[row, :n] = tokens
            mask[row, :n] = 1
        batches.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return batches

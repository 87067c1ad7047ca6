"""Tiny models and datasets for the trainer's unit tests (fast on CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset


class ClassificationData(Dataset):
    """``n`` random feature vectors with class labels, generated from ``seed``."""

    def __init__(self, n: int = 40, dim: int = 8, classes: int = 3, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class IterableClassificationData(IterableDataset):
    """The same examples as ClassificationData, as an iterable dataset."""

    def __init__(self, n: int = 40, seed: int = 0) -> None:
        self.inner = ClassificationData(n, seed=seed)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(len(self.inner)):
            yield self.inner[i]


class StatefulIterableClassificationData(IterableClassificationData):
    """The iterable examples with their own resumable position (``state_dict`` /
    ``load_state_dict``, as ``datasets.IterableDataset`` offers); counts the examples read."""

    def __init__(self, n: int = 40, seed: int = 0) -> None:
        super().__init__(n, seed)
        self.position = 0
        self.reads = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        start, self.position = self.position, 0
        for i in range(start, len(self.inner)):
            self.position = i + 1
            self.reads += 1
            yield self.inner[i]
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


class TinyClassifier(nn.Module):
    """MLP with dropout (so the RNG matters) and a LayerNorm (so weight-decay grouping matters)."""

    def __init__(self, dim: int = 8, hidden: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.dropout = nn.Dropout(0.2)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        logits = self.fc2(self.norm(self.dropout(torch.relu(self.fc1(x)))))
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


class TokenData(Dataset):
    """Token sequences whose labels have very uneven counts of real targets (rest -100)."""

    def __init__(self, n: int = 16, seq: int = 6, vocab: int = 11, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)
        labels = torch.randint(0, vocab, (n, seq), generator=g)
        for i in range(n):
            keep = 1 + (i * 5) % seq  # 1..seq real targets per example, unevenly spread
            labels[i, keep:] = -100
        self.labels = labels

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class TokenModelMean(nn.Module):
    """Token-level model returning the mean loss over its own targets (no loss kwargs)."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.head(torch.tanh(self.embed(input_ids)))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return (loss, logits)


class TokenModelKwargs(TokenModelMean):
    """Hugging Face convention: takes num_items_in_batch and returns sum / num_items_in_batch."""

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        num_items_in_batch: int | None = None,
    ) -> Any:
        logits = self.head(torch.tanh(self.embed(input_ids)))
        if labels is None:
            return {"logits": logits}
        flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        if num_items_in_batch is None:
            loss = F.cross_entropy(flat_logits, flat_labels)
        else:
            loss = F.cross_entropy(flat_logits, flat_labels, reduction="sum") / num_items_in_batch
        return {"loss": loss, "logits": logits}

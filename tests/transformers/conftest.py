"""Real-model tier: real transformers model classes from tiny configs, run under transformers'
own Trainer and ours side by side. Nothing is downloaded (offline mode is forced)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest.importorskip("transformers", reason="the real-model tier needs transformers (dev extra)")


@pytest.fixture
def tok():
    from tests.transformers import models

    return models.tokenizer()

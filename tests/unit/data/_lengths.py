"""Shared test data: skewed (long-tailed) sample lengths, deterministic."""

from __future__ import annotations

import math
import random


def skewed_lengths(n: int, seed: int = 0, low: int = 4, high: int = 512) -> list[int]:
    """Mostly short samples with a long tail, like tokenized instruction data."""
    rng = random.Random(seed)
    return [min(high, int(low * rng.paretovariate(1.1))) for _ in range(n)]


def lognormal_lengths(n: int, seed: int = 0, median: int = 120, high: int = 2048) -> list[int]:
    """Log-normal token counts (median ``median``), a milder tail than :func:`skewed_lengths`."""
    rng = random.Random(seed)
    return [max(1, min(high, int(rng.lognormvariate(math.log(median), 0.9)))) for _ in range(n)]

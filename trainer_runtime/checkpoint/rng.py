"""Capture and restore every random number generator a training step may draw from.

The state is stored as tensors (safetensors) plus a small JSON metadata dict, never pickled.
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng_state", "restore_rng_state", "rng_state_for_transformers"]

logger = logging.getLogger(__name__)


def capture_rng_state() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Return ``(tensors, metadata)`` holding python, numpy, torch and CUDA generator states."""
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}

    version, internal, gauss_next = random.getstate()
    tensors["python"] = torch.tensor(internal, dtype=torch.int64)
    meta["python"] = {"version": version, "gauss_next": gauss_next}

    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    tensors["numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.int64).copy())
    meta["numpy"] = {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached": cached}

    tensors["torch"] = torch.get_rng_state().clone()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = state.clone()
        meta["cuda_devices"] = torch.cuda.device_count()
    return tensors, {"rng": json.dumps(meta)}


def restore_rng_state(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> None:
    """Inverse of :func:`capture_rng_state`."""
    meta: dict[str, Any] = json.loads((metadata or {}).get("rng", "{}"))
    if "python" in tensors and "python" in meta:
        internal = tuple(int(x) for x in tensors["python"].tolist())
        random.setstate((meta["python"]["version"], internal, meta["python"]["gauss_next"]))
    if "numpy" in tensors and "numpy" in meta:
        m = meta["numpy"]
        keys = tensors["numpy"].numpy().astype(np.uint32)
        np.random.set_state((m["kind"], keys, m["pos"], m["has_gauss"], m["cached"]))
    if "torch" in tensors:
        torch.set_rng_state(tensors["torch"].to(torch.uint8))
    cuda = sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k.split(".")[1]))
    if cuda:
        if torch.cuda.is_available():
            states = [tensors[k].to(torch.uint8) for k in cuda]
            if len(states) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(states)
            else:
                logger.warning(
                    "checkpoint has CUDA RNG states for %d devices, this process sees %d: "
                    "restoring the first %d only",
                    len(states),
                    torch.cuda.device_count(),
                    min(len(states), torch.cuda.device_count()),
                )
                for i, state in enumerate(states[: torch.cuda.device_count()]):
                    torch.cuda.set_rng_state(state, i)
        else:
            logger.warning("checkpoint has CUDA RNG states but CUDA is not available: skipped")


def rng_state_for_transformers(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None, *, distributed: bool
) -> dict[str, Any]:
    """The state of :func:`capture_rng_state` as transformers.Trainer's ``rng_state.pth`` dict
    (``python``, ``numpy``, ``cpu`` and ``cuda``: one state, or a list per device when
    ``distributed``), built without touching this process's generators."""
    meta: dict[str, Any] = json.loads((metadata or {}).get("rng", "{}"))
    out: dict[str, Any] = {}
    if "python" in tensors and "python" in meta:
        internal = tuple(int(x) for x in tensors["python"].tolist())
        out["python"] = (meta["python"]["version"], internal, meta["python"]["gauss_next"])
    if "numpy" in tensors and "numpy" in meta:
        m = meta["numpy"]
        keys = tensors["numpy"].numpy().astype(np.uint32)
        out["numpy"] = (m["kind"], keys, m["pos"], m["has_gauss"], m["cached"])
    if "torch" in tensors:
        out["cpu"] = tensors["torch"].to(torch.uint8)
    cuda = sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k.split(".")[1]))
    if cuda:
        states = [tensors[k].to(torch.uint8) for k in cuda]
        out["cuda"] = states if distributed else states[0]
    return out

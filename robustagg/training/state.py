"""Process-global RNG state (Python, NumPy, torch CPU and CUDA) as plain, serialisable values."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng", "seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global RNG and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def capture_rng() -> dict[str, Any]:
    """The process-global RNG states.

    Returns:
        ``{"python": tuple, "numpy": dict, "torch": ByteTensor, "cuda": list[ByteTensor]}`` made of
        plain containers, ints, floats, strings and tensors only, so the values round-trip through
        :func:`restore_rng` and through ``torch.save`` / ``torch.load(weights_only=True)``.
    """
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    return {
        "python": random.getstate(),
        "numpy": {"name": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Restore :func:`capture_rng` output."""
    random.setstate(state["python"])
    npst = state["numpy"]
    np.random.set_state((npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"],
                         npst["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

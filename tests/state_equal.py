"""One bit-for-bit comparison of nested training state (tensors, dicts, lists, scalars) for the tests."""

from __future__ import annotations

import torch


def assert_state_equal(a, b, path: str = "state") -> None:
    """Assert ``a`` and ``b`` hold the same keys, lengths, dtypes and bits; ``path`` names the first difference."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            assert_state_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_state_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, path

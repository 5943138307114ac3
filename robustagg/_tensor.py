"""Input handling shared by every rule: stacking, validation, finiteness, flattening."""

from __future__ import annotations

from typing import Iterable, Sequence, Union

import torch

from .errors import NonFiniteInputError, ShapeError

Submissions = Union[torch.Tensor, Sequence[torch.Tensor]]

__all__ = ["as_matrix", "nonfinite_rows", "check_finite", "flatten", "unflatten_like"]


def as_matrix(x: Submissions, name: str = "x") -> torch.Tensor:
    """Return the submissions as one ``(n, d)`` floating tensor (no copy when already one).

    Args:
        x: a ``(n, d)`` floating tensor, or a non-empty sequence of ``(d,)`` tensors that are
            stacked (one copy).
        name: the argument name used in error messages.

    Raises:
        ShapeError: empty input, wrong number of dimensions, mismatched lengths, or a
            non-floating dtype; the message names ``name`` and the fix.
    """
    if not isinstance(x, torch.Tensor):
        rows = list(x)
        if not rows:
            raise ShapeError(f"{name} is empty: pass at least one submission (a (d,) tensor).")
        if any(not isinstance(r, torch.Tensor) or r.dim() != 1 for r in rows):
            raise ShapeError(f"{name} as a list must hold (d,) tensors; flatten each gradient first "
                             "(robustagg.flatten).")
        if len({r.shape[0] for r in rows}) != 1:
            raise ShapeError(f"{name} rows have different lengths {sorted({r.shape[0] for r in rows})}; "
                             "every worker must submit the same d.")
        x = torch.stack(rows)
    if x.dim() != 2:
        raise ShapeError(f"{name} must be a 2-D tensor of shape (n, d) (one row per worker); got shape "
                         f"{tuple(x.shape)}. Stack flattened gradients with torch.stack.")
    if x.shape[0] < 1 or x.shape[1] < 1:
        raise ShapeError(f"{name} must have at least one row and one column; got shape {tuple(x.shape)}.")
    if not x.is_floating_point():
        raise ShapeError(f"{name} must have a floating dtype; got {x.dtype}. Convert with x.float().")
    return x


def nonfinite_rows(x: torch.Tensor) -> list[int]:
    """Indices of the rows of ``x`` (n, d) that hold NaN or +-inf (ascending)."""
    # One cheap pass in the input dtype (a float64 sum converts every element and costs ~20x more):
    # an IEEE sum is NaN or +-inf whenever a summand is (NaN propagates, inf + -inf is NaN), so every
    # non-finite row is a suspect; a finite row whose sum overflows is a false suspect, and each
    # suspect is confirmed exactly with isfinite on that row alone.
    sums = x.sum(dim=1)
    suspects = (~torch.isfinite(sums)).nonzero().flatten().tolist()
    return [i for i in suspects if not bool(torch.isfinite(x[i]).all())]


def check_finite(x: torch.Tensor, name: str = "x") -> None:
    """Raise :class:`NonFiniteInputError` naming the rows of ``x`` that hold NaN or +-inf."""
    bad = nonfinite_rows(x)
    if bad:
        raise NonFiniteInputError(
            f"{name} has non-finite values (NaN or inf) in rows {bad}; drop or repair those "
            "submissions before aggregating (see robustagg.integrity).")


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors (e.g. ``p.grad`` of every parameter) into one ``(d,)`` vector.

    Same order and semantics as ``torch.nn.utils.parameters_to_vector``.
    """
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_like(vector: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Split a ``(d,)`` vector back into tensors shaped like ``like``.

    Raises:
        ShapeError: when ``vector`` does not have exactly ``sum(t.numel() for t in like)`` entries.
    """
    total = sum(t.numel() for t in like)
    if vector.dim() != 1 or vector.numel() != total:
        raise ShapeError(f"vector must be 1-D with {total} entries to match the parameters; got shape "
                         f"{tuple(vector.shape)}.")
    out, start = [], 0
    for t in like:
        out.append(vector[start:start + t.numel()].view_as(t))
        start += t.numel()
    return out

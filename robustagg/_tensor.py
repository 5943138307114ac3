"""Input handling shared by every rule: stacking, validation, finiteness, flattening."""

from __future__ import annotations

from typing import Any, Iterable, Sequence, Union

import numpy as np
import torch

from .errors import NonFiniteInputError, ShapeError

Submissions = Union[torch.Tensor, np.ndarray, Sequence[torch.Tensor], Sequence[np.ndarray]]

__all__ = ["as_matrix", "nonfinite_rows", "check_finite", "flatten", "unflatten_like"]


def _from_numpy(a: np.ndarray, name: str) -> torch.Tensor:
    """A NumPy array as a tensor of the same dtype (shared memory; a copy when read-only or byte-swapped)."""
    if a.dtype.kind != "f":
        raise ShapeError(f"{name} is a NumPy array of dtype {a.dtype}; rules need floating values: pass "
                         f"{name}.astype(numpy.float64).")
    if not a.flags.writeable or not a.dtype.isnative:
        a = np.array(a, dtype=a.dtype.newbyteorder("="))  # torch refuses byte-swapped and warns on read-only
    return torch.from_numpy(a)


def _as_row(r: Any, name: str) -> Any:
    return _from_numpy(r, f"{name}[i]") if isinstance(r, np.ndarray) else r


def as_matrix(x: Submissions, name: str = "x") -> torch.Tensor:
    """Return the submissions as one ``(n, d)`` floating tensor (no copy when already one).

    Args:
        x: a ``(n, d)`` floating tensor or NumPy array, or a non-empty sequence of ``(d,)`` tensors
            or NumPy arrays that are stacked (one copy). A NumPy array keeps its dtype (float64 stays
            float64) and, when writable, shares its memory (the rules never write to their input);
            the rule's result is a tensor (``.numpy()`` turns it back).
        name: the argument name used in error messages.

    Shape: ``(n, d)`` (or n rows of ``(d,)``) ``-> (n, d)``, dtype and device of the input.

    Raises:
        ShapeError: empty input, wrong number of dimensions, mismatched lengths, or a
            non-floating dtype; the message names ``name`` and the fix.

    Example:
        >>> import numpy as np
        >>> as_matrix(np.array([[1.0, 2.0], [3.0, 4.0]])).dtype
        torch.float64
    """
    if isinstance(x, np.ndarray):
        x = _from_numpy(x, name)
    if not isinstance(x, torch.Tensor):
        rows = [_as_row(r, name) for r in x]
        if not rows:
            raise ShapeError(f"{name} is empty: pass at least one submission (a (d,) tensor).")
        bad = next((r for r in rows if not isinstance(r, torch.Tensor) or r.dim() != 1), None)
        if bad is not None:
            got = (f"a {bad.dim()}-D tensor of shape {tuple(bad.shape)}" if isinstance(bad, torch.Tensor)
                   else f"a {type(bad).__name__}")
            raise ShapeError(f"{name} as a list must hold (d,) tensors or NumPy arrays, one per worker; got {got}. "
                             "Flatten each gradient first (robustagg.flatten), or pass one (n, d) tensor.")
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

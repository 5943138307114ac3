"""``mode="gather"``: every rank gathers every submission and runs the rule itself.

Per step, two collectives (three when an omniscient attack needs the honest rows first):

1. :meth:`Reduction.announce <robustagg.distributed.Reduction.announce>`: all-gather of the
   fixed-size headers (step id, collective sequence number, rank, length, dtype, digest of the
   previous aggregate) and the desynchronisation and agreement checks, *before* any data moves;
2. (:meth:`Reduction.share <robustagg.distributed.Reduction.share>`: all-gather of the honest
   submissions, for omniscient attacks;)
3. :meth:`GatherReduction.reduce`: all-gather of the submissions, each *framed* with its
   sender's checksum (the submission's bytes followed by the 8 checksum bytes, one ``uint8``
   buffer), integrity checks, the rule; the aggregate's digest is checked at the next announce,
   or now by :meth:`Reduction.verify <robustagg.distributed.Reduction.verify>`.

Cost: ``O(n d)`` traffic and rule work on every rank (``mode="sharded"`` divides it).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from ..errors import IntegrityError, NonFiniteInputError
from ..integrity import checksum, inspect_rows
from .header import Header, dtype_of, step_name
from .reduction import NonFinitePolicy, Reduced, Reduction, Transform, register_reduction

__all__ = ["GatherReduction"]


@register_reduction("gather")
class GatherReduction(Reduction):
    """Robust reduction by all-gather: every rank holds the full ``(n, d)`` matrix and runs the rule.

    Integrity: each received row is checked against the checksum framed with it, its length and
    dtype, and for finiteness. A checksum mismatch raises :class:`IntegrityError` (corruption in
    transit is never repaired in place); a non-finite row is dropped or aborts the step per
    ``on_nonfinite``. Agreement: headers before every exchange; the aggregate's digest at the next
    step's header (or :meth:`~robustagg.distributed.reduction.Reduction.verify`).

    Args:
        rule: see :class:`~robustagg.distributed.Reduction`.
        comm: see :class:`~robustagg.distributed.Reduction`.
        on_nonfinite: see :class:`~robustagg.distributed.Reduction`.
        check_digest: see :class:`~robustagg.distributed.Reduction`.

    Shape: each submission ``(d,)``; aggregate ``(d,)`` in the submissions' dtype.

    Raises:
        DesyncError: as :meth:`Reduction.reduce`, which lists the others (integrity, non-finite,
            requirement, collective).

    Example:
        >>> import torch, robustagg as ra
        >>> from robustagg.distributed import GatherReduction, LocalComm
        >>> red = GatherReduction(ra.CoordinateWiseMedian(f=1), LocalComm(3))
        >>> rows = {0: torch.tensor([1.0, 5.0]), 1: torch.tensor([2.0, 6.0]), 2: torch.tensor([100.0, -9.0])}
        >>> red.reduce(rows, step=0).aggregate
        tensor([2., 5.])
    """

    def reduce(self, rows: Mapping[int, torch.Tensor], *, step: int,
               aux: Optional[Mapping[int, tuple[float, float]]] = None, want_weights: bool = False,
               headers: Optional[list[Header]] = None, members: Optional[Sequence[int]] = None,
               transform: Optional[Transform] = None) -> Reduced:
        """See :meth:`Reduction.reduce`; ``headers`` from this step's :meth:`announce` (announced now if ``None``)."""
        if headers is None:
            headers = self.announce(rows, step=step, aux=aux, members=members)
        dtype = dtype_of(headers[0].dtype)
        matrix, sums = self._gather_rows(rows, dtype, step, headers=headers)
        ranks = [h.rank for h in headers]
        seq = self.comm.seq
        known = sums if self._in_process() else None  # in-process, untampered: the bytes the senders hashed
        reports = inspect_rows(matrix, sums, expected_dtype=dtype, received_checksums=known)
        corrupted = [ranks[int(r.row)] for r in reports if r.corrupted and r.row is not None]
        if corrupted:
            raise IntegrityError(f"{step_name(step)}: submissions of rank(s) {corrupted} do not match their checksums "
                                 "(corrupted in transit): " + "; ".join(p for r in reports for p in r.problems
                                                                        if "checksum" in p))
        bad_rows = [int(r.row) for r in reports if not r.finite and r.row is not None]
        bad = [ranks[i] for i in bad_rows]
        if bad and self.on_nonfinite is NonFinitePolicy.ABORT:
            raise NonFiniteInputError(f"{step_name(step)}: submissions of rank(s) {bad} hold NaN or inf. Set "
                                      "on_nonfinite='drop' to leave such rows out and count them as faults.")
        self.faults.extend((step, r) for r in bad)
        kept_rows = [i for i in range(matrix.shape[0]) if i not in bad_rows]
        if not kept_rows:
            raise IntegrityError(f"{step_name(step)}: every submission is non-finite; nothing to aggregate.")
        kept = [ranks[i] for i in kept_rows]
        x = matrix if not bad_rows else matrix[kept_rows]
        inputs, rule_input = list(kept), None
        if transform is not None:
            x, inputs = transform(x, kept, [sums[i] for i in kept_rows])
            rule_input = x
        weights = self.rule.weights(x) if want_weights else None  # before the call: stateful rules
        aggregate = self._cross_check(self.rule(x), step)
        digest = checksum(aggregate)
        self.last_digest = digest
        return Reduced(aggregate=aggregate, step=step, seq=seq, headers=headers, matrix=matrix, kept=kept,
                       dropped=bad, reports=reports, digest=digest, weights=weights, members=ranks,
                       inputs=list(inputs), rule_input=rule_input)

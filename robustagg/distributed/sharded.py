"""Coordinate-sharded robust aggregation over a process group (``mode="sharded"``).

Gathering every worker's full gradient to every rank costs ``O(n d)`` traffic and work per rank.
Here each rank owns a contiguous slice of ``d / world`` coordinates:

1. ``all_to_all``: rank r receives slice r of every worker's submission, an ``(n, d_r)`` block.
2. Coordinate-wise rules (mean, median, trimmed mean, MeaMed) aggregate their block directly.
   Distance-based rules need only small global statistics, summed over slices with one
   ``all_reduce`` each: the float64 Gram matrix of the rows (``n x n``, or ``(n+1) x (n+1)`` with
   a start row), recentred on a central row by a second all-reduce when the rows are
   near-identical relative to their norm (:func:`robustagg.functional.gram.robust_gram`). Selections (Krum, Multi-Krum, Bulyan, MDA, NNM's neighbours) and weights (geometric
   median's Weiszfeld coefficients, centered clipping's clip factors) are computed from those on
   every rank identically and applied to the local block. Clipping-type maps all-reduce row norms.
3. ``all_gather`` of the aggregated slices gives the ``(d,)`` aggregate on every rank.

Equality with ``mode="gather"``: coordinate-wise rules and selection rules whose selection is the
same give bitwise-equal outputs; Gram sums are accumulated in another order (per slice, then
across ranks), so weighted rules (GM, centered clipping) and near-tied selections agree to float64
rounding of the distances (tested to 1e-6 relative on the outputs).

Trust assumption: sharding moves the *computation* of the trusted aggregation onto the ranks. It
assumes the aggregation code on every rank is trusted, as a parameter server would be; a Byzantine
*worker* still only controls its own submission.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from .. import functional as F
from ..aggregators import (Bulyan, CenteredClipping, GeometricMedian, Krum, MinimumDiameterAveraging, MultiKrum)
from ..aggregators.base import Aggregator
from ..errors import ConfigError
from ..functional.gram import gram_to_sq_dist, robust_gram
from ..functional.preagg import arc_factors_from_norms, clipping_factors_from_norms
from ..functional.weiszfeld import clipping_iterations, weiszfeld_coefficients
from ..errors import IntegrityError, NonFiniteInputError
from ..integrity import checksum, inspect_rows
from ..preaggregation import ARC, NNM, Bucketing, Clipping, Pipeline, PreAggregator
from .comm import CollectiveError, Communicator, ProcessGroupComm
from .gather import GatherReduction
from .header import Header, dtype_of
from .reduction import NonFinitePolicy, Reduced, frame, register_reduction, unframe

__all__ = ["shard_bounds", "SliceStatistics", "supports_sharding", "aggregate_block", "sharded_aggregate",
           "ShardedReduction", "ShardedReduced", "block_shares", "AUTO_MIN_D"]

Reducer = Callable[[torch.Tensor], torch.Tensor]


def shard_bounds(d: int, world: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` coordinate ranges of each rank (sizes differ by at most one)."""
    base, extra = divmod(d, world)
    bounds, start = [], 0
    for r in range(world):
        end = start + base + (1 if r < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class SliceStatistics:
    """Global row statistics of an ``(n, d)`` matrix from its coordinate slices.

    Args:
        allreduce: sums a float64 tensor over all slices (``dist.all_reduce`` in a group; the
            identity when one slice holds every coordinate).
    """

    def __init__(self, allreduce: Reducer) -> None:
        self.allreduce = allreduce

    def gram(self, xs: torch.Tensor, extra: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Global float64 Gram of the rows (plus ``extra`` rows) relative to one centre.

        :func:`robustagg.functional.gram.robust_gram` with the partial Grams summed over slices:
        one all-reduce, or two when the rows are near-identical relative to their norm.
        """
        return robust_gram(xs, extra, reduce=self.allreduce)

    def sq_dist(self, xs: torch.Tensor) -> torch.Tensor:
        """Global ``(n, n)`` float64 squared distances."""
        return torch.nan_to_num(gram_to_sq_dist(self.gram(xs)), nan=math.inf)

    def row_norms(self, xs: torch.Tensor) -> torch.Tensor:
        """Global float64 row norms ``(n,)``."""
        return self.allreduce((xs.double() ** 2).sum(dim=1)).sqrt()


_SELECTION = (Krum, MultiKrum, Bulyan, MinimumDiameterAveraging)
_MAPS = (NNM, Bucketing, Clipping, ARC)


def supports_sharding(rule: Aggregator) -> bool:
    """True when :func:`aggregate_block` can run ``rule`` on coordinate slices."""
    if isinstance(rule, Pipeline):
        return all(isinstance(p, _MAPS) for p in rule.pre) and supports_sharding(rule.rule)
    return rule.coordinatewise or isinstance(rule, _SELECTION + (GeometricMedian, CenteredClipping))


def _map_block(p: PreAggregator, xs: torch.Tensor, stats: SliceStatistics) -> torch.Tensor:
    n = xs.shape[0]
    if isinstance(p, NNM):
        return F.nnm_weights(stats.sq_dist(xs), min(p.f, n - 1)).to(xs.dtype) @ xs
    if isinstance(p, Bucketing):
        return p.apply(xs)  # the same generator state on every rank gives the same permutation
    if isinstance(p, Clipping):
        return xs * clipping_factors_from_norms(stats.row_norms(xs), p.tau).to(xs.dtype)[:, None]
    if isinstance(p, ARC):
        return xs * arc_factors_from_norms(stats.row_norms(xs), p.f).to(xs.dtype)[:, None]
    raise ConfigError(f"sharded mode cannot apply {p!r}; use mode='gather'.")


def _gm_coefficients(rule: GeometricMedian, xs: torch.Tensor, stats: SliceStatistics) -> torch.Tensor:
    """Weiszfeld coefficients over the rows (then the zero start row when ``init="zero"``)."""
    n = xs.shape[0]
    extra = None if rule.init == "mean" else torch.zeros(1, xs.shape[1], dtype=xs.dtype, device=xs.device)
    g = stats.gram(xs, extra)
    a0 = torch.full((g.shape[0],), 1.0 / n, dtype=torch.float64, device=xs.device)
    if extra is not None:
        a0.zero_()
        a0[n] = 1.0
    return weiszfeld_coefficients(g, n, a0, rule.nu, rule.max_iter, rule.tol)[0]


def _cclip_start(xs: torch.Tensor, center_block: Optional[torch.Tensor]) -> torch.Tensor:
    """Centered clipping's starting centre on this block (zero before the first call)."""
    if center_block is None:
        return torch.zeros(xs.shape[1], dtype=xs.dtype, device=xs.device)
    return center_block.to(device=xs.device, dtype=xs.dtype)


def aggregate_block(rule: Aggregator, xs: torch.Tensor, stats: SliceStatistics,
                    center_block: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Aggregate one coordinate block ``(n, d_r) -> (d_r,)`` of a rule, using global statistics.

    Args:
        rule: a rule for which :func:`supports_sharding` is true (requirement already checked).
        xs: this rank's block of every submission.
        stats: global statistics over all blocks.
        center_block: centered clipping's current centre restricted to this block.

    Raises:
        ConfigError: the rule cannot be sharded.
    """
    if isinstance(rule, Pipeline):
        for p in rule.pre:
            xs = _map_block(p, xs, stats)
        return aggregate_block(rule.rule, xs, stats, center_block)
    n = xs.shape[0]
    if rule.coordinatewise:
        return rule._aggregate(xs)
    if isinstance(rule, Krum):
        return xs[int(torch.argmin(F.krum_scores(stats.sq_dist(xs), rule.f)))].clone()
    if isinstance(rule, MultiKrum):
        m = max(1, n - rule.f) if rule.m is None else min(rule.m, n)
        chosen = torch.sort(F.krum_scores(stats.sq_dist(xs), rule.f), stable=True).indices[:m]
        return F.distance.mean_of_rows(xs, chosen)
    if isinstance(rule, Bulyan):
        f = rule._effective_f(n)
        sel = F.bulyan_select(stats.sq_dist(xs), f, n - 2 * f).to(xs.device)
        return F.meamed(xs[sel], 2 * f)
    if isinstance(rule, MinimumDiameterAveraging):
        f = min(rule.f, n - 1)
        if math.comb(n, f) > rule.max_subsets:
            raise ConfigError(f"MDA: C(n={n}, f={f}) subsets exceeds max_subsets={rule.max_subsets}.")
        return F.distance.mean_of_rows(xs, F.mda_select(stats.sq_dist(xs), f))
    if isinstance(rule, GeometricMedian):
        return _gm_coefficients(rule, xs, stats)[:n].to(xs.dtype) @ xs
    if isinstance(rule, CenteredClipping):
        start = _cclip_start(xs, center_block)
        a = clipping_iterations(stats.gram(xs, start.reshape(1, -1)), n, rule.tau, rule.iterations)
        return a[:n].to(xs.dtype) @ xs + a[n].to(xs.dtype) * start
    raise ConfigError(f"{type(rule).__name__} has no sharded implementation; use mode='gather'.")


def block_shares(rule: Aggregator, xs: torch.Tensor, stats: SliceStatistics, d_total: int,
                 center_block: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Global row shares (``rule.weights`` of the full rows) from one coordinate block, or ``None``.

    Coordinate-wise rules sum their per-block shares weighted by the block width; selection and
    weighted rules recompute their global selection or coefficients. Pipelines return ``None``
    (their maps' mixing needs every row).

    Args:
        rule: as for :func:`aggregate_block` (call before the rule's state moves).
        xs: as for :func:`aggregate_block`.
        stats: as for :func:`aggregate_block`.
        center_block: as for :func:`aggregate_block`.
        d_total: the full submission length ``d``.

    Returns:
        ``(n,)`` float64 shares, identical on every rank, or ``None``.
    """
    from ..functional.weights import meamed_weights, selection_weights

    n = xs.shape[0]
    if isinstance(rule, Pipeline):
        return None
    if rule.coordinatewise:
        return stats.allreduce(rule._weights(xs) * xs.shape[1]) / d_total
    if isinstance(rule, Krum):
        return selection_weights(n, torch.argmin(F.krum_scores(stats.sq_dist(xs), rule.f)).reshape(1))
    if isinstance(rule, MultiKrum):
        m = max(1, n - rule.f) if rule.m is None else min(rule.m, n)
        return selection_weights(n, torch.sort(F.krum_scores(stats.sq_dist(xs), rule.f), stable=True).indices[:m])
    if isinstance(rule, MinimumDiameterAveraging):
        return selection_weights(n, F.mda_select(stats.sq_dist(xs), min(rule.f, n - 1)))
    if isinstance(rule, Bulyan):
        f = rule._effective_f(n)
        sel = F.bulyan_select(stats.sq_dist(xs), f, n - 2 * f)
        sub = xs[sel.to(xs.device)]
        w = torch.zeros(n, dtype=torch.float64)
        w[sel] = (stats.allreduce(meamed_weights(sub, 2 * f, F.coordinate_median(sub)) * xs.shape[1]) / d_total).cpu()
        return w
    if isinstance(rule, GeometricMedian):
        return _gm_coefficients(rule, xs, stats)[:n]
    if isinstance(rule, CenteredClipping):
        start = _cclip_start(xs, center_block)
        return clipping_iterations(stats.gram(xs, start.reshape(1, -1)), n, rule.tau, rule.iterations)[:n]
    return None


def _centre_of(rule: Aggregator) -> Optional[CenteredClipping]:
    inner = rule.rule if isinstance(rule, Pipeline) else rule
    return inner if isinstance(inner, CenteredClipping) else None


def sharded_aggregate(rule: Aggregator, local: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Robust aggregate of one submission per rank, computed coordinate-sharded.

    Every rank of ``group`` calls this with its own ``(d,)`` submission (world size = n workers)
    and receives the same ``(d,)`` aggregate. The rule's requirement must have been checked for
    ``n = world size`` (the caller validates integrity before aggregating: this function sees only
    its slice of the other ranks' rows). Centered clipping's centre is updated on every rank.

    Shape: ``(d,) -> (d,)``, float dtype; the block travels in the submission's dtype.

    Raises:
        ConfigError: the rule cannot be sharded (check :func:`supports_sharding` first).
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    d = local.numel()
    bounds = shard_bounds(d, world)
    sizes = [e - s for s, e in bounds]
    mine = sizes[rank]
    recv = torch.empty(world * mine, dtype=local.dtype, device=local.device)
    dist.all_to_all_single(recv, local.contiguous(), output_split_sizes=[mine] * world, input_split_sizes=sizes,
                           group=group)
    xs = recv.view(world, mine)

    def allreduce(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        dist.all_reduce(t, group=group)
        return t

    cc = _centre_of(rule)
    start, end = bounds[rank]
    center_block = None if cc is None or cc.center is None else cc.center[start:end]
    block = aggregate_block(rule, xs, SliceStatistics(allreduce), center_block)
    width = max(sizes)
    padded = torch.zeros(width, dtype=block.dtype, device=block.device)
    padded[:mine] = block
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    out = torch.cat([g[:sz] for g, sz in zip(gathered, sizes)])
    if cc is not None:
        cc.center = out.clone()
    return out


# --------------------------------------------------------------------------------------------
# The trainer's reduction mode
# --------------------------------------------------------------------------------------------

class ShardedReduced(Reduced):
    """A :class:`~robustagg.distributed.Reduced` of the sharded mode: no rank holds every row.

    ``matrix`` is ``None``; instead ``moments`` holds the global sums from which the per-step
    metrics of *any* honest set follow without another collective (see :meth:`metrics_for`):
    ``gram`` ``(k, k)`` of the kept rows centred on ``c`` (the robust centre row), ``cross`` ``(k,)``
    ``<x_i - c, F - c>``, ``fc`` ``||F - c||^2``, ``xc`` ``(k,)`` ``<x_i - c, c>``, ``cc`` ``||c||^2``.
    """

    moments: dict[str, torch.Tensor]

    def metrics_for(self, honest_mask: torch.Tensor) -> dict[str, float]:
        """Per-step metrics for the kept rows in ``honest_mask``, without another collective.

        ``agg/kappa_hat``, ``agg/dev_norm``, ``agg/cosine``, ``agg/retained`` and, when the
        reduction computed row shares, ``agg/byz_accepted`` and ``agg/honest_weight/<rank>``: the
        definitions of :func:`robustagg.metrics.step_metrics`.

        Args:
            honest_mask: ``(n,)`` bool over every worker (dropped rows are ignored).
        """
        mk = torch.as_tensor(honest_mask, dtype=torch.bool)[self.kept].to(torch.float64)
        h = float(mk.sum())
        if h == 0:
            return {}
        m = self.moments
        g, w = m["gram"], mk / h
        mu_c2 = float(w @ g @ w)                                   # ||mu_H - c||^2
        dev2 = float(m["fc"] - 2 * (w @ m["cross"]) + mu_c2)       # ||F - mu_H||^2
        var = float((mk @ torch.diagonal(g)) / h - mu_c2)          # V(H)
        mu2 = mu_c2 + 2 * float(w @ m["xc"]) + float(m["cc"])      # ||mu_H||^2
        f2 = float(m["fc"]) + 2 * float(m["fx"]) + float(m["cc"])  # ||F||^2
        fmu = float(w @ m["cross"]) + float(w @ m["xc"]) + float(m["fx"]) + float(m["cc"])  # <F, mu_H>
        dev2, var, mu2, f2 = max(dev2, 0.0), max(var, 0.0), max(mu2, 0.0), max(f2, 0.0)
        shares: dict[str, float] = {}
        if self.weights is not None:
            w = self.weights.double().cpu()
            total = float(w.sum())
            honest = [j for j, r in enumerate(self.kept) if bool(mk[j])]
            byz = [j for j in range(len(self.kept)) if not bool(mk[j])]
            shares["agg/byz_accepted"] = float(w[byz].sum()) / total if total > 0 else math.nan
            shares.update({f"agg/honest_weight/{self.kept[j]}": float(w[j]) for j in honest})
        return shares | {
            "agg/kappa_hat": 0.0 if dev2 == 0 else (dev2 / var if var > 0 else math.inf),
            "agg/dev_norm": math.sqrt(dev2 / mu2) if mu2 > 0 else math.nan,
            "agg/cosine": fmu / math.sqrt(f2 * mu2) if f2 > 0 and mu2 > 0 else math.nan,
            "agg/retained": fmu / mu2 if mu2 > 0 else math.nan,
        }


#: ``trainer.reduction=auto`` shards only submissions of at least this many coordinates: below it
#: the five small collectives of a sharded step cost more than gathering (measured on the 2-core
#: development machine: a 4.8k-parameter MLP on 10 gloo processes took 0.22 s per step sharded,
#: 0.10-0.13 s gathered).
AUTO_MIN_D = 1 << 16


@register_reduction("sharded")
class ShardedReduction(GatherReduction):
    """Robust reduction by coordinate shards: ``all_to_all`` of slices, a rule per slice, ``all_gather``.

    In a process group each rank receives slice r of every submission, each slice framed with its
    own checksum (so corruption in transit is caught by the rank that owns the slice); a small
    ``all_reduce`` of per-row verdicts (corrupted, non-finite) makes every rank drop or abort on the
    same rows; then :func:`aggregate_block` runs the rule on the slice with global statistics, and
    an ``all_gather`` returns the aggregate to every rank. Headers and digest agreement are the
    base class's. In one process (:class:`~robustagg.distributed.LocalComm`, the simulated mode)
    every row is local anyway and this behaves exactly like ``gather``.

    Per-step metrics: no rank holds every row, so the reduction all-reduces the small moments of
    :class:`ShardedReduced` and the trainer derives ``agg/kappa_hat``, ``agg/dev_norm``,
    ``agg/cosine`` and ``agg/retained`` from them; with ``row_shares`` it also computes every
    row's share (:func:`block_shares`: ``agg/byz_accepted``, ``agg/honest_weight/i``), except for
    pipelines, whose maps need every row (use ``gather`` or a simulated run for those).

    Args:
        rule: a rule for which :func:`supports_sharding` holds.
        row_shares: compute row shares every step (costs about one more pass of the rule).
        min_d: gather instead when the submissions have fewer than ``min_d`` coordinates
            (``mode="auto"`` uses :data:`AUTO_MIN_D`).
        comm: see :class:`~robustagg.distributed.Reduction`.
        **kwargs: ``on_nonfinite`` and ``check_digest``, see :class:`~robustagg.distributed.Reduction`.

    Raises:
        ConfigError: the rule has no sharded implementation (use ``gather``).
        Others: see :meth:`Reduction.reduce <robustagg.distributed.Reduction.reduce>`.
    """

    def __init__(self, rule: Aggregator, comm: Communicator, *, row_shares: bool = True, min_d: int = 0,
                 **kwargs: Any) -> None:
        if not supports_sharding(rule):
            raise ConfigError(f"{type(rule).__name__} has no sharded implementation; use trainer.reduction=gather.")
        super().__init__(rule, comm, **kwargs)
        #: submissions shorter than this are gathered instead (latency of the extra collectives
        #: dominates for small models); the same on every rank, since the headers agree on d.
        self.min_d = int(min_d)
        #: also compute every row's share in the aggregate (:func:`block_shares`) for the metrics.
        self.row_shares = bool(row_shares)

    def _collective(self, op: str, t: torch.Tensor, fn: Callable[[], Any]) -> None:
        comm = self.comm
        comm.seq += 1
        rec = comm.begin_record(op, tuple(t.shape), str(t.dtype))  # evidence names the collective in flight
        try:
            fn()
        except Exception as exc:  # backend errors differ by backend and version
            raise CollectiveError(f"{op} #{comm.seq} (shape {tuple(t.shape)}, {t.dtype}) failed on rank "
                                  f"{comm.rank}: {exc}") from exc
        comm.end_record(rec)

    def _allreduce(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        group = getattr(self.comm, "group", None)
        self._collective("all_reduce", t, lambda: dist.all_reduce(t, group=group))
        return t

    def reduce(self, rows: Mapping[int, torch.Tensor], *, step: int,
               aux: Optional[Mapping[int, tuple[float, float]]] = None, want_weights: bool = False,
               headers: Optional[list[Header]] = None) -> Reduced:
        """See :meth:`Reduction.reduce <robustagg.distributed.Reduction.reduce>`; no ``matrix`` in a process group."""
        if headers is None:
            headers = self.announce(rows, step=step, aux=aux)
        comm = self.comm
        if not isinstance(comm, ProcessGroupComm) or headers[0].numel < self.min_d:
            return super().reduce(rows, step=step, aux=aux, want_weights=want_weights, headers=headers)
        group, world, rank = comm.group, comm.world_size, comm.rank
        dtype = dtype_of(headers[0].dtype)
        local = rows[rank].to(device=comm.device, dtype=dtype).reshape(-1).contiguous()
        bounds = shard_bounds(local.numel(), world)
        size = local.element_size()
        send = torch.cat([frame(local[s:e]) for s, e in bounds])
        if self.tamper is not None:  # fault injection (corruption after the checksums were taken)
            send = self.tamper(step, rank, send)
        send_sizes = [(e - s) * size + 8 for s, e in bounds]
        mine = bounds[rank][1] - bounds[rank][0]
        recv = torch.empty(world * (mine * size + 8), dtype=torch.uint8, device=comm.device)
        self._collective("all_to_all", send, lambda: dist.all_to_all_single(
            recv, send, output_split_sizes=[mine * size + 8] * world, input_split_sizes=send_sizes, group=group))
        block, sums = unframe(recv.view(world, -1), dtype)
        reports = inspect_rows(block, sums, expected_dtype=dtype)
        verdict = torch.tensor([[float(r.corrupted), float(not r.finite)] for r in reports], dtype=torch.float64,
                               device=comm.device)
        verdict = self._allreduce(verdict)
        corrupted = [i for i in range(world) if verdict[i, 0] > 0]
        if corrupted:
            raise IntegrityError(f"step {step}: slices of the submissions of rank(s) {corrupted} do not match their "
                                 "checksums (corrupted in transit).")
        bad = [i for i in range(world) if verdict[i, 1] > 0]
        if bad and self.on_nonfinite is NonFinitePolicy.ABORT:
            raise NonFiniteInputError(f"step {step}: submissions of rank(s) {bad} hold NaN or inf. Set "
                                      "on_nonfinite='drop' to leave such rows out and count them as faults.")
        self.faults.extend((step, r) for r in bad)
        kept = [i for i in range(world) if i not in bad]
        if not kept:
            raise IntegrityError(f"step {step}: every submission is non-finite; nothing to aggregate.")
        self.rule.check(len(kept))
        xs = block if not bad else block[kept]
        stats = SliceStatistics(self._allreduce)
        cc = _centre_of(self.rule)
        start, end = bounds[rank]
        center_block = None if cc is None or cc.center is None else cc.center[start:end].to(xs.device)
        shares = block_shares(self.rule, xs, stats, local.numel(), center_block) if self.row_shares else None
        out_block = aggregate_block(self.rule, xs, stats, center_block)
        moments = self._moments(xs, out_block, stats)
        width = max(e - s for s, e in bounds)
        padded = torch.zeros(width, dtype=out_block.dtype, device=out_block.device)
        padded[:mine] = out_block
        gathered = [torch.empty_like(padded) for _ in range(world)]
        self._collective("all_gather", padded, lambda: dist.all_gather(gathered, padded, group=group))
        aggregate = torch.cat([g[:e - s] for g, (s, e) in zip(gathered, bounds)])
        if cc is not None:
            cc.center = aggregate.clone()
        digest = checksum(aggregate)
        self.last_digest = digest
        out = ShardedReduced(aggregate=aggregate, step=step, seq=comm.seq, headers=headers, matrix=None, kept=kept,
                             dropped=bad, reports=[], digest=digest, weights=shares)
        out.moments = moments
        return out

    def _moments(self, xs: torch.Tensor, out_block: torch.Tensor, stats: SliceStatistics) -> dict[str, torch.Tensor]:
        # One robust Gram of [x_1..x_k, F, 0] relative to some centre c: every inner product the
        # metrics need follows, whichever centre robust_gram chose (the zero row gives -c).
        n = xs.shape[0]
        extra = torch.stack([out_block.to(xs.dtype), torch.zeros_like(out_block, dtype=xs.dtype)])
        g = stats.gram(xs, extra).cpu()
        return {"gram": g[:n, :n], "cross": g[:n, n], "fc": g[n, n], "xc": -g[:n, n + 1], "cc": g[n + 1, n + 1],
                "fx": -g[n, n + 1]}

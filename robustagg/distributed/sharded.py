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
3. ``all_to_all`` again: every rank sends its aggregated slice to every rank (the same ``d_r``
   values in each of its ``world`` send slots) and receives the ``(d,)`` aggregate directly in
   coordinate order, with no padding or concatenation. An ``all_gather`` would move the same
   bytes, but gloo's took about twice as long as ``all_to_all_single`` (measured at 8 ranks,
   ``d = 1e7`` float32 on the 2-core development machine: 187 ms against 82 ms).

Memory: large buffers are reused across steps (:func:`sharded_aggregate` keeps a small cache,
:class:`~robustagg.distributed.sharded_reduction.ShardedReduction` its own wire buffers): glibc serves blocks above its mmap threshold
(at most 32 MB) with fresh pages, and faulting them in every step cost about as much as the
robust rule itself at ``d = 1e7``.

Equality with ``mode="gather"``: coordinate-wise rules and selection rules whose selection is the
same give bitwise-equal outputs. Gram sums are accumulated in another order (per slice, then
across ranks), so weighted rules (GM, centered clipping) agree to float64 rounding of the
distances (tested to 1e-6 relative on the outputs), and a selection between candidates whose
scores lie within that rounding of each other may pick a different row. Bitwise-identical rows
still tie exactly (the same summation order for every Gram entry) and the lowest index wins.

Trust assumption: sharding moves the *computation* of the aggregation onto the ranks. With one
replica per slice (the default) the aggregation code on every rank is trusted, as a parameter server
would be; a Byzantine *worker* still only controls its own submission. With
``trainer.aggregator_replicas = r_a > 1`` every slice, and every slice's partial statistic for the
distance-based rules, is computed by ``r_a`` ranks and voted on bit for bit (:mod:`~robustagg.distributed.vote`;
:meth:`~robustagg.distributed.sharded_reduction.ShardedReduction._reduce_replicated`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .. import functional as F
from ..aggregators import (Bulyan, CenteredClipping, GeometricMedian, Krum, MinimumDiameterAveraging, MultiKrum)
from ..aggregators.base import Aggregator
from ..functional.gram import gram_to_sq_dist, robust_gram
from ..functional.preagg import arc_factors_from_norms, clipping_factors_from_norms
from ..functional.weiszfeld import clipping_iterations, weiszfeld_coefficients
from ..errors import ConfigError, ShapeError
from ..preaggregation import ARC, NNM, Bucketing, Clipping, Pipeline, PreAggregator

__all__ = ["AUTO_MIN_D", "shard_bounds", "SliceStatistics", "supports_sharding", "supports_replication", "aggregate_block", "sharded_aggregate",
           "clear_buffers", "block_shares"]

Reducer = Callable[[torch.Tensor], torch.Tensor]

#: ``trainer.reduction=auto`` shards only submissions of at least this many coordinates: below it
#: the five small collectives of a sharded step cost more than gathering (measured on the 2-core
#: development machine: a 4.8k-parameter MLP on 10 gloo processes took 0.22 s per step sharded,
#: 0.10-0.13 s gathered).
AUTO_MIN_D = 1 << 16


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


def supports_replication(rule: Aggregator) -> bool:
    """True when ``trainer.aggregator_replicas > 1`` can run ``rule``: it shards, and no pre-aggregation
    draws random numbers (Bucketing's permutation would be drawn once per held slice, not once per step).

    Example:
        >>> from robustagg.aggregators import Krum
        >>> from robustagg.preaggregation import Bucketing, Pipeline
        >>> supports_replication(Krum(f=1)), supports_replication(Pipeline(pre=[Bucketing(s=2)], rule=Krum(f=1)))
        (True, False)
    """
    if isinstance(rule, Pipeline):
        return not any(isinstance(p, Bucketing) for p in rule.pre) and supports_sharding(rule)
    return supports_sharding(rule)


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


def _width_weighted(shares: Callable[[], torch.Tensor], xs: torch.Tensor) -> torch.Tensor:
    """Per-block shares times the block's width (zeros for an empty block: d < world leaves some ranks none)."""
    if xs.shape[1] == 0:
        return torch.zeros(xs.shape[0], dtype=torch.float64, device=xs.device)
    return shares() * xs.shape[1]


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
        return stats.allreduce(_width_weighted(lambda: rule._weights(xs), xs)) / d_total
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
        w[sel] = (stats.allreduce(_width_weighted(lambda: meamed_weights(sub, 2 * f, F.coordinate_median(sub)), sub))
                  / d_total).cpu()
        return w
    if isinstance(rule, GeometricMedian):
        return _gm_coefficients(rule, xs, stats)[:n]
    if isinstance(rule, CenteredClipping):
        start = _cclip_start(xs, center_block)
        return clipping_iterations(stats.gram(xs, start.reshape(1, -1)), n, rule.tau, rule.iterations)[:n]
    return None


def stateful_clipping_of(rule: Aggregator) -> Optional[CenteredClipping]:
    """The :class:`~robustagg.aggregators.CenteredClipping` inside ``rule`` (itself or a pipeline's
    final rule), whose centre every rank must update after a sharded step; ``None`` otherwise."""
    inner = rule.rule if isinstance(rule, Pipeline) else rule
    return inner if isinstance(inner, CenteredClipping) else None


#: :func:`sharded_aggregate`'s ``(receive, send)`` buffers, each ``(world * d_r,)``, keyed by
#: ``(device, dtype, world, d_r)``; the two most recently used keys are kept (LRU).
_BUFFERS: OrderedDict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
_BUFFER_KEYS = 2


def _buffers(device: torch.device, dtype: torch.dtype, world: int, mine: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device, dtype, world, mine)
    bufs = _BUFFERS.pop(key, None)
    if bufs is None:
        bufs = (torch.empty(world * mine, dtype=dtype, device=device),
                torch.empty(world * mine, dtype=dtype, device=device))
    _BUFFERS[key] = bufs
    while len(_BUFFERS) > _BUFFER_KEYS:
        _BUFFERS.popitem(last=False)
    return bufs


def clear_buffers() -> None:
    """Free the receive/send buffers that :func:`sharded_aggregate` keeps between calls."""
    _BUFFERS.clear()


def _check_out(out: torch.Tensor, local: torch.Tensor) -> None:
    want = (local.numel(),)
    if tuple(out.shape) != want or out.dtype != local.dtype or out.device != local.device:
        raise ShapeError(f"out must be a {want} {local.dtype} tensor on {local.device} (the submission's length, "
                         f"dtype and device); got {tuple(out.shape)} {out.dtype} on {out.device}. Allocate it "
                         "with torch.empty_like(local.reshape(-1)).")
    if not out.is_contiguous():
        raise ShapeError("out must be contiguous (the all-to-all writes it as one buffer); pass a tensor "
                         "from torch.empty_like(local.reshape(-1)).")


def sharded_aggregate(rule: Aggregator, local: torch.Tensor, group: Optional[dist.ProcessGroup] = None, *,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Robust aggregate of one submission per rank, computed coordinate-sharded.

    Every rank of ``group`` calls this with its own ``(d,)`` submission (world size = n workers)
    and receives the same ``(d,)`` aggregate: an ``all_to_all`` of slices, the rule on this rank's
    ``(n, d_r)`` block with global statistics (:func:`aggregate_block`), and an ``all_to_all`` of
    the aggregated slices. The rule's requirement must have been checked for ``n = world size``
    (the caller validates integrity before aggregating: this function sees only its slice of the
    other ranks' rows). Centered clipping's centre is updated on every rank.

    Args:
        rule: a rule for which :func:`supports_sharding` holds.
        local: this rank's submission.
        group: the process group (``None``: the default group).
        out: where to write the aggregate (returned); ``None`` allocates a fresh tensor. At large
            ``d`` a reused ``out`` saves faulting in fresh pages every call.

    Shape: ``local`` ``(d,)`` (any shape is flattened), float dtype; ``out`` and the result
    ``(d,)`` in ``local``'s dtype and device. The blocks travel in that dtype.

    Returns:
        ``out`` when given, else a new ``(d,)`` tensor; never one of the internal buffers.

    Raises:
        ShapeError: ``out`` is not a contiguous ``(d,)`` tensor of ``local``'s dtype and device.
        ConfigError: the rule cannot be sharded (check :func:`supports_sharding` first).

    Note:
        The receive and send buffers (each about ``d`` elements, so about twice the submission
        size in all) are kept between calls for the two most recent ``(device, dtype, world,
        d_r)``; :func:`clear_buffers` frees them. The rule's block output may be a view of the
        receive buffer: it is copied into the send buffer before the next exchange, so nothing
        returned aliases a buffer the next call overwrites. Calls are not thread-safe.
    """
    if out is not None:
        _check_out(out, local)
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    d = local.numel()
    bounds = shard_bounds(d, world)
    sizes = [e - s for s, e in bounds]
    mine = sizes[rank]
    recv, send = _buffers(local.device, local.dtype, world, mine)
    dist.all_to_all_single(recv, local.reshape(-1).contiguous(), output_split_sizes=[mine] * world,
                           input_split_sizes=sizes, group=group)

    def allreduce(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        dist.all_reduce(t, group=group)
        return t

    cc = stateful_clipping_of(rule)
    start, end = bounds[rank]
    center_block = None if cc is None or cc.center is None else cc.center[start:end]
    block = aggregate_block(rule, recv.view(world, mine), SliceStatistics(allreduce), center_block)
    send.view(world, mine).copy_(block.detach())  # the same aggregated slice in every rank's send slot
    if out is None:
        out = torch.empty(d, dtype=local.dtype, device=local.device)
    dist.all_to_all_single(out, send, output_split_sizes=sizes, input_split_sizes=[mine] * world, group=group)
    if cc is not None:
        cc.center = out.clone()
    return out

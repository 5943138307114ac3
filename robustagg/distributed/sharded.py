"""Coordinate-sharded robust aggregation over a process group (``mode="sharded"``).

Gathering every worker's full gradient to every rank costs ``O(n d)`` traffic and work per rank.
Here each rank owns a contiguous slice of ``d / world`` coordinates:

1. ``all_to_all``: rank r receives slice r of every worker's submission, an ``(n, d_r)`` block.
2. Coordinate-wise rules (mean, median, trimmed mean, MeaMed) aggregate their block directly.
   Distance-based rules need only small global statistics, summed over slices with one
   ``all_reduce`` each: squared distances to the mean (``n``) to pick the robust centre row, then
   the float64 Gram matrix of the rows centred on it (``n x n``, or ``(n+1) x (n+1)`` with a start
   row). Selections (Krum, Multi-Krum, Bulyan, MDA, NNM's neighbours) and weights (geometric
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
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import functional as F
from ..aggregators import (Bulyan, CenteredClipping, GeometricMedian, Krum, MinimumDiameterAveraging, MultiKrum)
from ..aggregators.base import Aggregator
from ..errors import ConfigError
from ..functional.preagg import arc_factors_from_norms, clipping_factors_from_norms
from ..functional.weiszfeld import clipping_iterations, weiszfeld_coefficients
from ..preaggregation import ARC, NNM, Bucketing, Clipping, Pipeline, PreAggregator

__all__ = ["shard_bounds", "SliceStatistics", "supports_sharding", "aggregate_block", "sharded_aggregate"]

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

    def center_row(self, xs: torch.Tensor) -> int:
        """Index of the row whose squared distance to the mean is the lower median (global)."""
        n = xs.shape[0]
        mu = xs.mean(dim=0, dtype=torch.float64)
        part = ((xs.double() - mu) ** 2).sum(dim=1)
        r = torch.nan_to_num(self.allreduce(part), nan=math.inf)
        return 0 if n <= 2 else int(torch.sort(r, stable=True).indices[(n - 1) // 2])

    def gram(self, xs: torch.Tensor, extra: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Global float64 Gram of the rows (plus ``extra`` rows) centred on the robust centre row."""
        k = self.center_row(xs)
        return self.allreduce(F.distance.centered_gram(xs, xs[k], extra))

    def sq_dist(self, xs: torch.Tensor) -> torch.Tensor:
        """Global ``(n, n)`` float64 squared distances."""
        g = self.gram(xs)
        sq = torch.diagonal(g)
        out = (sq[:, None] + sq[None, :] - 2.0 * g).clamp_(min=0.0)
        out.fill_diagonal_(0.0)
        return torch.nan_to_num(out, nan=math.inf)

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
        return xs[chosen.to(xs.device)].mean(dim=0)
    if isinstance(rule, Bulyan):
        f = rule._effective_f(n)
        sel = F.bulyan_select(stats.sq_dist(xs), f, n - 2 * f).to(xs.device)
        return F.meamed(xs[sel], 2 * f)
    if isinstance(rule, MinimumDiameterAveraging):
        f = min(rule.f, n - 1)
        if math.comb(n, f) > rule.max_subsets:
            raise ConfigError(f"MDA: C(n={n}, f={f}) subsets exceeds max_subsets={rule.max_subsets}.")
        return xs[F.mda_select(stats.sq_dist(xs), f).to(xs.device)].mean(dim=0)
    if isinstance(rule, GeometricMedian):
        extra = None if rule.init == "mean" else torch.zeros(1, xs.shape[1], dtype=xs.dtype, device=xs.device)
        g = stats.gram(xs, extra)
        a0 = torch.full((g.shape[0],), 1.0 / n, dtype=torch.float64, device=xs.device)
        if extra is not None:
            a0.zero_()
            a0[n] = 1.0
        a, _ = weiszfeld_coefficients(g, n, a0, rule.nu, rule.max_iter, rule.tol)
        return a[:n].to(xs.dtype) @ xs
    if isinstance(rule, CenteredClipping):
        if center_block is None:
            center_block = torch.zeros(xs.shape[1], dtype=xs.dtype, device=xs.device)
        extra = center_block.to(xs.dtype).reshape(1, -1)
        a = clipping_iterations(stats.gram(xs, extra), n, rule.tau, rule.iterations)
        return a[:n].to(xs.dtype) @ xs + a[n].to(xs.dtype) * extra[0]
    raise ConfigError(f"{type(rule).__name__} has no sharded implementation; use mode='gather'.")


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

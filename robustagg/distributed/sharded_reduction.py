"""The trainer's ``mode="sharded"`` reduction: integrity-checked coordinate shards in a process group.

The kernels (slices, global statistics, one rule per block, the all-to-all exchanges) are in
:mod:`~robustagg.distributed.sharded`; this module adds what a training step needs around them:
framed slices with checksums, the all-reduced integrity verdict, evidence records of every
collective, per-step metric moments and persistent wire buffers.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ..aggregators.base import Aggregator
from ..errors import ConfigError, IntegrityError, NonFiniteInputError
from ..integrity import checksum, digest, inspect_rows
from .comm import CollectiveError, Communicator, ProcessGroupComm
from .gather import GatherReduction
from .header import Header, dtype_of, step_name
from .reduction import NonFinitePolicy, Reduced, Transform, frame, register_reduction, unframe
from .sharded import (AUTO_MIN_D, SliceStatistics, aggregate_block, block_shares, shard_bounds, stateful_clipping_of,
                      supports_replication, supports_sharding)
from .vote import Copy, Lockstep, held_slices, majority_copy, majority_digest, slice_holders

__all__ = ["ShardedReduction", "ShardedReduced", "AUTO_MIN_D"]


def _frame_slices(local: torch.Tensor, bounds: list[tuple[int, int]], buf: torch.Tensor) -> torch.Tensor:
    """Write the frame (:func:`~robustagg.distributed.reduction.frame`) of every slice of ``local`` into ``buf``."""
    at = 0
    for s, e in bounds:
        end = at + (e - s) * local.element_size() + 8
        frame(local[s:e], out=buf[at:end])
        at = end
    return buf[:at]



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
        if h == 0 or not self.moments:  # no honest row kept, or the reduction ran with metrics=False
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




@register_reduction("sharded")
class ShardedReduction(GatherReduction):
    """Robust reduction by coordinate shards: ``all_to_all`` of slices, a rule per slice, ``all_to_all`` back.

    In a process group each rank receives slice r of every submission, each slice framed with its
    own checksum (so corruption in transit is caught by the rank that owns the slice); a small
    ``all_reduce`` of per-row verdicts (corrupted, non-finite) makes every rank drop or abort on the
    same rows; then :func:`~robustagg.distributed.sharded.aggregate_block` runs the rule on the slice with global statistics, and
    a second ``all_to_all`` returns the aggregate to every rank (see :mod:`~robustagg.distributed.sharded`). The
    send and receive byte buffers persist between steps (about twice the submission's size); the
    returned aggregate is always a fresh tensor. Headers and digest agreement are the
    base class's. In one process (:class:`~robustagg.distributed.LocalComm`, the simulated mode)
    every row is local anyway and this behaves exactly like ``gather``.

    Per-step metrics: no rank holds every row, so the reduction all-reduces the small moments of
    :class:`ShardedReduced` and the trainer derives ``agg/kappa_hat``, ``agg/dev_norm``,
    ``agg/cosine`` and ``agg/retained`` from them; with ``row_shares`` it also computes every
    row's share (:func:`~robustagg.distributed.sharded.block_shares`: ``agg/byz_accepted``, ``agg/honest_weight/i``), except for
    pipelines, whose maps need every row (use ``gather`` or a simulated run for those).

    Args:
        rule: a rule for which :func:`supports_sharding` holds.
        row_shares: compute row shares every step (costs about one more pass of the rule).
        metrics: compute the metric moments (and, with ``row_shares``, the shares) every step; the
            trainer sets it from ``trainer.metrics``. When false, :meth:`ShardedReduced.metrics_for`
            returns no metrics and the step saves one robust Gram pass and an all-reduce.
        min_d: gather instead when the submissions have fewer than ``min_d`` coordinates
            (``mode="auto"`` uses :data:`AUTO_MIN_D`).
        comm: see :class:`~robustagg.distributed.Reduction`.
        **kwargs: ``on_nonfinite`` and ``check_digest``, see :class:`~robustagg.distributed.Reduction`.

    Raises:
        ConfigError: the rule has no sharded implementation (use ``gather``).
        Others: see :meth:`Reduction.reduce <robustagg.distributed.Reduction.reduce>`.
    """

    def __init__(self, rule: Aggregator, comm: Communicator, *, row_shares: bool = True, metrics: bool = True,
                 min_d: int = 0, **kwargs: Any) -> None:
        if not supports_sharding(rule):
            raise ConfigError(f"{type(rule).__name__} has no sharded implementation; use trainer.reduction=gather.")
        super().__init__(rule, comm, **kwargs)
        #: submissions shorter than this are gathered instead (latency of the extra collectives
        #: dominates for small models); the same on every rank, since the headers agree on d.
        self.min_d = int(min_d)
        #: also compute every row's share in the aggregate (:func:`~robustagg.distributed.sharded.block_shares`) for the metrics.
        self.row_shares = bool(row_shares)
        #: compute the metric moments (and shares) every step; the same on every rank.
        self.metrics = bool(metrics)
        self._wire: Optional[tuple[tuple[Any, ...], torch.Tensor, torch.Tensor]] = None

    #: Test hook of the replicated return, a class attribute (``(step, rank, aggregated slices) ->
    #: the flat values sent``): what a rank that claims one digest and sends other bytes does.
    #: ``None`` in every run.
    send_hook: Optional[Callable[[int, int, list[torch.Tensor]], torch.Tensor]] = None

    def _wire_buffers(self, device: torch.device, dtype: torch.dtype, world: int, d: int,
                      mine: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Persistent ``uint8`` send (every slice framed) and receive (this slice of every row) buffers."""
        key = (device, dtype, world, d)
        if self._wire is None or self._wire[0] != key:
            size = torch.empty((), dtype=dtype).element_size()
            self._wire = (key, torch.empty(d * size + 8 * world, dtype=torch.uint8, device=device),
                          torch.empty(world * (mine * size + 8), dtype=torch.uint8, device=device))
        return self._wire[1], self._wire[2]

    def _placement(self, d: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """The slices and their holders (:func:`~robustagg.distributed.vote.slice_holders`) from
        :attr:`min_d` coordinates on; below it the process-group run gathers (every rank a holder)."""
        world = self.comm.world_size
        if d < self.min_d:
            return super()._placement(d)
        holders = slice_holders(world, self.check.replicas)
        return [(a, b, holders[s]) for s, (a, b) in enumerate(shard_bounds(d, world))]

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
               headers: Optional[list[Header]] = None, members: Optional[Sequence[int]] = None,
               transform: Optional[Transform] = None) -> Reduced:
        """See :meth:`Reduction.reduce <robustagg.distributed.Reduction.reduce>`; no ``matrix`` in a process group.

        Submissions are gathered (as ``mode="gather"``) when the group is simulated, when a process
        hosts several workers, when only some workers submit (``members``), with a ``transform``,
        or below :attr:`min_d` coordinates.
        """
        if headers is None:
            headers = self.announce(rows, step=step, aux=aux, members=members)
        comm = self.comm
        if (not isinstance(comm, ProcessGroupComm) or comm.num_processes != comm.world_size
                or len(headers) != comm.world_size or transform is not None or headers[0].numel < self.min_d):
            return super().reduce(rows, step=step, aux=aux, want_weights=want_weights, headers=headers,
                                  transform=transform)
        self._frames.clear()  # share()'s frames, not needed by the sliced exchange
        group, world, rank = comm.group, comm.world_size, comm.rank
        dtype = dtype_of(headers[0].dtype)
        local = rows[rank].to(device=comm.device, dtype=dtype).reshape(-1).contiguous()
        chk = self.check
        chk.begin()
        if chk.replicas > 1:
            return self._reduce_replicated(local, step, headers)
        bounds = shard_bounds(local.numel(), world)
        sizes = [e - s for s, e in bounds]
        size = local.element_size()
        mine = sizes[rank]
        wire, recv = self._wire_buffers(comm.device, dtype, world, local.numel(), mine)
        send = _frame_slices(local, bounds, wire)
        if self.tamper is not None:  # fault injection (corruption after the checksums were taken)
            send = self.tamper(step, rank, send)
        send_sizes = [n * size + 8 for n in sizes]
        self._collective("all_to_all", send, lambda: dist.all_to_all_single(
            recv, send, output_split_sizes=[mine * size + 8] * world, input_split_sizes=send_sizes, group=group))
        block, sums = unframe(recv.view(world, -1), dtype)
        reports = inspect_rows(block, sums, expected_dtype=dtype)
        verdict = torch.tensor([[float(r.corrupted), float(not r.finite)] for r in reports], dtype=torch.float64,
                               device=comm.device)
        kept, bad = self._settle_verdict(verdict, step)
        xs = block if not bad else block[kept]
        stats = SliceStatistics(self._allreduce)
        cc = stateful_clipping_of(self.rule)
        start, end = bounds[rank]
        center_block = None if cc is None or cc.center is None else cc.center[start:end].to(xs.device)
        shares = (block_shares(self.rule, xs, stats, local.numel(), center_block)
                  if self.metrics and self.row_shares else None)
        out_block = aggregate_block(self.rule, xs, stats, center_block)
        moments = self._moments(xs, out_block, stats) if self.metrics else {}
        lie = chk.lie_of(step, rank)  # r_a = 1: a lying slice reaches every rank, and nobody can tell
        sent = out_block if lie is None else chk.lied(lie, out_block, start, end)
        # The frames have left: their buffer's first world * d_r elements (<= d + world - 1, which
        # fits in d * size + 8 * world bytes) carry this rank's aggregated slice once per rank.
        final = wire[:world * mine * size].view(dtype)
        final.view(world, mine).copy_(sent.detach())
        aggregate = torch.empty(local.numel(), dtype=dtype, device=comm.device)  # the caller's, never reused
        self._collective("all_to_all", final, lambda: dist.all_to_all_single(
            aggregate, final, output_split_sizes=sizes, input_split_sizes=[mine] * world, group=group))
        return self._finish(aggregate, step, headers, kept, bad, shares, moments, cc)

    def _finish(self, aggregate: torch.Tensor, step: int, headers: list[Header], kept: list[int], bad: list[int],
                shares: Optional[torch.Tensor], moments: dict[str, torch.Tensor], cc: Any) -> ShardedReduced:
        """The step's result: centered clipping's centre and the check's memory updated, the digest taken."""
        if cc is not None:
            cc.center = aggregate.clone()
        self.check.remember(aggregate)
        agg_sum = checksum(aggregate)
        self.last_digest = agg_sum
        out = ShardedReduced(aggregate=aggregate, step=step, seq=self.comm.seq, headers=headers, matrix=None,
                             kept=kept, dropped=bad, reports=[], digest=agg_sum, weights=shares)
        out.moments = moments
        return out

    def _settle_verdict(self, flags: torch.Tensor, step: int) -> tuple[list[int], list[int]]:
        """All-reduce the per-row ``(world, 2)`` flags (corrupted, non-finite) and act on them alike on
        every rank: the kept rows and the dropped (non-finite) ones.

        Raises:
            IntegrityError: a slice did not match its checksum, or every row is non-finite.
            NonFiniteInputError: a non-finite row under ``on_nonfinite="abort"``.
            AssumptionError: the rule's requirement fails for the kept rows.
        """
        verdict = self._allreduce(flags)
        world = verdict.shape[0]
        corrupted = [i for i in range(world) if verdict[i, 0] > 0]
        if corrupted:
            raise IntegrityError(f"{step_name(step)}: slices of the submissions of rank(s) {corrupted} do not match their "
                                 "checksums (corrupted in transit).")
        bad = [i for i in range(world) if verdict[i, 1] > 0]
        if bad and self.on_nonfinite is NonFinitePolicy.ABORT:
            raise NonFiniteInputError(f"{step_name(step)}: submissions of rank(s) {bad} hold NaN or inf. Set "
                                      "on_nonfinite='drop' to leave such rows out and count them as faults.")
        self.faults.extend((step, r) for r in bad)
        kept = [i for i in range(world) if i not in bad]
        if not kept:
            raise IntegrityError(f"{step_name(step)}: every submission is non-finite; nothing to aggregate.")
        self.rule.check(len(kept))
        return kept, bad

    def _moments(self, xs: torch.Tensor, out_block: torch.Tensor, stats: SliceStatistics) -> dict[str, torch.Tensor]:
        # One robust Gram of [x_1..x_k, F, 0] relative to some centre c: every inner product the
        # metrics need follows, whichever centre robust_gram chose (the zero row gives -c).
        n = xs.shape[0]
        extra = torch.stack([out_block.to(xs.dtype), torch.zeros_like(out_block, dtype=xs.dtype)])
        g = stats.gram(xs, extra).cpu()
        return {"gram": g[:n, :n], "cross": g[:n, n], "fc": g[n, n], "xc": -g[:n, n + 1], "cc": g[n + 1, n + 1],
                "fx": -g[n, n + 1]}

    def _replica_buffers(self, device: torch.device, dtype: torch.dtype, send_bytes: int, recv_bytes: int,
                         back: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Persistent buffers of the replicated exchange: framed slices out, this rank's held slices of
        every row in, and every holder's aggregated slices back (``back`` elements of ``dtype``)."""
        key = (device, dtype, send_bytes, recv_bytes, back)
        cached = getattr(self, "_rwire", None)
        if cached is None or cached[0] != key:
            self._rwire = (key, torch.empty(send_bytes, dtype=torch.uint8, device=device),
                           torch.empty(recv_bytes, dtype=torch.uint8, device=device),
                           torch.empty(back, dtype=dtype, device=device))
        return self._rwire[1], self._rwire[2], self._rwire[3]

    def _reduce_replicated(self, local: torch.Tensor, step: int, headers: list[Header]) -> Reduced:
        """``aggregator_replicas = r_a > 1``: every slice computed by ``r_a`` ranks and voted on, bit for bit.

        Placement :func:`~robustagg.distributed.vote.slice_holders`: rank q computes the slices
        :func:`~robustagg.distributed.vote.held_slices` ``(q)``. (1) ``all_to_all``: every rank sends
        rank q the framed columns of q's ``r_a`` slices (``r_a`` times the bytes of ``r_a = 1``); the
        integrity verdict is all-reduced as there. (2) The rule on each held block: a coordinate-wise
        rule needs nothing global; a distance-based rule (Krum, Multi-Krum, Bulyan, MDA, GM, centered
        clipping, NNM / clipping / ARC in front) runs on the ``r_a`` held blocks in
        :class:`~robustagg.distributed.vote.Lockstep`, and at each global-statistic request every
        rank all-gathers the partials of its held slices, so every rank holds ``r_a`` copies of
        every slice's partial; the bit-exact majority of each is summed in slice order
        (:meth:`_voted_sum`), so a liar's partial never reaches the sum. (3) Every rank all-gathers
        every holder's digest of each aggregated slice (``world x r_a`` ``int64``) and takes each
        slice's strict-majority digest (:func:`~robustagg.distributed.vote.majority_digest`); the
        holders that claimed another are accused on every rank. (4) ``all_to_all``: each slice goes
        out once, from its first holder whose digest is the majority's (about ``d`` values per rank,
        as with ``r_a = 1``), and every rank checks each copy against the majority digest on
        arrival. A holder that claimed the majority's digest and sent other bytes is accused by the
        ranks that got them; a flag per slice is all-reduced with the accusations, and for every
        flagged slice every holder sends its copy to every rank and the bit-exact majority of the
        copies (:func:`~robustagg.distributed.vote.majority_copy`) is used (the fallback, ``r_a``
        copies of those slices only). Every rank names (``vote``: accused by a strict majority of
        ranks) or stops on (``abort``: accused by any) the same ranks. Metrics and row shares come
        from each rank's own slice (``s = rank``) only, which is not cross-checked.

        The global sums are accumulated in slice order, not in the all-reduce's order, so a
        distance-based rule's weights here may differ from ``r_a = 1`` in float64 rounding (as
        ``sharded`` differs from ``gather``); every replica computes the same bytes.

        Raises:
            ConfigError: the rule draws random numbers per call (Bucketing in front), see
                :func:`~robustagg.distributed.sharded.supports_replication`.
            DesyncError: a slice or partial without a strict majority, or any disagreement under
                ``on_aggregate_mismatch=abort``. Others: as :meth:`reduce`.
        """
        comm, chk = self.comm, self.check
        assert isinstance(comm, ProcessGroupComm)  # reduce() sends every other communicator to the gather path
        group, world, rank = comm.group, comm.world_size, comm.rank
        if not supports_replication(self.rule):
            raise ConfigError(f"trainer.aggregator_replicas={chk.replicas} cannot replicate {self.rule!r}: Bucketing "
                              "draws its permutation once per call, so the replicas of a slice would see different "
                              "buckets. Use trainer.reduction=gather with trainer.on_aggregate_mismatch=vote.")
        dtype, d, size = local.dtype, local.numel(), local.element_size()
        bounds = shard_bounds(d, world)
        sizes = [e - s for s, e in bounds]
        held = [held_slices(q, world, chk.replicas) for q in range(world)]
        nbytes = [n * size + 8 for n in sizes]
        send_sizes = [sum(nbytes[s] for s in held[q]) for q in range(world)]
        per_src = send_sizes[rank]
        back_sizes = [sum(sizes[s] for s in held[q]) for q in range(world)]
        mine_total = back_sizes[rank]
        send_buf, recv, back = self._replica_buffers(comm.device, dtype, sum(send_sizes), world * per_src,
                                                     d)
        slice_sums = [torch.tensor([checksum(local[a:b])], dtype=torch.int64).view(torch.uint8).to(local.device)
                      for a, b in bounds]  # each slice hashed once, framed for each of its r_a holders
        at = 0
        for q in range(world):
            for s in held[q]:
                a, b = bounds[s]
                body = (b - a) * size
                send_buf[at:at + body].copy_(local[a:b].view(torch.uint8))
                send_buf[at + body:at + body + 8].copy_(slice_sums[s])
                at += body + 8
        send = send_buf[:at]
        if self.tamper is not None:
            send = self.tamper(step, rank, send)
        self._collective("all_to_all", send, lambda: dist.all_to_all_single(
            recv, send, output_split_sizes=[per_src] * world, input_split_sizes=send_sizes, group=group))
        table = recv.view(world, per_src)
        blocks, flags = [], torch.zeros((world, 2), dtype=torch.float64)
        at = 0
        for s in held[rank]:
            block, sums = unframe(table[:, at:at + nbytes[s]], dtype)
            at += nbytes[s]
            blocks.append(block)
            for i, r in enumerate(inspect_rows(block, sums, expected_dtype=dtype)):
                flags[i, 0] += float(r.corrupted)
                flags[i, 1] += float(not r.finite)
        kept, bad = self._settle_verdict(flags.to(comm.device), step)
        stats = SliceStatistics(self._allreduce)
        xs = [b if not bad else b[kept] for b in blocks]
        cc = stateful_clipping_of(self.rule)
        centers = [None if cc is None or cc.center is None else cc.center[slice(*bounds[s])].to(local.device)
                   for s in held[rank]]
        lie = chk.lie_of(step, rank)  # one fault: its partial statistics and its aggregated slices lie
        shares = (block_shares(self.rule, xs[0], stats, d, centers[0]) if self.metrics and self.row_shares else None)
        outcomes: list[tuple[int, int, int, list[int], dict[int, int], int, str]] = []
        accused = torch.zeros(world, dtype=torch.float64)
        if self.rule.coordinatewise:  # nothing global to ask for
            out_blocks = [aggregate_block(self.rule, x, stats, None) for x in xs]
        else:
            asked = [0]

            def combine(parts: list[torch.Tensor]) -> torch.Tensor:
                asked[0] += 1
                return self._voted_sum(parts, held, bounds, step, lie, outcomes, accused, asked[0])

            def on_block(x: torch.Tensor, c: Optional[torch.Tensor]) -> Callable[[Callable[..., torch.Tensor]], torch.Tensor]:
                return lambda red: aggregate_block(self.rule, x, SliceStatistics(red), c)

            lockstep = Lockstep(len(xs), combine, timeout_s=float(comm.timeout_s or 300.0))
            out_blocks = lockstep.run([on_block(x, c) for x, c in zip(xs, centers)])
        moments = self._moments(xs[0], out_blocks[0], stats) if self.metrics else {}
        if lie is not None:
            out_blocks = [chk.lied(lie, ob, *bounds[s]) for ob, s in zip(out_blocks, held[rank])]
        aggregate = torch.empty(d, dtype=dtype, device=comm.device)  # the caller's, never reused
        # (3) every holder's digest of every held slice: a world x r_a int64 table on every rank
        claims = self._digest_table(out_blocks, held, step)
        majority: list[int] = []
        sender: list[int] = []
        for s, (a, b) in enumerate(bounds):
            m, liars = majority_digest(claims[s], step=step, what=f"slice {s} [{a}, {b})")
            majority.append(m)
            sender.append(next(q for q in slice_holders(world, chk.replicas)[s] if claims[s][q] == m))
            if liars:
                outcomes.append((s, a, b, liars, dict(claims[s]), m, "aggregate"))
                accused[liars] = 1.0
        # (4) each slice once, from its first holder whose digest is the majority's; checked on arrival
        mine_out = [ob for ob, s in zip(out_blocks, held[rank]) if sender[s] == rank]
        width = sum(int(ob.numel()) for ob in mine_out)
        recv_sizes = [sum(sizes[s] for s in held[q] if sender[s] == q) for q in range(world)]
        final = send_buf[:world * width * size].view(dtype).view(world, width)
        if width:
            final.copy_((torch.cat([ob.detach().to(dtype) for ob in mine_out])
                         if self.send_hook is None else self.send_hook(step, rank, mine_out)).expand(world, width))
        got = back[:d]
        self._collective("all_to_all", final, lambda: dist.all_to_all_single(
            got, final.reshape(-1), output_split_sizes=recv_sizes, input_split_sizes=[width] * world, group=group))
        wrong = torch.zeros(world, dtype=torch.float64)  # slices whose copy here is not the majority's bytes
        at = 0
        for q in range(world):
            for s in held[q]:
                if sender[s] != q:
                    continue
                a, b = bounds[s]
                piece = got[at:at + sizes[s]]
                at += sizes[s]
                if digest(piece) != majority[s]:  # the sender claimed the majority's digest, sent other bytes
                    wrong[s], accused[q] = 1.0, 1.0
                    continue
                aggregate[a:b] = piece
        flags = self._allreduce(torch.stack([accused, wrong]).to(comm.device)).cpu()
        counts, refetch = flags[0].clone(), [s for s in range(world) if flags[1, s] > 0]
        if refetch:  # some rank got a copy that is not what its sender claimed: every holder sends those slices
            for s, liars, digests in self._vote_copies(out_blocks, held, bounds, refetch, step, aggregate):
                a, b = bounds[s]
                outcomes.append((s, a, b, liars, digests, majority[s], "aggregate"))
                counts[liars] += world  # every rank saw the same copies
            for s in refetch:  # the senders that lied to some ranks only: named by those ranks
                if not any(o[0] == s and sender[s] in o[3] for o in outcomes):
                    outcomes.append((s, *bounds[s], [sender[s]], {sender[s]: 0}, majority[s], "aggregate"))
        if chk.on_mismatch == "abort":
            convicted = [i for i in range(world) if counts[i] > 0]
        else:
            convicted = [i for i in range(world) if 2 * counts[i] > world]
        if convicted or outcomes:
            chk.judge(step, outcomes, convicted=convicted)
        return self._finish(aggregate, step, headers, kept, bad, shares, moments, cc)

    def _digest_table(self, out_blocks: list[torch.Tensor], held: list[list[int]], step: int) -> list[dict[int, int]]:
        """Every holder's :func:`~robustagg.integrity.digest` (BLAKE2b-64: a copy is later accepted by
        this digest alone, so it must resist a forged collision) of each of its aggregated slices,
        all-gathered: ``claims[s] = {holder rank: digest}`` (one small ``world x r_a`` ``int64`` exchange)."""
        comm = self.comm
        assert isinstance(comm, ProcessGroupComm)
        mine = torch.tensor([digest(ob) for ob in out_blocks], dtype=torch.int64, device=comm.device)
        table = [torch.empty_like(mine) for _ in range(comm.world_size)]
        self._collective("all_gather", mine, lambda: dist.all_gather(table, mine, group=comm.group))
        claims: list[dict[int, int]] = [{} for _ in range(comm.world_size)]
        for q in range(comm.world_size):
            for j, s in enumerate(held[q]):
                claims[s][q] = int(table[q][j])
        return claims

    def _vote_copies(self, out_blocks: list[torch.Tensor], held: list[list[int]], bounds: list[tuple[int, int]],
                     slices: list[int], step: int, aggregate: torch.Tensor) -> list[tuple[int, list[int], dict[int, int]]]:
        """The fallback of the replicated return: every holder of each of ``slices`` sends its copy to
        every rank (``all_to_all``), and the bit-exact majority of the copies is written into ``aggregate``.

        Returns:
            ``(slice, liars, digests)`` of every slice whose copies disagreed.

        Raises:
            DesyncError: a slice's copies have no strict majority.
        """
        comm = self.comm
        assert isinstance(comm, ProcessGroupComm)
        world, rank = comm.world_size, comm.rank
        mine = [ob for ob, s in zip(out_blocks, held[rank]) if s in slices]
        if self.send_hook is not None and mine:
            sent = self.send_hook(step, rank, mine)
            cut = [0]
            for ob in mine:
                cut.append(cut[-1] + int(ob.numel()))
            mine = [sent[cut[i]:cut[i + 1]] for i in range(len(mine))]
        width = sum(int(ob.numel()) for ob in mine)
        sizes = {s: b - a for s, (a, b) in enumerate(bounds)}
        recv_sizes = [sum(sizes[s] for s in held[q] if s in slices) for q in range(world)]
        send = (torch.cat([ob.detach() for ob in mine]) if mine else aggregate.new_empty(0)).expand(world, width)
        send = send.contiguous()
        got = aggregate.new_empty(sum(recv_sizes))
        self._collective("all_to_all", send, lambda: dist.all_to_all_single(
            got, send.reshape(-1), output_split_sizes=recv_sizes, input_split_sizes=[width] * world, group=comm.group))
        where: dict[int, list[Copy]] = {s: [] for s in slices}
        at = 0
        for q in range(world):
            for s in held[q]:
                if s in slices:
                    where[s].append(Copy(q, got[at:at + sizes[s]]))
                    at += sizes[s]
        out = []
        for s in slices:
            a, b = bounds[s]
            value, liars, digests = majority_copy(where[s], step=step, what=f"slice {s} [{a}, {b})")
            aggregate[a:b] = value
            if liars:
                out.append((s, liars, digests))
        return out

    def _voted_sum(self, parts: list[torch.Tensor], held: list[list[int]], bounds: list[tuple[int, int]], step: int,
                   lie: Optional[Any], outcomes: list[tuple[int, int, int, list[int], dict[int, int], int, str]],
                   accused: torch.Tensor, request: int) -> torch.Tensor:
        """One global statistic of the replicated path: the bit-exact majority of every slice's partial, summed.

        Args:
            parts: this rank's float64 partials, one per held slice (in :func:`held_slices` order).
            held: every rank's held slices. bounds: the slices' coordinate ranges. step: 0-based.
            lie: this rank's ``aggregator_lie`` fault of the step (its partials lie too), or ``None``.
            outcomes, accused: this step's disagreements and accusations, extended in place.
            request: the statistic's 1-based number within the step (for messages).

        Returns:
            the sum over slices ``0..world-1`` (in that order) of each slice's majority partial.

        Raises:
            DesyncError: a slice's partial has no strict majority. CollectiveError: the all-gather failed.
        """
        comm, chk = self.comm, self.check
        assert isinstance(comm, ProcessGroupComm)
        mine = torch.stack(parts)
        if lie is not None:
            mine = torch.stack([chk.injector.lied(lie, p, None) for p in mine])  # stale: zeros
        mine = mine.to(comm.device).contiguous()
        table = [torch.empty_like(mine) for _ in range(comm.world_size)]
        self._collective("all_gather", mine, lambda: dist.all_gather(table, mine, group=comm.group))
        total: Optional[torch.Tensor] = None
        for s, (a, b) in enumerate(bounds):
            copies = [Copy(q, table[q][j]) for q in range(comm.world_size) for j, hs in enumerate(held[q]) if hs == s]
            value, liars, digests = majority_copy(copies, step=step,
                                                  what=f"global statistic #{request}'s partial of slice {s} [{a}, {b})")
            if liars:
                honest = next(c.rank for c in copies if c.rank not in liars)
                outcomes.append((s, a, b, liars, digests, digests[honest], "statistic"))
                accused[liars] = 1.0
            total = value.clone() if total is None else total.add_(value)
        assert total is not None
        return total.to(parts[0].device)

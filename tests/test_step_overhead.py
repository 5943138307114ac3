"""Per-step work a run does not ask for is not done (issue 19): metrics off computes no ``agg/*`` metrics.

The speed itself is what ``experiments.bench_train`` reports; here only what is computed, and that
the trainer's results do not change.
"""

from __future__ import annotations

import pytest
import torch

import robustagg as ra
from robustagg.distributed import LocalComm, make_reduction
from robustagg.training import Shard, Trainer, step_record


def _trainer(metrics: bool, seed: int = 0) -> Trainer:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    red = make_reduction("gather", ra.CoordinateWiseTrimmedMean(f=1), LocalComm(4))
    gen = torch.Generator().manual_seed(1)
    shards = {r: Shard(torch.randn(8, 3, generator=gen), torch.randint(0, 2, (8,), generator=gen)) for r in range(4)}
    return Trainer(model, opt, red, shards, batch_size=4, num_classes=2, metrics=metrics)


def test_metrics_off_records_no_aggregation_metrics():
    off, on = _trainer(False), _trainer(True)
    rec_off, rec_on = step_record(off.step(), off), step_record(on.step(), on)
    assert [k for k in rec_off if k.startswith("agg/")] == ["agg/dropped"]
    assert {"agg/kappa_hat", "agg/dev_norm", "agg/cosine", "agg/retained", "agg/honest_weight/0"} <= set(rec_on)
    for k in ("train/loss", "train/lr", "time/step_s", "time/compute_max_s", "time/compute_min_s"):
        assert k in rec_off and k in rec_on


def test_metrics_do_not_change_the_trajectory_and_dropout_stays_on_in_training():
    off, on = _trainer(False), _trainer(True)
    for _ in range(3):
        a, b = off.step(), on.step()
        assert torch.equal(a.reduced.aggregate, b.reduced.aggregate)
    assert off.parameter_digest() == on.parameter_digest()
    off.model.eval()  # an evaluation between steps: the next step trains with dropout again
    before = off.parameter_digest()
    fresh = _trainer(False)
    for _ in range(3):
        fresh.step()
    assert fresh.parameter_digest() == before
    off.step()
    fresh.step()
    assert off.parameter_digest() == fresh.parameter_digest() and off.model.training


def test_inspect_rows_reports_what_inspect_reports_row_by_row():
    from robustagg.integrity import checksum, inspect, inspect_rows

    x = torch.tensor([[1.0, 2.0, 3.0], [float("nan"), 1.0, float("inf")], [0.0, -0.0, 5.0]])
    declared = [checksum(x[0]), 7, checksum(x[2])]  # row 1's declared checksum is wrong
    rows = inspect_rows(x, declared, expected_dtype=torch.float64)  # and every dtype is wrong
    one = [inspect(x[i], row=i, expected_numel=3, expected_dtype=torch.float64, expected_checksum=declared[i])
           for i in range(3)]
    assert rows == one
    assert [r.nonfinite for r in rows] == [0, 2, 0] and [r.corrupted for r in rows] == [False, True, False]


def test_received_checksums_are_trusted_only_when_given():
    from robustagg.integrity import checksum, inspect_rows

    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    sums = [checksum(x[0]), checksum(x[1])]
    assert [r.checksum for r in inspect_rows(x, sums, received_checksums=sums)] == sums
    assert not any(r.corrupted for r in inspect_rows(x, sums, received_checksums=sums))
    assert [r.corrupted for r in inspect_rows(x, [sums[0], 1])] == [False, True]


def test_simulated_reduction_still_catches_a_tampered_frame():
    import pytest

    from robustagg.errors import IntegrityError

    red = make_reduction("gather", ra.CoordinateWiseMedian(f=1), LocalComm(3))
    rows = {r: torch.full((4,), float(r)) for r in range(3)}
    assert red._in_process()
    red.reduce(rows, step=0)

    def flip(step: int, rank: int, frame: torch.Tensor) -> torch.Tensor:
        if rank == 1:
            frame = frame.clone()
            frame[0] ^= 1
        return frame

    red.tamper = flip  # what fault injection's "corrupt" installs: the receiver hashes again
    assert not red._in_process()
    with pytest.raises(IntegrityError, match=r"rank\(s\) \[1\]"):
        red.reduce(rows, step=1)


class _WireComm(LocalComm):
    """A LocalComm subclass: the reduction cannot assume the stacked bytes are the senders' (framed path)."""


@__import__("pytest").mark.parametrize("comm_cls,hook,cache", [(LocalComm, "checksum", "_sums"),
                                                                (_WireComm, "frame", "_frames")])
def test_reduce_reuses_shares_frames_only_for_unchanged_rows(comm_cls, hook, cache):
    """What share made of a row (its frame on the wire path, its checksum in-process) is reused by
    the same step's reduce only for the very same, unchanged tensor."""
    from robustagg.distributed import reduction as red_mod

    calls = []
    real = getattr(red_mod, hook)

    def counting(t, *args):
        calls.append(t.clone())
        return real(t, *args)

    red = make_reduction("gather", ra.CoordinateWiseTrimmedMean(f=1), comm_cls(4))
    rows = {r: torch.full((3,), float(r)) for r in range(4)}
    mp = __import__("pytest").MonkeyPatch()
    mp.setattr(red_mod, hook, counting)
    try:
        red.share(rows, step=0)
        assert len(calls) == 4
        rows[3] = torch.full((3,), 100.0)  # a Byzantine row replaced by a new tensor
        rows[2].add_(1.0)  # and one changed in place: both framed again
        out = red.reduce(rows, step=0)
        assert len(calls) == 6 and torch.equal(calls[4], rows[2]) and torch.equal(calls[5], rows[3])
        assert torch.equal(out.matrix, torch.stack([rows[r] for r in range(4)]))
        assert getattr(red, cache) == {}  # released by the reduce
        red.reduce(rows, step=1)  # no share at this step: every row framed
        assert len(calls) == 10
    finally:
        mp.undo()


def test_in_process_exchange_gives_the_framed_exchanges_rows_checksums_and_count():
    """The in-process path (no frames) and the framed path agree on everything the reduction returns."""
    from robustagg.integrity import checksum

    g = torch.Generator().manual_seed(0)
    rows = {r: torch.randn(5, generator=g) for r in range(4)}
    rows[1] = rows[1].double()  # a row in another dtype is converted to the announced one, like a frame
    outs = []
    for comm in (LocalComm(4), _WireComm(4)):
        red = make_reduction("gather", ra.CoordinateWiseTrimmedMean(f=1), comm)
        headers = red.announce({r: t.float() for r, t in rows.items()}, step=0)
        outs.append((red.reduce(rows, step=0, headers=headers), comm.seq))
    (a, seq_a), (b, seq_b) = outs
    assert seq_a == seq_b == 2 and torch.equal(a.matrix, b.matrix) and a.matrix.dtype == torch.float32
    assert [r.checksum for r in a.reports] == [r.checksum for r in b.reports] == [checksum(rows[r].float())
                                                                                   for r in range(4)]
    assert a.reports == b.reports and torch.equal(a.aggregate, b.aggregate) and a.digest == b.digest


def test_received_checksums_of_the_wrong_length_are_refused():
    import pytest

    from robustagg.errors import ShapeError
    from robustagg.integrity import inspect_rows

    with pytest.raises(ShapeError, match="received_checksums must have one entry per row \\(2\\); got 1"):
        inspect_rows(torch.zeros(2, 3), received_checksums=[0])


def test_step_metrics_give_each_metrics_own_float64_formula_exactly(monkeypatch):
    """The torch path (other devices and dtypes) computes the honest mean and the float64 copies once;
    every value is still the bits of its own formula (kappa_hat and honest_variance as public
    functions, the norms and products)."""
    import math

    from robustagg import metrics
    from robustagg.metrics import honest_variance, kappa_hat, step_metrics

    monkeypatch.setattr(metrics, "_compiled", lambda x, aggregate: False)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 300, generator=g)
    mask = torch.tensor([True, False, True, True, False, True, True])
    agg = x[mask].median(dim=0).values + 0.01
    w = torch.rand(7, generator=g, dtype=torch.float64)
    got = step_metrics(agg, x, mask, w)
    honest = x[mask]
    mu, a = honest.double().mean(dim=0), agg.double()
    err = float(((a - mu) ** 2).sum())
    assert got["agg/kappa_hat"] == kappa_hat(agg, honest) == err / honest_variance(honest)
    assert got["agg/dev_norm"] == float((a - mu).norm()) / float(mu.norm())
    assert got["agg/cosine"] == float(a @ mu) / (float(a.norm()) * float(mu.norm()))
    assert got["agg/retained"] == float(a @ mu) / float(mu.norm()) ** 2
    assert got["agg/byz_accepted"] == float(w[~mask].sum()) / float(w.sum())
    assert {k: v for k, v in got.items() if "honest_weight" in k} == {
        f"agg/honest_weight/{i}": float(w[i]) for i in (0, 2, 3, 5, 6)}
    assert step_metrics(mu.float(), honest, torch.ones(5, dtype=torch.bool))["agg/kappa_hat"] >= 0.0
    assert kappa_hat(honest.double().mean(dim=0), honest) == 0.0
    assert kappa_hat(torch.ones(300), torch.zeros(3, 300)) == math.inf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("d", [1, 300, 5000])  # one block, a partial block, several blocks
def test_compiled_step_metrics_agree_with_the_float64_formulas_to_rounding(dtype, d):
    """The CPU path (one pass of the compiled moments kernel) gives every metric of the torch path to float64
    rounding, keeps the exact cases exact (kappa 0 for the honest mean itself, inf for zero variance) and
    propagates a non-finite aggregate."""
    import math

    from robustagg import metrics
    from robustagg.metrics import step_metrics

    def torch_path(*args):
        saved = metrics._compiled
        metrics._compiled = lambda x, aggregate: False
        try:
            return step_metrics(*args)
        finally:
            metrics._compiled = saved

    g = torch.Generator().manual_seed(d)
    x = (torch.randn(9, d, generator=g, dtype=torch.float64) * 3 + 1).to(dtype)
    mask = torch.tensor([True, True, False, True, True, True, False, True, True])
    for agg in (x[mask].median(dim=0).values + 0.25, x[~mask][0], x[mask][2]):
        got, want = step_metrics(agg, x, mask), torch_path(agg, x, mask)
        assert got.keys() == want.keys()
        for k in got:
            assert got[k] == pytest.approx(want[k], rel=1e-13, abs=1e-300), k
    near = step_metrics(x[mask].double().mean(dim=0), x, mask)["agg/kappa_hat"]  # torch's mean: last bits only
    assert 0.0 <= near < 1e-28
    same = x[:1].expand(4, d).contiguous()
    assert step_metrics(x[1], same, torch.ones(4, dtype=torch.bool))["agg/kappa_hat"] == math.inf
    assert step_metrics(same[0], same, torch.ones(4, dtype=torch.bool))["agg/kappa_hat"] == 0.0
    inf_agg = x[0].clone()
    inf_agg[0] = math.inf
    assert step_metrics(inf_agg, x, mask)["agg/kappa_hat"] == math.inf

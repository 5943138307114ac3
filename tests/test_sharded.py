"""Coordinate-sharded aggregation equals gathered aggregation (real gloo processes)."""

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import robustagg as ra
from robustagg.distributed import ProcessGroupComm, ShardedReduction, destroy_group, free_port, init_group, spawn
from robustagg.distributed.sharded import (SliceStatistics, aggregate_block, clear_buffers, shard_bounds,
                                           sharded_aggregate, supports_sharding)
from robustagg.errors import ShapeError

WORKER = Path(__file__).with_name("mp_sharded_worker.py")
# Medians and single-row selections move no arithmetic: bitwise equal. Averages over rows are summed by
# torch in an order that depends on the block width, so they agree to float32 rounding only.
BITWISE = {"coordinate_median {'f': 1}", "krum {'f': 1}", "bulyan {'f': 1}",
           "bucketing>coordinate_median {'f': 1}", "arc>coordinate_median {'f': 1}"}


def test_shard_bounds_cover_every_coordinate_once():
    # d = 10 over 4 ranks: sizes 3, 3, 2, 2
    assert shard_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert shard_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_single_block_reproduces_every_rule():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(11, 40, generator=gen, dtype=torch.float64)
    x[9:] += 7.0
    stats = SliceStatistics(lambda t: t)  # one block holding every coordinate: no reduction needed
    for name in ["mean", "coordinate_median", "trimmed_mean", "meamed", "krum", "multi_krum", "bulyan",
                 "geometric_median", "mda", "nnm>trimmed_mean", "nnm>krum", "arc>coordinate_median"]:
        a, b = ra.get(name, f=2), ra.get(name, f=2)
        assert supports_sharding(b)
        assert torch.equal(a(x), aggregate_block(b, x, stats)), name


def test_unsupported_rule_is_reported():
    class Odd(ra.Mean):
        coordinatewise = False

    assert not supports_sharding(Odd())


@pytest.mark.slow
@pytest.mark.parametrize("d", [1001])
def test_sharded_equals_gather_with_seven_processes(tmp_path, d):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(WORKER), "7", str(d), str(out)], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result) == 16
    for key, r in result.items():
        if key in BITWISE:
            assert r["equal"], key
        assert r["max_rel"] <= 1e-6, (key, r)


def test_auto_mode_picks_sharded_where_supported():
    from robustagg.distributed import GatherReduction, LocalComm, ShardedReduction, make_reduction

    assert type(make_reduction("auto", ra.CoordinateWiseTrimmedMean(f=1), LocalComm(4))) is ShardedReduction
    assert type(make_reduction("auto", ra.get("bucketing>krum", f=0), LocalComm(4))) is ShardedReduction

    class Unshardable(ra.Mean):
        coordinatewise = False

    assert type(make_reduction("auto", Unshardable(), LocalComm(4))) is GatherReduction


@pytest.mark.slow
def test_sharded_training_matches_gather_training(tmp_path):
    # Real 5-process gloo runs: the coordinate median moves no arithmetic, so the whole trajectory is
    # bitwise equal; the metrics come from all-reduced moments and agree to float64 rounding.
    from hydra import compose, initialize_config_dir
    from safetensors.torch import load_file

    from experiments.train import train

    conf = str(Path(__file__).resolve().parents[1] / "conf")
    common = ["logger=none", "trainer.progress=false", "threat.n=5", "threat.f=1", "aggregator=coordinate_median",
              "attack=alie", "trainer.steps=4", "trainer.eval_every=4"]
    runs = {}
    for mode in ("gather", "sharded"):
        with initialize_config_dir(config_dir=conf, version_base="1.3"):
            cfg = compose("config", overrides=[*common, f"trainer.reduction={mode}"])
        train(cfg, out_dir=tmp_path / mode, quiet=True)
        runs[mode] = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
    wa = load_file(str(tmp_path / "gather" / "model.safetensors"))
    wb = load_file(str(tmp_path / "sharded" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    train_recs = [(a, b) for a, b in zip(runs["gather"], runs["sharded"]) if a["kind"] == "train"]
    assert len(train_recs) == 4
    for a, b in train_recs:
        for key in ("agg/kappa_hat", "agg/cosine", "agg/retained", "agg/byz_accepted", "agg/honest_weight/0"):
            assert b[key] == pytest.approx(a[key], rel=1e-9, abs=1e-12), key


# --- buffer reuse across calls (real gloo processes) ---------------------------------------------
# Five ranks, d = 13 coordinates: slices of 3, 3, 3, 2, 2 (uneven). Row i, coordinate j:
#   step A: x[i, j] = v_i + 10 j with v = (0, 1, 2, 3.5, 1000)            (row 4 an outlier)
#   step B: x[i, j] = 1 - 2 (v_i + 10 j) = w_i - 20 j with w = (1, -1, -3, -6, -1999)
WORLD, D = 5, 13


def _rows(step: str, d: int = D) -> torch.Tensor:
    v = torch.tensor([0.0, 1.0, 2.0, 3.5, 1000.0])
    x = v[:, None] + 10.0 * torch.arange(d, dtype=torch.float32)[None, :]
    return x if step == "A" else 1.0 - 2.0 * x


def _expected(name: str, step: str, d: int = D) -> list[float]:
    j = torch.arange(d, dtype=torch.float64)
    # A: median of (0, 1, 2, 3.5, 1000) = 2; trimmed mean drops 0 and 1000: (1 + 2 + 3.5) / 3 = 6.5 / 3;
    #    Krum (f=1, 2 closest): row 0: 1 + 4 = 5, row 1: 1 + 1 = 2, row 2: 1 + 2.25 = 3.25, row 3: 2.25 + 6.25
    #    = 8.5 (times d) -> row 1, v = 1.
    # B: median of (1, -1, -3, -6, -1999) = -3; trimmed mean drops -1999 and 1: (-1 - 3 - 6) / 3 = -10 / 3;
    #    Krum: row 0: 4 + 16 = 20, row 1: 4 + 4 = 8, row 2: 4 + 9 = 13, row 3: 9 + 25 = 34 -> row 1, w = -1.
    a = {"coordinate_median": 2.0, "trimmed_mean": 6.5 / 3, "krum": 1.0}
    b = {"coordinate_median": -3.0, "trimmed_mean": -10.0 / 3, "krum": -1.0}
    return ((a[name] + 10.0 * j) if step == "A" else (b[name] - 20.0 * j)).tolist()


def _enter(rank, port, fn, out_dir):
    torch.set_num_threads(1)
    init_group(backend="gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30),
               init_method=f"tcp://127.0.0.1:{port}")
    try:
        fn(rank, out_dir)
    finally:
        destroy_group()


def _reuse_worker(rank, out_dir):
    result = {}
    for name in ("coordinate_median", "trimmed_mean", "krum"):
        rule = ra.get(name, f=1)
        first = sharded_aggregate(rule, _rows("A")[rank].clone())  # fresh output, internal buffers filled
        kept = first.clone()
        buf = torch.full((D,), float("nan"))
        second = sharded_aggregate(rule, _rows("B")[rank].clone(), out=buf)
        r = {"second": second.tolist(), "second_is_out": second is buf}
        r["other_d"] = sharded_aggregate(rule, _rows("B", 7)[rank].clone()).tolist()  # another slice size
        r["third"] = sharded_aggregate(rule, _rows("A")[rank].clone(), out=buf).tolist()  # the first buffers again
        r["tiny"] = sharded_aggregate(rule, _rows("A", 3)[rank].clone()).tolist()  # d < world: ranks 3, 4 own nothing
        result[name] = r | {"first": first.tolist(), "first_untouched": bool(torch.equal(first, kept))}
    red = ShardedReduction(ra.get("trimmed_mean", f=1), ProcessGroupComm(), row_shares=False)
    aggs = [red.reduce({rank: _rows(step)[rank].clone()}, step=i).aggregate for i, step in enumerate("AB")]
    result["reduction"] = {"aggs": [a.tolist() for a in aggs], "last_op": red.comm.last_completed.op}
    tiny = ShardedReduction(ra.get("trimmed_mean", f=1), ProcessGroupComm()).reduce({rank: _rows("A", 3)[rank].clone()},
                                                                                  step=0)
    result["tiny_reduction"] = {"agg": tiny.aggregate.tolist(), "shares": tiny.weights.tolist()}
    for metrics in (True, False):  # trainer.metrics=false skips the moments' Gram and its all-reduce
        r = ShardedReduction(ra.get("trimmed_mean", f=1), ProcessGroupComm(), metrics=metrics)
        out = r.reduce({rank: _rows("A")[rank].clone()}, step=0)
        result[f"metrics={metrics}"] = {"agg": out.aggregate.tolist(), "collectives": r.comm.seq,
                                        "keys": sorted(out.metrics_for(torch.ones(WORLD, dtype=torch.bool)))}
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(result))


def test_consecutive_calls_reuse_buffers_without_leaking_the_previous_step(tmp_path):
    clear_buffers()
    spawn(_enter, WORLD, args=(free_port(), _reuse_worker, str(tmp_path)), start_method="fork", grace_seconds=1.0)
    for rank in range(WORLD):
        got = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        for name in ("coordinate_median", "trimmed_mean", "krum"):
            g = got[name]
            assert g["first"] == pytest.approx(_expected(name, "A"), rel=1e-6), (rank, name)
            assert g["first_untouched"] and g["second_is_out"], (rank, name)
            assert g["second"] == pytest.approx(_expected(name, "B"), rel=1e-6), (rank, name)
            assert g["other_d"] == pytest.approx(_expected(name, "B", 7), rel=1e-6), (rank, name)
            assert g["third"] == pytest.approx(_expected(name, "A"), rel=1e-6), (rank, name)
            assert g["tiny"] == pytest.approx(_expected(name, "A", 3), rel=1e-6), (rank, name)
        tiny = got["tiny_reduction"]
        assert tiny["agg"] == pytest.approx(_expected("trimmed_mean", "A", 3), rel=1e-6)
        # every coordinate keeps rows 1, 2, 3 (1/3 each) whichever rank owns it; empty slices add nothing
        assert tiny["shares"] == pytest.approx([0.0, 1 / 3, 1 / 3, 1 / 3, 0.0], abs=1e-12)
        red = got["reduction"]
        # the returned aggregates are the caller's: step A's is intact after step B
        assert red["aggs"][0] == pytest.approx(_expected("trimmed_mean", "A"), rel=1e-6)
        assert red["aggs"][1] == pytest.approx(_expected("trimmed_mean", "B"), rel=1e-6)
        assert red["last_op"] == "all_to_all"  # the final exchange is recorded in the evidence
        on, off = got["metrics=True"], got["metrics=False"]
        assert on["agg"] == off["agg"] == pytest.approx(_expected("trimmed_mean", "A"), rel=1e-6)
        assert "agg/kappa_hat" in on["keys"] and "agg/byz_accepted" in on["keys"] and off["keys"] == []
        # header, all_to_all, verdict all_reduce, final all_to_all (+ the digest agreement) without metrics;
        # the shares' and the moments' all-reduces only with them
        assert off["collectives"] < on["collectives"]


@pytest.mark.parametrize("out,match", [
    (torch.empty(4), r"out must be a \(5,\) torch.float32 tensor on cpu .*got \(4,\) torch.float32"),
    (torch.empty(5, dtype=torch.float64), r"out must be a \(5,\) torch.float32 .*got \(5,\) torch.float64"),
    (torch.empty(5, 1), r"out must be a \(5,\) .*got \(5, 1\)"),
    (torch.empty(10)[::2], r"out must be contiguous"),
])
def test_out_of_the_wrong_shape_or_dtype_is_refused_before_any_collective(out, match):
    # no process group exists here: the argument check comes first
    with pytest.raises(ShapeError, match=match):
        sharded_aggregate(ra.get("mean"), torch.zeros(5), out=out)

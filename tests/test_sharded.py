"""Coordinate-sharded aggregation equals gathered aggregation (real gloo processes)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import robustagg as ra
from robustagg.distributed.sharded import SliceStatistics, aggregate_block, shard_bounds, supports_sharding

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

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

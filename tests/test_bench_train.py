"""``python -m experiments.bench_train``: the floor computes what it claims, and the smoke run writes both CSVs.

No timing assertions (speed is what the benchmark reports, not what tests check).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from robustagg.training import Shard

ROOT = Path(__file__).resolve().parents[1]


class _Host:
    """The trainer attributes :class:`experiments.bench_train.Floor` reads."""

    def __init__(self, model, opt, shards):
        self.model, self.optimizer, self.shards = model, opt, shards


def test_floor_step_is_sgd_on_the_mean_of_the_workers_gradients():
    from experiments.bench_train import Floor

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    shards = {r: Shard(torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))) for r in range(3)}
    floor = Floor(_Host(model, torch.optim.SGD(model.parameters(), lr=0.5), shards), batch_size=4)
    floor.step()
    # reference: the same batches (the floor's generator, seed 0), the gradient of each worker's mean
    # cross-entropy by hand (softmax - one-hot), averaged over workers, one step of lr 0.5
    gen = torch.Generator().manual_seed(0)
    gw, gb = torch.zeros_like(w0), torch.zeros_like(b0)
    for s in shards.values():
        idx = torch.randint(5, (4,), generator=gen)
        x, y = s.x[idx], s.y[idx]
        p = torch.softmax(x @ w0.T + b0, dim=1)
        delta = (p - torch.nn.functional.one_hot(y, 2).double()) / 4
        gw += delta.T @ x / 3
        gb += delta.sum(0) / 3
    torch.testing.assert_close(model.weight.detach(), w0 - 0.5 * gw, rtol=0, atol=1e-12)
    torch.testing.assert_close(model.bias.detach(), b0 - 0.5 * gb, rtol=0, atol=1e-12)


def test_vmap_floor_takes_the_floors_batches_and_step_to_1e_12_with_uneven_batch_sizes():
    from experiments.bench_train import Floor, VmapFloor

    torch.manual_seed(0)
    shards = {r: Shard(torch.randn(5 if r else 3, 4, dtype=torch.float64), torch.randint(0, 3, (5 if r else 3,)))
              for r in range(4)}  # worker 0's shard is smaller than the batch: two batch sizes, two vmap calls
    after = []
    for cls in (Floor, VmapFloor):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3)).double()
        floor = cls(_Host(model, torch.optim.SGD(model.parameters(), lr=0.5), shards), batch_size=4)
        for _ in range(3):
            floor.step()
        after.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert sorted(set(VmapFloor(_Host(model, None, shards), batch_size=4).batch)) == [3, 4]
    torch.testing.assert_close(after[1], after[0], rtol=0, atol=1e-12)
    torch.manual_seed(1)
    start = torch.cat([p.detach().reshape(-1) for p in torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3)).double().parameters()])
    assert float((after[0] - start).abs().max()) > 1e-3  # the steps moved the parameters


def test_quick_run_writes_both_tables(tmp_path):
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "experiments.bench_train", "quick=true", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from experiments.bench_train import COLUMNS, PIECES, STARTUP_COLUMNS

    table = pd.read_csv(tmp_path / "bench_train.csv")
    assert list(table.columns) == COLUMNS
    assert list(table["case"]) == ["floor", "floor_vmap", "mean", "cwtm", "cwtm_alie", "cwtm_alie_metrics", "mean_vmap",
                                   "cwtm_vmap", "cwtm_alie_vmap", "cwtm_alie_metrics_vmap", "processes"]
    sim = table[table["mode"] == "simulated"]
    assert (sim["n"] == 5).all() and (sim["median_ms"] > 0).all() and (sim["timed_steps"] == 2).all()
    floor = float(sim.loc[sim["case"] == "floor", "median_ms"].iloc[0])
    assert ((sim["ratio_to_floor"] - sim["median_ms"] / floor).abs() < 1e-9).all()
    vmap = float(sim.loc[sim["case"] == "floor_vmap", "median_ms"].iloc[0])
    assert ((sim["ratio_to_vmap_floor"] - sim["median_ms"] / vmap).abs() < 1e-9).all()
    assert set(sim.loc[sim["case"].str.endswith("_vmap") & (sim["case"] != "floor_vmap"), "note"]) == {
        "trainer.batched_gradients=true"}
    assert set(sim.loc[sim["attack"] == "alie", "byzantine"]) == {1}  # f = 5 // 5
    proc_row = table[table["case"] == "processes"].iloc[0]
    assert proc_row["n"] == 3 and proc_row["timed_steps"] == 3 and proc_row["median_ms"] > 0  # 4 steps, 1 skipped
    startup = pd.read_csv(tmp_path / "startup.csv")
    assert list(startup.columns) == STARTUP_COLUMNS and len(startup) == 2
    probe = startup.iloc[0]
    assert all(probe[p] >= 0 for p in PIECES) and abs(sum(probe[p] for p in PIECES) - probe["total_s"]) < 1e-6
    assert startup.iloc[1]["total_s"] > 0 and not (tmp_path / "bench_train.csv.tmp").exists()


def test_a_misspelt_clock_is_refused_not_timed_on_the_wall():
    # found by a review run: clock=bogus silently measured wall time
    from experiments.bench import _clock

    assert _clock("cpu") is time.process_time and _clock("wall") is time.perf_counter
    with pytest.raises(ValueError, match=r"clock='cpus': choose clock=wall .* or clock=cpu"):
        _clock("cpus")

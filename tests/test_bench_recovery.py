"""Recovery measured (``experiments.bench_recovery``): the timestamps the run records carry, the
timeline read back from them, the checkpoint-cost split, and a smoke run at a tiny size.

- ``record_failure`` stamps the detection record and ``restore`` times itself (the benchmark reads
  both; a fake clock makes the values exact);
- :func:`experiments.bench_recovery.timeline` turns hand-written records of a run (fired fault,
  the survivors' evidence, the detection, the restore and grow lineage records) into the
  recovery rows, checked against values computed by hand;
- :class:`experiments.bench_recovery.SaveSplit` times the pieces of a real
  :meth:`~robustagg.training.Checkpointer.save` and they add up to at most the whole;
- the smoke test runs the Hydra app with ``quick=true``: the overhead table at a tiny size and one
  real SIGKILL under ``on_failure=restart`` (3 worker processes, a few steps).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

import robustagg as ra
from robustagg.checkpoint import CheckpointStore, append_jsonl
from robustagg.distributed import LocalComm, make_reduction
from robustagg.training import Checkpointer, Shard, Trainer, restore

ROOT = Path(__file__).resolve().parents[1]


def _clock(*values: float) -> SimpleNamespace:
    """A stand-in for the ``time`` module whose ``time()`` returns ``values`` in turn (then the last)."""
    seq = list(values)
    return SimpleNamespace(time=lambda: seq.pop(0) if len(seq) > 1 else seq[0], monotonic=time.monotonic,
                           perf_counter=time.perf_counter, sleep=time.sleep)


def _trainer() -> Trainer:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(9)
    shards = {r: Shard(torch.randn(12, 3, generator=g), torch.randint(0, 2, (12,), generator=g)) for r in range(3)}
    red = make_reduction("gather", ra.CoordinateWiseMedian(f=1), LocalComm(3))
    return Trainer(model, opt, red, shards, batch_size=4, num_classes=2, seed=0)


# --- the records carry the timestamps ----------------------------------------------------------------------
def test_the_detection_record_carries_the_time_it_was_recorded(tmp_path, monkeypatch):
    from robustagg.launch import records

    monkeypatch.setattr(records, "time", _clock(1234.5))
    rec = records.record_failure(tmp_path, 0, lost=[1], message="worker rank 1 died (SIGKILL)", archive=True)
    assert rec["time"] == 1234.5
    assert json.loads((tmp_path / "detections.jsonl").read_text())["time"] == 1234.5


def test_the_restore_lineage_record_says_how_long_the_restore_took(tmp_path, monkeypatch):
    from robustagg.training import resume

    src = _trainer()
    ck = Checkpointer(CheckpointStore(tmp_path), every=2, meta={"run_id": "r"})
    for _ in range(2):
        src.step()
    ck.save(src)
    monkeypatch.setattr(resume, "time", _clock(100.0, 102.5))  # entry, then the record
    got = restore(_trainer(), ck.store, restart=1, reason="test", last_step=3)
    assert got.step == 2 and got.record["time"] == 102.5 and got.record["restore_s"] == 2.5
    assert ck.store.lineage()[-1]["restore_s"] == 2.5

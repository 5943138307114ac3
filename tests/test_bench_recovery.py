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


# --- the timeline read back from a run's records -----------------------------------------------------------
def _write_run(run: Path) -> None:
    ck = run / "checkpoints"
    append_jsonl(ck / "faults.jsonl", {"kind": "rejoin", "rank": 1, "step": 13, "attempt": 0, "time": 1000.0})
    ev = run / "evidence" / "attempt-0"
    ev.mkdir(parents=True)
    for rank, workers, t in ((0, [0], 1000.25), (1, [1], 999.0), (2, [2], 1000.5)):  # worker 1 is the killed one
        (ev / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "workers": workers, "time": t}))
    append_jsonl(run / "detections.jsonl", {"source": "in-run", "attempt": 0, "kind": "straggler", "step": 3})
    append_jsonl(run / "detections.jsonl", {"source": "failure", "attempt": 0, "kind": "fail-stop", "time": 1001.0})
    for rec in ({"event": "restore", "restart": 1, "time": 1003.0, "restore_s": 0.5, "restored_from": 10,
                 "steps_replayed": [11, 12], "world_size": 4},
                {"event": "shrink", "lost_workers": [1], "step": 10},
                {"event": "grow", "step": 14, "new_n": 5, "time": 1006.0, "regroup_s": 1.25, "transfer_s": 0.125,
                 "state_from": "live peer worker 0 over the process group (SHA-256 checked by the joiner)",
                 "own_state_from": {"1": "step-00000010"}}):
        append_jsonl(ck / "lineage.jsonl", rec)


def test_timeline_turns_the_records_into_disk_and_live_peer_rows(tmp_path):
    from experiments.bench_recovery import RECOVERY_COLUMNS, timeline

    _write_run(tmp_path)
    disk, peer = timeline(tmp_path)
    assert set(disk) <= set(RECOVERY_COLUMNS) and set(peer) <= set(RECOVERY_COLUMNS)
    # by hand: kill at 1000.0; first survivor's evidence 1000.25 (the killed worker's own file is not
    # a survivor's); detection 1001.0; the restore began at 1003.0 - 0.5 and ended at 1003.0
    assert disk == {"restore_source": "disk", "crash_step": 13, "committed_step": 10, "steps_lost": 2, "n_after": 4,
                    "detect_s": 0.25, "recorded_s": 1.0, "respawn_s": 1.5, "restore_s": 0.5, "back_s": 3.0}
    assert (peer["restore_source"], peer["n_after"], peer["restore_s"], peer["regroup_s"], peer["back_s"]) == \
        ("live-peer", 5, 0.125, 1.25, 6.0)
    assert peer["note"] == ("admitted after step 14: live peer worker 0 over the process group; own data position "
                            "and RNG from disk step-00000010")


def test_timeline_names_the_peer_memory_when_the_joiner_took_its_own_state_from_it(tmp_path):
    from experiments.bench_recovery import SOURCES, timeline

    _write_run(tmp_path)
    lineage = tmp_path / "checkpoints" / "lineage.jsonl"
    recs = [json.loads(x) for x in lineage.read_text().splitlines()]
    for r in recs:
        if r.get("event") == "grow":  # what trainer.peer_copy=true records when the disk copy was pruned
            r["sources"] = {"replicated": "peer 0", "own": {"1": "peer-memory 0"}}
    lineage.write_text("".join(json.dumps(r) + "\n" for r in recs))
    disk, peer = timeline(tmp_path)
    assert peer["restore_source"] == "live-peer, own: peer-memory" and peer["restore_source"] in SOURCES
    assert peer["note"].endswith("own data position and RNG from peer-memory 0 step-00000010")


def test_timeline_labels_a_restore_with_the_source_its_record_names(tmp_path):
    from experiments.bench_recovery import SOURCES, timeline

    _write_run(tmp_path)
    lineage = tmp_path / "checkpoints" / "lineage.jsonl"
    recs = [json.loads(x) for x in lineage.read_text().splitlines()]
    recs[0]["restore_source"] = "peer-memory"  # what an in-memory copy on a peer would record
    lineage.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rows = timeline(tmp_path)
    assert [r["restore_source"] for r in rows] == ["peer-memory", "live-peer"]
    assert {r["restore_source"] for r in rows} <= set(SOURCES)


def test_timeline_of_a_run_without_a_crash_is_empty_and_missing_records_give_nan(tmp_path):
    from experiments.bench_recovery import timeline

    assert timeline(tmp_path) == []
    append_jsonl(tmp_path / "checkpoints" / "faults.jsonl", {"kind": "crash", "rank": 0, "step": 5, "time": 7.0})
    (row,) = timeline(tmp_path)  # the run stopped there: no evidence, detection or restore
    assert row["crash_step"] == 5 and all(row[k] != row[k] for k in ("detect_s", "recorded_s", "restore_s", "back_s"))


# --- the split of one save ----------------------------------------------------------------------------------
def test_save_split_times_a_real_save_and_puts_everything_back(tmp_path):
    import robustagg.checkpoint as ck_mod
    import robustagg.training.resume as resume_mod
    from experiments.bench_recovery import PIECES, SaveSplit

    tr = _trainer()
    store = CheckpointStore(tmp_path)
    ck = Checkpointer(store, every=1, meta={"run_id": "r"})
    before = (resume_mod.save_state, ck_mod.atomic_write_bytes)
    split = SaveSplit()
    tr.step()
    with split.timing(tr, store) as entry:
        ck.save(tr)
    assert store.latest()[0].step == 1  # the save committed
    assert (resume_mod.save_state, ck_mod.atomic_write_bytes) == before
    assert "state_dict" not in vars(tr) and "commit" not in vars(store)
    assert split.saves == [entry] and all(entry[p] >= 0 for p in PIECES)
    assert entry["write_fsync_ms"] > 0 and entry["commit_ms"] > 0 and entry["snapshot_ms"] > 0
    assert sum(entry[p] for p in PIECES) == pytest.approx(entry["save_ms"])


def test_overhead_needs_the_reference_and_intervals_that_divide_the_steps(tmp_path):
    from omegaconf import OmegaConf

    from experiments.bench_recovery import overhead_rows

    cfg = OmegaConf.create({"overhead": {"n": 3, "f": 0, "every": [1, 10], "steps": 4, "repeats": 1}})
    with pytest.raises(ValueError, match=r"overhead.every=\[1, 10\] needs 0"):
        overhead_rows(cfg, tmp_path)
    cfg.overhead.every = [0, 3]
    with pytest.raises(ValueError, match=r"\[3\] do not divide overhead.steps x overhead.repeats = 4"):
        overhead_rows(cfg, tmp_path)


# --- the app at a tiny size: one real SIGKILL ---------------------------------------------------------------
def test_quick_run_writes_both_tables_with_a_real_restart(tmp_path):
    from experiments.bench_recovery import OVERHEAD_COLUMNS, RECOVERY_COLUMNS

    cmd = [sys.executable, "-m", "experiments.bench_recovery", "quick=true", f"hydra.run.dir={tmp_path}"]
    env = {**__import__("os").environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    over = pd.read_csv(tmp_path / "overhead.csv")
    assert list(over.columns) == OVERHEAD_COLUMNS and list(over["every"]) == [0, 2]
    on = over[over["every"] == 2].iloc[0]
    assert on["saves"] == 2 and on["state_mb"] > 0 and on["overhead_pct"] > 0  # 4 timed steps, every 2
    assert sum(on[p] for p in ("snapshot_ms", "serialise_ms", "write_fsync_ms", "commit_ms", "other_ms")) == \
        pytest.approx(on["save_ms"])
    rec = pd.read_csv(tmp_path / "recovery.csv")
    assert list(rec.columns) == RECOVERY_COLUMNS and list(rec["case"]) == ["unfaulted", "restart"]
    med = pd.read_csv(tmp_path / "recovery_median.csv")  # one round: the medians are that round
    assert list(med["repeat"]) == [1, 1] and med["steps_lost"].iloc[1] == rec["steps_lost"].iloc[1]
    row = rec.iloc[1]
    # killed at the start of step 4 (3 completed), committed every 2: restored at 2, step 3 recomputed
    assert (row["restore_source"], row["crash_step"], row["committed_step"], row["steps_lost"]) == ("disk", 4, 2, 1)
    # the order of events, from the run's own timestamps
    assert 0 < row["detect_s"] <= row["recorded_s"] < row["back_s"]
    assert row["restore_s"] > 0 and row["respawn_s"] > 0 and row["wall_s"] > 0


def test_medians_group_by_case_and_source_over_the_rounds():
    from experiments.bench_recovery import RECOVERY_COLUMNS, medians

    rec = pd.DataFrame([{"case": "restart", "restore_source": "disk", "repeat": i, "back_s": b, "note": "x"}
                        for i, b in enumerate((3.0, 1.0, 2.0))] +
                       [{"case": "rejoin", "restore_source": "live-peer", "repeat": 0, "back_s": 5.0, "note": "y"}]
                       ).reindex(columns=RECOVERY_COLUMNS)
    med = medians(rec)
    assert list(zip(med["case"], med["restore_source"], med["repeat"], med["back_s"], med["note"])) == \
        [("restart", "disk", 3, 2.0, "x"), ("rejoin", "live-peer", 1, 5.0, "y")]


@pytest.mark.parametrize("setting, words", [
    ("quick_settings.crash.rank=7", "rank 7 does not exist among n=3 workers"),
    ("quick_settings.crash.step=50", "step 50"),
    ("quick_settings.crash.cases=[bogus]", "unknown case 'bogus'"),
    ("quick_settings.overhead.every=[0,3]", r"\[3\] do not divide"),
])
def test_a_bad_setting_is_refused_in_one_line_before_any_run(tmp_path, setting, words):
    # found by a review run: these failed with a traceback after the unfaulted reference had run
    # and written its folder, which then blocked a rerun in the same folder
    import re

    cmd = [sys.executable, "-m", "experiments.bench_recovery", "quick=true", setting, f"hydra.run.dir={tmp_path}"]
    env = {**__import__("os").environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and re.search(words, proc.stderr) and "Traceback" not in proc.stderr, proc.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("run-")]

"""The checkpoint store's restore-side helpers and the in-process save/restore round trip (no processes)."""

from __future__ import annotations

import json

import pytest
import torch

import robustagg as ra
from robustagg.checkpoint import CheckpointStore, append_jsonl, read_jsonl, save_state
from robustagg.distributed import LocalComm, make_reduction
from robustagg.errors import CheckpointError
from robustagg.training import Checkpointer, Shard, Trainer, restore


def _commit(store, step, world=2):
    staging = store.staging(step)
    save_state(staging / "replicated.pt", {"step": step})
    for r in range(world):
        save_state(staging / f"rank-{r}.pt", {"position": r})
    return store.commit(step, {"hosts": {f"rank-{r}.pt": [r] for r in range(world)}},
                        ["replicated.pt"] + [f"rank-{r}.pt" for r in range(world)])


def test_verify_own_files_clean_staging_and_reject(tmp_path):
    store = CheckpointStore(tmp_path)
    ck = _commit(store, 4)
    (ck.path / "rank-1.pt").write_bytes(b"damaged")
    assert store.verify(ck.path, ["replicated.pt", "rank-0.pt"]) == []  # rank 0's own files are fine
    assert store.verify(ck.path, ["rank-1.pt"]) == ["step-00000004/rank-1.pt: size 7 != " +
                                                    str(json.loads((ck.path / "manifest.json").read_text())
                                                        ["files"]["rank-1.pt"]["size"])]
    assert store.verify(ck.path, ["rank-9.pt"]) == ["step-00000004/rank-9.pt: not in the manifest"]
    store.staging(8)
    assert store.clean_staging() == ["step-00000008.tmp"] and not (tmp_path / "step-00000008.tmp").exists()
    moved = store.reject(ck.path)
    assert moved.name == "step-00000004.rejected-1" and store.candidates() == []
    assert store.latest() == (None, [])


def test_a_crash_before_the_commit_rename_leaves_no_committed_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path)
    _commit(store, 2)

    def die(staging):
        raise KeyboardInterrupt("simulated death after the manifest")

    staging = store.staging(4)
    save_state(staging / "replicated.pt", {"step": 4})
    with pytest.raises(KeyboardInterrupt):
        store.commit(4, {}, ["replicated.pt"], before_rename=die)
    assert (staging / "manifest.json").is_file()  # written, but the folder still ends in .tmp
    latest, _ = store.latest()
    assert latest.step == 2 and (tmp_path / "LATEST").read_text().strip() == "step-00000002"


def test_jsonl_append_and_torn_last_line(tmp_path):
    path = tmp_path / "log.jsonl"
    append_jsonl(path, {"a": 1})
    with open(path, "a") as fh:
        fh.write('{"b": ')  # a writer died mid-line
    assert read_jsonl(path) == [{"a": 1}] and read_jsonl(tmp_path / "none.jsonl") == []


def _trainer(seed=0):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(9)
    shards = {r: Shard(torch.randn(12, 3, generator=g), torch.randint(0, 2, (12,), generator=g)) for r in range(3)}
    red = make_reduction("gather", ra.CoordinateWiseMedian(f=1), LocalComm(3))
    return Trainer(model, opt, red, shards, batch_size=4, num_classes=2, seed=seed, worker_momentum=0.5)


def test_in_process_checkpoint_restore_and_fallback_with_reason(tmp_path):
    ref = _trainer()
    ck = Checkpointer(CheckpointStore(tmp_path / "a"), every=2, meta={"run_id": "ref"})
    for _ in range(6):
        ref.step()
        if ck.due(ref.step_id):
            ck.save(ref)
    store = ck.store
    assert [p.name for p in store.candidates()] == ["step-00000006", "step-00000004", "step-00000002"]
    m = json.loads((store.root / "step-00000004" / "manifest.json").read_text())
    assert m["parent"] == "step-00000002" and m["hosts"] == {"rank-0.pt": [0, 1, 2]} and m["world_size"] == 3
    # damage the newest: the restore falls back to step 4, says why, and replays to the same state
    blob = bytearray((store.root / "step-00000006" / "replicated.pt").read_bytes())
    blob[100] ^= 1
    (store.root / "step-00000006" / "replicated.pt").write_bytes(bytes(blob))
    t = _trainer()
    got = restore(t, store, restart=1, reason="test", last_step=6)
    assert got.step == 4 and got.skipped == ["step-00000006/replicated.pt: SHA-256 mismatch"]
    assert got.record["steps_replayed"] == [5, 6] and store.lineage()[-1]["restored_from"] == 4
    t.step()
    t.step()
    assert all(torch.equal(p, q) for p, q in zip(t.model.parameters(), ref.model.parameters()))
    assert t.optimizer_digest() == ref.optimizer_digest()  # Adam's moments and step counters too
    with pytest.raises(CheckpointError, match="does not verify"):
        restore(_trainer(), store, request=str(store.root / "step-00000006.rejected-1"))

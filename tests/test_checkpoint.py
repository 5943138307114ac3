"""Committed checkpoints: atomic commit, verification, fallback, safe loading."""

import json
import os
import pickle

import pytest
import torch

from robustagg.checkpoint import CheckpointStore, load_state, save_state
from robustagg.errors import CheckpointError


def _write(store, step, world=2, value=1.0):
    staging = store.staging(step)
    save_state(staging / "replicated.pt", {"params": torch.full((3,), value), "step": step})
    for r in range(world):
        save_state(staging / f"rank-{r}.pt", {"rng": torch.arange(4), "position": 10 * step + r})
    files = ["replicated.pt"] + [f"rank-{r}.pt" for r in range(world)]
    return store.commit(step, {"run_id": "t", "world_size": world}, files)


def test_commit_writes_manifest_last_and_latest(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    ck = _write(store, 5)
    assert (tmp_path / "LATEST").read_text().strip() == "step-00000005"
    manifest = json.loads((ck.path / "manifest.json").read_text())
    assert manifest["step"] == 5 and set(manifest["files"]) == {"replicated.pt", "rank-0.pt", "rank-1.pt"}
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    latest, skipped = store.latest()
    assert latest.step == 5 and skipped == []
    assert torch.equal(latest.load("replicated.pt")["params"], torch.ones(3))


def test_prune_keeps_last_k(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for s in (1, 2, 3):
        _write(store, s)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000003"]


def test_uncommitted_staging_is_ignored(tmp_path):
    store = CheckpointStore(tmp_path)
    _write(store, 1)
    staging = store.staging(2)  # a crash before commit: files, no manifest, still .tmp
    save_state(staging / "replicated.pt", {"step": 2})
    latest, _ = store.latest()
    assert latest.step == 1


def test_corrupted_file_falls_back_to_previous_with_reason(tmp_path):
    store = CheckpointStore(tmp_path)
    _write(store, 1, value=1.0)
    ck2 = _write(store, 2, value=2.0)
    data = bytearray((ck2.path / "rank-1.pt").read_bytes())
    data[-5] ^= 0xFF  # flip bits in a committed file
    (ck2.path / "rank-1.pt").write_bytes(bytes(data))
    latest, skipped = store.latest()
    assert latest.step == 1
    assert any("rank-1.pt: SHA-256 mismatch" in s for s in skipped)
    os.remove(ck2.path / "replicated.pt")
    assert any("replicated.pt: missing" in s for s in store.latest()[1])


def test_commit_refuses_missing_rank_file(tmp_path):
    store = CheckpointStore(tmp_path)
    save_state(store.staging(3) / "replicated.pt", {})
    with pytest.raises(CheckpointError, match=r"rank-1.pt.*not written by every rank"):
        store.commit(3, {}, ["replicated.pt", "rank-1.pt"])


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED_MARKER",))


def test_loading_never_executes_pickled_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.pt"
    with open(path, "wb") as fh:
        pickle.dump({"x": _Evil()}, fh)
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_state(path)
    assert not (tmp_path / "PWNED_MARKER").exists()
    # the same payload inside a torch.save zip archive is refused too
    torch.save({"x": _Evil()}, tmp_path / "evil2.pt")
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_state(tmp_path / "evil2.pt")
    assert not (tmp_path / "PWNED_MARKER").exists()


def test_lineage_appends(tmp_path):
    store = CheckpointStore(tmp_path)
    store.append_lineage({"restored_from": 4, "replay": [5, 7], "why": "crash"})
    store.append_lineage({"restored_from": 8, "replay": [9, 9], "why": "desync"})
    assert [r["restored_from"] for r in store.lineage()] == [4, 8]


def test_check_name_accepts_only_plain_names():
    from robustagg.checkpoint import check_name

    for ok in ("rank-0.pt", "replicated.pt", "manifest.json", "a", "A_1.b-c"):
        assert check_name(ok) is None, ok
    for bad in ("../x.pt", "..", ".", "/etc/passwd", "a/b.pt", "a\\b.pt", ".hidden", "", "x" * 129, "nul\0.pt",
                "step-1/../../x", 3, None):
        assert "is not a plain file name inside the checkpoint folder" in check_name(bad), bad


def test_commit_refuses_names_with_paths_and_writes_nothing_through_links(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"cannot commit step 3: '\.\./x\.pt' is not a plain file name"):
        store.commit(3, {}, ["../x.pt"])
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "ck" / "step-00000005.tmp").symlink_to(victim, target_is_directory=True)  # planted staging link
    staging = store.staging(5)
    assert not staging.is_symlink() and staging.is_dir()
    save_state(staging / "replicated.pt", {"step": 5})
    (tmp_path / "ck" / ".LATEST.{}.tmp".format(os.getpid())).symlink_to(victim / "latest-target")
    store.commit(5, {}, ["replicated.pt"])
    assert list(victim.iterdir()) == []  # nothing was written through either link
    assert store.latest_name() == "step-00000005" and store.latest()[0].step == 5

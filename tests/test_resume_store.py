"""The checkpoint store's restore-side helpers and the in-process save/restore round trip (no processes)."""

from __future__ import annotations

import json
import os
import re

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


# --- the checkpoint folder is untrusted input ------------------------------------------------
def _run(root, steps=4, key=b"", run_id="run-a"):
    """A reference trainer after ``steps`` steps and its store (checkpoints every 2 steps)."""
    ref = _trainer()
    ck = Checkpointer(CheckpointStore(root, key=key), every=2, meta={"run_id": run_id})
    for _ in range(steps):
        ref.step()
        if ck.due(ref.step_id):
            ck.save(ref)
    return ref, ck.store


def _edit_manifest(folder, edit):
    m = json.loads((folder / "manifest.json").read_text())
    edit(m)
    (folder / "manifest.json").write_text(json.dumps(m))


def _rehash(folder, name, target=None):
    """Make the manifest's entry ``name`` match the bytes at ``target`` (default: the file itself)."""
    from robustagg.checkpoint import sha256_file

    where = target if target is not None else folder / name
    _edit_manifest(folder, lambda m: m["files"].__setitem__(
        name, {"size": where.stat().st_size, "sha256": sha256_file(where)}))


def _falls_back_to_2(store, reason):
    """restore() skips step 4 with ``reason`` (a regex), loads step 2, and says so in the lineage."""
    t = _trainer()
    got = restore(t, store)
    assert got.step == 2 and got.checkpoint == "step-00000002", got
    assert got.skipped and re.search(reason, " | ".join(got.skipped)), got.skipped
    assert store.lineage()[-1]["skipped"] == got.skipped and (store.root / "step-00000004.rejected-1").exists()
    return t


class _OpenSpy:
    """Records every path opened through open/io.open/os.open while installed."""

    def __init__(self, monkeypatch):
        import builtins
        import io
        import os

        self.paths = []
        for mod, name in ((builtins, "open"), (io, "open"), (os, "open")):
            real = getattr(mod, name)
            monkeypatch.setattr(mod, name, self._wrap(real))

    def _wrap(self, real):
        def spy(path, *a, **k):
            if isinstance(path, (str, bytes)) or hasattr(path, "__fspath__"):
                self.paths.append(str(os.fsdecode(path)))
            return real(path, *a, **k)
        return spy


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_manifest_file_outside_the_folder_is_rejected_never_read(tmp_path, monkeypatch, how):
    _, store = _run(tmp_path / "ck")
    ck4 = store.root / "step-00000004"
    outside = tmp_path / "leak.pt"  # a copy of the real state, with its true digest: only the path is wrong
    outside.write_bytes((ck4 / "rank-0.pt").read_bytes())
    name = "../../leak.pt" if how == "dotdot" else str(outside)
    _rehash(ck4, name, target=outside)
    _edit_manifest(ck4, lambda m: m["hosts"].__setitem__(name, [0, 1, 2]))
    spy = _OpenSpy(monkeypatch)
    _falls_back_to_2(store, re.escape(f"manifest file {name!r} is not a plain file name inside the checkpoint"))
    assert not any(p.endswith("leak.pt") for p in spy.paths), spy.paths  # neither hashed nor loaded


def test_hosts_entry_pointing_out_is_rejected(tmp_path, monkeypatch):
    _, store = _run(tmp_path / "ck")
    ck4 = store.root / "step-00000004"
    outside = tmp_path / "state.pt"
    outside.write_bytes((ck4 / "rank-0.pt").read_bytes())
    _edit_manifest(ck4, lambda m: m.__setitem__("hosts", {str(outside): [0, 1, 2]}))  # files untouched
    spy = _OpenSpy(monkeypatch)
    _falls_back_to_2(store, re.escape(f"manifest hosts entry {str(outside)!r} is not a plain file name"))
    assert not any(p.endswith("state.pt") for p in spy.paths), spy.paths
    # a plain name that the manifest does not list is refused too (hosts must name listed files)
    _, store = _run(tmp_path / "ck2")
    _edit_manifest(store.root / "step-00000004", lambda m: m.__setitem__("hosts", {"rank-7.pt": [0, 1, 2]}))
    _falls_back_to_2(store, r"hosts names 'rank-7.pt', which the manifest does not list")


def test_symlinked_file_is_rejected(tmp_path):
    _, store = _run(tmp_path / "ck")
    ck4 = store.root / "step-00000004"
    outside = tmp_path / "elsewhere.pt"
    outside.write_bytes((ck4 / "rank-0.pt").read_bytes())  # the same bytes: the digest still matches
    (ck4 / "rank-0.pt").unlink()
    (ck4 / "rank-0.pt").symlink_to(outside)
    assert store.verify(ck4) == ["step-00000004/rank-0.pt: is a symbolic link (refused: only regular files "
                                 "inside the folder are read)"]
    _falls_back_to_2(store, r"rank-0.pt: is a symbolic link")
    assert outside.read_bytes() == (store.root / "step-00000004.rejected-1" / "rank-0.pt").read_bytes()


def test_symlinked_step_folder_and_latest_target_are_rejected(tmp_path):
    import shutil

    _, store = _run(tmp_path / "ck")
    real = tmp_path / "elsewhere"
    shutil.move(str(store.root / "step-00000004"), real)  # a valid checkpoint, moved out ...
    (store.root / "step-00000004").symlink_to(real, target_is_directory=True)  # ... and linked back in
    assert store.latest_name() is None  # LATEST names step-00000004, a link: not trusted
    _falls_back_to_2(store, r"step-00000004: the step folder is a symbolic link")
    assert real.is_dir() and (real / "manifest.json").is_file()  # the link was set aside, its target untouched
    assert store.latest_name() == "step-00000002"


def test_an_older_rank_file_with_a_matching_digest_is_refused(tmp_path):
    _, store = _run(tmp_path / "ck")
    ck2, ck4 = store.root / "step-00000002", store.root / "step-00000004"
    (ck4 / "rank-0.pt").write_bytes((ck2 / "rank-0.pt").read_bytes())  # step 2's worker state, swapped in
    _rehash(ck4, "rank-0.pt")  # ... with the manifest's digest edited to match
    assert store.verify(ck4) == []  # the digests alone cannot tell
    _falls_back_to_2(store, r"step 4/rank-0.pt: the file holds step 2, the manifest says 4")


def test_a_rank_file_of_another_run_is_refused(tmp_path):
    _, store = _run(tmp_path / "ck", run_id="run-a")
    _, other = _run(tmp_path / "other", run_id="run-b")
    ck4 = store.root / "step-00000004"
    (ck4 / "rank-0.pt").write_bytes((other.root / "step-00000004" / "rank-0.pt").read_bytes())
    _rehash(ck4, "rank-0.pt")
    _falls_back_to_2(store, r"rank-0.pt: the file is from run 'run-b', the manifest from run 'run-a'")


def test_an_edited_manifest_step_is_refused(tmp_path):
    _, store = _run(tmp_path / "ck")
    ck4 = store.root / "step-00000004"
    _edit_manifest(ck4, lambda m: m.__setitem__("step", 3))
    assert store.verify(ck4) == ["step-00000004: the manifest says step 3, the folder name says 4"]
    _falls_back_to_2(store, r"the manifest says step 3, the folder name says 4")
    # the folder renamed to match: the files themselves still say step 4
    _, store = _run(tmp_path / "ck2")
    ck4 = store.root / "step-00000004"
    _edit_manifest(ck4, lambda m: m.__setitem__("step", 3))
    ck4.rename(store.root / "step-00000003")
    t = _trainer()
    got = restore(t, store)
    assert got.step == 2 and t.step_id == 2
    assert got.skipped == ["step 3/replicated.pt: the file holds step 4, the manifest says 3; "
                           "step 3/replicated.pt: the trainer state inside is at step 4; "
                           "step 3/rank-0.pt: the file holds step 4, the manifest says 3"]


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED_MARKER",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_forged_digest_on_a_pickle_payload_falls_back_to_the_previous_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ref, store = _run(tmp_path / "ck", steps=6)
    ck6 = store.root / "step-00000006"
    torch.save({"workers": _Evil()}, ck6 / "rank-0.pt")  # needs code to unpickle
    _rehash(ck6, "rank-0.pt")
    t = _trainer()
    got = restore(t, store, restart=1, reason="test")
    assert not (tmp_path / "PWNED_MARKER").exists()
    assert got.step == 4 and len(got.skipped) == 1
    assert got.skipped[0].startswith("refusing to load step-00000006/rank-0.pt: UnpicklingError")
    assert store.lineage()[-1]["skipped"] == got.skipped and store.lineage()[-1]["restored_from"] == 4
    t.step()
    t.step()
    assert all(torch.equal(p, q) for p, q in zip(t.model.parameters(), ref.model.parameters()))


def test_verified_state_that_does_not_fit_is_rolled_back_and_the_previous_checkpoint_used(tmp_path):
    ref, store = _run(tmp_path / "ck", steps=6)
    ck6 = store.root / "step-00000006"
    rep = torch.load(ck6 / "replicated.pt", weights_only=True)
    rep["optimizer"] = {"state": "garbage"}  # the model loads first, then this fails: a partial load
    save_state(ck6 / "replicated.pt", rep)
    _rehash(ck6, "replicated.pt")
    t = _trainer()
    got = restore(t, store)
    assert got.step == 4 and len(got.skipped) == 1
    assert got.skipped[0].startswith("step-00000006: its state does not fit this trainer (")
    t.step()
    t.step()  # the half-applied step-6 state is gone: replaying from 4 reproduces the reference
    assert all(torch.equal(p, q) for p, q in zip(t.model.parameters(), ref.model.parameters()))
    assert t.optimizer_digest() == ref.optimizer_digest()


def test_hmac_authenticates_the_manifest(tmp_path, monkeypatch):
    from robustagg.checkpoint import KEY_ENV, manifest_mac

    ref, store = _run(tmp_path / "ck", key=b"secret")
    ck2, ck4 = store.root / "step-00000002", store.root / "step-00000004"
    m = json.loads((ck4 / "manifest.json").read_text())
    assert m["hmac"] == manifest_mac(m, b"secret") and len(m["hmac"]) == 64
    assert store.verify(ck4) == []
    assert CheckpointStore(store.root, key=b"other").verify(ck4) == [
        "step-00000004: manifest HMAC mismatch (edited, or signed with another key)"]
    # an edit that keeps every digest consistent (what defeats the digests alone) breaks the HMAC
    (ck4 / "rank-0.pt").write_bytes((ck2 / "rank-0.pt").read_bytes())
    _rehash(ck4, "rank-0.pt")
    assert CheckpointStore(store.root, key=b"").verify(ck4) == []  # without the key: undetected here
    _falls_back_to_2(store, r"^step-00000004: manifest HMAC mismatch")
    # a store with a key refuses unsigned manifests; the key can come from the environment
    _, plain = _run(tmp_path / "plain", key=b"")
    monkeypatch.setenv(KEY_ENV, "secret")
    keyed = CheckpointStore(plain.root)
    assert keyed.key == b"secret" and CheckpointStore(plain.root, key=b"").key is None
    assert keyed.verify(plain.root / "step-00000004") == [
        "step-00000004: the manifest has no HMAC, and this store has a key (written without it, or forged)"]
    with pytest.raises(CheckpointError, match="key must be bytes"):
        CheckpointStore(plain.root, key="secret")

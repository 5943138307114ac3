"""Committed checkpoints and coordinated restore, with real processes that really die.

A 4-process gloo run (stateful rule, stateful omniscient attack, worker and server momentum, a
cosine schedule, dropout) is interrupted by SIGKILL at a step drawn from a seeded RNG, between the
ranks' optimizer steps, while writing a checkpoint, and after a committed checkpoint was damaged
on disk. Each time the app's launcher restarts the group, every rank restores the same verified
committed checkpoint, the lost steps are replayed, and the run ends with parameters and optimizer
state ``torch.equal`` to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from experiments.train import train
from state_equal import assert_state_equal
from robustagg.checkpoint import CheckpointStore, load_state, sha256_file
from robustagg.errors import CheckpointError, ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"
STEPS, EVERY, N = 12, 4, 4
COMMON = ["logger=none", "trainer.progress=false", f"threat.n={N}", "threat.f=1", "aggregator=centered_clipping",
          "aggregator.tau=0.5", "attack=mimic", "model.dropout=0.3", f"trainer.steps={STEPS}", "trainer.eval_every=4",
          "trainer.worker_momentum=0.9", "optimizer.momentum=0.5", "scheduler=cosine",
          f"trainer.checkpoint.every={EVERY}", "trainer.param_check_every=3", "trainer.collective_timeout_s=30"]
SEED = 20240607  # the test's own seeded choices of ranks and steps


def _rng(name: str) -> random.Random:
    return random.Random(f"{SEED}/{name}")


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*COMMON, *overrides])


def _final(run: Path):
    """Parameters (model.safetensors) and the committed end state (optimizer, scheduler, rule)."""
    ck = run / "checkpoints" / f"step-{STEPS:08d}"
    return load_file(str(run / "model.safetensors")), load_state(ck / "replicated.pt")


def _assert_same_run(run: Path, ref: Path):
    wa, sa = _final(run)
    wb, sb = _final(ref)
    assert_state_equal(wa, wb, "parameters")
    for key in ("model", "optimizer", "scheduler", "rule", "step", "last_digest"):
        assert_state_equal(sa[key], sb[key], key)
    assert sa["optimizer"]["state"][0]["momentum_buffer"].abs().sum() > 0  # momentum really is in the state


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("reference")
    s = train(_cfg(), out_dir=run, quiet=True)
    assert s["steps"] == STEPS and s["restarts"] == 0 and s["lineage"] == []
    names = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert names == ["step-00000004", "step-00000008", "step-00000012"]  # keep=3: every 4 steps + the end
    return run, s


def test_sigkill_at_a_random_step_resumes_bit_for_bit(reference, tmp_path):
    rng = _rng("sigkill")
    step, rank = rng.randint(2, STEPS), rng.randrange(N)
    s = train(_cfg("faults=[crash]", f"faults.crash.step={step}", f"faults.crash.rank={rank}",
                   "trainer.max_restarts=1"), out_dir=tmp_path, quiet=True)
    _assert_same_run(tmp_path, reference[0])
    for key in ("final_test_acc", "best_test_acc", "mean_kappa_hat", "byz_accepted_rate"):
        assert s[key] == reference[1][key], key  # the summary covers the whole restored trajectory
    assert s["restarts"] == 1 and s["steps"] == STEPS
    (rec,) = s["lineage"]
    restored = (step - 1) // EVERY * EVERY  # the last committed boundary before the crash
    assert rec["restored_from"] == (restored or None) and rec["restart"] == 1
    assert rec["steps_replayed"] == ([restored + 1, step - 1] if step - 1 > restored else [])
    assert "SIGKILL" in rec["reason"] and f"rank {rank}" in rec["reason"]
    injected, detected = s["faults"]["injected"], s["faults"]["detected"]
    assert [(f["kind"], f["rank"], f["step"]) for f in injected] == [("crash", rank, step)]
    # a loaded machine may add straggler records at any step: assert the failure this test caused
    assert [(d["kind"], d["step"], d["lost"]) for d in detected if d["kind"] != "straggler"] == [
        ("fail-stop", step, [rank])]
    # every survivor wrote evidence before teardown (archived when the group restarted)
    ev = sorted((tmp_path / "evidence" / "attempt-0").glob("rank-*.json"))
    assert [p.name for p in ev] == [f"rank-{r}.json" for r in range(N) if r != rank]
    e = json.loads(ev[0].read_text())
    assert e["kind"] == "peer_lost" and e["step"] == step and e["collective"]["last_completed"]["seq"] > 0
    assert set(e["digests"]) >= {"last_aggregate", "parameters", "optimizer"} and e["exception"]["message"]
    # metrics.jsonl holds the restored trajectory once: no duplicated steps
    steps = [r["step"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    assert steps == list(range(1, STEPS + 1))


def test_crash_between_the_ranks_optimizer_steps(reference, tmp_path):
    rng = _rng("between")
    step, rank = rng.randint(2, STEPS), rng.randrange(N)
    s = train(_cfg("faults=[crash_between]", f"faults.crash_between.step={step}",
                   f"faults.crash_between.rank={rank}", "trainer.max_restarts=1"), out_dir=tmp_path, quiet=True)
    _assert_same_run(tmp_path, reference[0])
    (rec,) = s["lineage"]
    restored = (step - 1) // EVERY * EVERY
    # the survivors applied step `step`; the killed rank did not; the restore undoes their step too
    assert rec["restored_from"] == (restored or None) and rec["steps_replayed"] == [restored + 1, step]


@pytest.mark.parametrize("phase,rank", [("files", _rng("files").randrange(N)), ("commit", 0)])
def test_crash_while_writing_a_checkpoint(reference, tmp_path, phase, rank):
    s = train(_cfg("faults=[checkpoint_crash]", "faults.checkpoint_crash.step=8", f"faults.checkpoint_crash.rank={rank}",
                   f"faults.checkpoint_crash.phase={phase}", "trainer.max_restarts=1"), out_dir=tmp_path, quiet=True)
    _assert_same_run(tmp_path, reference[0])
    (rec,) = s["lineage"]
    assert rec["restored_from"] == 4 and rec["steps_replayed"] == [5, 8]  # step 8 was never committed
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_corrupted_committed_checkpoint_is_detected_and_the_previous_one_used(reference, tmp_path):
    s = train(_cfg("faults=[checkpoint_corrupt,crash]", "faults.checkpoint_corrupt.step=8",
                   "faults.checkpoint_corrupt.rank=1", "faults.crash.step=10", "faults.crash.rank=3",
                   "trainer.max_restarts=1"), out_dir=tmp_path, quiet=True)
    _assert_same_run(tmp_path, reference[0])
    (rec,) = s["lineage"]
    assert rec["restored_from"] == 4 and rec["steps_replayed"] == [5, 9]
    assert rec["skipped"] == ["step-00000008/rank-1.pt: SHA-256 mismatch"]
    assert (tmp_path / "checkpoints" / "step-00000008.rejected-1").is_dir()  # set aside, kept for inspection
    assert sorted(f["id"] for f in s["faults"]["injected"]) == ["checkpoint_corrupt", "crash"]


def test_an_older_rank_file_swapped_in_is_refused_by_its_rank_and_everyone_falls_back(reference, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference[0], run)  # the uninterrupted run, its last checkpoint taken away
    root = run / "checkpoints"
    shutil.rmtree(root / "step-00000012")
    ck8 = root / "step-00000008"
    (ck8 / "rank-1.pt").write_bytes((root / "step-00000004" / "rank-1.pt").read_bytes())
    manifest = json.loads((ck8 / "manifest.json").read_text())  # the digest edited to match: only rank 1
    manifest["files"]["rank-1.pt"] = {"size": (ck8 / "rank-1.pt").stat().st_size,  # reads that file
                                      "sha256": sha256_file(ck8 / "rank-1.pt")}
    (ck8 / "manifest.json").write_text(json.dumps(manifest))
    s = train(_cfg(), out_dir=run, quiet=True)
    (rec,) = s["lineage"]
    assert rec["restored_from"] == 4 and rec["steps_replayed"] == [] and rec["skipped"] == [
        "step 8/rank-1.pt: the file holds step 4, the manifest says 8"]  # rank 0 names rank 1's reason
    assert (root / "step-00000008.rejected-1").is_dir()
    _assert_same_run(run, reference[0])  # rank 0 had loaded step 8 before the vote: it was rolled back


# --- simulated mode: the same restore logic in one process (fast) ------------------------------
SIM = ["trainer.mode=simulated", "attack=ipm"]


def test_resume_from_an_explicit_checkpoint_folder(tmp_path):
    a = train(_cfg(*SIM), out_dir=tmp_path / "a", quiet=True)
    start = tmp_path / "a" / "checkpoints" / "step-00000004"
    b = train(_cfg(*SIM, f"trainer.resume={start}"), out_dir=tmp_path / "b", quiet=True)
    assert_state_equal(load_file(str(tmp_path / "b" / "model.safetensors")),
                  load_file(str(tmp_path / "a" / "model.safetensors")), "parameters")
    assert b["resumed_from"] == 4 and b["lineage"][0]["restored_from"] == 4 and b["steps"] == a["steps"] == STEPS
    fresh = train(_cfg(*SIM, "trainer.resume=never"), out_dir=tmp_path / "a", quiet=True)  # never on top of old files
    assert fresh["run_dir"] == f"{tmp_path / 'a'}-2" and fresh["resumed_from"] is None
    with pytest.raises(ConfigError, match="is not a committed checkpoint folder"):
        train(_cfg(*SIM, f"trainer.resume={tmp_path / 'nowhere'}"), out_dir=tmp_path / "c", quiet=True)
    again = train(_cfg(*SIM), out_dir=tmp_path / "a", quiet=True)  # resume=auto on a finished run: nothing to do
    assert again["resumed_from"] == STEPS and again["final_test_acc"] == a["final_test_acc"]


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED_MARKER",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_restore_never_executes_pickled_code_even_with_a_matching_manifest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train(_cfg(*SIM, "trainer.steps=8"), out_dir=tmp_path / "a", quiet=True)
    ck = tmp_path / "a" / "checkpoints" / "step-00000008"
    torch.save({"workers": _Evil()}, ck / "rank-0.pt")  # an attacker who can also rewrite the manifest
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["files"]["rank-0.pt"] = {"size": (ck / "rank-0.pt").stat().st_size, "sha256": sha256_file(ck / "rank-0.pt")}
    (ck / "manifest.json").write_text(json.dumps(manifest))
    assert CheckpointStore(tmp_path / "a" / "checkpoints").verify(ck) == []  # the hashes match ...
    # (the cosine schedule's T_max follows trainer.steps, so a longer run is the same experiment; allow is harmless)
    s = train(_cfg(*SIM, "trainer.steps=12", "trainer.resume_changes=allow"), out_dir=tmp_path / "a", quiet=True)
    assert not (tmp_path / "PWNED_MARKER").exists()  # ... and still nothing was executed
    # ... and the run fell back to the previous verified checkpoint, with the reason in the lineage
    assert s["resumed_from"] == 4 and s["steps"] == 12
    (rec,) = [r for r in s["lineage"] if r["event"] == "restore"]
    assert rec["restored_from"] == 4 and len(rec["skipped"]) == 1
    assert rec["skipped"][0].startswith("refusing to load step-00000008/rank-0.pt: UnpicklingError")
    assert (tmp_path / "a" / "checkpoints" / "step-00000008.rejected-1").is_dir()
    with open(ck.with_name("x.pkl"), "wb") as fh:  # the plain pickle route is refused as well
        pickle.dump(_Evil(), fh)
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_state(ck.with_name("x.pkl"))
    assert not (tmp_path / "PWNED_MARKER").exists()

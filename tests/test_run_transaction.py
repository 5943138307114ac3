"""The run transaction's remaining holes (issue 27, items 1-7 and 11).

Real processes where the failure needs them: two lock racers over many trials, two launchers
sharing one checkpoint folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "WANDB_MODE": "disabled",
       "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}


def _wait_for(paths: list[Path], seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"{[str(p) for p in paths if not p.exists()]} did not appear"
        time.sleep(0.001)


# --- item 1: the run lock is written whole, then linked into place ---------------------------------
@pytest.mark.slow
def test_two_processes_racing_for_one_lock_never_both_hold_it(tmp_path):
    trials = 150
    racers = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "lock_racer.py"), str(tmp_path), name,
                                str(trials)], env=ENV) for name in ("a", "b")]
    try:
        for k in range(trials):
            _wait_for([tmp_path / f"a-ready-{k}", tmp_path / f"b-ready-{k}"])
            (tmp_path / f"go-{k}").touch()
        for p in racers:
            assert p.wait(timeout=300) == 0
    finally:
        for p in racers:
            if p.poll() is None:
                p.kill()
    verdicts = [sorted((tmp_path / f"{n}-{k}").read_text() for n in ("a", "b")) for k in range(trials)]
    both = [k for k, v in enumerate(verdicts) if v == ["held", "held"]]
    assert not both, f"both racers held the lock in {len(both)} of {trials} trials: {both[:10]}"
    assert all(v == ["held", "refused"] for v in verdicts), verdicts


@pytest.mark.parametrize("content", ["", '{"host": "h', "[1, 2]", "\x00\x01"])
def test_an_empty_or_partly_written_lock_counts_as_held_never_stale(tmp_path, content):
    from robustagg.launch import RunLock, RunLockedError

    (tmp_path / "run.lock").write_text(content)
    with pytest.raises(RunLockedError, match=r"cannot be read as a lock record .* counts as held.*delete .*run\.lock"):
        RunLock(tmp_path).acquire()
    assert (tmp_path / "run.lock").read_text() == content  # left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == [".run.lock.guard", "run.lock"]  # no temp file left


# --- item 2: the checkpoint folder is locked too ----------------------------------------------------
SMALL = ["logger=none", "trainer.progress=false", "threat.n=3", "threat.f=1", "aggregator=coordinate_median",
         "attack=sign_flip", "trainer.batch_size=16", "trainer.param_check_every=0", "trainer.mode=simulated"]


def _cli(args, cwd):
    return subprocess.Popen([sys.executable, "-m", "experiments.train", *SMALL, *args], cwd=cwd, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_run_folders_sharing_one_checkpoint_folder_cannot_run_together(tmp_path):
    shared, go = tmp_path / "shared-ckpt", tmp_path / "go"
    common = ["trainer.steps=12", "trainer.checkpoint.every=2", f"trainer.checkpoint.dir={shared}"]
    hold = f"trainer.callbacks=[{{_target_: lifecycle_helpers.WaitForFile, path: '{go}', step: 5}}]"
    a = _cli(["run_name=first", *common, hold], tmp_path)
    try:
        _wait_for([shared / "step-00000004" / "manifest.json"], seconds=300)
        b = _cli(["run_name=second", *common, "trainer.resume_changes=allow"], tmp_path)  # (no callback)
        out_b, err_b = b.communicate(timeout=300)
    finally:
        go.touch()
        out_a, err_a = a.communicate(timeout=300)
    assert b.returncode == 2, err_b[-3000:]
    assert f"checkpoint folder {shared} is in use by another launch: PID {a.pid}" in err_b, err_b[-3000:]
    assert "Traceback" not in err_b and not (tmp_path / "outputs" / "second").exists()
    assert a.returncode == 0, err_a[-3000:]
    import json

    s = json.loads((tmp_path / "outputs" / "first" / "summary.json").read_text())
    assert s["steps"] == 12 and s["resumed_from"] is None
    assert not (shared / "run.lock").exists() and not (tmp_path / "outputs" / "first" / "run.lock").exists()


# --- item 7: no file of the run is written through a symbolic link ---------------------------------
def _cfg(*overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[*SMALL[:-1], "trainer.collective_timeout_s=60", *overrides])


def test_append_jsonl_and_the_metrics_sink_replace_a_planted_link_never_write_through_it(tmp_path):
    from robustagg.checkpoint import append_jsonl, read_jsonl
    from robustagg.training import JsonlSink

    victim = tmp_path / "victim.txt"
    victim.write_text("keep\n")
    for name in ("lineage.jsonl", "m.jsonl", "dangling.jsonl"):
        (tmp_path / name).symlink_to(victim if name != "dangling.jsonl" else tmp_path / "nowhere")
    append_jsonl(tmp_path / "lineage.jsonl", {"a": 1})
    append_jsonl(tmp_path / "dangling.jsonl", {"b": 2})
    sink = JsonlSink(tmp_path / "m.jsonl")
    sink.log({"kind": "train", "step": 1}, 1)
    sink.close()
    assert victim.read_text() == "keep\n" and not (tmp_path / "nowhere").exists()
    for name in ("lineage.jsonl", "m.jsonl", "dangling.jsonl"):
        assert not (tmp_path / name).is_symlink()
    assert read_jsonl(tmp_path / "lineage.jsonl") == [{"a": 1}] and read_jsonl(tmp_path / "m.jsonl")[0]["step"] == 1


@pytest.mark.slow
def test_a_run_with_a_restart_writes_no_byte_through_links_planted_at_its_logs(tmp_path):
    from experiments.train import train

    outside = tmp_path / "outside"
    outside.mkdir()
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    planted = {run / "checkpoints" / "lineage.jsonl", run / "checkpoints" / "faults.jsonl",
               run / "detections.jsonl", run / "metrics.jsonl", run / "summary.json"}
    for i, link in enumerate(sorted(planted)):
        (outside / f"t{i}").write_text("")
        link.symlink_to(outside / f"t{i}")
    s = train(_cfg("trainer.steps=6", "trainer.checkpoint.every=2", "trainer.max_restarts=1", "faults=[crash]",
                   "faults.crash.rank=1", "faults.crash.step=3"), out_dir=run, quiet=True)
    assert s["restarts"] == 1 and s["resumed_from"] == 2
    assert [p.stat().st_size for p in sorted(outside.iterdir())] == [0] * len(planted)  # nothing written outside
    for link in planted:
        assert link.is_file() and not link.is_symlink() and link.stat().st_size > 0, link


# --- item 6: crafted checkpoint folders are rejections with a reason, and the run falls back ------
def _nested(step: Path) -> str:
    (step / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    return "nested too deeply"


def _sparse(step: Path) -> str:
    os.truncate(step / "rank-0.pt", 1 << 40)  # 1 TiB, sparse: reading it would exhaust the memory
    return "size 1099511627776 != "


def _arabic_indic(step: Path) -> str:
    step.rename(step.with_name("step-" + "".join(chr(0x660 + int(c)) for c in step.name[5:])))
    return "not step- followed by 8 ASCII digits"


@pytest.mark.parametrize("craft", [_nested, _sparse, _arabic_indic])
def test_a_crafted_checkpoint_is_rejected_with_its_reason_and_the_run_falls_back(tmp_path, craft):
    from experiments.train import train
    from robustagg.checkpoint import CheckpointStore
    from robustagg.launch import check_resume

    args = ["trainer.mode=simulated", "trainer.checkpoint.every=2", "trainer.checkpoint.keep=5"]
    train(_cfg("trainer.steps=4", *args), out_dir=tmp_path, quiet=True)
    ckpt = tmp_path / "checkpoints"
    why = craft(ckpt / "step-00000004")
    store = CheckpointStore(ckpt)
    found, skipped = store.latest()
    assert found is not None and found.step == 2 and any(why in s for s in skipped), skipped
    fp = json.loads((ckpt / "step-00000002" / "manifest.json").read_text())["fingerprint"]
    assert check_resume(ckpt, fp, record=False).step == 2
    s = train(_cfg("trainer.steps=6", *args), out_dir=tmp_path, quiet=True)
    assert s["resumed_from"] == 2 and s["steps"] == 6
    restore = [r for r in s["lineage"] if r.get("event") == "restore"][-1]
    assert any(why in x for x in restore["skipped"]), restore


# --- item 3: trainer.resume=PATH passes the same identity check as resume=auto, before launch ---------
@pytest.mark.parametrize("change, key", [("optimizer.lr=0.5", "optimizer.lr: 0.1 (checkpoint) -> 0.5 (now)"),
                                         ("threat.n=4", "threat.n: 3 (checkpoint) -> 4 (now)"),
                                         ("aggregator=trimmed_mean", "aggregator._target_")])
def test_an_explicit_resume_folder_of_another_experiment_is_refused_before_launch(tmp_path, change, key):
    from experiments.train import train
    from robustagg.errors import ConfigError

    sim = ["trainer.mode=simulated", "trainer.checkpoint.every=2"]
    train(_cfg("trainer.steps=4", *sim), out_dir=tmp_path / "a", quiet=True)
    start = tmp_path / "a" / "checkpoints" / "step-00000004"
    with pytest.raises(ConfigError, match="belongs to a different experiment") as err:
        train(_cfg("trainer.steps=6", *sim, f"trainer.resume={start}", change), out_dir=tmp_path / "b", quiet=True)
    assert key in str(err.value) and str(start) in str(err.value)
    assert not (tmp_path / "b" / "metrics.jsonl").exists()  # refused before any worker started
    s = train(_cfg("trainer.steps=6", *sim, f"trainer.resume={start}"), out_dir=tmp_path / "b", quiet=True)
    assert s["resumed_from"] == 4 and s["steps"] == 6  # the same experiment continues


def test_an_explicit_resume_folder_that_does_not_verify_is_refused_before_launch_with_the_reasons(tmp_path):
    from experiments.train import train
    from robustagg.errors import ConfigError

    sim = ["trainer.mode=simulated", "trainer.checkpoint.every=2"]
    train(_cfg("trainer.steps=4", *sim), out_dir=tmp_path / "a", quiet=True)
    start = tmp_path / "a" / "checkpoints" / "step-00000004"
    with open(start / "rank-0.pt", "r+b") as fh:
        fh.seek(100)
        fh.write(b"\xff\xfe")
    with pytest.raises(ConfigError, match=r"(?s)does not verify.*rank-0\.pt: SHA-256 mismatch"):
        train(_cfg("trainer.steps=6", *sim, f"trainer.resume={start}"), out_dir=tmp_path / "b", quiet=True)
    assert not (tmp_path / "b" / "metrics.jsonl").exists()


# --- item 5: every checkpoint verifies by digest but none loads: refused, never a restart from 0 -------
def _forge_every_checkpoint(ckpt: Path) -> None:
    """Replace every checkpoint's rank-0.pt by a plain payload and fix its digest: each verifies, none loads."""
    import torch

    from robustagg.checkpoint import sha256_file

    for step in sorted(ckpt.glob("step-????????")):
        torch.save({"workers": {}}, step / "rank-0.pt")
        m = json.loads((step / "manifest.json").read_text())
        m["files"]["rank-0.pt"] = {"size": (step / "rank-0.pt").stat().st_size, "sha256": sha256_file(step / "rank-0.pt")}
        (step / "manifest.json").write_text(json.dumps(m))


def _train_steps(run: Path) -> list[int]:
    from robustagg.checkpoint import read_jsonl

    return [int(r["step"]) for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "train"]


def test_when_every_checkpoint_verifies_but_none_loads_the_run_refuses_and_lists_the_reasons(tmp_path):
    from experiments.train import train
    from robustagg.errors import RobustAggError

    sim = ["trainer.mode=simulated", "trainer.checkpoint.every=2"]
    train(_cfg("trainer.steps=4", *sim), out_dir=tmp_path, quiet=True)
    _forge_every_checkpoint(tmp_path / "checkpoints")
    with pytest.raises(RobustAggError, match=r"(?s)none of the 2 committed checkpoint\(s\).*step 4/rank-0.pt: carries no "
                                             r"identity record.*step 2/rank-0.pt: carries no identity record"):
        train(_cfg("trainer.steps=6", *sim), out_dir=tmp_path, quiet=True)
    assert _train_steps(tmp_path) == [1, 2, 3, 4]  # not a step trained again from 0
    # the same command again: the set-aside checkpoints are still no reason to start over from step 0
    with pytest.raises(RobustAggError, match=r"(?s)set aside.*step-00000004\.rejected-1.*trainer\.resume=never"):
        train(_cfg("trainer.steps=6", *sim), out_dir=tmp_path, quiet=True)


@pytest.mark.slow
def test_with_processes_and_restarts_a_run_whose_checkpoints_do_not_load_exits_2_and_says_why(tmp_path):
    train_args = ["trainer.checkpoint.every=2", "hydra.run.dir=run"]
    first = _cli(["trainer.mode=processes", "trainer.steps=4", *train_args], tmp_path)
    assert first.wait(timeout=300) == 0, first.stderr.read()[-3000:]
    _forge_every_checkpoint(tmp_path / "run" / "checkpoints")
    p = _cli(["trainer.mode=processes", "trainer.steps=6", "trainer.max_restarts=2", *train_args], tmp_path)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 2 and "none of the 2 committed checkpoint(s)" in err, err[-3000:]
    assert "carries no identity record" in err and "restart" not in err, err[-3000:]  # no futile restart
    assert _train_steps(tmp_path / "run") == [1, 2, 3, 4]


# --- item 4: resume_changes=allow applies an optimizer change to the restored optimizer, or refuses ----
def _groups(step: Path) -> list[dict]:
    import torch

    return torch.load(step / "replicated.pt", weights_only=True)["optimizer"]["param_groups"]


@pytest.mark.parametrize("mode", ["simulated", pytest.param("processes", marks=pytest.mark.slow)])
def test_an_allowed_learning_rate_change_is_what_the_resumed_steps_train_with(tmp_path, mode):
    from experiments.train import train

    args = [f"trainer.mode={mode}", "trainer.checkpoint.every=2", "optimizer=sgd", "optimizer.momentum=0.5"]
    train(_cfg("trainer.steps=4", *args), out_dir=tmp_path / "a", quiet=True)
    assert [g["lr"] for g in _groups(tmp_path / "a" / "checkpoints" / "step-00000004")] == [0.1]
    s = train(_cfg("trainer.steps=6", *args, "optimizer.lr=0.5", "optimizer.momentum=0.9",
                   "trainer.resume_changes=allow"), out_dir=tmp_path / "a", quiet=True)
    assert s["resumed_from"] == 4
    changed = [r for r in s["lineage"] if r.get("event") == "experiment_changed"]
    assert changed[-1]["changes"] == {"optimizer.lr": [0.1, 0.5], "optimizer.momentum": [0.5, 0.9]}
    groups = _groups(tmp_path / "a" / "checkpoints" / "step-00000006")
    assert [(g["lr"], g["momentum"]) for g in groups] == [(0.5, 0.9)]  # what steps 5 and 6 trained with


@pytest.mark.parametrize("change, why", [
    (["optimizer=adam"], r"optimizer\._target_: .*cannot change on resume"),
    (["scheduler=multistep", "optimizer.lr=0.5"], r"optimizer\.lr: 0\.1 -> 0\.5 cannot change on resume under scheduler"),
])
def test_an_allowed_change_that_cannot_reach_the_restored_optimizer_is_refused_before_launch(tmp_path, change, why):
    from experiments.train import train
    from robustagg.errors import ConfigError

    base = ["trainer.mode=simulated", "trainer.checkpoint.every=2"]
    first = [c for c in change if c.startswith("scheduler")]
    train(_cfg("trainer.steps=4", *base, *first), out_dir=tmp_path, quiet=True)
    with pytest.raises(ConfigError, match=why):
        train(_cfg("trainer.steps=6", *base, *change, "trainer.resume_changes=allow"), out_dir=tmp_path, quiet=True)
    assert _train_steps(tmp_path) == [1, 2, 3, 4]


# --- item 11: a read-only run folder or a full disk: one line naming the path and the cause, exit 2 ----
def _mount_tmpfs(where: Path, size: str, *, read_only: bool = False) -> None:
    """A small tmpfs at ``where`` (a full disk within a few writes), or a read-only one; skip where
    this process may not mount (not root, or no mount in this container)."""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs to mount a tmpfs (root)")
    (where / "run").mkdir()
    if read_only:
        subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)


@pytest.fixture
def mount_point(tmp_path):
    where = tmp_path / "mnt"
    yield where
    if os.path.ismount(where):
        subprocess.run(["umount", str(where)], check=False)


def _one_line_error(p: subprocess.Popen, err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize("mode", ["simulated", pytest.param("processes", marks=pytest.mark.slow)])
def test_a_full_disk_ends_in_one_line_naming_the_path_and_exit_2(mount_point, tmp_path, mode):
    _mount_tmpfs(mount_point, "400k")
    p = _cli([f"trainer.mode={mode}", "trainer.steps=200", "trainer.checkpoint.every=2", "trainer.checkpoint.keep=50",
              f"hydra.run.dir={mount_point / 'run'}"], tmp_path)
    out, err = p.communicate(timeout=300)
    _one_line_error(p, err, f"cannot write {mount_point / 'run'}", "No space left on device", "run the same command")


def test_a_read_only_run_folder_ends_in_one_line_naming_the_path_and_exit_2(mount_point, tmp_path):
    _mount_tmpfs(mount_point, "1m", read_only=True)
    p = _cli(["trainer.steps=4", f"hydra.run.dir={mount_point / 'run'}"], tmp_path)
    out, err = p.communicate(timeout=300)
    _one_line_error(p, err, f"{mount_point / 'run'}", "Read-only file system")

"""Stops and refusals around a rejoin, with real processes (issue 27, items 8, 9 and 13).

A SIGTERM while a replacement waits to be admitted stops the members at one committed step and
says so (the waiting replacement is not a member: it does not vote on the stop). A replacement
that cannot take part (its peer copy refused and no disk copy; the live peer's transfer tampered
with) leaves with evidence, and the group goes on at its smaller size.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import json

import pytest
from hydra import compose, initialize_config_dir

from experiments.train import train
from robustagg.checkpoint import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "WANDB_MODE": "disabled",
       "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
SIX = ["logger=none", "trainer.progress=false", "threat.n=6", "threat.f=0", "aggregator=mean", "attack=none",
       "trainer.batch_size=8", "trainer.eval_every=0", "trainer.param_check_every=0",
       "trainer.collective_timeout_s=60", "trainer.checkpoint.every=1", "trainer.max_restarts=1",
       "trainer.on_failure=shrink", "trainer.rejoin=true"]


def _train_steps(run: Path) -> list[int]:
    return [int(r["step"]) for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "train"]


def _wait(cond, what: str, proc: subprocess.Popen, seconds: float = 300.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds} s"
        time.sleep(0.1)


def test_sigterm_while_a_replacement_waits_stops_the_members_at_one_committed_step(tmp_path):
    # worker 5 dies at the start of step 4; the five restore step 3 and go on; its replacement asks to
    # join and waits for the boundary after step 12. Rank 0 holds after step 7 until the test lets it
    # go, so the SIGTERM lands while the replacement is still waiting.
    gate, run = tmp_path / "go", tmp_path / "run"
    hold = f"trainer.callbacks=[{{_target_: lifecycle_helpers.WaitForFile, path: '{gate}', step: 7}}]"
    proc = subprocess.Popen([sys.executable, "-m", "experiments.train", *SIX, "trainer.steps=14", "faults=[rejoin]",
                             "faults.rejoin.rank=5", "faults.rejoin.step=4", "faults.rejoin.seconds=0.2",
                             "faults.rejoin.join_step=12", hold, f"hydra.run.dir={run}"],
                            cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: (run / "metrics.jsonl").exists() and 6 in _train_steps(run), "step 6 of the five", proc)
        time.sleep(2.0)  # rank 0 holds after step 7; the replacement (back 0.2 s after the restart) waits
        proc.send_signal(signal.SIGTERM)  # to the launcher only, as a scheduler's preemption would
        time.sleep(1.0)
        gate.write_text("go")
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    m = re.search(r"interrupted at step (\d+); run the same command to resume \(SIGTERM; committed checkpoint at "
                  r"step (\d+)\)", err)
    assert m and m.group(1) == m.group(2), err[-3000:]
    assert "different stop steps" not in err and "Traceback" not in err, err[-3000:]
    step = int(m.group(1))
    assert 7 < step < 12 and (run / "checkpoints" / f"step-{step:08d}" / "manifest.json").is_file()


# --- a replacement that cannot take part leaves; the group goes on (items 8, 9) -------------------------------
QUIET = ["logger=none", "trainer.progress=false", "trainer.eval_every=0", "trainer.param_check_every=0",
         "trainer.batch_size=8", "trainer.reduction=gather", "trainer.collective_timeout_s=60", "data=synthetic"]
#: worker 5 dies at the start of step 5; the five restore step 4 and admit its replacement after step 7
PEER_RUN = ("threat.n=6", "threat.f=0", "aggregator=mean", "attack=none", "trainer.steps=10",
            "trainer.checkpoint.every=2", "trainer.worker_momentum=0.5", "faults=[rejoin]", "faults.rejoin.rank=5",
            "faults.rejoin.step=5", "faults.rejoin.seconds=0.2", "faults.rejoin.join_step=7",
            "trainer.on_failure=shrink", "trainer.rejoin=true", "trainer.peer_copy=true", "trainer.max_restarts=1")


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[*QUIET, *overrides])


class TamperPeerCopy:
    """Test callback: after step 6 of the five, flip one byte of worker 5's own state in worker 4's memory."""

    def __call__(self, trainer, out) -> None:
        if trainer.step_id == 6 and trainer.comm.world_size == 5 and 4 in set(trainer.identities.values()):
            from robustagg.launch.peer import held

            part = held().parts[5]
            bad = bytearray(part.payload)
            bad[len(bad) // 2] ^= 0x01
            part.payload = bytes(bad)


def test_a_refused_peer_copy_without_a_disk_copy_leaves_the_group_at_its_smaller_size(tmp_path):
    # keep=1: when worker 5's replacement is admitted (after step 7) the commit of step 4 that held its
    # own state is pruned; the only copy is worker 4's in memory, and that one was tampered with
    run = tmp_path / "run"
    s = train(_cfg(*PEER_RUN, "trainer.checkpoint.keep=1",
                   "trainer.callbacks=[{_target_: test_rejoin_transaction.TamperPeerCopy}]"), out_dir=run, quiet=True)
    assert s["steps"] == 10 and s["workers"] == [0, 1, 2, 3, 4] and s["n"] == 5  # it went on without worker 5
    refused = [r for r in s["lineage"] if r["event"] == "rejoin_refused"]
    assert [(r["worker"], r["step"]) for r in refused] == [(5, 7)], s["lineage"]
    assert "refused the in-memory copy of its own state held by worker 4" in refused[0]["reason"]
    assert not [r for r in s["lineage"] if r["event"] == "grow"]
    ev = json.loads((run / "evidence" / "rejoin-5.json").read_text())
    assert ev["kind"] == "peer_copy_refused" and ev["received"]["sha256"] != ev["committed"]["sha256"]
    assert _train_steps(run)[-3:] == [8, 9, 10]  # trained on at n = 5 after the grow boundary


def _tamper_the_state_transfer(monkeypatch):
    """Flip one byte of the live peer's state after its manifest was taken (the sender's side of
    :func:`~robustagg.launch.grow.send_state`); forked workers inherit the patch."""
    import torch.distributed as dist

    real = dist.broadcast_object_list

    def tampered(box, src=0, **kw):
        if box and isinstance(box[0], dict) and {"manifest", "payload"} <= set(box[0]):
            bad = bytearray(box[0]["payload"])
            bad[len(bad) // 2] ^= 0x01
            box[0] = {**box[0], "payload": bytes(bad)}
        return real(box, src=src, **kw)

    monkeypatch.setattr(dist, "broadcast_object_list", tampered)


def test_a_tampered_live_peer_transfer_is_refused_with_evidence_and_the_group_goes_on(tmp_path, monkeypatch):
    _tamper_the_state_transfer(monkeypatch)
    run = tmp_path / "run"
    s = train(_cfg(*[o for o in PEER_RUN if o != "trainer.peer_copy=true"]), out_dir=run, quiet=True)
    assert s["steps"] == 10 and s["workers"] == [0, 1, 2, 3, 4]  # not "Connection closed by peer": it went on
    ev = json.loads((run / "evidence" / "rejoin-5.json").read_text())
    assert ev["kind"] == "transfer_refused" and ev["from_worker"] == 0 and ev["epoch"] == 2
    assert ev["received"]["size"] == ev["manifest"]["size"] and ev["received"]["sha256"] != ev["manifest"]["sha256"]
    assert "does not match its manifest" in ev["message"]
    (det,) = [d for d in read_jsonl(run / "detections.jsonl") if d["kind"] == "rejoin_refused"]
    assert det["ranks"] == [5] and det["step"] == 7 and "does not match its manifest" in det["message"]
    (rec,) = [r for r in s["lineage"] if r["event"] == "rejoin_refused"]
    assert rec["worker"] == 5 and rec["epoch"] == [2, 3] and rec["members"] == [0, 1, 2, 3, 4]


def _kill_the_joiner_in_the_transfer(monkeypatch):
    """SIGKILL the replacement (rank 5 of the grown group of six) as it receives the live peer's state."""
    import torch.distributed as dist

    real = dist.broadcast_object_list

    def dying(box, src=0, **kw):
        if dist.get_world_size() == 6 and dist.get_rank() == 5 and box and box[0] is None:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(box, src=src, **kw)

    monkeypatch.setattr(dist, "broadcast_object_list", dying)


def test_a_joiner_killed_in_the_transfer_is_named_and_the_group_goes_on_without_it(tmp_path, monkeypatch):
    _kill_the_joiner_in_the_transfer(monkeypatch)
    run = tmp_path / "run"
    s = train(_cfg(*[o for o in PEER_RUN if o not in ("trainer.peer_copy=true", "trainer.max_restarts=1")],
                   "trainer.max_restarts=2"), out_dir=run, quiet=True)
    assert s["steps"] == 10 and s["workers"] == [0, 1, 2, 3, 4]
    dets = [d for d in read_jsonl(run / "detections.jsonl") if d["kind"] != "straggler"]
    assert len(dets) == 2, dets  # the rejoin fault's SIGKILL, then the joiner's
    det = dets[1]  # the cause, not its consequence ("Connection closed by peer" in the survivors' transfer)
    assert det["kind"] == "fail-stop" and det["lost"] == [5] and det["step"] == 7, det
    assert det["launcher"].startswith("worker rank 5 died (signal SIGKILL) without raising"), det
    assert "Connection closed" not in det["launcher"]
    assert s["restarts"] == 2 and [r["event"] for r in s["lineage"]].count("shrink") == 1  # restarted as five


def test_a_sender_killed_in_the_transfer_is_named_not_the_closed_connection(tmp_path, monkeypatch):
    import torch.distributed as dist

    real = dist.broadcast_object_list

    def dying(box, src=0, **kw):  # the live peer (rank 0 of the six) dies as it sends its state
        if dist.get_world_size() == 6 and dist.get_rank() == 0 and box and isinstance(box[0], dict):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(box, src=src, **kw)

    monkeypatch.setattr(dist, "broadcast_object_list", dying)
    run = tmp_path / "run"
    s = train(_cfg(*[o for o in PEER_RUN if o not in ("trainer.peer_copy=true", "trainer.max_restarts=1")],
                   "trainer.max_restarts=2"), out_dir=run, quiet=True)
    assert s["steps"] == 10  # the others went on (the lost sender's replacement rejoined them)
    dets = [d for d in read_jsonl(run / "detections.jsonl") if d["kind"] != "straggler"]
    det = dets[1]
    assert det["kind"] == "fail-stop" and 0 in det["lost"] and det["step"] == 7, det
    assert det["launcher"].startswith("worker rank 0 died (signal SIGKILL) without raising"), det

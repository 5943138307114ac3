"""Workers live and stop with their launcher; stalls and kills are blamed on the right rank.

Real processes throughout: a launcher subprocess is SIGKILLed (its workers must be gone, for every
start method) or SIGTERMed/SIGINTed (every rank stops at one step, after a final committed
checkpoint, and the launcher exits 143/130 with "interrupted at step N"); in-process gloo groups
check the straggler report by waiting time and the failure messages after a SIGSTOP, an external
SIGKILL and a start-up stall.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from robustagg.checkpoint import CheckpointStore
from robustagg.distributed import (Header, ProcessGroupComm, WorkerFailedError, destroy_group, free_port, init_group,
                                   spawn)
from robustagg.distributed.lifeline import die_with
from robustagg.errors import Interrupted
from robustagg.training import StragglerLog, fit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lifeline_worker import tiny_trainer  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}


def _wait_for(pred, seconds: float, what: str):
    """Poll ``pred`` until it returns a truthy value; fail (naming ``what``) after ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {seconds} s waiting for {what}")


def _gone(pid: int) -> bool:
    """The process has exited (no such pid, or a zombie nobody reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _pids(folder: Path, n: int) -> list[int] | None:
    files = [folder / f"pid-{r}" for r in range(n)]
    return [int(f.read_text()) for f in files] if all(f.exists() for f in files) else None


def _reap(pids) -> None:
    for pid in pids or ():
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


# --- header fields ----------------------------------------------------------------------------------
def test_header_carries_the_arrival_time_and_the_stop_request_bit_exact():
    h = Header(step=2, seq=5, rank=1, tag=0, numel=3, dtype=1, prev_digest=7, loss=0.5, seconds=0.25,
               sent_at=1764582000.123456789,
               stop=int(signal.SIGTERM))
    back = Header.decode(h.encode())
    assert back.sent_at == h.sent_at and back.stop == 15 and back == h
    assert Header.decode(Header(step=0, seq=1, rank=0, tag=0, numel=1, dtype=1, prev_digest=0).encode()).stop == 0


def test_die_with_refuses_its_own_pid():
    with pytest.raises(ValueError, match="launcher_pid is this process"):
        die_with(os.getpid())


# --- death with the launcher ------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_workers_die_with_a_sigkilled_launcher(tmp_path, method):
    launcher = subprocess.Popen([sys.executable, str(HERE / "lifeline_worker.py"), "linger", str(tmp_path), method],
                                env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pids = None
    try:
        pids = _wait_for(lambda: _pids(tmp_path, 2), 180, "both workers to start")
        assert all(not _gone(p) for p in pids)
        launcher.kill()  # SIGKILL: no handler, no cleanup in the launcher
        launcher.wait(30)
        _wait_for(lambda: all(_gone(p) for p in pids), 30, f"workers {pids} to die with their launcher")
    finally:
        _reap(pids)
        if launcher.poll() is None:
            launcher.kill()


# --- graceful stop ----------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["sigterm-launcher", "sigint-group"])
def test_a_stop_signal_ends_every_rank_at_one_step_with_a_final_committed_checkpoint(tmp_path, how):
    launcher = subprocess.Popen([sys.executable, str(HERE / "lifeline_worker.py"), "train", str(tmp_path),
                                 str(free_port())], env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    pids = None
    try:
        pids = _wait_for(lambda: _pids(tmp_path, 2), 180, "both workers to start")
        progress = tmp_path / "progress"
        _wait_for(lambda: progress.exists() and int(progress.read_text()) >= 3, 180, "three steps")
        if how == "sigterm-launcher":  # e.g. a batch system preempting the job
            launcher.send_signal(signal.SIGTERM)
        else:  # Ctrl-C: the terminal signals the whole foreground process group
            os.killpg(launcher.pid, signal.SIGINT)
        _, err = launcher.communicate(timeout=180)
    finally:
        _reap(pids)
        if launcher.poll() is None:
            launcher.kill()
    code = {"sigterm-launcher": 128 + signal.SIGTERM, "sigint-group": 128 + signal.SIGINT}[how]
    assert launcher.returncode == code, err
    found = re.search(r"interrupted at step (\d+); run the same command to resume", err)
    assert found, err
    n = int(found.group(1))
    stopped = [json.loads((tmp_path / f"stopped-{r}").read_text()) for r in range(2)]
    assert stopped == [{"step": n, "step_id": n}] * 2  # both ranks stopped after the same step
    assert n >= 3  # it was training when stopped
    ck, skipped = CheckpointStore(tmp_path / "ckpt").latest()
    assert ck is not None and skipped == [] and ck.step == n  # the final checkpoint is committed and verifies
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == [CheckpointStore.name(n)]
    assert all(_gone(p) for p in pids)


# --- in-process gloo groups ---------------------------------------------------------------------------
def _group(world, fn, *args, timeout_s=30.0, grace_seconds=1.0):
    port = free_port()
    spawn(_enter, world, args=(world, port, timeout_s, fn, args), start_method="fork", grace_seconds=grace_seconds)


def _enter(rank, world, port, timeout_s, fn, args):
    torch.set_num_threads(1)
    init_group(backend="gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
               init_method=f"tcp://127.0.0.1:{port}")
    try:
        fn(rank, timeout_s, *args)
    finally:
        destroy_group()


def _stall_worker(rank, timeout_s, out, stall_rank, before_step, seconds):
    trainer = tiny_trainer(ProcessGroupComm(timeout_s=timeout_s))
    log = StragglerLog() if rank == 0 else None
    detected = []

    def stall(t, step_out):  # after step before_step - 1, i.e. before step before_step: outside compute
        if rank == stall_rank and t.step_id == before_step - 1:
            time.sleep(seconds)

    fit(trainer, steps=before_step + 2, callbacks=[stall], stragglers=log, on_detect=detected.append)
    if log is not None:
        Path(out).write_text(json.dumps({"report": log.report(), "detected": detected}))


def test_a_rank_stalled_outside_compute_is_the_straggler_everyone_waited_for(tmp_path):
    # rank 1 sleeps 2.5 s between steps 3 and 4 (collective timeout 30 s): its compute time is normal,
    # but ranks 0 and 2 reach step 4's header exchange about 2.5 s before it does.
    _group(3, _stall_worker, str(tmp_path / "out.json"), 1, 4, 2.5)
    got = json.loads((tmp_path / "out.json").read_text())
    rec = [x for x in got["report"]["stragglers"] if (x["step"], x["rank"]) == (4, 1)]
    assert len(rec) == 1 and rec[0]["cause"] == "outside compute", got["report"]["stragglers"]
    # waited = 2.5 s + rank 1's own compute after the sleep - the others' compute (and rank 0's logging)
    # before the exchange: within 0.5 s of the sleep unless the machine stalls a process for longer.
    assert 2.0 <= rec[0]["waited_s"] <= 3.0 and rec[0]["seconds"] < 1.0
    assert {"kind": "straggler", **rec[0]} in got["detected"]
    assert got["report"]["per_rank"]["1"]["waited_for_max_s"] == rec[0]["waited_s"]


def _fit_worker(rank, timeout_s, what, target, at):
    trainer = tiny_trainer(ProcessGroupComm(timeout_s=timeout_s))

    def fault(t, step_out):
        if rank == target and t.step_id == at:
            os.kill(os.getpid(), signal.SIGSTOP if what == "stop" else signal.SIGKILL)

    fit(trainer, steps=at + 20, callbacks=[fault])


def test_a_sigstopped_rank_is_reported_as_killed_by_the_launcher_not_as_died_of_sigkill():
    with pytest.raises(WorkerFailedError) as info:
        _group(3, _fit_worker, "stop", 1, 3, timeout_s=2.0)
    e = info.value
    msg = str(e)
    assert (e.rank, e.error_type, e.killed, e.states.get(1)) == (1, "unresponsive", [1], "T"), msg
    assert "worker rank 1 stopped answering" in msg and "stopped by a signal (SIGSTOP/SIGTSTP)" in msg
    assert "killed it with SIGKILL after it ignored SIGTERM for 1 s" in msg and "not an external one" in msg
    assert "3 steps completed" in msg and "died (signal SIGKILL)" not in msg
    assert e.exitcodes[1] == -signal.SIGKILL and e.lost == [1]


def test_an_externally_killed_rank_is_reported_as_died():
    with pytest.raises(WorkerFailedError) as info:
        _group(3, _fit_worker, "kill", 2, 3, timeout_s=20.0)
    e = info.value
    assert (e.rank, e.error_type, e.killed, e.lost) == (2, "signal SIGKILL", [], [2]), str(e)
    assert str(e).startswith("worker rank 2 died (signal SIGKILL) without raising a Python exception, before the "
                             "launcher stopped the group (its last heartbeat: 3 steps completed")


def _late_joiner(rank, port, timeout_s):
    if rank == 2:
        time.sleep(60.0)  # stuck before init_group (a slow import, a hung file system, ...)
    init_group(backend="gloo", rank=rank, world_size=3, timeout=timedelta(seconds=timeout_s),
               init_method=f"tcp://127.0.0.1:{port}")
    destroy_group()


def test_a_rank_that_never_joined_is_named_as_the_cause():
    with pytest.raises(WorkerFailedError) as info:
        spawn(_late_joiner, 3, args=(free_port(), 2.0), start_method="fork", grace_seconds=1.0)
    e = info.value
    msg = str(e)
    assert (e.rank, e.error_type) == (2, "never_joined"), msg
    assert msg.startswith("worker rank 2 never joined the group: it had not called init_group when ranks [0, 1] "
                          "gave up waiting for it; ")
    assert "the launcher terminated it with SIGTERM" in msg and "could not join the group of 3 within 2 s" in msg
    assert sorted(f["rank"] for f in e.failures) == [0, 1] and all(f["collective"] for f in e.failures)
    assert e.heartbeats[2]["phase_name"] == "started" and math.isfinite(e.heartbeats[2]["time"])


def test_interrupted_message_and_exit_code():
    exc = Interrupted(12, signum=int(signal.SIGTERM), checkpointed=True)
    assert str(exc).startswith("interrupted at step 12; run the same command to resume (SIGTERM;")
    assert exc.exit_code == 143 and Interrupted(None, signum=int(signal.SIGINT)).exit_code == 130


def test_waiting_for_the_main_ranks_own_evaluation_is_excused_not_a_straggler():
    # Periods 0.1 s; at step 3 rank 0 arrives 2 s late because it evaluated for 1.95 s after step 2.
    arrivals = [[10.0, 10.0, 10.0], [10.1, 10.1, 10.1], [12.1, 10.1, 10.1]]
    secs = [0.01, 0.01, 0.01]
    for excused, want in (({0: 1.95}, []), ({}, [(3, 0, 2.0)])):
        log = StragglerLog(factor=10, min_seconds=0.05)
        flags = [log.add(step, secs, arrivals=a, excused=excused) for step, a in enumerate(arrivals, start=1)]
        # waited_s for rank 0 at step 3: both others waited 12.1 - 10.1 = 2.0 s; 2.0 - 1.95 = 0.05 is not > 10 x 0.1
        assert [(x["step"], x["rank"], round(x["waited_s"], 9)) for f in flags for x in f] == want

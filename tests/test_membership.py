"""Membership that heals and cannot split: epochs changed only by a strict majority, fenced commits, rejoin.

Unit tests drive :class:`robustagg.launch.quorum.Membership` on an in-process store and with real
processes racing on a real ``TCPStore``; the end-to-end tests cut a real 6-process run 4 | 2 (the
4 continue and commit, the 2 stop with evidence) and 3 | 3 (both stop: no strict majority), and
grow a run back from 5 to 6 workers with the state of a live peer (after a SIGKILL, and after a
partition that heals).
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from experiments.train import train
from robustagg.errors import ConfigError, QuorumLostError
from robustagg.launch.quorum import SEAL, Membership, next_epoch
from robustagg.training import Fault
from robustagg.training.faults import Partition
from robustagg.training.resume import IDENTITY
from state_equal import assert_state_equal

CONF = Path(__file__).resolve().parents[1] / "conf"
QUIET = ["logger=none", "trainer.progress=false", "trainer.eval_every=0", "trainer.param_check_every=0",
         "trainer.batch_size=8", "trainer.reduction=gather", "trainer.collective_timeout_s=60", "data=synthetic"]
SIX = (0, 1, 2, 3, 4, 5)


def _store() -> Membership:
    ms = Membership(dist.HashStore())
    ms.install(SIX)
    return ms


# --- the rule, in one process --------------------------------------------------------------------------
def test_only_a_strict_majority_may_propose_the_next_epoch():
    ms = _store()
    with pytest.raises(QuorumLostError, match=r"cannot propose \{0, 1, 2\} of \{0, 1, 2, 3, 4, 5\}: a strict "
                                              r"majority needs 4 members"):
        ms.propose(0, [0, 1, 2])  # half is not a majority
    assert ms.current() == (0, SIX)
    assert ms.propose(0, [3, 0, 2, 1]) == (0, 1, 2, 3)
    assert ms.current() == (1, (0, 1, 2, 3))
    with pytest.raises(QuorumLostError, match=r"only members of epoch 1 \{0, 1, 2, 3\} decide"):
        ms.propose(1, [0, 1, 4])  # a worker outside the last membership has no vote


def test_the_first_proposal_wins_and_a_second_one_reads_it():
    # asymmetric reachability: two overlapping majorities, both proposing; one epoch results
    ms = _store()
    assert ms.propose(0, [0, 1, 2, 3]) == (0, 1, 2, 3)
    assert ms.propose(0, [2, 3, 4, 5]) == (0, 1, 2, 3)  # the store holds the first
    assert ms.current() == (1, (0, 1, 2, 3))


def test_commits_are_fenced_per_epoch_and_per_step():
    ms = _store()
    ms.claim_commit(0, 4)
    with pytest.raises(QuorumLostError, match=r"refusing to commit step 4: it was already committed under "
                                              r"membership epoch 0"):
        ms.claim_commit(0, 4)
    ms.propose(0, [0, 1, 2, 3])  # seals epoch 0
    with pytest.raises(QuorumLostError, match=r"refusing to commit step 6: membership epoch 0 was replaced by "
                                              r"epoch 1 \{0, 1, 2, 3\}"):
        ms.claim_commit(0, 6)
    ms.claim_commit(1, 6)  # the new epoch commits
    assert int(ms.store.add(f"{ms.prefix}/fence/0", 0)) >= SEAL


def test_next_epoch_after_a_crash_and_after_a_split_without_majority():
    ms = _store()
    assert next_epoch(ms, 0, [5], step=4) == (1, (0, 1, 2, 3, 4), "launcher")
    with pytest.raises(QuorumLostError, match=r"lost quorum at step 7: \{0, 1\} of \{0, 1, 2, 3, 4\} survive "
                                              r"\(a strict majority needs 3\)"):
        next_epoch(ms, 1, [2, 3, 4], step=7)
    ms2 = _store()
    with pytest.raises(QuorumLostError, match=r"no side of the group holds a strict majority of the last committed "
                                              r"membership \{0, 1, 2, 3, 4, 5\} at step 3 .*: side A; side B\."):
        next_epoch(ms2, 0, [], step=3, reports=["side A", "side B", "side A"])
    assert ms2.epoch() == 0  # nothing installed


def test_partition_fault_options_and_sides():
    f = Fault("partition", step=3, workers=[5, 4, 4])
    assert f.workers == (4, 5) and f.describe()["workers"] == [4, 5]
    with pytest.raises(ConfigError, match=r"join_step is a rejoin and partition option"):
        Fault("crash", step=3, join_step=4)
    with pytest.raises(ConfigError, match=r"a partition needs the worker ids it cuts off"):
        Fault("partition", step=3)
    with pytest.raises(ConfigError, match=r"workers is a partition option; remove it"):
        Fault("crash", step=3, workers=[1])
    assert Partition("p", 3, (4, 5), inside=True).reachable(SIX) == (4, 5)
    assert Partition("p", 3, (4, 5), inside=False).reachable([0, 2, 4]) == (0, 2)


# --- the protocol with real processes racing on one TCPStore ---------------------------------------------
# Each racer is a fresh interpreter, not a fork of pytest: a fork copies the locks that pytest's
# threads (the TCPStore server, torch's pools) hold at that instant, and under load a child could
# hang on one of them (seen once at load average 9).
_SIDE = """
import json, sys
from datetime import timedelta
import torch.distributed as dist
from robustagg.errors import QuorumLostError
from robustagg.launch.quorum import Membership
from robustagg.training.faults import Partition
port, me, cut = int(sys.argv[1]), int(sys.argv[2]), tuple(json.loads(sys.argv[3]))
ms = Membership(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120)))
side = Partition("p", 3, cut, inside=me in cut).reachable((0, 1, 2, 3, 4, 5))
try:
    d = ms.decide(0, me, side, step=3, wait_s=120.0)
    print(json.dumps([me, "won", list(d.after)]))
except QuorumLostError as exc:
    print(json.dumps([me, "lost", str(exc)]))
"""

_CLAIM = """
import json, sys
from datetime import timedelta
import torch.distributed as dist
from robustagg.errors import QuorumLostError
from robustagg.launch.quorum import Membership
ms = Membership(dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=120)))
try:
    ms.claim_commit(int(sys.argv[2]), 8)
    print(json.dumps(True))
except QuorumLostError:
    print(json.dumps(False))
"""


def _racers(code: str, argvs: list[list[str]]) -> list[object]:
    """Run ``code`` in one fresh interpreter per argv, all at once; each one's JSON answer."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CONF.parent), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for argv in argvs]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-2000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _race(cut: tuple[int, ...]) -> tuple[dict[int, tuple[str, object]], Membership]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ms = Membership(server)
    ms.install(SIX)
    answers = _racers(_SIDE, [[str(server.port), str(w), json.dumps(list(cut))] for w in SIX])
    return {int(me): (verdict, what) for me, verdict, what in answers}, ms  # type: ignore[misc]


def test_six_processes_cut_4_2_install_the_four_and_stop_the_two():
    got, ms = _race((4, 5))
    assert {w: v for w, (v, _) in got.items()} == {0: "won", 1: "won", 2: "won", 3: "won", 4: "lost", 5: "lost"}
    assert all(what == [0, 1, 2, 3] for v, what in got.values() if v == "won")
    for w in (4, 5):
        assert got[w][1].startswith("lost quorum at step 3: reached {4, 5} of {0, 1, 2, 3, 4, 5} (a strict "
                                    "majority needs 4); this side stops and commits no checkpoint")
    assert ms.current() == (1, (0, 1, 2, 3))


def test_six_processes_cut_3_3_install_nothing():
    got, ms = _race((3, 4, 5))
    assert all(v == "lost" for v, _ in got.values())
    assert got[0][1].startswith("lost quorum at step 3: reached {0, 1, 2} of {0, 1, 2, 3, 4, 5}")
    assert got[5][1].startswith("lost quorum at step 3: reached {3, 4, 5} of {0, 1, 2, 3, 4, 5}")
    assert ms.epoch() == 0


def test_racing_committers_of_one_step_commit_it_once():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    Membership(server).install(SIX)
    wins = _racers(_CLAIM, [[str(server.port), "0"] for _ in range(4)])
    assert sorted(wins) == [False, False, False, True]  # type: ignore[type-var]


# --- a real 6-process run, partitioned ----------------------------------------------------------------------
def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*QUIET, *overrides])


def _run(tmp_path: Path, cut: str):
    return train(_cfg("threat.n=6", "threat.f=0", "aggregator=mean", "attack=none", "trainer.steps=6",
                      "trainer.checkpoint.every=2", "faults=[partition]", f"faults.partition.workers={cut}",
                      "faults.partition.step=3", "trainer.on_failure=shrink", "trainer.max_restarts=1"),
                 out_dir=tmp_path / "run", quiet=True)


def _manifests(run: Path) -> dict[int, dict]:
    out = {}
    for p in sorted((run / "checkpoints").glob("step-*")):
        if p.is_dir() and (p / "manifest.json").is_file():
            m = json.loads((p / "manifest.json").read_text())
            out[int(m["step"])] = m
    return out


def test_partition_4_2_the_four_continue_and_commit_the_two_stop_with_evidence(tmp_path):
    s = _run(tmp_path, "[4,5]")
    run = tmp_path / "run"
    assert (s["n"], s["workers"], s["steps"], s["restarts"]) == (4, [0, 1, 2, 3], 6, 1)
    shrink = next(r for r in s["lineage"] if r.get("event") == "shrink")
    assert shrink["lost_workers"] == [4, 5] and shrink["step"] == 2
    assert shrink["membership"] == {"epoch": [0, 1], "before": list(SIX), "after": [0, 1, 2, 3],
                                    "decided_by": "quorum",
                                    "state_from": "disk: the newest committed checkpoint every member verifies"}
    ev = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in (run / "evidence" / "attempt-0").glob("rank-*.json")}
    for r in (4, 5):
        assert ev[r]["kind"] == "quorum_lost" and ev[r]["step"] == 3
        assert ev[r]["exception"]["message"].startswith(
            "lost quorum at step 3: reached {4, 5} of {0, 1, 2, 3, 4, 5} (a strict majority needs 4)")
    for r in (0, 1, 2, 3):
        if r in ev:  # a majority member may be stopped by the launcher before it wrote evidence
            assert ev[r]["kind"] == "partition" and ev[r]["quorum"]["won"] is True
    # every checkpoint committed after the cut is the four's, under the new epoch; none is the two's
    ms = _manifests(run)
    assert sorted(ms) == [2, 4, 6]
    assert ms[2]["identities"] == list(SIX) and ms[2]["membership_epoch"] == 0
    for step in (4, 6):
        assert ms[step]["identities"] == [0, 1, 2, 3] and ms[step]["membership_epoch"] == 1
        assert ms[step]["world_size"] == 4


def test_partition_3_3_stops_both_sides_with_a_clear_message(tmp_path):
    with pytest.raises(QuorumLostError) as info:
        _run(tmp_path, "[3,4,5]")
    msg = str(info.value)
    assert msg.startswith("no side of the group holds a strict majority of the last committed membership "
                          "{0, 1, 2, 3, 4, 5} at step 3 (a strict majority needs 4)")
    assert "reached {0, 1, 2} of {0, 1, 2, 3, 4, 5}" in msg and "reached {3, 4, 5} of {0, 1, 2, 3, 4, 5}" in msg
    run = tmp_path / "run"
    assert sorted(_manifests(run)) == [2]  # nothing was committed after the cut
    lineage = [json.loads(x) for x in (run / "checkpoints" / "lineage.jsonl").read_text().splitlines()]
    assert [r["event"] for r in lineage if r.get("event") == "quorum_lost"] == ["quorum_lost"]


# --- grow and heal: a replacement rejoins the running group from a live peer --------------------------------
def test_grow_job_is_the_inverse_of_shrink_and_keeps_the_joiners_role():
    from experiments.wiring import validate
    from robustagg.launch import grow_job, shrink_job

    plan = validate(_cfg("threat.n=6", "threat.f=1", "aggregator=trimmed_mean", "attack=sign_flip",
                         "trainer.steps=1"))
    job = plan.job()
    assert job.byzantine_ids == (5,)
    small, _ = shrink_job(job, [5, 2])
    assert small.identities == (0, 1, 3, 4) and small.byzantine_ids == ()
    back, rec = grow_job(small, [5, 2], byzantine=[5])
    assert back.identities == job.identities and back.byzantine_ids == (5,) and back.byzantine_ranks == (5,)
    assert (rec["old_n"], rec["new_n"], rec["joined"], rec["effective_batch"]) == (4, 6, [2, 5], [4 * 8, 6 * 8])
    with pytest.raises(ConfigError, match=r"worker\(s\) \[0\] are already members"):
        grow_job(small, [0])
    spread, _ = shrink_job(validate(_cfg("threat.n=6", "threat.f=0", "aggregator=mean", "attack=none",
                                         "trainer.shrink_shards=redistribute", "trainer.steps=1")).job(), [5])
    with pytest.raises(ConfigError, match=r"cannot rejoin after trainer.shrink_shards=redistribute"):
        grow_job(spread, [5])


def test_the_joiner_refuses_state_that_does_not_match_the_peers_manifest():
    import io

    import torch

    from robustagg.errors import CheckpointError
    from robustagg.checkpoint import sha256_bytes as _sha
    from robustagg.launch.grow import receive_state

    buf = io.BytesIO()
    torch.save({"step": 3, "model": {"w": torch.arange(4.0)}}, buf)
    payload = buf.getvalue()
    man = {"sha256": _sha(payload), "size": len(payload), "step": 3, "from_worker": 0}
    got = receive_state({"manifest": man, "payload": payload})
    assert got["step"] == 3 and torch.equal(got["model"]["w"], torch.arange(4.0))
    bad = bytearray(payload)
    bad[len(bad) // 2] ^= 0x01  # one bit flipped in transit
    with pytest.raises(CheckpointError, match=r"the state received from worker 0 does not match its manifest"):
        receive_state({"manifest": man, "payload": bytes(bad)})


class DigestLog:
    """Test callback (every rank): after every step, its worker ids, world size, parameter and optimizer digests."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, trainer, out) -> None:
        rec = {"step": trainer.step_id, "world": trainer.comm.world_size,
               "workers": sorted(trainer.identities.values()), "params": trainer.parameter_digest(),
               "optim": trainer.optimizer_digest(), "rows": int(out.reduced.matrix.shape[0])}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(rec) + "\n")


def test_six_workers_one_killed_shrink_to_five_then_rejoin_from_a_live_peer(tmp_path):
    log = tmp_path / "digests.jsonl"
    s = train(_cfg("threat.n=6", "threat.f=0", "aggregator=mean", "attack=none", "trainer.steps=12",
                   "trainer.checkpoint.every=2", "faults=[rejoin]", "faults.rejoin.rank=5", "faults.rejoin.step=4",
                   "faults.rejoin.seconds=0.5", "faults.rejoin.join_step=6", "trainer.on_failure=shrink", "trainer.rejoin=true",
                   "trainer.max_restarts=1", f"trainer.callbacks=[{{_target_: test_membership.DigestLog, path: '{log}'}}]"),
              out_dir=tmp_path / "run", quiet=True)
    assert (s["n"], s["workers"], s["steps"], s["restarts"]) == (6, list(SIX), 12, 1)
    events = [r["event"] for r in s["lineage"]]
    assert "shrink" in events and "grow" in events
    shrink = next(r for r in s["lineage"] if r["event"] == "shrink")
    grow = next(r for r in s["lineage"] if r["event"] == "grow")
    assert shrink["lost_workers"] == [5] and shrink["new_n"] == 5
    assert (grow["old_n"], grow["new_n"], grow["joined"], grow["members"], grow["epoch"]) == (5, 6, [5], list(SIX), [1, 2])
    assert grow["effective_batch"] == [5 * 8, 6 * 8] and grow["normalisation"] == "mean over the 6 members"
    assert grow["state_from"].startswith("live peer worker 0 over the process group")
    assert grow["own_state_from"] == {"5": "step-00000002"}  # its data position and RNG: the last copy holding it
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    b = int(grow["step"])
    after = [r for r in recs if r["step"] > b]
    shrunk = [r for r in recs if shrink["step"] < r["step"] <= b and r["world"] == 5]
    # restored at 2, steps 3-6 as five (one record per rank and step), then six from step 7
    assert b == 6 and sorted(r["step"] for r in shrunk) == [k for k in (3, 4, 5, 6) for _ in range(5)]
    assert all(r["rows"] == 5 and 5 not in r["workers"] for r in shrunk)
    assert {r["world"] for r in after} == {6} and all(r["rows"] == 6 for r in after)
    assert sorted({w for r in after for w in r["workers"]}) == list(SIX)  # the joiner trained too
    # at the end every rank holds the same parameters and optimizer state (the joiner included)
    final = [r for r in recs if r["step"] == 12]
    assert len(final) == 6 and len({(r["params"], r["optim"]) for r in final}) == 1
    # the manifests after the grow are the six's, under the new epoch
    ms = _manifests(tmp_path / "run")
    assert ms[12]["identities"] == list(SIX) and ms[12]["membership_epoch"] == 2


def test_partition_4_2_that_heals_lets_the_two_rejoin_the_four(tmp_path):
    log = tmp_path / "digests.jsonl"
    s = train(_cfg("threat.n=6", "threat.f=0", "aggregator=mean", "attack=none", "trainer.steps=8",
                   "trainer.checkpoint.every=2", "faults=[partition]", "faults.partition.workers=[4,5]",
                   "faults.partition.step=3", "faults.partition.seconds=0.5", "faults.partition.join_step=5",
                   "trainer.on_failure=shrink", "trainer.rejoin=true", "trainer.max_restarts=1",
                   f"trainer.callbacks=[{{_target_: test_membership.DigestLog, path: '{log}'}}]"),
              out_dir=tmp_path / "run", quiet=True)
    assert (s["n"], s["workers"], s["steps"]) == (6, list(SIX), 8)
    shrink = next(r for r in s["lineage"] if r["event"] == "shrink")
    grow = next(r for r in s["lineage"] if r["event"] == "grow")
    assert shrink["membership"]["decided_by"] == "quorum" and shrink["lost_workers"] == [4, 5]
    assert (grow["step"], grow["joined"], grow["epoch"]) == (5, [4, 5], [1, 2])
    assert grow["own_state_from"] == {"4": "step-00000002", "5": "step-00000002"}
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    assert sorted({r["world"] for r in recs if 2 < r["step"] <= 5}) == [4]
    final = [r for r in recs if r["step"] == 8]
    assert len(final) == 6 and len({(r["params"], r["optim"]) for r in final}) == 1


def test_a_replacement_without_a_committed_copy_of_its_state_stays_out_and_the_run_goes_on(tmp_path):
    s = train(_cfg("threat.n=6", "threat.f=0", "aggregator=mean", "attack=none", "trainer.steps=6",
                   "trainer.checkpoint.every=4", "faults=[rejoin]", "faults.rejoin.rank=5", "faults.rejoin.step=2",
                   "faults.rejoin.seconds=0.1", "trainer.on_failure=shrink", "trainer.rejoin=true",
                   "trainer.max_restarts=1"), out_dir=tmp_path / "run", quiet=True)
    assert (s["n"], s["workers"], s["steps"]) == (5, [0, 1, 2, 3, 4], 6)  # killed before any commit
    (refused,) = [r for r in s["lineage"] if r["event"] == "rejoin_refused"]
    assert refused["worker"] == 5 and "holds worker 5's state; it cannot rejoin" in refused["reason"]
    assert not [r for r in s["lineage"] if r["event"] == "grow"]


# --- the reference of a healed run: the same membership changes, scheduled, without a failure ----------------
def test_membership_schedule_parses_checks_and_names_the_members_of_each_step():
    from robustagg.launch.schedule import Absence, members_at, parse_membership

    sched = parse_membership([{"workers": [5, 4], "absent": [3, 7]}, {"workers": [0], "absent": [5, 0]}], n=6)
    assert sched == (Absence((4, 5), 3, 7), Absence((0,), 5, 0))
    assert [members_at(sched, SIX, k) for k in (2, 3, 6, 7, 100)] == [SIX, (0, 1, 2, 3), (1, 2, 3), (1, 2, 3, 4, 5),
                                                                       (1, 2, 3, 4, 5)]
    with pytest.raises(ConfigError, match=r"trainer.membership\[0\].absent = \[3, 3\]: .* a >= 1 and b > a"):
        parse_membership([{"workers": [1], "absent": [3, 3]}], n=6)
    with pytest.raises(ConfigError, match=r"trainer.membership\[0\].workers must name worker ids in 0..5; got \[6\]"):
        parse_membership([{"workers": [6], "absent": [1, 2]}], n=6)
    with pytest.raises(ConfigError, match=r"trainer.membership\[0\] must be \{workers"):
        parse_membership([{"workers": [1], "steps": [1, 2]}], n=6)
    with pytest.raises(ConfigError, match=r"every worker is absent at step 2"):
        parse_membership([{"workers": [0, 1], "absent": [2, 4]}], n=2)
    # issue 27: these were accepted (3.5 read as 3, [5, 5] as [5], the second entry silently merged)
    with pytest.raises(ConfigError, match=r"trainer.membership\[0\]: .*all whole numbers"):
        parse_membership([{"workers": [5], "absent": [3.5, 7]}], n=6)
    with pytest.raises(ConfigError, match=r"trainer.membership\[0\].workers lists worker\(s\) \[5\] more than once"):
        parse_membership([{"workers": [5, 5], "absent": [3, 7]}], n=6)
    with pytest.raises(ConfigError, match=r"trainer.membership\[1\] and trainer.membership\[0\] both make worker"
                                          r"\(s\) \[5\] absent at step 6"):
        parse_membership([{"workers": [5], "absent": [3, 7]}, {"workers": [4, 5], "absent": [6, 0]}], n=6)
    assert parse_membership([{"workers": [5], "absent": [3, 7]}, {"workers": [5], "absent": [7, 9]}], n=6)  # disjoint
    with pytest.raises(ConfigError, match=r"trainer.membership replays membership changes in simulated mode only"):
        train(_cfg("threat.n=3", "threat.f=0", "aggregator=mean", "attack=none", "trainer.steps=2",
                   "trainer.mode=processes", "trainer.membership=[{workers: [2], absent: [1, 2]}]"), quiet=True)


@pytest.mark.parametrize("schedule, words", [("[{workers: [7], absent: [3, 7]}]", r"worker ids in 0..5; got \[7\]"),
                                             ("[{workers: [0, 1, 2, 3, 4, 5], absent: [3, 5]}]",
                                              "every worker is absent at step 3")])
def test_a_schedule_that_needs_n_to_be_refused_is_refused_before_launch(tmp_path, schedule, words):
    # found by a review run: these two were raised inside the running worker, after the run folder,
    # its lock and an evidence file (recording the error as a failure) had been written
    with pytest.raises(ConfigError, match=words):
        train(_cfg("threat.n=6", "threat.f=0", "aggregator=mean", "attack=none", "trainer.steps=12",
                   "trainer.mode=simulated", f"trainer.membership={schedule}"), out_dir=tmp_path / "run", quiet=True)
    assert not (tmp_path / "run").exists()


def _final_state(run: Path) -> dict:
    """The last committed checkpoint of ``run``: replicated state and every worker's own state, by worker id."""
    from robustagg.checkpoint import CheckpointStore

    ck, _ = CheckpointStore(run / "checkpoints").latest()
    assert ck is not None
    rep = {k: v for k, v in ck.load("replicated.pt").items() if k not in ("comm_seq", IDENTITY)}
    workers = {}
    for name in ck.manifest["hosts"]:
        workers.update({int(w): p for w, p in ck.load(name)["workers"].items()})
    return {"step": ck.step, "replicated": rep, "workers": workers, "identities": ck.manifest["identities"]}


REFERENCE_RUN = ("threat.n=6", "threat.f=0", "aggregator=mean", "attack=none", "trainer.steps=10",
                 "trainer.checkpoint.every=2", "trainer.worker_momentum=0.5")


def test_a_scheduled_absence_shrinks_and_grows_the_simulated_group(tmp_path):
    s = train(_cfg(*REFERENCE_RUN, "trainer.mode=simulated", "trainer.membership=[{workers: [5], absent: [3, 7]}]"),
              out_dir=tmp_path / "ref", quiet=True)
    assert (s["n"], s["workers"], s["steps"]) == (6, list(SIX), 10)
    changes = [(r["event"], r["step"], r.get("lost_workers", r.get("joined"))) for r in s["lineage"]
               if r["event"] in ("shrink", "grow")]
    assert changes == [("shrink", 2, [5]), ("grow", 6, [5])]
    final = _final_state(tmp_path / "ref")
    # worker 5 computed steps 1-2 and 7-10: six batches drawn; the others ten
    assert final["workers"][5]["sampler"] != final["workers"][4]["sampler"]


def test_a_healed_run_is_bit_equal_to_its_reference_membership_schedule(tmp_path):
    # real processes: worker 5 SIGKILLed in step 4, the five restore the commit of step 2 and go on,
    # the replacement is admitted after step 6 (join_step) with its own state of that commit
    real = train(_cfg(*REFERENCE_RUN, "faults=[rejoin]", "faults.rejoin.rank=5", "faults.rejoin.step=4",
                      "faults.rejoin.seconds=0.2", "faults.rejoin.join_step=6", "trainer.on_failure=shrink",
                      "trainer.rejoin=true", "trainer.max_restarts=1"), out_dir=tmp_path / "real", quiet=True)
    ref = train(_cfg(*REFERENCE_RUN, "trainer.mode=simulated", "trainer.membership=[{workers: [5], absent: [3, 7]}]"),
                out_dir=tmp_path / "ref", quiet=True)
    assert real["workers"] == ref["workers"] == list(SIX) and real["restarts"] == 1
    grow = next(r for r in real["lineage"] if r["event"] == "grow")
    assert grow["step"] == 6 and grow["own_state_from"] == {"5": "step-00000002"}
    a, b = _final_state(tmp_path / "real"), _final_state(tmp_path / "ref")
    assert a["step"] == b["step"] == 10 and a["identities"] == b["identities"] == list(SIX)
    assert_state_equal(a["replicated"], b["replicated"], "replicated")  # parameters, optimizer, scheduler, rule
    assert_state_equal(a["workers"], b["workers"], "workers")  # data positions, momentum, RNG streams
    assert (tmp_path / "real" / "model.safetensors").read_bytes() == (tmp_path / "ref" / "model.safetensors").read_bytes()
    # and the schedule is not a no-op: without it the simulated run ends elsewhere
    plain = train(_cfg(*REFERENCE_RUN, "trainer.mode=simulated"), out_dir=tmp_path / "plain", quiet=True)
    assert plain["workers"] == list(SIX)
    flat = [torch.cat([v.flatten().double() for v in st["replicated"]["model"].values()])
            for st in (_final_state(tmp_path / "plain"), b)]
    assert not torch.equal(*flat)


# --- the in-memory peer copy of a lost worker's own state (trainer.peer_copy) --------------------------------
PEER_RUN = (*REFERENCE_RUN, "faults=[rejoin]", "faults.rejoin.rank=5", "faults.rejoin.step=5", "faults.rejoin.seconds=0.2",
            "faults.rejoin.join_step=7", "trainer.on_failure=shrink", "trainer.rejoin=true", "trainer.peer_copy=true",
            "trainer.max_restarts=1")
#: worker 5 computed steps 1-4 (the commit of step 4 is its last), absent in 5-7, back from step 8
PEER_REFERENCE = ("trainer.mode=simulated", "trainer.membership=[{workers: [5], absent: [5, 8]}]")


def test_holder_of_is_the_nearest_member_before_in_the_ring():
    from robustagg.launch.peer import holder_of

    assert [holder_of(w, SIX, SIX) for w in SIX] == [5, 0, 1, 2, 3, 4]  # worker i holds worker i+1's
    assert holder_of(5, (0, 1, 2, 3, 4), SIX) == 4 and holder_of(0, (2, 3), SIX) == 3
    assert holder_of(4, (0, 1, 2), SIX) == holder_of(5, (0, 1, 2), SIX) == 2


def test_a_replacement_whose_disk_copy_was_pruned_takes_the_peer_memory_copy(tmp_path):
    # keep=1: when the joiner is admitted (after step 7) the only commit is the five's of step 6;
    # worker 5's own state of step 4 survives in worker 4's memory, its digest in step 6's manifest
    real = train(_cfg(*PEER_RUN, "trainer.checkpoint.keep=1"), out_dir=tmp_path / "real", quiet=True)
    grow = next(r for r in real["lineage"] if r["event"] == "grow")
    assert grow["sources"] == {"replicated": "peer 0", "own": {"5": "peer-memory 4"}}
    assert grow["own_state_from"] == {"5": "step-00000004"} and grow["step"] == 7
    assert not [r for r in real["lineage"] if r["event"] == "peer_copy_refused"]
    # the state it took is the right one: the run equals its reference schedule bit for bit
    train(_cfg(*REFERENCE_RUN, *PEER_REFERENCE), out_dir=tmp_path / "ref", quiet=True)
    a, b = _final_state(tmp_path / "real"), _final_state(tmp_path / "ref")
    assert_state_equal(a["replicated"], b["replicated"], "replicated")
    assert_state_equal(a["workers"], b["workers"], "workers")


class Spoil:
    """Test callback: after step 6 of the five, corrupt worker 5's file of the commit of step 4 on disk
    (its newest disk copy becomes the older one of step 2) and, with ``tamper``, one byte of the copy in
    worker 4's memory."""

    def __init__(self, ckpt: str, tamper: bool) -> None:
        self.ckpt, self.tamper = Path(ckpt), bool(tamper)

    def __call__(self, trainer, out) -> None:
        if trainer.step_id != 6 or trainer.comm.world_size != 5:
            return
        ids = set(trainer.identities.values())
        if 0 in ids:
            f = self.ckpt / "step-00000004" / "rank-5.pt"
            data = bytearray(f.read_bytes())
            data[-10] ^= 0xFF
            f.write_bytes(bytes(data))
        if 4 in ids and self.tamper:
            from robustagg.launch.peer import held

            part = held().parts[5]
            bad = bytearray(part.payload)
            bad[len(bad) // 2] ^= 0x01
            part.payload = bytes(bad)


@pytest.mark.parametrize("tamper", [False, True])
def test_an_older_disk_copy_loses_to_the_peer_memory_copy_unless_that_was_tampered_with(tmp_path, tamper):
    log = tmp_path / "digests.jsonl"
    ckpt = tmp_path / "real" / "checkpoints"
    cbs = (f"trainer.callbacks=[{{_target_: test_membership.DigestLog, path: '{log}'}}, "
           f"{{_target_: test_membership.Spoil, ckpt: '{ckpt}', tamper: {str(tamper).lower()}}}]")
    real = train(_cfg(*PEER_RUN, "trainer.checkpoint.keep=3", cbs), out_dir=tmp_path / "real", quiet=True)
    assert real["workers"] == list(SIX) and real["steps"] == 10
    grow = next(r for r in real["lineage"] if r["event"] == "grow")
    refused = [r for r in real["lineage"] if r["event"] == "peer_copy_refused"]
    evidence = tmp_path / "real" / "evidence" / "rejoin-5.json"
    if not tamper:
        assert grow["sources"]["own"] == {"5": "peer-memory 4"} and grow["own_state_from"] == {"5": "step-00000004"}
        assert not refused and not evidence.exists()
        train(_cfg(*REFERENCE_RUN, *PEER_REFERENCE), out_dir=tmp_path / "ref", quiet=True)
        assert_state_equal(_final_state(tmp_path / "real")["workers"], _final_state(tmp_path / "ref")["workers"])
    else:
        assert grow["sources"]["own"] == {"5": "disk"} and grow["own_state_from"] == {"5": "step-00000002"}
        (rec,) = refused
        assert rec["worker"] == 5 and rec["used"] == "disk"
        assert rec["reason"].startswith("worker 5 refused the in-memory copy of its own state held by worker 4 "
                                        "(step-00000004/rank-5.pt)")
        ev = json.loads(evidence.read_text())
        assert ev["kind"] == "peer_copy_refused" and ev["committed"]["checkpoint"] == "step-00000004"
        assert ev["received"]["size"] == ev["committed"]["size"]
        assert ev["received"]["sha256"] != ev["committed"]["sha256"]  # one flipped bit, caught by the digest
    # the five's commits carry the committed record of worker 5's part; the six's do not
    ms = _manifests(tmp_path / "real")
    assert ms[6]["identities"] == [0, 1, 2, 3, 4] and ms[6]["absent_parts"]["5"]["checkpoint"] == "step-00000004"
    assert "absent_parts" not in ms[8] and ms[8]["identities"] == list(SIX)
    # every rank, the joiner included, ends with the same parameters and optimizer state
    final = [json.loads(x) for x in log.read_text().splitlines() if json.loads(x)["step"] == 10]
    assert len(final) == 6 and len({(r["params"], r["optim"]) for r in final}) == 1


# --- torchrun: its elastic agent restarts the whole group, so rejoin (and shrink) stay with the app's launcher --
def test_rejoin_is_refused_under_torchrun_naming_the_key_and_the_fix(tmp_path, monkeypatch):
    from experiments.recovery import check_faults
    from experiments.wiring import validate
    from robustagg.launch import launch

    cfg = _cfg("threat.n=6", "threat.f=0", "aggregator=mean", "attack=none", "trainer.steps=4",
               "trainer.on_failure=shrink", "trainer.rejoin=true")
    with pytest.raises(ConfigError, match=r"trainer.rejoin=true is not available under torchrun: .* restarts the whole "
                                          r"worker group .*set trainer.rejoin=false"):
        check_faults(cfg, 6, under_torchrun=True)
    job = validate(cfg).job()
    monkeypatch.setenv("RANK", "0")  # what torchrun sets: the library refuses before forming any group
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ConfigError, match=r"trainer.rejoin=true is not available under torchrun.*Run the app's own "
                                          r"launcher instead"):
        launch(job)
    job.settings.rejoin = False
    with pytest.raises(ConfigError, match=r"trainer.on_failure=shrink is not available under torchrun.*set "
                                          r"trainer.on_failure=restart"):
        launch(job)


def test_two_replacements_rejoin_at_two_boundaries_and_the_run_equals_its_reference(tmp_path):
    # workers 4 and 5 killed in step 4; the four restore step 2; 5 is admitted after step 6, 4 after step 8
    real = train(_cfg(*REFERENCE_RUN, "faults=[rejoin]", "faults.rejoin.rank=5", "faults.rejoin.step=4",
                      "faults.rejoin.seconds=0.2", "faults.rejoin.join_step=6",
                      "+faults.back4={kind: rejoin, rank: 4, step: 4, seconds: 0.2, join_step: 8}",
                      "trainer.on_failure=shrink", "trainer.rejoin=true", "trainer.max_restarts=1"),
                 out_dir=tmp_path / "real", quiet=True)
    assert real["workers"] == list(SIX) and real["restarts"] == 1
    shrink = next(r for r in real["lineage"] if r["event"] == "shrink")
    grows = [r for r in real["lineage"] if r["event"] == "grow"]
    assert shrink["lost_workers"] == [4, 5] and shrink["step"] == 2
    assert [(g["step"], g["joined"], g["old_n"], g["new_n"], g["epoch"]) for g in grows] == [
        (6, [5], 4, 5, [1, 2]), (8, [4], 5, 6, [2, 3])]
    ref = train(_cfg(*REFERENCE_RUN, "trainer.mode=simulated",
                     "trainer.membership=[{workers: [5], absent: [3, 7]}, {workers: [4], absent: [3, 9]}]"),
                out_dir=tmp_path / "ref", quiet=True)
    assert [(r["event"], r["step"]) for r in ref["lineage"] if r["event"] in ("shrink", "grow")] == [
        ("shrink", 2), ("grow", 6), ("grow", 8)]
    a, b = _final_state(tmp_path / "real"), _final_state(tmp_path / "ref")
    assert_state_equal(a["replicated"], b["replicated"], "replicated")
    assert_state_equal(a["workers"], b["workers"], "workers")

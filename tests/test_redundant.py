"""protocol=redundant: the vote's arithmetic, what it catches (a corrupted replica, a Byzantine
minority) and what it does not (a common-mode fault, a Byzantine majority), the derived requirement
before launch, and the app in both modes and across a real SIGKILL."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

import attacks
import robustagg as ra
from experiments.train import train
from experiments.wiring import validate
from robustagg.distributed import GatherReduction, LocalComm
from robustagg.errors import AssumptionError, ConfigError, IntegrityError, ReplicaVoteError
from robustagg.protocols import Redundant
from robustagg.protocols.redundant import groups_of, majority_vote, pool_parts, quorum, takeover_bound
from robustagg.training import AttackAdapter, ByzantineBehaviour, Fault, FaultInjector, Shard, Trainer

CONF = Path(__file__).resolve().parents[1] / "conf"
QUIET = ["logger=none", "trainer.progress=false"]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*QUIET, *overrides])


# --- the reconstruction rule -------------------------------------------------------------------
def test_quorum_and_takeover_bound_by_hand():
    # q = ceil((r+1)/2): r=3 -> 2, r=5 -> 3; floor(f/q): f=2,r=3 -> 1; f=1,r=3 -> 0; f=5,r=5 -> 1; f=6,r=5 -> 2
    assert [quorum(r) for r in (1, 3, 5)] == [1, 2, 3]
    assert [takeover_bound(f, r) for f, r in ((2, 3), (1, 3), (5, 5), (6, 5), (0, 3))] == [1, 0, 1, 2, 0]
    assert groups_of(9, 3) == [(0, 1, 2), (3, 4, 5), (6, 7, 8)]
    with pytest.raises(ConfigError, match=r"protocol\.r must be an odd integer"):
        groups_of(8, 2)
    with pytest.raises(ConfigError, match=r"protocol\.r=3 does not divide threat\.n=10.*threat\.n=9 or 12"):
        groups_of(10, 3)


def test_the_vote_needs_a_bit_identical_quorum_not_a_checksum_alone():
    x = torch.tensor([[1.0, 2.0], [1.0, 2.0], [1.0, 2.5],     # group 0: ranks 0, 1 agree, 2 dissents
                      [4.0, 4.0], [4.0, 4.0000005], [4.0, 4.0]])  # group 1: 3 and 5 agree (4 is 1 ulp-ish off)
    sums = [11, 11, 12, 40, 40, 40]  # a forged collision: rank 4's checksum equals 3's and 5's
    v = majority_vote(x, [0, 1, 2, 3, 4, 5], sums, groups_of(6, 3), q=2)
    assert [(g.agreed, g.disagreeing, g.row) for g in v] == [((0, 1), (2,), 0), ((3, 5), (4,), 3)]
    # rank 1 dropped by integrity (non-finite): 0 and 2 differ, no quorum of 2 out of r=3
    v = majority_vote(x[[0, 2]], [0, 2], [11, 12], groups_of(3, 3), q=2)
    assert not v[0].majority and v[0].present == (0, 2) and v[0].disagreeing == (0, 1, 2)


def test_pooled_parts_give_every_replica_its_groups_shard():
    import numpy as np

    parts = [np.array([0, 1]), np.array([2]), np.array([3]), np.array([4, 5]), np.array([6]), np.array([7])]
    got = [p.tolist() for p in pool_parts(parts, 3)]
    assert got == [[0, 1, 2, 3]] * 3 + [[4, 5, 6, 7]] * 3


# --- in one process: a small trainer ---------------------------------------------------------
N, D_IN, C = 9, 5, 3


def _trainer(*, rule=None, byzantine=None, faults=(), on_no_majority="drop"):
    torch.manual_seed(0)
    model = torch.nn.Linear(D_IN, C)
    g = torch.Generator().manual_seed(1)
    groups = []
    for _ in range(N // 3):
        x = torch.randn(40, D_IN, generator=g)
        groups.append(Shard(x, torch.randint(0, C, (40,), generator=g)))
    shards = {r: Shard(groups[r // 3].x.clone(), groups[r // 3].y.clone()) for r in range(N)}
    comm = LocalComm(N)
    red = GatherReduction(rule or ra.Mean(), comm)
    inj = FaultInjector(list(faults), worker_ids={r: r for r in range(N)}) if faults else None
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), red, shards, batch_size=8, num_classes=C,
                   byzantine=byzantine, injector=inj, protocol=Redundant(r=3, f=2, on_no_majority=on_no_majority))


def _run(t, steps):
    return [t.step() for _ in range(steps)]


def test_honest_replicas_are_bit_identical_and_the_rule_sees_one_row_per_group():
    out = _run(_trainer(), 2)[-1]
    x = out.reduced.matrix
    for grp in groups_of(N, 3):
        assert all(torch.equal(x[grp[0]], x[w]) for w in grp)
    assert out.reduced.inputs == [0, 1, 2] and not out.detections
    assert out.plan.info == {"vote/groups": 3, "vote/disagreements": 0, "vote/no_majority": 0}
    # rule=mean over the three group rows (not over nine worker rows: the same here, since equal)
    assert torch.equal(out.reduced.aggregate, ra.Mean()(x[[0, 3, 6]]))


def test_compute_corrupt_passes_integrity_and_the_vote_outvotes_and_names_the_replica():
    clean = _run(_trainer(), 2)
    hit = _run(_trainer(faults=[Fault("compute_corrupt", rank=4, step=2)]), 2)
    assert not hit[0].detections
    red = hit[1].reduced
    assert not any(rep.corrupted for rep in red.reports)  # the checksum was taken after the error
    x = red.matrix
    diff = (x[4] - x[3]).nonzero().flatten().tolist()
    assert len(diff) == 1 and float(x[4, diff[0]] - x[3, diff[0]]) == pytest.approx(1.0)
    (det,) = hit[1].detections
    assert det["kind"] == "replica_vote" and det["step"] == 2 and det["group"] == 1
    assert det["agreed"] == [3, 5] and det["disagreeing"] == [4] and det["action"] == "voted_out"
    assert det["digests"]["3"] == det["digests"]["5"] != det["digests"]["4"]
    assert torch.equal(red.aggregate, clean[1].reduced.aggregate)  # voted out: no trace in the update


def test_common_mode_corruption_passes_the_vote_undetected():
    clean = _run(_trainer(), 2)
    hit = _run(_trainer(faults=[Fault("common_mode", rank=4, step=2)]), 2)
    red = hit[1].reduced
    assert not hit[1].detections and hit[1].plan.info["vote/disagreements"] == 0
    x, ref = red.matrix, clean[1].reduced.matrix
    assert all(torch.equal(x[w], x[3]) for w in (4, 5))  # the replicas still agree ...
    diff = (x[3] - ref[3]).nonzero().flatten().tolist()  # ... on a row that is wrong by +1.0 at one coordinate
    assert len(diff) == 1 and float(x[3, diff[0]] - ref[3, diff[0]]) == pytest.approx(1.0)
    assert torch.equal(x[[0, 6]], ref[[0, 6]])  # the other groups are untouched
    assert not torch.equal(red.aggregate, clean[1].reduced.aggregate)  # and it reached the update


def _flip(ranks, rule):
    return ByzantineBehaviour(ranks=ranks, gradient_fn=AttackAdapter(attacks.get("sign_flip"), rule), name="sign_flip")


def test_a_byzantine_minority_is_voted_out_a_majority_passes_the_vote_and_meets_the_rule():
    clean = _run(_trainer(), 2)
    spread = _run(_trainer(byzantine=_flip((2, 5), ra.Mean())), 2)  # one per group: a minority everywhere
    assert torch.equal(spread[1].reduced.aggregate, clean[1].reduced.aggregate)
    assert spread[1].honest_mask().tolist() == [True, True, True]
    assert sorted(d["disagreeing"][0] for d in spread[1].detections) == [2, 5]
    # two in group 1 (ranks 4, 5): they agree bit for bit (the same -mean row) and win the vote
    placed = _trainer(byzantine=_flip((4, 5), ra.Mean()))
    out = _run(placed, 2)[1]
    assert out.honest_mask().tolist() == [True, False, True]
    (det,) = out.detections
    assert det["agreed"] == [4, 5] and det["disagreeing"] == [3]  # the outvoted honest replica is named
    rows = out.reduced.rule_rows()
    honest = out.reduced.matrix[[w for w in range(N) if w not in (4, 5)]]
    ref = -honest.to(torch.float64).mean(dim=0)  # float64 reference of SignFlip's row
    assert torch.allclose(rows[1].to(torch.float64), ref, rtol=0, atol=1e-6)  # the attack's row reached the rule
    assert not torch.allclose(rows[1], rows[0], atol=1e-3)
    # behind the vote a robust rule with f = floor(2/2) = 1 (median of 3 here) keeps it out of the update
    med = _run(_trainer(rule=ra.CoordinateWiseMedian(f=1), byzantine=_flip((4, 5), ra.CoordinateWiseMedian(f=1))),
               2)[1]
    r = med.reduced.rule_rows()
    lo, hi = torch.minimum(r[0], r[2]), torch.maximum(r[0], r[2])
    assert bool(((med.reduced.aggregate >= lo) & (med.reduced.aggregate <= hi)).all())


def test_no_majority_drops_the_group_or_aborts():
    two = [Fault("compute_corrupt", rank=3, step=1), Fault("compute_corrupt", rank=4, step=1)]  # 3 rows differ
    out = _trainer(faults=two).step()
    assert out.reduced.inputs == [0, 2] and out.plan.info["vote/no_majority"] == 1
    (det,) = out.detections
    assert det["agreed"] == [] and det["disagreeing"] == [3, 4, 5] and det["action"] == "no_majority_drop"
    with pytest.raises(ReplicaVoteError, match=r"step 1: no 2 of 3 replicas agree.*group 1.*on_no_majority=drop"):
        _trainer(faults=two, on_no_majority="abort").step()
    assert issubclass(ReplicaVoteError, IntegrityError)


def test_a_resumed_trainer_draws_the_groups_batches_bit_for_bit():
    a = _trainer()
    _run(a, 2)
    state = a.state_dict()
    b = _trainer()
    b.load_state_dict(state)
    assert torch.equal(a.step().reduced.aggregate, b.step().reduced.aggregate)


# --- before launch --------------------------------------------------------------------------
def test_the_derived_requirement_is_printed_and_what_breaks_it_refused():
    plan = validate(_cfg("protocol=redundant", "threat.n=9", "trainer.mode=simulated"))
    assert plan.config().aggregator.f == 1  # floor(threat.f=2 / quorum 2)
    assert any("take over at most floor(2/2) = 1 groups" in n for n in plan.notes)
    with pytest.raises(AssumptionError, match=r"Krum requires n >= 2f \+ 3.*got n=3, f=1.*protocol=redundant"):
        validate(_cfg("protocol=redundant", "threat.n=9", "aggregator=krum", "trainer.mode=simulated"))
    loose = validate(_cfg("protocol=redundant", "threat.n=9", "aggregator=krum", "strict=false",
                          "trainer.mode=simulated"))
    assert loose.assumption_violated and loose.violations
    with pytest.raises(AssumptionError, match=r"aggregator\.f=0 is below the 1 replica groups"):
        validate(_cfg("protocol=redundant", "threat.n=9", "aggregator.f=0", "trainer.mode=simulated"))
    with pytest.raises(ConfigError, match=r"protocol\.r=3 does not divide threat\.n=10"):
        validate(_cfg("protocol=redundant", "threat.n=10", "trainer.mode=simulated"))
    with pytest.raises(ConfigError, match=r"protocol\.on_no_majority must be drop or abort"):
        validate(_cfg("protocol=redundant", "threat.n=9", "protocol.on_no_majority=vote", "trainer.mode=simulated"))
    with pytest.raises(ConfigError, match=r"trainer\.reduction=gather"):
        validate(_cfg("protocol=redundant", "threat.n=9", "trainer.reduction=sharded", "trainer.mode=simulated"))


# --- the app, both modes, SIGKILL -------------------------------------------------------------
COMMON = ["protocol=redundant", "protocol.r=3", "threat.n=9", "trainer.steps=4", "trainer.batch_size=8",
          "trainer.eval_every=0", "trainer.checkpoint.every=2", "trainer.threads=1"]


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    out = tmp_path_factory.mktemp("red-sim")
    s = train(_cfg(*COMMON, "trainer.mode=simulated"), out_dir=out, quiet=True)
    return s, load_file(str(out / "model.safetensors"))


def _same(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_digits_trains_bit_identically_with_one_process_per_replica(simulated, tmp_path):
    s, w = simulated
    assert s["protocol"] == "redundant" and s["cost/effective_batch"] == 24 and s["cost/gradients_per_update"] == 9
    assert s["vote_disagreements"] == 4  # threat.ranks default 7, 8: they take over group 2, 6 is outvoted
    p = train(_cfg(*COMMON, "trainer.mode=processes", "trainer.collective_timeout_s=300"), out_dir=tmp_path,
              quiet=True)
    assert p["processes"] == 9 and _same(w, load_file(str(tmp_path / "model.safetensors")))
    # only the votes: under load the straggler log may add records of its own
    assert [d["disagreeing"] for d in p["faults"]["detected"] if d["kind"] == "replica_vote"] == [[6]] * 4
    assert p["faults"]["detected_by_kind"]["replica_vote"] == 4 and not p["faults"]["detected_truncated"]


def test_the_summary_keeps_a_bounded_account_of_the_detections():
    # a Byzantine replica outvoted at every step writes a record per step: the summary keeps the first
    # DETECTIONS_KEPT and the counts; detections.jsonl keeps them all
    from robustagg.launch.records import DETECTIONS_KEPT, detected_faults

    records = [{"kind": "replica_vote", "step": i} for i in range(1, 251)] + [{"kind": "straggler", "step": 3}]
    got = detected_faults(records)
    assert got["detected"] == records[:DETECTIONS_KEPT] and got["detected_count"] == 251 and got["detected_truncated"]
    assert got["detected_by_kind"] == {"replica_vote": 250, "straggler": 1}
    assert detected_faults(records[:3]) == {"detected": records[:3], "detected_count": 3,
                                            "detected_by_kind": {"replica_vote": 3}, "detected_truncated": False}


@pytest.mark.slow
def test_a_sigkill_resumes_bit_for_bit(simulated, tmp_path):
    _, w = simulated
    p = train(_cfg(*COMMON, "trainer.mode=processes", "trainer.processes=3", "trainer.collective_timeout_s=300",
                   "faults=[crash]", "faults.crash.rank=4", "faults.crash.step=3", "trainer.max_restarts=1"),
              out_dir=tmp_path, quiet=True)
    assert p["restarts"] == 1 and p["resumed_from"] == 2
    assert _same(w, load_file(str(tmp_path / "model.safetensors")))


@pytest.mark.slow
def test_the_fault_kinds_in_real_processes_one_per_replica(tmp_path):
    # compute_corrupt on replica 1 at step 2: outvoted and named; common_mode on group 1 at step 3:
    # each of its three processes applies the same +1.0, the vote sees agreement and records nothing
    p = train(_cfg(*COMMON, "attack=none", "trainer.steps=3", "trainer.mode=processes",
                   "trainer.collective_timeout_s=300", "faults=[compute_corrupt,common_mode]",
                   "faults.compute_corrupt.rank=1", "faults.compute_corrupt.step=2",
                   "faults.common_mode.rank=4", "faults.common_mode.step=3"), out_dir=tmp_path, quiet=True)
    votes = [d for d in p["faults"]["detected"] if d["kind"] == "replica_vote"]
    assert [(d["step"], d["group"], d["agreed"], d["disagreeing"]) for d in votes] == [(2, 0, [0, 2], [1])]
    injected = sorted((f["kind"], f["step"]) for f in p["faults"]["injected"])
    assert injected == [("common_mode", 3)] * 3 + [("compute_corrupt", 2)]  # one record per process it hit
    assert p["vote_disagreements"] == 1 and p["vote_no_majority"] == 0

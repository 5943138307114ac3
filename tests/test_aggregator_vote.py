"""No trusted aggregator (issue 29): a rank that lies about its slice of the aggregate is caught, named and outvoted.

Hand-computed placements and votes; the ``aggregator_lie`` fault's four lies on hand values; whole
runs (simulated and real processes) where a lying rank changes nothing with replicas and the vote,
changes the model without them, is excluded through the shrink path when asked; what the vote
cannot catch (two replicas lying alike); the requirement ``r_a >= 2 f_a + 1`` refused before launch.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import robustagg as ra
from experiments.train import train
from robustagg.distributed import LocalComm, make_reduction
from robustagg.distributed.vote import (AggregatorCheck, Copy, aggregator_requirement, held_slices, majority_copy,
                                        slice_holders)
from robustagg.errors import AssumptionError, ConfigError, DesyncError
from robustagg.training.faults import Fault, FaultInjector

CONF = Path(__file__).resolve().parents[1] / "conf"
QUIET = ["logger=none", "trainer.progress=false", "trainer.eval_every=0", "trainer.param_check_every=0",
         "trainer.batch_size=16", "trainer.steps=5", "aggregator=coordinate_median", "attack=none",
         "trainer.collective_timeout_s=30"]
SHARDED3 = ["threat.n=4", "threat.f=1", "trainer.reduction=sharded", "trainer.aggregator_replicas=3",
            "trainer.on_aggregate_mismatch=vote"]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*QUIET, *overrides])


def _run(tmp_path, name, *overrides):
    out = tmp_path / name
    summary = train(_cfg(*overrides), out_dir=out, quiet=True)
    model = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    path = out / "detections.jsonl"
    dets = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return summary, model, [d for d in dets if d["kind"] == "lying_aggregator" and d["source"] == "in-run"]


# --- placement, vote, requirement, the fault --------------------------------------------------------
@pytest.mark.parametrize("world,r", [(1, 1), (4, 1), (4, 3), (5, 5), (8, 3)])
def test_every_slice_has_r_distinct_holders_and_every_rank_computes_r_slices(world, r):
    holders = slice_holders(world, r)
    assert all(len(set(h)) == r and h[0] == s for s, h in enumerate(holders))
    for q in range(world):
        assert sorted(held_slices(q, world, r)) == sorted(s for s, h in enumerate(holders) if q in h)
        assert held_slices(q, world, r)[0] == q  # its own slice first (metrics come from it)


def test_placement_refuses_more_replicas_than_ranks():
    with pytest.raises(ConfigError, match=r"aggregator_replicas must be in \[1, world=3\].*got 4"):
        slice_holders(3, 4)


def test_the_majority_is_bit_exact_and_names_the_minority():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 2**-22])  # differs in the last bits only
    value, liars, digests = majority_copy([Copy(0, a), Copy(1, b), Copy(2, a.clone()), Copy(3, b.clone()),
                                           Copy(4, a.clone())], step=6, what="slice 2")
    assert value.tolist() == [1.0, 2.0] and liars == [1, 3] and digests[1] == digests[3] != digests[0]
    same, none, nothing = majority_copy([Copy(0, a), Copy(1, a.clone())], step=0, what="x")
    assert torch.equal(same, a) and none == [] and nothing == {}  # the common case hashes nothing
    with pytest.raises(DesyncError, match=r"step 7: the 4 replicas of slice 2 have no strict majority.*2 f_a \+ 1"):
        majority_copy([Copy(0, a), Copy(1, b), Copy(2, a.clone()), Copy(3, b.clone())], step=6, what="slice 2")


@pytest.mark.parametrize("r,fa,policy,holds", [(3, 1, "vote", True), (2, 1, "vote", False), (5, 2, "vote", True),
                                                (4, 2, "vote", False), (2, 1, "abort", True), (1, 1, "abort", False),
                                                (1, 0, "vote", True)])
def test_requirement_r_at_least_2fa_plus_1_to_outvote_fa_plus_1_to_detect(r, fa, policy, holds):
    assert aggregator_requirement(r, fa, policy)[1] is holds


def test_each_lie_on_hand_values():
    v, prev = torch.tensor([1.0, -2.0, 4.0]), torch.tensor([0.5, 0.5, 0.5])
    lie = {how: FaultInjector.lied(Fault("aggregator_lie", rank=2, step=3, how=how), v, prev) for how in
           ("scale", "sign_flip", "stale", "last_bits")}
    assert lie["scale"].tolist() == [2.0, -4.0, 8.0] and lie["sign_flip"].tolist() == [-1.0, 2.0, -4.0]
    assert lie["stale"].tolist() == [0.5, 0.5, 0.5]
    assert FaultInjector.lied(Fault("aggregator_lie", how="stale"), v, None).tolist() == [0.0, 0.0, 0.0]
    diff = (lie["last_bits"].view(torch.int32) ^ v.view(torch.int32)).tolist()
    assert sorted(diff) == [0, 0, 1] and torch.allclose(lie["last_bits"], v)  # one lowest bit, nothing else
    assert v.tolist() == [1.0, -2.0, 4.0]  # never in place


def test_the_fault_refuses_an_unknown_lie_and_defaults_to_scale():
    assert Fault("aggregator_lie", rank=1, step=2).how == "scale"
    with pytest.raises(ConfigError, match=r"how must be one of scale, sign_flip, stale, last_bits; got 'scal' "
                                          r"\(did you mean scale or stale\?\)"):
        Fault("aggregator_lie", how="scal")


def _reduce(mode, replicas, policy, lies, world=5):
    rows = {i: torch.randn(10, generator=torch.Generator().manual_seed(i)) for i in range(world)}
    red = make_reduction(mode, ra.CoordinateWiseMedian(f=1), LocalComm(world))
    inj = FaultInjector([Fault("aggregator_lie", rank=r, step=1, how=h, name=f"l{r}") for r, h in lies],
                        worker_ids={i: i for i in range(world)})
    red.check = AggregatorCheck(replicas=replicas, on_mismatch=policy, injector=inj)
    honest = ra.CoordinateWiseMedian(f=1)(torch.stack([rows[i] for i in range(world)]))
    return red, red.reduce(rows, step=0).aggregate, honest


def test_simulated_gather_outvotes_two_of_five_liars_and_names_them():
    red, out, honest = _reduce("gather", 1, "vote", [(1, "sign_flip"), (3, "last_bits")])
    assert torch.equal(out, honest)
    assert [(d["step"], d["ranks"], d["action"]) for d in red.check.detections] == [(1, [1], "outvoted"),
                                                                                   (1, [3], "outvoted")]
    with pytest.raises(DesyncError, match=r"step 1: the replicas of the aggregate disagree.*rank\(s\) \[2\] differ"):
        _reduce("gather", 1, "abort", [(2, "scale")])


def test_simulated_sharded_slices_are_caught_with_three_replicas_and_not_with_one():
    red, out, honest = _reduce("sharded", 3, "vote", [(1, "scale")])
    assert torch.equal(out, honest)
    (det,) = red.check.detections
    assert det["ranks"] == [1] and [s["slice"] for s in det["slices"]] == [0, 1, 4]  # held_slices(1, 5, 3)
    red, out, honest = _reduce("sharded", 1, "vote", [(1, "scale")])
    assert not torch.equal(out, honest) and red.check.detections == []  # r_a = 1: nobody to compare with
    assert torch.equal(out[:2], honest[:2]) and torch.equal(out[2:4], 2 * honest[2:4])  # slice 1 is rank 1's


def test_two_replicas_lying_alike_win_the_vote_and_the_honest_one_is_named():
    # common-mode (the same wrong code on two ranks) beats r_a = 3 where both hold a slice: at world 5,
    # slice 0 is held by ranks (0, 1, 2) and slice 1 by (1, 2, 3); slices 2 and 4 have one of them each
    red, out, honest = _reduce("sharded", 3, "vote", [(1, "scale"), (2, "scale")])
    assert torch.equal(out[:4], 2 * honest[:4]) and torch.equal(out[4:], honest[4:])
    named = {d["ranks"][0]: [x["slice"] for x in d["slices"]] for d in red.check.detections}
    assert named == {0: [0], 1: [4], 2: [2], 3: [1]}  # the honest ranks 0 and 3 are the ones outvoted


# --- whole runs --------------------------------------------------------------------------------------
def test_processes_sharded_with_three_replicas_trains_as_if_nobody_lied(tmp_path):
    _, ref, none = _run(tmp_path, "ref", "trainer.mode=processes", *SHARDED3)
    s, lied, (det,) = _run(tmp_path, "lie", "trainer.mode=processes", *SHARDED3, "faults=[aggregator_lie]")
    _, sim, (sim_det,) = _run(tmp_path, "sim", "trainer.mode=simulated", *SHARDED3, "faults=[aggregator_lie]")
    assert none == [] and lied == ref == sim  # bit-identical, and the same in both modes
    assert (det["step"], det["ranks"], det["action"]) == (3, [1], "outvoted") and det["source"] == "in-run"
    assert [x["slice"] for x in det["slices"]] == [0, 1, 3] == [x["slice"] for x in sim_det["slices"]]
    check = s["aggregator_check"]
    assert check["requirement"].startswith("r_a >= 2 f_a + 1") and check["replicas"] == 3
    d = s["num_parameters"]  # 4 ranks, 3 replicas: rank 0 aggregates slices 0, 3 and 2 (float32)
    sizes = [d // 4 + (1 if i < d % 4 else 0) for i in range(4)]
    held = sizes[0] + sizes[3] + sizes[2]
    assert (check["aggregated_coordinates"], check["aggregated_coordinates_r1"]) == (held, sizes[0])
    # frames in, 3 digests to each rank, its own aggregated slice to each rank (each slice goes out once)
    assert check["sent_bytes_per_step"] == 3 * (4 * d + 8 * 4) + 4 * 3 * 8 + 4 * 4 * sizes[0]
    assert check["sent_bytes_per_step_r1"] == (4 * d + 8 * 4) + 4 * 4 * sizes[0]
    _, once, nothing = _run(tmp_path, "r1", "trainer.mode=processes", "threat.n=4", "threat.f=1",
                            "trainer.reduction=sharded", "faults=[aggregator_lie]")
    assert once != ref and nothing == []  # r_a = 1: the lie reaches every rank unnoticed


SHARDED5 = ["threat.n=5", "threat.f=1", "trainer.reduction=sharded", "trainer.aggregator_replicas=3",
            "trainer.on_aggregate_mismatch=vote", "trainer.mode=processes"]


@pytest.mark.parametrize("rule", [["aggregator=geometric_median"], ["aggregator=krum", "preaggregation=nnm"]])
def test_distance_based_rules_vote_on_every_partial_statistic_and_train_as_if_nobody_lied(tmp_path, rule):
    # A liar's partial Gram of each held slice is outvoted before any rank sums it, and its
    # aggregated slices after: the run is bit-identical to the one without the lie.
    _, ref, none = _run(tmp_path, "ref", *SHARDED5, *rule)
    _, lied, (det,) = _run(tmp_path, "lie", *SHARDED5, *rule, "faults=[aggregator_lie]")
    assert none == [] and lied == ref
    assert (det["step"], det["ranks"], det["action"]) == (3, [1], "outvoted")
    held = [0, 1, 4]  # held_slices(1, 5, 3)
    assert sorted({x["slice"] for x in det["slices"] if x["of"] == "statistic"}) == held
    assert sorted(x["slice"] for x in det["slices"] if x["of"] == "aggregate") == held
    assert all(x["digest"] != x["majority_digest"] for x in det["slices"])


def _two_faced(step, rank, blocks):
    """Rank 1 at step 3 claims its honest digests but sends doubled values (in both returns)."""
    flat = torch.cat([b.detach() for b in blocks])
    return flat * 2 if (step, rank) == (2, 1) else flat


def test_a_rank_that_claims_the_majority_digest_but_sends_other_bytes_is_caught_where_they_arrive(tmp_path,
                                                                                               monkeypatch):
    from robustagg.distributed import ShardedReduction

    _, ref, _ = _run(tmp_path, "ref", *SHARDED5, "aggregator=trimmed_mean")
    monkeypatch.setattr(ShardedReduction, "send_hook", staticmethod(_two_faced))  # forked workers inherit it
    _, lied, (det,) = _run(tmp_path, "lie", *SHARDED5, "aggregator=trimmed_mean")
    assert lied == ref  # every rank refetched slice 1 from all its holders and kept the majority
    assert (det["step"], det["ranks"], det["action"]) == (3, [1], "outvoted")
    assert [x["slice"] for x in det["slices"]] == [1]  # the one slice it was the first honest-looking holder of


def test_a_lie_in_the_last_bits_of_a_partial_gram_is_caught_too(tmp_path):
    _, ref, _ = _run(tmp_path, "ref", *SHARDED5, "aggregator=centered_clipping")
    _, lied, (det,) = _run(tmp_path, "lie", *SHARDED5, "aggregator=centered_clipping", "faults=[aggregator_lie]",
                           "faults.aggregator_lie.how=last_bits")
    assert lied == ref and det["ranks"] == [1] and {x["of"] for x in det["slices"]} == {"statistic", "aggregate"}


def test_processes_sharded_exclude_shrinks_the_liar_out(tmp_path):
    s, _, (det,) = _run(tmp_path, "excl", *SHARDED5, "aggregator=geometric_median", "faults=[aggregator_lie]",
                        "trainer.on_lying_aggregator=exclude", "trainer.on_failure=shrink", "trainer.max_restarts=1",
                        "trainer.checkpoint.every=2")
    assert det["action"] == "excluded" and s["workers"] == [0, 2, 3, 4] and s["restarts"] == 1 and s["steps"] == 5
    shrink = [r for r in s["lineage"] if r["event"] == "shrink"][0]
    assert shrink["lost_workers"] == [1] and "lying_aggregator detected at step 3" in shrink["reason"]


def test_lockstep_meets_at_every_request_and_reports_the_first_real_error():
    from robustagg.distributed.vote import Lockstep
    from robustagg.errors import DesyncError

    seen = []

    def combine(parts):
        seen.append([float(p) for p in parts])
        return sum(parts)

    def rule(v):
        def fn(red):
            a = red(torch.tensor(float(v)))          # the first global value: 1 + 2 + 3
            return float(red(torch.tensor(float(v)) * a))  # the second: 6 * (1 + 2 + 3)
        return fn
    assert Lockstep(3, combine).run([rule(1), rule(2), rule(3)]) == [36.0, 36.0, 36.0]
    assert seen == [[1.0, 2.0, 3.0], [6.0, 12.0, 18.0]]

    def boom(red):
        raise ValueError("rule failed in thread 1")
    with pytest.raises(ValueError, match="rule failed in thread 1"):  # not a hang, not a BrokenBarrierError
        Lockstep(2, combine).run([lambda red: red(torch.tensor(1.0)), boom])
    with pytest.raises(DesyncError, match="did not meet"):  # one asks twice, the other once
        Lockstep(2, combine, timeout_s=5).run([lambda red: red(red(torch.tensor(1.0))), lambda red: red(torch.tensor(1.0))])


def test_processes_gather_vote_outvotes_two_liars_of_five_then_excludes_one(tmp_path):
    base = ["trainer.mode=processes", "threat.n=5", "threat.f=1", "trainer.reduction=gather",
            "trainer.on_aggregate_mismatch=vote"]
    two = ["faults=[aggregator_lie]", "+faults.other={kind: aggregator_lie, rank: 3, step: 4, how: stale}"]
    _, ref, _ = _run(tmp_path, "ref", *base)
    _, lied, dets = _run(tmp_path, "two", *base, *two)
    assert lied == ref and [(d["step"], d["ranks"]) for d in dets] == [(3, [1]), (4, [3])]
    s, _, (det,) = _run(tmp_path, "excl", *base, "faults=[aggregator_lie]", "trainer.on_lying_aggregator=exclude",
                        "trainer.on_failure=shrink", "trainer.max_restarts=1", "trainer.checkpoint.every=2")
    assert det["action"] == "excluded" and s["workers"] == [0, 2, 3, 4] and s["restarts"] == 1
    shrink = [r for r in s["lineage"] if r["event"] == "shrink"][0]
    assert shrink["lost_workers"] == [1] and "lying_aggregator detected at step 3" in shrink["reason"]


def test_processes_gather_abort_stops_at_the_next_header(tmp_path):
    with pytest.raises(Exception, match=r"DesyncError: ranks disagree before the exchange at step 4.*the aggregates "
                                        r"applied at step 3 differ"):
        train(_cfg("trainer.mode=processes", "threat.n=4", "threat.f=1", "trainer.reduction=gather",
                   "faults=[aggregator_lie]"), out_dir=tmp_path, quiet=True)


# --- refusals before launch ------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,error,message", [
    (["trainer.lying_aggregators=1", "trainer.reduction=sharded", "trainer.on_aggregate_mismatch=vote"],
     AssumptionError, r"aggregate cross-check requires r_a >= 2 f_a \+ 1 \(every slice correct\): r_a=1, f_a=1"),
    (["trainer.lying_aggregators=2", *SHARDED3[2:]], AssumptionError, r"r_a=3, f_a=2"),
    (["trainer.aggregator_replicas=5", "trainer.reduction=sharded"], ConfigError, r"aggregator_replicas=5 exceeds"),
    (["trainer.aggregator_replicas=3", "trainer.reduction=sharded", "preaggregation=bucketing", "threat.f=0"], ConfigError,
     r"cannot replicate Pipeline: Bucketing draws its permutation once per call"),
    (["trainer.aggregator_replicas=3", "trainer.reduction=sharded", "aggregator=dnc"], ConfigError,
     r"no sharded implementation|has no sharded implementation"),
    (["trainer.aggregator_replicas=3", "trainer.reduction=gather"], ConfigError, r"with gather every rank computes"),
    (["trainer.on_aggregate_mismatch=vote", "trainer.on_lying_aggregator=exclude"], ConfigError,
     r"exclude removes a named rank through the launcher's shrink path"),
    (["trainer.on_aggregate_mismatch=vote", "trainer.processes=2"], ConfigError, r"compares processes, one worker each"),
    (["trainer.on_aggregate_mismatch=majority"], ConfigError, r"on_aggregate_mismatch must be one of abort, vote"),
])
def test_cross_check_configurations_are_refused_before_launch(tmp_path, overrides, error, message):
    with pytest.raises(error, match=message):
        train(_cfg("threat.n=4", "threat.f=1", *overrides), out_dir=tmp_path / "run", quiet=True)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_strict_false_runs_a_broken_requirement_and_records_it(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = train(_cfg("threat.n=4", "threat.f=1", "trainer.mode=simulated", "trainer.lying_aggregators=1",
                       "trainer.reduction=sharded", "trainer.on_aggregate_mismatch=vote", "strict=false"),
                  out_dir=tmp_path, quiet=True)
    assert s["aggregator_check"]["holds"] is False
    assert any("aggregate cross-check requires" in v for v in s["violations"])


def test_the_cross_check_requirement_is_printed_at_launch(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="robustagg.launch"):
        train(_cfg("trainer.mode=simulated", *SHARDED3, "trainer.lying_aggregators=1"), out_dir=tmp_path, quiet=True)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("aggregate cross-check"))
    assert "3 replica(s) of every slice, vote on a mismatch" in line and "r_a >= 2 f_a + 1" in line
    assert line.endswith("with f_a = 1: holds")

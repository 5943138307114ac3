"""protocol=async: the virtual-time schedule by hand, its staleness bound, dsgd as its tau = 0 case,
the staleness weights, a Byzantine early submitter, the checks before launch, and real processes
(simulated vs processes bit for bit on digits; SIGKILL and resume bit for bit)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from experiments.train import train
from experiments.wiring import validate
from robustagg.checkpoint import load_state
from robustagg.errors import ConfigError
from robustagg.protocols import AsyncSGD, RoundPlan
from robustagg.protocols.asynchronous import polynomial_staleness
from robustagg.protocols.schedule import DelayModel, StalenessSchedule
from state_equal import assert_state_equal

CONF = Path(__file__).resolve().parents[1] / "conf"
QUIET = ["logger=none", "trainer.progress=false", "trainer.eval_every=0"]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*QUIET, *overrides])


def _records(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model.safetensors"))


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# --- the schedule ------------------------------------------------------------------------------
def test_a_three_worker_schedule_matches_the_hand_computed_one():
    # durations 1, 2, 3 ticks, tau = 1, the server updates as soon as one row waits. By hand:
    # t=1 w0 (v0) -> u0 ; t=2 w0 (v1), w1 (v0, 1 stale) -> u1 ; t=3 w0 fresh, w2 (v0) is 3 - 0 = 2 > 1
    # stale at u2: rejected, restarts on v2 (arrives t=6) -> u2 = {w0} ; t=4 w0 (v3), w1 (v2) -> u3 ;
    # t=5 w0 -> u4 ; t=6 w0 (v5), w1 (v4), w2 (v2: 5 - 2 = 3 > 1, rejected again) -> u5.
    s = StalenessSchedule(3, max_staleness=1, min_arrivals=1, delays=DelayModel(kind="fixed", delays=(1, 2, 3)))
    ups = [s.advance() for _ in range(6)]
    assert [u.time for u in ups] == [1, 2, 3, 4, 5, 6]
    assert [u.members for u in ups] == [(0,), (0, 1), (0,), (0, 1), (0,), (0, 1)]
    assert [u.staleness for u in ups] == [{0: 0}, {0: 0, 1: 1}, {0: 0}, {0: 0, 1: 1}, {0: 0}, {0: 0, 1: 1}]
    assert [u.discarded for u in ups] == [(), (), (2,), (), (), (2,)]
    # the rows computed in step u: every job that starts on version u (w2's restarts included)
    assert [u.started for u in ups] == [(0, 1, 2), (0,), (0, 1, 2), (0,), (0, 1), (0, 2)]
    # min_arrivals = 2: t=2 {w0 (v0), w1 (v0)} -> u0 ; t=3 w2 (v0, 1 stale) ; t=4 w0 (v1) -> u1 = {w0, w2}
    s2 = StalenessSchedule(3, max_staleness=1, min_arrivals=2, delays=DelayModel(kind="fixed", delays=(2, 2, 3)))
    u0, u1 = s2.advance(), s2.advance()
    assert (u0.time, u0.members, u0.staleness) == (2, (0, 1), {0: 0, 1: 0})
    assert (u1.time, u1.members, u1.staleness, u1.started) == (4, (0, 1, 2), {0: 0, 1: 0, 2: 1}, (0, 1))


@pytest.mark.parametrize("seed", range(12))
def test_no_aggregated_row_is_ever_staler_than_tau_and_the_schedule_resumes_exactly(seed):
    n, tau, m = 7, seed % 4, 1 + seed % 5
    delays = DelayModel(kind="uniform", min_delay=1, max_delay=6, slow_workers=(2,), slow_factor=3,
                        byzantine=(6,), byzantine_delay=1 if seed % 2 else None, seed=seed)
    s = StalenessSchedule(n, max_staleness=tau, min_arrivals=m, delays=delays)
    ups = [s.advance() for _ in range(60)]
    assert all(0 <= v <= tau for u in ups for v in u.staleness.values())
    assert all(len(u.usable) >= m for u in ups)
    assert all(a.time < b.time for a, b in zip(ups, ups[1:]))
    # every aggregated row was computed in the step of its version (started there, not yet arrived)
    last_start = {}
    for u in ups:
        for w in u.started:
            last_start[w] = u.step
        assert all(last_start[w] == u.step - u.staleness[w] for w in u.members)
    # the replicated state is the whole story: a copy restored mid-way continues identically
    t = StalenessSchedule(n, max_staleness=tau, min_arrivals=m, delays=delays)
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert [t.advance() for _ in range(10)] == [s.advance() for _ in range(10)]


def test_uniform_delays_are_seeded_per_worker_and_job():
    a = DelayModel(kind="uniform", min_delay=2, max_delay=5, seed=3)
    draws = [a.duration(w, j) for w in range(4) for j in range(200)]
    assert set(draws) == {2, 3, 4, 5}
    assert draws == [DelayModel(kind="uniform", min_delay=2, max_delay=5, seed=3).duration(w, j)
                     for w in range(4) for j in range(200)]
    assert draws != [DelayModel(kind="uniform", min_delay=2, max_delay=5, seed=4).duration(w, j)
                     for w in range(4) for j in range(200)]


def test_a_byzantine_early_submitter_is_always_fresh_and_in_every_update():
    # honest jobs take 2..5 ticks, the Byzantine worker 3's always 1: it arrives first after every
    # update, so it sits in every update with staleness 0, while honest rows are often stale
    delays = DelayModel(kind="uniform", min_delay=2, max_delay=5, byzantine=(3,), byzantine_delay=1, seed=0)
    s = StalenessSchedule(4, max_staleness=3, min_arrivals=2, delays=delays)
    ups = [s.advance() for _ in range(40)]
    assert all(3 in u.members and u.staleness[3] == 0 for u in ups)
    honest = [v for u in ups for w, v in u.staleness.items() if w != 3]
    assert max(honest) > 0
    fair = StalenessSchedule(4, max_staleness=3, min_arrivals=2,
                             delays=DelayModel(kind="uniform", min_delay=2, max_delay=5, seed=0))
    assert sum(3 in fair.advance().members for _ in range(40)) < 40


# --- the server's transform ------------------------------------------------------------------------
def test_inverse_weights_scale_rows_by_the_polynomial_staleness_and_drop_above_drops():
    x = torch.tensor([[4.0, 8.0], [4.0, 8.0], [4.0, 8.0]])
    plan = RoundPlan(step=5, members=(0, 2, 5), full=False, staleness={0: 0, 2: 1, 5: 3})
    assert polynomial_staleness(3, 1.0) == 0.25 and polynomial_staleness(0, 7.0) == 1.0
    inv = AsyncSGD(staleness_weight="inverse", staleness_a=1.0).transform(plan)
    rows, labels = inv(x, [0, 2, 5], [0, 0, 0])
    assert labels == [0, 2, 5] and torch.equal(rows, torch.tensor([[4.0, 8.0], [2.0, 4.0], [1.0, 2.0]]))
    drop = AsyncSGD(staleness_weight="drop_above", drop_threshold=1).transform(plan)
    rows, labels = drop(x, [0, 2, 5], [0, 0, 0])
    assert labels == [0, 2] and rows.shape == (2, 2)
    assert AsyncSGD().transform(plan) is None
    # drop_above: rows over the threshold do not count towards min_arrivals
    s = StalenessSchedule(2, max_staleness=5, min_arrivals=1, delays=DelayModel(kind="fixed", delays=(1, 3)),
                          drop_above=1)
    ups = [s.advance() for _ in range(3)]  # t=1 w0 ; t=2 w0 ; t=3 w0 fresh, w1 (v0) 2 stale: received, unused
    assert ups[2].members == (0, 1) and ups[2].usable == (0,) and ups[2].staleness == {0: 0, 1: 2}


# --- before launch ------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, key", [
    (["protocol.max_staleness=-1"], "protocol.max_staleness"),
    (["protocol.min_arrivals=0"], "protocol.min_arrivals"),
    (["protocol.min_arrivals=11"], "protocol.min_arrivals"),
    (["protocol.min_arrivals=3"], "protocol.min_arrivals>=5"),  # trimmed mean, f = 2: 2f + 1 rows
    (["protocol.staleness_weight=oldest"], "protocol.staleness_weight"),
    (["protocol.staleness_weight=drop_above"], "protocol.drop_threshold"),
    (["protocol.staleness_a=-1"], "protocol.staleness_a"),
    (["protocol.delay=fixed"], "protocol.delays"),
    (["protocol.delay=fixed", "protocol.delays=[1,2]"], "protocol.delays"),
    (["protocol.min_delay=3", "protocol.max_delay=2"], "protocol.max_delay"),
    (["protocol.slow_workers=[10]"], "protocol.slow_workers"),
    (["protocol.byzantine_delay=0"], "protocol.byzantine_delay"),
    (["protocol.slow_factor=0"], "protocol.slow_factor"),
    (["protocol.drop_threshold=2"], "protocol.drop_threshold=2 has no effect"),
    (["protocol.delays=[1,1,1,1,1,1,1,1,1,1]"], "protocol.delays is read by protocol.delay=fixed only"),
    (["trainer.on_failure=shrink"], "trainer.on_failure=restart"),
])
def test_a_bad_async_setting_is_refused_before_launch_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[")):
        validate(_cfg("protocol=async", *overrides))


# --- in the trainer -------------------------------------------------------------------------------
def test_tau_zero_waiting_for_everyone_is_dsgd_bit_for_bit(tmp_path):
    # stateful rule, an omniscient attack, worker momentum and random delays: with tau = 0 and
    # min_arrivals = n every update is synchronous, so the parameters match dsgd to the bit
    common = ["threat.n=4", "threat.f=1", "aggregator=centered_clipping", "attack=mimic", "trainer.steps=6",
              "trainer.worker_momentum=0.9", "trainer.reduction=gather", "trainer.mode=simulated",
              "trainer.measure_bias=true"]
    a = train(_cfg(*common), out_dir=tmp_path / "dsgd", quiet=True)
    b = train(_cfg(*common, "protocol=async", "protocol.max_staleness=0", "protocol.min_arrivals=4",
                   "protocol.max_delay=3"), out_dir=tmp_path / "async", quiet=True)
    assert _same_weights(tmp_path / "dsgd", tmp_path / "async")
    assert a["mean_kappa_hat"] == b["mean_kappa_hat"] and b["protocol"] == "async"
    recs = _records(tmp_path / "async")
    assert all(r["round/participants"] == 4 and r["round/staleness_max"] == 0 for r in recs)
    # the fresh-gradient reference is dsgd's honest mean: the same bias at every step
    bias_a = [r["agg/bias_vs_sync"] for r in _records(tmp_path / "dsgd")]
    assert [r["agg/bias_vs_sync"] for r in recs] == pytest.approx(bias_a, rel=1e-9, abs=1e-12)


def test_measuring_the_bias_does_not_change_the_run_and_records_the_obligations(tmp_path):
    common = ["threat.n=5", "threat.f=1", "aggregator=trimmed_mean", "attack=gaussian", "trainer.steps=8",
              "trainer.mode=simulated", "protocol=async", "protocol.max_staleness=2", "protocol.min_arrivals=3",
              "protocol.byzantine_delay=1", "protocol.min_delay=2", "protocol.max_delay=5"]
    a = train(_cfg(*common), out_dir=tmp_path / "a", quiet=True)
    b = train(_cfg(*common, "trainer.measure_bias=true"), out_dir=tmp_path / "b", quiet=True)
    assert _same_weights(tmp_path / "a", tmp_path / "b")
    recs = _records(tmp_path / "b")
    # the early-submitting Byzantine worker (rank 4) is in every update
    assert all(r["round/byzantine"] == 1 and r["round/participants"] >= 3 for r in recs)
    assert all(sum(r[f"round/staleness_hist/{s}"] for s in range(3)) == r["round/participants"] for r in recs)
    per_row = [{int(k.rsplit("/", 1)[1]): v for k, v in r.items() if k.startswith("round/staleness/")} for r in recs]
    assert all(len(p) == r["round/participants"] and p[4] == 0 and max(p.values()) == r["round/staleness_max"]
               for p, r in zip(per_row, recs))  # the Byzantine rank 4 submits first: always fresh
    assert all(r["agg/bias_vs_sync"] > 0 for r in recs) and "mean_bias_vs_sync" in b
    assert b["byzantine_submissions"] == 8 and a["max_staleness_seen"] <= 2


# --- real processes -------------------------------------------------------------------------------
DIGITS = ["threat.n=6", "threat.f=1", "aggregator=trimmed_mean", "attack=alie", "protocol=async",
          "protocol.max_staleness=4", "protocol.min_arrivals=3", "protocol.max_delay=4", "protocol.slow_workers=[1]",
          "protocol.slow_factor=3", "trainer.steps=60", "trainer.collective_timeout_s=120"]


@pytest.mark.slow
def test_an_async_run_with_tau_4_trains_on_digits_bit_for_bit_in_both_modes(tmp_path):
    sim = train(_cfg(*DIGITS, "trainer.mode=simulated"), out_dir=tmp_path / "sim", quiet=True)
    proc = train(_cfg(*DIGITS, "trainer.mode=processes", "trainer.processes=2"), out_dir=tmp_path / "proc",
                 quiet=True)
    assert _same_weights(tmp_path / "sim", tmp_path / "proc")
    assert sim["final_test_acc"] == proc["final_test_acc"] and proc["processes"] == 2
    assert sim["final_test_acc"] > 0.6  # ten classes: chance is 0.1
    assert 0 < sim["mean_staleness"] and sim["max_staleness_seen"] <= 4 and sim["mean_participants"] < 6


@pytest.mark.slow
def test_sigkill_mid_run_resumes_the_async_schedule_and_rows_in_flight_bit_for_bit(tmp_path):
    steps, every = 10, 3
    common = [*DIGITS[:-2], f"trainer.steps={steps}", f"trainer.checkpoint.every={every}", "trainer.mode=processes",
              "trainer.processes=2", "trainer.worker_momentum=0.5", "trainer.collective_timeout_s=120"]
    ref = train(_cfg(*common), out_dir=tmp_path / "ref", quiet=True)
    s = train(_cfg(*common, "faults=[crash]", "faults.crash.step=7", "faults.crash.rank=4", "trainer.max_restarts=1"),
              out_dir=tmp_path / "crash", quiet=True)
    assert s["restarts"] == 1 and s["lineage"][0]["restored_from"] == 6 and "SIGKILL" in s["lineage"][0]["reason"]
    assert _same_weights(tmp_path / "ref", tmp_path / "crash")
    final = f"step-{steps:08d}"
    for part in ("replicated.pt", "rank-0.pt", "rank-1.pt"):  # the schedule; every worker's row in flight
        sa = load_state(tmp_path / "crash" / "checkpoints" / final / part)
        sb = load_state(tmp_path / "ref" / "checkpoints" / final / part)
        keys = ("model", "optimizer", "protocol", "step") if part == "replicated.pt" else ("workers",)
        for key in keys:
            assert_state_equal(sa[key], sb[key], f"{part}:{key}")
    last = [_records(tmp_path / run)[-1]["round/virtual_time"] for run in ("crash", "ref")]
    assert last[0] == last[1]


@pytest.mark.parametrize("rule", ["mean", "trimmed_mean", "coordinate_median", "krum"])
def test_every_cell_of_the_staleness_sweep_passes_the_checks_before_launch(rule):
    cfg = _cfg("+experiment=staleness_vs_bias", f"+experiment/rule={rule}", "attack=alie", "protocol.max_staleness=4")
    plan = validate(cfg)
    assert plan.cfg["protocol"]["min_arrivals"] == 7 and plan.cfg["trainer"]["measure_bias"] is True
    assert plan.rule_name == rule


def test_drop_above_keeps_stale_rows_out_of_the_rule_in_a_run(tmp_path):
    train(_cfg("threat.n=5", "threat.f=1", "aggregator=trimmed_mean", "attack=none", "trainer.steps=12",
               "trainer.mode=simulated", "protocol=async", "protocol.max_staleness=3", "protocol.min_arrivals=3",
               "protocol.staleness_weight=drop_above", "protocol.drop_threshold=0", "protocol.max_delay=5"),
          out_dir=tmp_path, quiet=True)
    recs = _records(tmp_path)
    assert all(r["round/staleness_max"] == 0 and r["round/participants"] >= 3 for r in recs)
    assert sum(r["round/discarded"] for r in recs) > 0  # stale rows arrived and were left out
    # every row the rule weighed is one of the fresh ones
    assert all({k.rsplit("/", 1)[1] for k in r if k.startswith("agg/honest_weight/")}
               == {k.rsplit("/", 1)[1] for k in r if k.startswith("round/staleness/")} for r in recs)

"""protocol=local with real processes: many clients per process train bit for bit like the simulated
mode, a SIGKILL mid-round resumes bit-equal, and the issue's 100-client run trains on digits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from experiments.train import train
from robustagg.checkpoint import load_state
from robustagg.protocols.local import sample_clients
from state_equal import assert_state_equal

CONF = Path(__file__).resolve().parents[1] / "conf"
QUIET = ["logger=none", "trainer.progress=false", "protocol=local", "trainer.collective_timeout_s=120"]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*QUIET, *overrides])


def _weights(run: Path):
    return load_file(str(run / "model.safetensors"))


def _train_records(run: Path):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "train"]


@pytest.mark.slow
def test_twenty_clients_on_two_processes_train_bit_for_bit_like_simulated(tmp_path):
    # Byzantine clients 3 and 17 live in different processes and the attack is stateful
    # (PoisonedFL): each process must advance the attack's state exactly as the one simulated
    # process does, also in rounds where only the other process's Byzantine client is sampled.
    common = ["threat.n=20", "threat.f=2", "threat.ranks=[3,17]", "aggregator=trimmed_mean", "aggregator.f=1",
              "attack=poisoned_fl", "protocol.clients_per_round=5", "protocol.local_steps=2",
              "protocol.client_state=keep", "optimizer.momentum=0.9", "trainer.steps=6", "trainer.eval_every=0",
              "trainer.checkpoint.every=3", "seed=1"]
    a = train(_cfg(*common, "trainer.mode=simulated", "trainer.measure_bias=true"), out_dir=tmp_path / "sim",
              quiet=True)
    b = train(_cfg(*common, "trainer.mode=processes", "trainer.processes=2"), out_dir=tmp_path / "proc", quiet=True)
    wa, wb = _weights(tmp_path / "sim"), _weights(tmp_path / "proc")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a["processes"] == 1 and b["processes"] == 2
    members = [sample_clients(20, 5, seed=1, round_id=t) for t in range(6)]
    one_side = [t for t, m in enumerate(members) if (3 in m) != (17 in m)]
    assert one_side, members  # the case the test is about happens in this run
    byz = [sum(r in (3, 17) for r in m) for m in members]
    for s in (a, b):
        assert s["byzantine_submissions"] == sum(byz) and s["rounds_without_guarantee"] == sum(c > 1 for c in byz)
    assert a["mean_bias_vs_sync"] > 0 and "mean_bias_vs_sync" not in b  # measured where every client is hosted
    ra_, rb = _train_records(tmp_path / "sim"), _train_records(tmp_path / "proc")
    assert [r["train/loss"] for r in ra_] == [r["train/loss"] for r in rb]
    assert all(r["train/lr"] == 1.0 for r in ra_)  # the trainer's optimizer is the server's (SGD, lr 1)
    ck = tmp_path / "proc" / "checkpoints" / "step-00000006"
    kept = {w: s["protocol"] for p in ("rank-0.pt", "rank-1.pt") for w, s in load_state(ck / p)["workers"].items()}
    sampled = {r for m in members for r in m}
    assert sorted(kept) == list(range(20))
    assert {w for w, s in kept.items() if s} == sampled  # local momentum of every client that trained


@pytest.mark.slow
def test_a_sigkill_mid_round_resumes_bit_equal(tmp_path):
    # 6 clients on 2 processes, 3 per round; the process hosting client 4 is killed after the
    # reduction of round 5 (the others apply it, it never does); the group restores round 4's
    # checkpoint: local momentum per client, data positions, RNG streams, PoisonedFL's state
    common = ["threat.n=6", "threat.f=2", "aggregator=trimmed_mean", "aggregator.f=1", "attack=poisoned_fl",
              "protocol.clients_per_round=3", "protocol.local_steps=2", "protocol.client_state=keep",
              "optimizer.momentum=0.9", "model.dropout=0.2", "trainer.steps=6", "trainer.eval_every=3",
              "trainer.checkpoint.every=2", "trainer.mode=processes", "trainer.processes=2"]
    ref = train(_cfg(*common), out_dir=tmp_path / "ref", quiet=True)
    crash = train(_cfg(*common, "faults=[crash]", "faults.crash.step=5", "faults.crash.rank=4",
                       "faults.crash.where=after_reduce", "trainer.max_restarts=1"), out_dir=tmp_path / "crash",
                  quiet=True)
    assert crash["restarts"] == 1 and crash["steps"] == 6
    (rec,) = crash["lineage"]
    assert rec["restored_from"] == 4 and "SIGKILL" in rec["reason"]
    wa, wb = _weights(tmp_path / "crash"), _weights(tmp_path / "ref")
    assert_state_equal(wa, wb, "parameters")
    keys = {"replicated.pt": ("model", "optimizer", "rule", "step", "last_digest", "protocol"),
            "rank-0.pt": ("workers", "attack", "attack_generator", "rng"),
            "rank-1.pt": ("workers", "attack", "attack_generator", "rng")}
    for name, wanted in keys.items():
        a = load_state(tmp_path / "crash" / "checkpoints" / "step-00000006" / name)
        b = load_state(tmp_path / "ref" / "checkpoints" / "step-00000006" / name)
        for key in wanted:
            assert_state_equal(a[key], b[key], f"{name}.{key}")
    b4 = load_state(tmp_path / "ref" / "checkpoints" / "step-00000004" / "rank-1.pt")
    assert b4["attack"] and any(w["protocol"] for w in b4["workers"].values())  # the state that had to come back
    for key in ("final_test_acc", "mean_kappa_hat", "rounds_without_guarantee", "byzantine_submissions"):
        assert crash[key] == ref[key], key


@pytest.mark.slow
def test_hundred_clients_ten_per_round_with_twenty_byzantine_train_on_digits_in_both_modes(tmp_path):
    # issue 15's done-when run: n = 100 clients, k = 10 per round, 5 local steps, 20 Byzantine
    # clients (ALIE), CWTM with the per-round f = 3 (its requirement 2f + 1 <= 10 holds at k rows)
    n, k, rounds, byz = 100, 10, 30, set(range(80, 100))
    common = [f"threat.n={n}", "threat.f=20", "aggregator=trimmed_mean", "aggregator.f=3", "attack=alie",
              "attack.z=1.0", f"protocol.clients_per_round={k}", "protocol.local_steps=5", "trainer.eval_every=0"]
    untrained = train(_cfg(*common, "trainer.mode=simulated", "trainer.steps=0"), out_dir=tmp_path / "init",
                      quiet=True)
    sim = train(_cfg(*common, "trainer.mode=simulated", f"trainer.steps={rounds}"), out_dir=tmp_path / "sim",
                quiet=True)
    proc = train(_cfg(*common, "trainer.mode=processes", "trainer.processes=4", f"trainer.steps={rounds}"),
                 out_dir=tmp_path / "proc", quiet=True)
    wa, wb = _weights(tmp_path / "sim"), _weights(tmp_path / "proc")
    assert all(torch.equal(wa[key], wb[key]) for key in wa)
    assert sim["final_test_acc"] == proc["final_test_acc"]
    assert untrained["final_test_acc"] < 0.2 and sim["final_test_acc"] > untrained["final_test_acc"] + 0.4
    counts = [len(byz.intersection(sample_clients(n, k, seed=0, round_id=t))) for t in range(rounds)]
    for s in (sim, proc):
        assert s["mean_participants"] == k and s["byzantine_submissions"] == sum(counts)
        assert s["rounds_without_guarantee"] == sum(c > 3 for c in counts)
    assert proc["processes"] == 4 and proc["protocol"] == "local"

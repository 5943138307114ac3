"""protocol=gossip (issue 30): the trainer's decentralised protocol. Its relation to dsgd by hand
(complete graph, uniform weights, plain SGD: every node holds dsgd-with-the-mean's model), the checks
before launch (per node, naming the node), simulated vs processes bit for bit, and a real SIGKILL
resumed bit for bit (every node's model and optimizer state)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file
from torch import nn

import robustagg as ra
from attacks.gossip import Dissensus
from experiments.train import train
from experiments.wiring import validate
from robustagg.checkpoint import load_state
from robustagg.distributed import GatherReduction, LocalComm
from robustagg.errors import AssumptionError, ConfigError
from robustagg.protocols import Gossip
from robustagg.training import ByzantineBehaviour, Trainer
from robustagg.training.trainer import Shard
from state_equal import assert_state_equal

CONF = Path(__file__).resolve().parents[1] / "conf"
QUIET = ["logger=none", "trainer.progress=false"]
RING = ["protocol=gossip", "attack=dissensus", "threat.n=6", "threat.f=1", "protocol.node_f=1",
        "protocol.placement=max_degree", "trainer.eval_every=0"]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*QUIET, *overrides])


def _trainer(n: int, protocol, byzantine=None, dtype=torch.float32) -> Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
    g = torch.Generator().manual_seed(1)
    shards = {r: Shard(torch.randn(40, 6, generator=g, dtype=dtype), torch.randint(0, 3, (40,), generator=g))
              for r in range(n)}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Trainer(model, opt, GatherReduction(ra.Mean(), LocalComm(n)), shards, batch_size=8, num_classes=3,
                   seed=0, protocol=protocol, byzantine=byzantine)


def _sgd(lr=0.1):
    return functools.partial(torch.optim.SGD, lr=lr)


def test_gossip_on_the_complete_graph_with_uniform_weights_is_dsgd_with_the_mean():
    # x_i <- (1/N) sum_j (x_j - lr g_j); every node starts at x, so every node holds x - lr mean_j g_j
    for dtype, tol in ((torch.float64, 1e-13), (torch.float32, 1e-6)):
        dsgd = _trainer(6, None, dtype=dtype)
        proto = Gossip(topology="complete", node_rule="gossip", node_f=0, weights="uniform", client_optimizer=_sgd())
        gossip = _trainer(6, proto, dtype=dtype)
        for _ in range(6):
            dsgd.step()
            out = gossip.step()
        ref = ra.flatten([p.detach() for p in dsgd.params])
        assert proto.models is not None and proto.models.dtype == dtype
        assert torch.allclose(proto.models, ref.expand(6, -1), atol=tol, rtol=0), dtype
        assert torch.allclose(ra.flatten([p.detach() for p in gossip.params]), ref, atol=tol, rtol=0)
        assert out.node_metrics["gossip/consensus_distance"] < tol


def test_every_node_keeps_its_own_model_and_optimizer_state_on_a_ring():
    proto = Gossip(topology="ring", node_rule="gossip", node_f=0, client_optimizer=functools.partial(
        torch.optim.SGD, lr=0.1, momentum=0.9))
    t = _trainer(6, proto)
    for _ in range(3):
        out = t.step()
    assert proto.models is not None and len({tuple(m.tolist()) for m in proto.models}) == 6  # six different models
    assert out.node_metrics["gossip/consensus_distance"] > 0
    st = proto.worker_state(2)["optimizer"]["state"]
    assert all("momentum_buffer" in v for v in st.values())
    honest_mean = proto.models.to(torch.float64).mean(dim=0).to(torch.float32)
    assert torch.equal(ra.flatten([p.detach() for p in t.params]), honest_mean)  # the trainer holds the average


def test_the_dissensus_attack_drives_gossip_apart_and_clipped_gossip_holds():
    spread = {}
    for rule in ("gossip", "clipped_gossip"):
        proto = Gossip(topology="torus", node_rule=rule, node_f=1, placement="max_degree", client_optimizer=_sgd())
        byz = ByzantineBehaviour(ranks=(3, 5), gossip_fn=Dissensus(epsilon=1.05), name="dissensus")
        t = _trainer(16, proto, byzantine=byz)
        spread[rule] = [t.step().node_metrics["gossip/consensus_distance"] for _ in range(12)]
        assert sorted(proto.node_of[r] for r in (3, 5)) == [0, 1]  # max_degree on the torus: the two lowest ids
    assert spread["gossip"][-1] > 5 * spread["gossip"][0]
    assert spread["clipped_gossip"][-1] < spread["gossip"][-1] / 5


def test_the_library_refuses_a_gossip_attack_under_a_server_protocol_and_bad_arguments():
    with pytest.raises(ConfigError, match="is a gossip attack .* has a server aggregate"):
        _trainer(4, None, byzantine=ByzantineBehaviour(ranks=(1,), gossip_fn=Dissensus(), name="dissensus"))
    with pytest.raises(ConfigError, match="protocol.graph_seed must be an integer"):
        Gossip(graph_seed=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="protocol.strict must be true or false"):
        Gossip(strict="false")  # type: ignore[arg-type]
    import numpy as np

    assert Gossip(node_f=np.int64(2)).node_f == 2


def test_gossip_refuses_what_it_cannot_run_at_bind():
    with pytest.raises(ConfigError, match="needs each node's optimizer"):
        _trainer(4, Gossip(topology="ring", node_rule="gossip", node_f=0))
    byz = ByzantineBehaviour(ranks=(1,), gradient_fn=lambda h, b, o, g: torch.zeros(b, h.shape[1]), name="zero")
    with pytest.raises(ConfigError, match="use a gossip attack"):
        _trainer(4, Gossip(topology="ring", node_rule="gossip", node_f=1, client_optimizer=_sgd()), byzantine=byz)
    with pytest.raises(AssumptionError, match=r"honest node 4 \(degree 2, Byzantine neighbours \[3, 5\]\) has 2"):
        _trainer(6, Gossip(topology="ring", node_rule="clipped_gossip", node_f=1, placement="random", graph_seed=4,
                           client_optimizer=_sgd()),  # graph nodes 3 and 5
                 byzantine=ByzantineBehaviour(ranks=(4, 5), gossip_fn=Dissensus(), name="dissensus"))


def test_the_app_refuses_before_launch_naming_the_key_or_the_node():
    with pytest.raises(ConfigError, match="attack=alie replaces a server submission; under protocol=gossip"):
        validate(_cfg(*RING[:1], "attack=alie", "trainer.steps=1"))
    with pytest.raises(ConfigError, match="attack=dissensus is a gossip attack .* needs protocol=gossip"):
        validate(_cfg("attack=dissensus", "trainer.steps=1"))
    with pytest.raises(ConfigError, match="trainer.worker_momentum=0"):
        validate(_cfg(*RING, "trainer.worker_momentum=0.9"))
    with pytest.raises(ConfigError, match="scheduler=none"):
        validate(_cfg(*RING, "scheduler=cosine"))
    with pytest.raises(AssumptionError, match=r"BRIDGE-M requires n >= 2f \+ 1 .*got n=3, f=2"):
        validate(_cfg(*RING, "protocol.node_rule=bridge_median", "protocol.node_f=2"))
    with pytest.raises(AssumptionError, match=r"disconnected without the Byzantine nodes \[3, 4\]"):
        validate(_cfg(*RING[:4], "protocol.topology=dumbbell", "threat.n=8", "threat.f=2", "protocol.node_f=2",
                      "protocol.placement=cut"))
    with pytest.raises(ConfigError, match="trainer.aggregator_replicas=1"):
        validate(_cfg(*RING, "trainer.aggregator_replicas=3", "trainer.mode=processes"))
    with pytest.raises(ConfigError, match="trainer.measure_bias=false"):
        validate(_cfg(*RING, "trainer.measure_bias=true", "trainer.mode=simulated"))
    with pytest.raises(ConfigError, match="a torus needs an integer number of nodes >= 4 \\(threat.n"):
        validate(_cfg(*RING, "threat.n=3", "protocol.topology=torus"))
    with pytest.raises(ConfigError, match="unknown protocol.topology 'grid'"):
        validate(_cfg(*RING, "protocol.topology=grid"))
    with pytest.raises(ConfigError, match="trainer.membership .* cannot run with it"):
        validate(_cfg(*RING, "trainer.membership=[{workers: [5], absent: [1, 2]}]"))
    with pytest.raises(ConfigError, match="attack=backdoor poisons batches .* use attack=label_flip"):
        validate(_cfg(*RING, "attack=backdoor"))
    with pytest.raises(AssumptionError, match="BRIDGE-T cannot trim f=1 values .* even to study breakdown"):
        validate(_cfg(*RING, "protocol.node_rule=bridge_trimmed_mean", "strict=false"))
    broken = validate(_cfg(*RING, "protocol.node_f=0", "strict=false", "trainer.steps=1"))
    assert broken.assumption_violated and any("has 1 Byzantine neighbours but the node rule tolerates "
                                              "protocol.node_f=0" in v for v in broken.violations)
    calm = validate(_cfg("protocol=gossip", "attack=none", "threat.n=4", "trainer.steps=1"))  # trimmed_mean, f=2:
    assert not calm.assumption_violated and calm.job().rule is None  # the unused server rule is not checked
    plan = validate(_cfg(*RING, "trainer.steps=1"))
    assert plan.fingerprint["protocol.graph_sha256"] != validate(_cfg(*RING, "trainer.steps=1", "threat.n=7"))\
        .fingerprint["protocol.graph_sha256"]
    assert plan.rule_name == "gossip:clipped_gossip" and plan.attack_name == "dissensus"
    assert "protocol=gossip on ring(6): Byzantine nodes [0] (worker ranks [5]), node rule clipped_gossip with " \
           "node_f=1; largest Byzantine gossip weight at an honest node 0.333, honest subgraph's spectral gap" in \
           " ".join(plan.notes)


def _records(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_simulated_run_records_per_node_accuracy_and_consensus(tmp_path):
    s = train(_cfg(*RING, "trainer.mode=simulated", "trainer.steps=12", "trainer.eval_every=6",
                   "optimizer.momentum=0.9"), out_dir=tmp_path / "sim", quiet=True)
    test = _records(tmp_path / "sim", "test")[-1]
    assert test["test/acc_worst_node"] <= test["test/acc"] <= test["test/acc_best_node"]
    assert s["final_test_acc"] == test["test/acc"] and s["final_test_acc_worst_node"] == test["test/acc_worst_node"]
    trainrec = _records(tmp_path / "sim", "train")
    assert len(trainrec) == 12 and "gossip/consensus_distance" in trainrec[-1]
    assert not [k for k in trainrec[-1] if k.startswith("agg/")]  # no server aggregate, no agg/* metrics
    assert s["final_consensus_distance"] == trainrec[-1]["gossip/consensus_distance"]
    assert s["rule"] == "gossip:clipped_gossip" and s["protocol"] == "gossip" and s["topology"] == "ring(6)"
    assert s["byzantine_nodes"] == [0] and s["node_rule"] == "clipped_gossip"


@pytest.mark.slow
def test_simulated_and_processes_are_bit_identical_and_a_sigkill_resumes_bit_for_bit(tmp_path):
    steps, every = 9, 3
    common = [*RING, f"trainer.steps={steps}", "optimizer.momentum=0.9", "trainer.collective_timeout_s=120"]
    sim = train(_cfg(*common, "trainer.mode=simulated"), out_dir=tmp_path / "sim", quiet=True)
    proc = [*common, "trainer.mode=processes", "trainer.processes=2", f"trainer.checkpoint.every={every}"]
    ref = train(_cfg(*proc), out_dir=tmp_path / "ref", quiet=True)
    assert _same_weights(tmp_path / "sim", tmp_path / "ref") and ref["processes"] == 2
    assert sim["final_consensus_distance"] == ref["final_consensus_distance"]
    s = train(_cfg(*proc, "faults=[crash]", "faults.crash.step=5", "faults.crash.rank=4", "trainer.max_restarts=1"),
              out_dir=tmp_path / "crash", quiet=True)
    assert s["restarts"] == 1 and s["lineage"][0]["restored_from"] == 3 and "SIGKILL" in s["lineage"][0]["reason"]
    assert _same_weights(tmp_path / "ref", tmp_path / "crash")
    final = f"step-{steps:08d}"
    for part in ("replicated.pt", "rank-0.pt", "rank-1.pt"):  # every node's model; every node's optimizer state
        sa = load_state(tmp_path / "crash" / "checkpoints" / final / part)
        sb = load_state(tmp_path / "ref" / "checkpoints" / final / part)
        for key in (("model", "protocol", "step") if part == "replicated.pt" else ("workers",)):
            assert_state_equal(sa[key], sb[key], f"{part}:{key}")
    assert _records(tmp_path / "crash", "train")[-1] == {**_records(tmp_path / "ref", "train")[-1],
                                                           **{k: v for k, v in _records(tmp_path / "crash", "train")[-1].items()
                                                              if k.startswith("time/")}}

"""protocol=local: client sampling, local steps from the round's model, the server step on -aggregate,
the bias reference, client state across rounds and checkpoints, and the validation before launch."""

from __future__ import annotations

import io
import math
from functools import partial
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

import robustagg as ra
from experiments.wiring import validate
from robustagg.distributed import GatherReduction, LocalComm
from robustagg.errors import AssumptionError, ConfigError
from robustagg.protocols import LocalRounds
from robustagg.protocols.local import sample_clients
from robustagg.training import ByzantineBehaviour, Shard, Trainer
from state_equal import assert_state_equal

CONF = Path(__file__).resolve().parents[1] / "conf"
W0 = 0.5
XS, YS = [1.0, 2.0, -1.0], [2.0, 0.5, 1.0]  # client i holds the one example (XS[i], YS[i])


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=["logger=none", "trainer.progress=false", "protocol=local",
                                            "trainer.mode=simulated", *overrides])


class Scalar(nn.Module):
    """``w * x`` with one parameter and a buffer that counts forward passes (changed by local training)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([W0]))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.w * x


def mse(out, y):
    return ((out - y) ** 2).mean()


def _grad(w, i):  # d/dw (w x - y)^2
    return 2.0 * XS[i] * (w * XS[i] - YS[i])


def _local(w, i, steps, lr):  # float64 local SGD of client i from w: (delta, mean loss)
    w0, losses = w, []
    for _ in range(steps):
        losses.append((w * XS[i] - YS[i]) ** 2)
        w = w - lr * _grad(w, i)
    return w - w0, sum(losses) / len(losses)


def _scalar_trainer(proto, rule=None, measure_bias=False, byzantine=None, n=3):
    model = Scalar()
    shards = {i: Shard(torch.tensor([XS[i % 3]]), torch.tensor([YS[i % 3]])) for i in range(n)}
    server = proto.server_optimizer_for(model.parameters())
    return Trainer(model, server, GatherReduction(rule or ra.Mean(), LocalComm(n)), shards, batch_size=1, num_classes=1,
                   loss_fn=mse, protocol=proto, measure_bias=measure_bias, byzantine=byzantine, metrics=False)


def _mlp_trainer(proto, *, n=4, seed=3, measure_bias=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), nn.Dropout(0.5), nn.Linear(4, 3))  # dropout: the RNG streams matter
    g = torch.Generator().manual_seed(1)
    shards = {i: Shard(torch.randn(5, 2, generator=g), torch.randint(0, 3, (5,), generator=g)) for i in range(n)}
    return Trainer(model, proto.server_optimizer_for(model.parameters()), GatherReduction(ra.Mean(), LocalComm(n)),
                   shards, batch_size=2, num_classes=3, seed=seed, protocol=proto, measure_bias=measure_bias,
                   metrics=False)


def _sgd(lr=0.1, **kw):
    return partial(torch.optim.SGD, lr=lr, **kw)


def test_sampling_is_seeded_uniform_without_replacement():
    n, k, rounds = 10, 3, 3000
    draws = [sample_clients(n, k, seed=4, round_id=t) for t in range(rounds)]
    assert all(len(set(d)) == k and list(d) == sorted(d) and all(0 <= i < n for i in d) for d in draws)
    assert draws[17] == sample_clients(n, k, seed=4, round_id=17) != sample_clients(n, k, seed=5, round_id=17)
    counts = [sum(i in d for d in draws) for i in range(n)]
    mean, sd = rounds * k / n, math.sqrt(rounds * (k / n) * (1 - k / n))  # each client: Binomial(rounds, k/n)
    assert all(abs(c - mean) < 5 * sd for c in counts), counts
    assert sample_clients(n, n, seed=0, round_id=0) == tuple(range(n))
    with pytest.raises(ConfigError, match="protocol.clients_per_round"):
        sample_clients(3, 4, seed=0, round_id=0)


def test_a_round_is_fedavg_by_hand_from_the_rounds_model_with_buffers_restored():
    # every client trains 2 SGD steps from w0 (not from the previous client's result); the
    # server's SGD(lr=1) on -mean(delta) gives w0 + mean(delta) (McMahan et al. 2017)
    proto = LocalRounds(sampling="all", local_steps=2, client_optimizer=_sgd(0.1))
    tr = _scalar_trainer(proto)
    out = tr.step()
    hand = [_local(W0, i, 2, 0.1) for i in range(3)]
    assert float(tr.model.w.detach()) == pytest.approx(W0 + sum(d for d, _ in hand) / 3, rel=1e-6)
    assert out.losses == pytest.approx([loss for _, loss in hand], rel=1e-6)
    assert [float(v) for v in out.reduced.matrix[:, 0]] == pytest.approx([d for d, _ in hand], rel=1e-6)
    assert float(tr.model.calls) == 0.0  # buffers are restored to the round's state, not aggregated
    assert out.plan.info == {"round/participants": 3, "round/byzantine": 0, "round/over_f": 0}


def test_the_server_optimizer_steps_with_minus_the_aggregate_fedadam():
    # Adam's first step is -lr * g / (|g| + eps): with g = -delta the model moves by +lr * sign(delta)
    # (Reddi et al., ICLR 2021, FedAdam); the two clients' mean delta is +0.05 here
    proto = LocalRounds(sampling="all", local_steps=1, client_optimizer=_sgd(0.1),
                        server_optimizer=partial(torch.optim.Adam, lr=0.01))
    tr = _scalar_trainer(proto, n=2)
    assert (_local(W0, 0, 1, 0.1)[0] + _local(W0, 1, 1, 0.1)[0]) / 2 == pytest.approx(0.05)
    tr.step()
    assert float(tr.model.w.detach()) == pytest.approx(W0 + 0.01, abs=1e-6)
    assert isinstance(tr.optimizer, torch.optim.Adam) and tr.optimizer.state[tr.params[0]]["step"] == 1


def test_the_bias_reference_is_the_mean_delta_of_every_honest_client_by_hand():
    proto = LocalRounds(clients_per_round=1, local_steps=1, client_optimizer=_sgd(0.1))
    tr = _scalar_trainer(proto, measure_bias=True)
    out = tr.step()
    (s,) = out.plan.members
    ref = sum(_local(W0, i, 1, 0.1)[0] for i in range(3)) / 3
    agg = _local(W0, s, 1, 0.1)[0]
    assert out.bias["agg/bias_vs_sync"] == pytest.approx(abs(agg - ref), rel=1e-5)
    assert out.bias["agg/bias_vs_sync_rel"] == pytest.approx(abs(agg - ref) / abs(ref), rel=1e-5)
    assert float(tr.model.w.detach()) == pytest.approx(W0 + agg, rel=1e-6)


def test_measuring_the_bias_consumes_no_data_position_rng_or_client_state():
    # 4 clients, 2 per round, dropout, local momentum kept: the reference trains the unsampled
    # clients too, and must put their batches, RNG streams and optimizer state back
    def run(measure):
        proto = LocalRounds(clients_per_round=2, local_steps=2, client_state="keep",
                            client_optimizer=_sgd(0.1, momentum=0.9))
        tr = _mlp_trainer(proto, measure_bias=measure)
        biases = [tr.step().bias for _ in range(4)]
        return tr.state_dict(), biases  # now: local.rng is the process's RNG, shared by both runs

    a, ba = run(True)
    b, bb = run(False)
    assert all(x is not None and x["agg/bias_vs_sync"] > 0 for x in ba) and bb == [None] * 4
    assert_state_equal(a, b)  # the process RNG (local.rng) included


def test_omniscient_attacks_see_only_the_sampled_honest_deltas_and_rounds_count_byzantine_members():
    seen = []

    def spy(honest, b, own, generator):
        seen.append(honest.clone())
        return torch.zeros(b, honest.shape[1], dtype=honest.dtype)

    n, byz_ranks = 6, (4, 5)
    proto = LocalRounds(clients_per_round=3, local_steps=1, client_optimizer=_sgd(0.1))
    byz = ByzantineBehaviour(ranks=byz_ranks, gradient_fn=spy, name="spy")
    tr = _scalar_trainer(proto, rule=ra.CoordinateWiseTrimmedMean(f=1), byzantine=byz, n=n)
    counts = []
    for t in range(10):
        before = len(seen)
        out = tr.step()
        members = sample_clients(n, 3, seed=0, round_id=t)
        assert out.plan.members == members
        sampled_byz = [r for r in members if r in byz_ranks]
        honest = [r for r in members if r not in byz_ranks]
        counts.append(len(sampled_byz))
        assert out.plan.info == {"round/participants": 3, "round/byzantine": len(sampled_byz),
                                 "round/over_f": int(len(sampled_byz) > 1)}
        if not sampled_byz:
            assert len(seen) == before  # no Byzantine member: no attack this round
            continue
        rows = seen[-1]
        assert rows.shape == (len(honest), 1)
        assert torch.equal(rows, out.reduced.matrix[[out.reduced.row_of(r) for r in honest]])
    assert len(set(counts)) > 1, counts  # the number of Byzantine members varied over the rounds


def test_local_epochs_set_the_number_of_local_steps():
    # shard of 5, batch 2: E=1 -> ceil(5/2) = 3 steps (batches 0-1, 2-3, then a new epoch), E=0.5 -> 2
    for epochs, state in ((1.0, {"epoch": 1, "position": 2}), (0.5, {"epoch": 0, "position": 4})):
        proto = LocalRounds(sampling="all", local_epochs=epochs, client_optimizer=_sgd())
        tr = _mlp_trainer(proto, n=2)
        tr.step()
        assert [tr.samplers[r].state_dict() for r in range(2)] == [state, state]


def test_client_state_keep_persists_local_momentum_and_a_restored_trainer_continues_bit_for_bit():
    def make(state):
        return _mlp_trainer(LocalRounds(clients_per_round=2, local_steps=2, client_state=state,
                                        client_optimizer=_sgd(0.1, momentum=0.9)))

    full = make("keep")
    for _ in range(5):
        full.step()
    reset = make("reset")
    for _ in range(5):
        reset.step()
    assert not torch.equal(full.params[0], reset.params[0])  # the kept momentum changed the trajectory
    sampled = {r for t in range(5) for r in sample_clients(4, 2, seed=3, round_id=t)}
    for r in range(4):
        ws = full.protocol.worker_state(r)
        assert (r in sampled) == bool(ws), r
        if ws:
            assert all("momentum_buffer" in v for v in ws["optimizer"]["state"].values())
    assert all(reset.protocol.worker_state(r) == {} for r in range(4))

    first = make("keep")
    for _ in range(2):
        first.step()
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = make("keep")
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    for _ in range(3):
        resumed.step()
    assert_state_equal(resumed.state_dict(), full.state_dict())


def test_worker_momentum_is_refused_with_local_rounds():
    with pytest.raises(ConfigError, match="trainer.worker_momentum"):
        model = Scalar()
        Trainer(model, torch.optim.SGD(model.parameters(), lr=1.0), GatherReduction(ra.Mean(), LocalComm(2)),
                {i: Shard(torch.ones(1), torch.ones(1)) for i in range(2)}, batch_size=1, num_classes=1,
                worker_momentum=0.9, protocol=LocalRounds(clients_per_round=1, client_optimizer=_sgd()))
    with pytest.raises(ConfigError, match="trainer.worker_momentum"):
        validate(_cfg("threat.n=6", "threat.f=1", "trainer.worker_momentum=0.9", "protocol.clients_per_round=3"))


@pytest.mark.parametrize("override, match", [
    ("protocol.clients_per_round=7", "protocol.clients_per_round=7 exceeds"),
    ("protocol.sampling=some", "protocol.sampling"),
    ("protocol.local_steps=0", "protocol.local_steps"),
    ("protocol.client_state=forever", "protocol.client_state"),
    ("protocol.server_optimizer.lr=-1", "protocol.server_optimizer"),
    ("trainer.reduction=sharded", "trainer.reduction=gather"),
])
def test_bad_protocol_settings_fail_before_launch_naming_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        validate(_cfg("threat.n=6", "threat.f=1", "protocol.clients_per_round=3", override))


def test_the_rules_requirement_is_checked_at_k_rows_before_launch():
    # CWTM needs n >= 2f + 1: f = 3 holds at n = 20 clients but not at k = 6 sampled rows
    common = ["threat.n=20", "threat.f=4", "aggregator=trimmed_mean", "aggregator.f=3",
              "protocol.clients_per_round=6"]
    with pytest.raises(AssumptionError, match="6 rows per update"):
        validate(_cfg(*common))
    plan = validate(_cfg(*common, "strict=false"))
    assert plan.assumption_violated and any(v.startswith("protocol=local, 6 rows") for v in plan.violations)
    ok = validate(_cfg(*common[:-1], "protocol.clients_per_round=7"))
    assert not ok.assumption_violated and ok.violations == []


def test_a_one_row_gather_of_an_odd_length_row_unframes():
    # k = 1 sampled client: the gathered (1, 4 + 8) frame's checksum bytes start at offset 4, which
    # a view as int64 refuses unless they are copied first (found by the k = 1 bias test)
    from robustagg.distributed.reduction import frame, unframe

    x = torch.tensor([1.5])
    rows, sums = unframe(frame(x).unsqueeze(0), torch.float32)
    assert torch.equal(rows, x.unsqueeze(0)) and sums == [ra.integrity.checksum(x)]


def test_the_apps_give_the_trainer_the_server_optimizer_and_the_clients_the_optimizer_group(tmp_path):
    # FedAdam by override; the cosine schedule steps the server optimizer once per round (from its
    # lr 0.5, not the clients' 0.1); the clients' SGD with momentum is kept per client
    import json

    from experiments.train import train
    from robustagg.checkpoint import load_state

    rounds = 4
    s = train(_cfg("threat.n=6", "threat.f=1", "aggregator=trimmed_mean", "attack=none",
                   "protocol.clients_per_round=3", "protocol.local_steps=2", "protocol.client_state=keep",
                   "protocol.server_optimizer._target_=torch.optim.Adam", "protocol.server_optimizer.lr=0.5",
                   "optimizer.lr=0.1", "optimizer.momentum=0.9", "scheduler=cosine", f"trainer.steps={rounds}",
                   "trainer.eval_every=0", "trainer.checkpoint.every=2"), out_dir=tmp_path, quiet=True)
    lrs = [json.loads(line)["train/lr"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
           if json.loads(line)["kind"] == "train"]
    assert lrs == pytest.approx([0.5 * (1 + math.cos(math.pi * t / rounds)) / 2 for t in range(1, rounds + 1)])
    ck = tmp_path / "checkpoints" / f"step-{rounds:08d}"
    server = load_state(ck / "replicated.pt")["optimizer"]
    assert all(int(v["step"]) == rounds and "exp_avg_sq" in v for v in server["state"].values())
    clients = [w["protocol"] for w in load_state(ck / "rank-0.pt")["workers"].values() if w["protocol"]]
    assert clients and all("momentum_buffer" in v for c in clients for v in c["optimizer"]["state"].values())
    assert all(c["optimizer"]["param_groups"][0]["lr"] == 0.1 for c in clients)  # no schedule on the clients
    assert s["protocol"] == "local" and s["client_state"] == "keep"

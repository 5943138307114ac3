"""The trainer end to end in one pytest process: smoke runs of every rule and attack (simulated), a real
4-process gloo run, simulated == multi-process bit for bit, a worker failing mid-run, state round trip.
"""

from __future__ import annotations

import io
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

import attacks
import robustagg as ra
from experiments.train import train
from experiments.wiring import AttackAdapter, rule_names
from robustagg.distributed import LocalComm, WorkerFailedError, make_reduction
from robustagg.training import ByzantineBehaviour, Shard, Trainer

CONF = Path(__file__).resolve().parents[1] / "conf"
QUIET = ["logger=none", "trainer.progress=false"]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*QUIET, *overrides])


def _records(run: Path):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


class RaiseAt:
    """Test callback (instantiated from the config in every worker): rank ``rank`` raises after ``step`` steps."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def __call__(self, trainer, out) -> None:
        if trainer.comm.rank == self.rank and out.step + 1 == self.step:
            raise RuntimeError(f"injected failure at step {self.step}")


SMALL = ["threat.n=7", "threat.f=1", "trainer.steps=2", "trainer.eval_every=0", "trainer.batch_size=8",
         "trainer.mode=simulated", "trainer.param_check_every=0"]


#: Extra overrides a rule needs: FLTrust's trusted update comes from the server's root data.
NEEDS = {"fltrust": ["server.root_samples=32"]}


@pytest.mark.parametrize("rule", rule_names())
def test_smoke_every_rule_simulated(rule, tmp_path):
    s = train(_cfg(*SMALL, f"aggregator={rule}", "attack=sign_flip", *NEEDS.get(rule, [])), out_dir=tmp_path,
              quiet=True)
    assert s["steps"] == 2 and s["rule"] == rule and 0.0 <= s["final_test_acc"] <= 1.0
    recs = _records(tmp_path)
    assert [r["kind"] for r in recs] == ["train", "train", "test"]
    assert math.isfinite(recs[0]["agg/kappa_hat"]) and "agg/honest_weight/0" in recs[0]
    assert "agg/byz_accepted" in recs[0] and "agg/honest_weight/6" not in recs[0]  # rank 6 is Byzantine


def test_fltrust_run_without_root_data_is_refused(tmp_path):
    # FLTrust(root="given") must never run without the server's update: refused before launch,
    # naming the option; and root data for a rule that cannot use it is refused too.
    with pytest.raises(ra.ConfigError, match=r"^FLTrust needs the server's update on a clean root data set: set "
                                             r"server\.root_samples=K"):
        train(_cfg(*SMALL, "aggregator=fltrust", "attack=sign_flip"), out_dir=tmp_path, quiet=True)
    with pytest.raises(ra.ConfigError, match=r"^server\.root_samples=8 but Krum takes no trusted update"):
        train(_cfg(*SMALL, "aggregator=krum", "server.root_samples=8"), out_dir=tmp_path / "k", quiet=True)
    with pytest.raises(ra.ConfigError, match=r"^server\.root_samples must be >= 0; got -1\.$"):
        train(_cfg(*SMALL, "aggregator=fltrust", "server.root_samples=-1"), out_dir=tmp_path / "m", quiet=True)
    assert not any(tmp_path.rglob("metrics.jsonl"))  # nothing ran


def test_fltrust_is_handed_the_gradient_on_the_root_set(tmp_path, monkeypatch):
    # The trusted update is the plain gradient of the current model on all root examples:
    # recomputed here with autograd from the trainer's model and root set, before every step.
    checked = []
    original = Trainer._trust_root

    def check(self, step):
        loss = torch.nn.functional.cross_entropy(self.model(self.root.x), self.root.y)
        params = [p for p in self.model.parameters() if p.requires_grad]
        want = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])
        original(self, step)
        assert self.root.x.shape[0] == 16
        assert torch.allclose(self.reduction.rule.trusted, want, rtol=0, atol=1e-6)
        checked.append(step)

    monkeypatch.setattr(Trainer, "_trust_root", check)
    s = train(_cfg(*SMALL, "aggregator=fltrust", "attack=sign_flip", "server.root_samples=16"), out_dir=tmp_path,
              quiet=True)
    assert s["steps"] == 2 and checked == [0, 1]


def test_fltrust_three_process_run_agrees_on_the_root_gradient(tmp_path):
    # gather mode: every process computes g0 itself; a rank with another g0 would produce another
    # aggregate, caught by the digest check of the next step's headers and the parameter check.
    s = train(_cfg("threat.n=3", "threat.f=1", "trainer.steps=3", "trainer.eval_every=0", "trainer.batch_size=8",
                   "trainer.param_check_every=1", "aggregator=fltrust", "server.root_samples=16", "attack=sign_flip"),
              out_dir=tmp_path, quiet=True)
    assert s["mode"] == "processes" and s["steps"] == 3


def test_root_set_is_a_seeded_sample_of_the_training_pool():
    from experiments.data import DataBundle

    x = torch.arange(20, dtype=torch.float32).reshape(10, 2)
    bundle = DataBundle(train_x=x, train_y=torch.arange(10), test_x=x[:2], test_y=torch.arange(2), num_classes=10,
                        input_shape=(2,), parts=[np.arange(5), np.arange(5, 10)])
    a, b = bundle.root(4, seed=3), bundle.root(4, seed=3)
    assert torch.equal(a.x, b.x) and len(a) == 4 and len(set(a.y.tolist())) == 4
    assert torch.equal(a.x, x[a.y])  # true labels: row i of the pool has label i here
    assert not torch.equal(bundle.root(4, seed=4).y, a.y)
    with pytest.raises(ra.ConfigError, match=r"server\.root_samples must be in \[1, 10\]"):
        bundle.root(11, seed=0)


@pytest.mark.parametrize("attack", attacks.available())
def test_smoke_every_attack_simulated(attack, tmp_path):
    s = train(_cfg(*SMALL, "aggregator=trimmed_mean", f"attack={attack}"), out_dir=tmp_path, quiet=True)
    assert s["steps"] == 2 and s["attack"] == attack and s["byzantine_ranks"] == [6]
    assert math.isfinite(s["mean_kappa_hat"])


@pytest.mark.parametrize("attack", ["backdoor", "backdoor_dba", "model_replacement"])
def test_backdoor_runs_log_the_attack_success_rate(attack, tmp_path):
    s = train(_cfg(*SMALL, "trainer.eval_every=1", "aggregator=mean", f"attack={attack}"),
              out_dir=tmp_path, quiet=True)
    tests = [r for r in _records(tmp_path) if r["kind"] == "test"]
    assert len(tests) == 3 and all(0.0 <= r["test/asr"] <= 1.0 for r in tests) and s["attack"] == attack  # steps 0, 1, 2


def test_four_process_gloo_run_writes_the_run_files(tmp_path):
    s = train(_cfg("threat.n=4", "threat.f=1", "trainer.steps=4", "trainer.eval_every=2", "trainer.param_check_every=2",
                   "attack=alie"), out_dir=tmp_path, quiet=True)
    assert s["mode"] == "processes" and s["n"] == 4 and s["steps"] == 4 and s["byzantine_ranks"] == [3]
    for key in ("final_test_acc", "best_test_acc", "worst_class_acc", "mean_kappa_hat", "byz_accepted_rate",
                "steps", "wall_seconds", "seconds_per_step"):
        assert key in s
    assert json.loads((tmp_path / "summary.json").read_text())["final_test_acc"] == s["final_test_acc"]
    recs = _records(tmp_path)
    assert [(r["kind"], r["step"]) for r in recs] == [("test", 0), ("train", 1), ("train", 2), ("test", 2),
                                                       ("train", 3), ("train", 4), ("test", 4)]
    test = recs[-1]
    per_class = [test[f"test/acc_per_class/{c}"] for c in range(10)]
    assert test["test/worst_class_acc"] == min(per_class) and s["worst_class_acc"] == min(per_class)
    assert s["best_test_acc"] == max(recs[3]["test/acc"], test["test/acc"])  # the untrained model (step 0) not counted
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(weights) == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]  # model.state_dict() names
    assert (tmp_path / "config_resolved.yaml").exists()


def test_simulated_equals_multiprocess_bit_for_bit(tmp_path):
    # Stateful rule (centered clipping's centre), stateful omniscient attack (mimic), worker and
    # server momentum, a scheduler, dropout (per-worker RNG streams): every piece of state must
    # evolve identically in both modes.
    common = ["threat.n=5", "threat.f=1", "aggregator=centered_clipping", "aggregator.tau=0.5", "attack=mimic",
              "model.dropout=0.3",
              "trainer.steps=6", "trainer.eval_every=3", "trainer.worker_momentum=0.9", "optimizer.momentum=0.5",
              "scheduler=cosine", "data.partition=dirichlet", "data.alpha=0.5",
              # gather: both modes then compute the metrics from the same matrix (sharded runs derive
              # them from all-reduced moments, equal to float64 rounding; their parameters are
              # compared bit for bit in tests/test_sharded.py)
              "trainer.reduction=gather"]
    a = train(_cfg(*common, "trainer.mode=simulated"), out_dir=tmp_path / "sim", quiet=True)
    b = train(_cfg(*common, "trainer.mode=processes"), out_dir=tmp_path / "proc", quiet=True)
    wa, wb = load_file(str(tmp_path / "sim" / "model.safetensors")), load_file(str(tmp_path / "proc" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a["final_test_acc"] == b["final_test_acc"] and a["mean_kappa_hat"] == b["mean_kappa_hat"]
    ra_, rb = _records(tmp_path / "sim"), _records(tmp_path / "proc")
    assert [r.get("agg/kappa_hat") for r in ra_] == [r.get("agg/kappa_hat") for r in rb]
    assert [r.get("train/loss") for r in ra_] == [r.get("train/loss") for r in rb]


def test_one_worker_raising_mid_run_ends_the_group(tmp_path):
    t0 = time.monotonic()
    cb = "trainer.callbacks=[{_target_: test_train.RaiseAt, rank: 2, step: 3}]"
    with pytest.raises(WorkerFailedError, match=r"worker rank 2 failed: RuntimeError: injected failure at step 3"):
        train(_cfg("threat.n=4", "threat.f=1", "trainer.steps=50", "trainer.collective_timeout_s=30", cb),
              out_dir=tmp_path, quiet=True)
    assert time.monotonic() - t0 < 25.0  # ended by the failure, well inside the collective timeout


# --- the library trainer directly --------------------------------------------------------------
def _trainer(byzantine=None, rule=None, n=4, seed=0):
    torch.manual_seed(123)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    red = make_reduction("gather", rule or ra.CoordinateWiseMedian(f=1), LocalComm(n))
    g = torch.Generator().manual_seed(7)
    shards = {r: Shard(torch.randn(10, 3, generator=g), torch.randint(0, 2, (10,), generator=g)) for r in range(n)}
    return Trainer(model, opt, red, shards, batch_size=4, num_classes=2, seed=seed, scheduler=sched,
                   worker_momentum=0.5, byzantine=byzantine)


def test_omniscient_attack_sees_this_steps_honest_submissions():
    seen = {}

    def spy(honest, b, own, gen):
        seen["honest"], seen["own"] = honest.clone(), own.clone()
        return -honest.mean(dim=0, keepdim=True).repeat(b, 1)

    t = _trainer(ByzantineBehaviour(ranks=[3], gradient_fn=spy))
    out = t.step()
    clean = _trainer(None).step()  # the same step with everyone honest
    assert torch.equal(seen["honest"], clean.reduced.matrix[:3]) and torch.equal(seen["own"], clean.reduced.matrix[3:])
    assert torch.equal(out.reduced.matrix[3], -seen["honest"].mean(dim=0))
    assert out.byzantine == (3,) and out.honest_mask().tolist() == [True, True, True, False]
    assert t.comm.seq == 3  # header + shared honest rows + submissions


def test_uninformed_attack_skips_the_exchange_and_poison_hits_only_byzantine_labels():
    calls = []

    def noise(honest, b, own, gen):
        calls.append((bool(honest.abs().sum() == 0), own))
        return torch.randn(b, honest.shape[1], generator=gen)

    t = _trainer(ByzantineBehaviour(ranks=[2, 3], gradient_fn=noise, needs_exchange=False, start_step=1))
    t.step()
    t.step()
    assert calls == [(True, None)] and t.comm.seq == 4  # step 0 honest; step 1: header + submissions only
    poisoned = []

    def poison(y, c):
        poisoned.append(y.clone())
        return (c - 1) - y

    t = _trainer(ByzantineBehaviour(ranks=[1], poison_fn=poison))
    out = t.step()
    assert len(poisoned) == 1 and t.comm.seq == 2 and out.byzantine == (1,)


def test_state_dict_round_trip_continues_bit_for_bit():
    def build():
        rule = ra.Pipeline(pre=[ra.Bucketing(s=2, generator=torch.Generator().manual_seed(3), f=1)],
                           rule=ra.CenteredClipping(tau=0.1, f=1))
        mimic = attacks.get("mimic", warmup=2)
        return _trainer(ByzantineBehaviour(ranks=[5], gradient_fn=AttackAdapter(mimic, rule), seed=11), rule=rule, n=6)

    a = build()
    for _ in range(3):
        a.step()
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    for _ in range(3):
        a.step()
    b = build()
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))  # plain containers only: no pickled code
    for _ in range(3):
        b.step()
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    assert a.step_id == b.step_id == 6 and a.comm.seq == b.comm.seq
    assert torch.equal(a.optimizer.state_dict()["state"][0]["momentum_buffer"],
                       b.optimizer.state_dict()["state"][0]["momentum_buffer"])


def test_dnc_generator_state_resumes_bit_for_bit():
    # DnC draws fresh coordinates every step from its generator; a resumed run must draw the same.
    def build(seed):
        rule = ra.DnC(f=1, sub_dim=5, iterations=2, seed=seed)
        mimic = attacks.get("mimic", warmup=2)
        return _trainer(ByzantineBehaviour(ranks=[5], gradient_fn=AttackAdapter(mimic, rule), seed=11), rule=rule, n=6)

    a = build(3)
    for _ in range(3):
        a.step()
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    for _ in range(3):
        a.step()
    b = build(99)  # another seed: only the checkpointed generator state can make the runs agree
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    for _ in range(3):
        b.step()
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    assert torch.equal(a.reduction.rule.generator.get_state(), b.reduction.rule.generator.get_state())


class _FakeRun:
    def __init__(self):
        self.logged, self.summary, self.finished = [], {}, None

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self, exit_code=0):
        self.finished = exit_code


def test_wandb_logs_on_rank_0_and_is_finished_even_after_a_crash(tmp_path, monkeypatch):
    import wandb

    runs = []

    def fake_init(**kw):
        runs.append(_FakeRun())
        runs[-1].kw = kw
        return runs[-1]

    monkeypatch.setattr(wandb, "init", fake_init)
    monkeypatch.setenv("WANDB_MODE", "offline")
    base = ["threat.n=4", "threat.f=1", "trainer.steps=3", "trainer.eval_every=0", "trainer.mode=simulated"]
    s = train(_cfg(*base, "logger=wandb"), out_dir=tmp_path / "ok", quiet=True)
    run = runs[-1]
    assert run.kw["mode"] == "offline" and run.kw["project"] == "robustagg" and run.finished == 0
    assert [step for step, _ in run.logged] == [1, 2, 3, 3]  # three train records, one test record
    assert run.summary["final_test_acc"] == s["final_test_acc"]
    cb = "trainer.callbacks=[{_target_: test_train.RaiseAt, rank: 0, step: 2}]"
    with pytest.raises(RuntimeError, match="injected failure at step 2"):
        train(_cfg(*base, "logger=wandb", cb), out_dir=tmp_path / "crash", quiet=True)
    assert runs[-1].finished == 1 and not (tmp_path / "crash" / "summary.json").exists()


def test_the_library_never_imports_attacks_or_experiments():
    root = Path(ra.__file__).resolve().parent
    for sub in ("training", "distributed"):
        for path in (root / sub).rglob("*.py"):
            text = path.read_text()
            assert "import attacks" not in text and "from attacks" not in text, path
            assert "import experiments" not in text and "from experiments" not in text, path


@pytest.mark.parametrize("mode", ["gather", "sharded"])
def test_drop_policy_filters_nonfinite_honest_rows_before_the_omniscient_attack_sees_them(mode):
    """Honest worker 1's batch holds a NaN input, so its gradient is NaN. With ``on_nonfinite=drop``
    the attack (which, like ALIE, refuses non-finite input) must see only honest workers 0 and 2."""
    from robustagg._tensor import check_finite

    seen = []

    def alie_like(honest, b, own, gen):
        check_finite(honest, "honest")  # what a statistics-based attack does with a NaN row
        seen.append(honest.clone())
        return (honest.mean(dim=0) - honest.std(dim=0, unbiased=False)).repeat(b, 1)

    def build(policy):
        t = _trainer(ByzantineBehaviour(ranks=[3], gradient_fn=alie_like))
        t.reduction = make_reduction(mode, ra.CoordinateWiseMedian(f=1), t.comm, on_nonfinite=policy)
        t.shards[1].x[:] = float("nan")
        return t

    t = build("drop")
    out = t.step()
    assert out.reduced.dropped == [1] and out.reduced.kept == [0, 2, 3]
    (honest,) = seen
    assert honest.shape[0] == 2 and torch.isfinite(honest).all()
    assert torch.equal(honest, out.reduced.matrix[[0, 2]])  # exactly the kept honest rows, in rank order
    assert torch.equal(out.reduced.matrix[3], honest.mean(dim=0) - honest.std(dim=0, unbiased=False))
    assert t.reduction.faults == [(0, 1)]  # counted once, by the reduction
    # abort: every rank stops with the integrity layer's error, before the attack runs
    seen.clear()
    with pytest.raises(ra.errors.NonFiniteInputError, match=r"^step 1: submissions of rank\(s\) \[1\] hold NaN"):
        build("abort").step()
    assert seen == []


def test_finite_rows_applies_the_policy_to_the_listed_rows_only():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, 2.0], [nan, 0.0], [3.0, inf], [4.0, 5.0]])
    drop = make_reduction("gather", ra.CoordinateWiseMedian(f=1), LocalComm(4), on_nonfinite="drop")
    assert drop.finite_rows(x, [0, 1, 2], step=5) == [0] and drop.finite_rows(x, [0, 3], step=5) == [0, 3]
    assert drop.faults == []  # counted by reduce, not here
    with pytest.raises(ra.errors.IntegrityError, match=r"^step 6: every checked submission \(rank\(s\) \[1, 2\]\)"):
        drop.finite_rows(x, [1, 2], step=5)
    abort = make_reduction("gather", ra.CoordinateWiseMedian(f=1), LocalComm(4))
    assert abort.finite_rows(x, [0, 3], step=5) == [0, 3]
    with pytest.raises(ra.errors.NonFiniteInputError, match=r"^step 6: submissions of rank\(s\) \[1, 2\] hold NaN"):
        abort.finite_rows(x, [0, 1, 2, 3], step=5)

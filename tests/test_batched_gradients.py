"""trainer.batched_gradients: every hosted worker's gradient of an update in one torch.func.vmap call.

What is proved here: the batched gradients are the loop's (float64: to 1e-12; float32: within the
measured tolerance, docs/performance.md), on the same batches, drawn in the same order, with the
same RNG streams afterwards (a data poison that draws from the global stream sees the same numbers);
uneven batches are grouped; a model, protocol or precision that cannot be batched is refused with
the key and the fix, before launch in the app; simulated and processes mode agree with the flag on;
an old checkpoint (no such key) resumes as ``false``. ``auto`` (the default) is decided before
launch by the library's ``resolve_batched`` wherever a run is built (the app, a hand-built Job, a
Trainer): on exactly when every check of ``true`` passes, else off with the reason; the resolved
value, never ``auto``, is what the fingerprint, the summary and ``config_resolved.yaml`` record; a
resume keeps a loop checkpoint's ``false``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

import robustagg as ra
from experiments.train import train
from experiments.wiring import validate
from robustagg.distributed import LocalComm, make_reduction
from robustagg.errors import ConfigError
from robustagg.models import MLP, LeNet5, SmallCNN
from robustagg.protocols import AsyncSGD, LocalRounds
from robustagg.training import ByzantineBehaviour, IterableSource, Shard, Trainer
from robustagg.launch import RunSettings, launch
from robustagg.launch.identity import recorded_value
from robustagg.training.batched import (BatchedGradients, batchable_problems, check_batchable, parse_batched,
                                        resolve_batched)

CONF = Path(__file__).resolve().parents[1] / "conf"
KEY = "trainer.batched_gradients"


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=["logger=none", "trainer.progress=false", *overrides])


def _shards(n, shape, sizes=None, dtype=torch.float32, seed=9):
    g = torch.Generator().manual_seed(seed)
    sizes = sizes or [40] * n
    return {r: Shard(torch.randn(sizes[r], *shape, generator=g).to(dtype),
                     torch.randint(0, 10, (sizes[r],), generator=g)) for r in range(n)}


def _trainer(model_fn, batched, *, n=4, shape=(64,), dtype=torch.float32, sizes=None, batch_size=8, **kw):
    torch.manual_seed(3)
    model = model_fn().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    red = make_reduction("gather", ra.Mean(), LocalComm(n))
    return Trainer(model, opt, red, _shards(n, shape, sizes, dtype), batch_size=batch_size, num_classes=10, seed=1,
                   batched_gradients=batched, **kw)


def _loop_rows(trainer, batches):
    """The reference: each batch's gradient by the trainer's own backward pass, one at a time."""
    return torch.stack([trainer._gradient(b)[0] for b in batches])


def _mlp():
    return MLP(64, [32], 10)


def _cnn():
    return SmallCNN((1, 8, 8), [4, 8], 10)


@pytest.mark.parametrize("model_fn,shape", [(_mlp, (64,)), (_cnn, (1, 8, 8))], ids=["mlp", "cnn"])
def test_float64_batched_gradients_equal_the_loop_to_1e_12(model_fn, shape):
    t = _trainer(model_fn, False, shape=shape, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, *shape, generator=g, dtype=torch.float64), torch.randint(0, 10, (8,), generator=g))
               for _ in range(5)]
    rows, losses = BatchedGradients(t.model).gradients(batches)
    ref = _loop_rows(t, batches)
    assert rows.dtype == torch.float64 and rows.shape == (5, t.num_parameters())
    assert float(ref.abs().max()) > 1e-3  # a real gradient, not zeros
    torch.testing.assert_close(rows, ref, rtol=0, atol=1e-12)
    with torch.no_grad():
        ref_loss = [float(torch.nn.functional.cross_entropy(t.model(x), y)) for x, y in batches]
    torch.testing.assert_close(losses, torch.tensor(ref_loss, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("model_fn,shape", [(_mlp, (64,)), (_cnn, (1, 8, 8)), (lambda: LeNet5((1, 28, 28), 10),
                                                                               (1, 28, 28))],
                         ids=["mlp", "cnn", "lenet5"])
def test_float32_batched_gradients_match_the_loop_within_the_measured_tolerance(model_fn, shape):
    # measured (docs/performance.md): at most 2.3e-7 of the largest coordinate (a few float32 ulps)
    t = _trainer(model_fn, False, shape=shape)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, *shape, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(6)]
    rows, _ = BatchedGradients(t.model).gradients(batches)
    ref = _loop_rows(t, batches)
    scale = float(ref.abs().max())
    assert float((rows - ref).abs().max()) <= 1e-6 * scale
    # the rows are the workers' own: each differs from the others by far more than the tolerance
    assert float((ref[0] - ref[1]).abs().max()) > 1e-2 * scale


def test_a_trainer_with_the_flag_takes_the_loops_batches_and_leaves_the_rng_streams_where_the_loop_does():
    # a batch poison that draws from the process-global torch stream: the loop leaves that stream at
    # the previous worker's own stream, so the batched path must swap the streams in the same order
    def noisy(x, y, num_classes, index):
        return x + torch.randn(x.shape), (y + 1) % num_classes

    byz = ByzantineBehaviour(ranks=[1, 2], batch_poison_fn=noisy)
    runs = []
    for batched in (False, True):
        t = _trainer(_mlp, batched, dtype=torch.float64, byzantine=byz)
        torch.manual_seed(11)
        mats = [t.step().reduced.matrix.clone() for _ in range(4)]
        runs.append((t, mats, torch.get_rng_state()))
    (a, ma, ga), (b, mb, gb) = runs
    for x, y in zip(ma, mb):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
    sa, sb = a.state_dict()["local"], b.state_dict()["local"]
    for w in range(4):
        assert sa["workers"][w]["sampler"] == sb["workers"][w]["sampler"]
        assert torch.equal(sa["workers"][w]["rng"], sb["workers"][w]["rng"])
    assert torch.equal(ga, gb)
    assert b._prefetched == {}  # nothing computed ahead outlives the step


def test_a_checkpoint_taken_with_the_flag_continues_without_it_on_the_same_batches():
    a = _trainer(_mlp, True, dtype=torch.float64)
    for _ in range(3):
        a.step()
    b = _trainer(_mlp, False, dtype=torch.float64)
    b.load_state_dict(a.state_dict())
    c = _trainer(_mlp, True, dtype=torch.float64)
    c.load_state_dict(a.state_dict())
    torch.testing.assert_close(b.step().reduced.matrix, c.step().reduced.matrix, rtol=0, atol=1e-12)


def test_uneven_batches_are_batched_by_shape_and_match_the_loop():
    # worker 0's shard (5 examples) is smaller than the batch (8): its batch has 5 rows; worker 3 reads
    # an IterableSource whose epoch ends on a 3-row batch
    def make(batched):
        t = _trainer(_mlp, batched, dtype=torch.float64, sizes=[5, 40, 40, 40])
        g = torch.Generator().manual_seed(4)
        x, y = torch.randn(11, 64, generator=g, dtype=torch.float64), torch.randint(0, 10, (11,), generator=g)
        t.shards[3] = IterableSource(iterable=[(x[:8], y[:8]), (x[8:], y[8:])])
        t.samplers[3] = t.shards[3]
        return t

    a, b = make(False), make(True)
    for _ in range(3):
        torch.testing.assert_close(a.step().reduced.matrix, b.step().reduced.matrix, rtol=0, atol=1e-12)


def test_async_with_the_flag_computes_the_loops_rows():
    runs = []
    for batched in (False, True):
        t = _trainer(_mlp, batched, dtype=torch.float64, protocol=AsyncSGD(max_staleness=2))
        runs.append([t.step().reduced.matrix.clone() for _ in range(4)])
    for x, y in zip(*runs):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)


def test_models_protocols_and_precisions_that_cannot_be_batched_are_refused_with_the_key_and_the_fix():
    bn = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2), torch.nn.Flatten(),
                             torch.nn.Linear(72, 10))
    with pytest.raises(ConfigError, match=r"(?s)trainer.batched_gradients=true.*1 \(BatchNorm2d\): BatchNorm in train "
                                          r"mode.*Fix: use trainer.batched_gradients=false"):
        _trainer(lambda: bn, True, shape=(1, 8, 8))
    with pytest.raises(ConfigError, match=r"(?s)net.2 \(Dropout\): dropout \(p=0.3\).*batched_gradients=false"):
        _trainer(lambda: MLP(64, [32], 10, dropout=0.3), True)
    assert batchable_problems(MLP(64, [32], 10, dropout=0.0)) == []
    with pytest.raises(ConfigError, match=r"protocol=local does not submit one plain gradient"):
        check_batchable(_mlp(), protocol=LocalRounds(local_steps=2))
    with pytest.raises(ConfigError, match=r"trainer.precision=bf16.*use trainer.precision=32"):
        _trainer(_mlp, True, precision="bf16")

    class Branchy(torch.nn.Module):  # data-dependent control flow: only the dry run sees it
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 10)

        def forward(self, x):
            return self.lin(x) if float(x.sum()) > 0 else -self.lin(x)

    x, y = torch.randn(2, 64), torch.tensor([0, 1])
    with pytest.raises(ConfigError, match=r"(?s)a dry run of torch.func.vmap over the model failed.*"
                                          r"batched_gradients=false"):
        check_batchable(Branchy(), example=(x, y))


def test_the_app_refuses_an_unbatchable_run_before_launch_and_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"(?s)trainer.batched_gradients=true.*dropout.*model.dropout=0"):
        validate(_cfg("model.dropout=0.3", f"{KEY}=true"), out_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"protocol=redundant does not submit"):
        validate(_cfg("protocol=redundant", "threat.n=6", "threat.f=1", "aggregator=mean", "attack=none",
                      f"{KEY}=true"), out_dir=str(tmp_path))
    plan = validate(_cfg(f"{KEY}=true"), out_dir=str(tmp_path))
    assert plan.job().settings.batched_gradients is True and plan.fingerprint[KEY] is True


def test_an_old_checkpoint_without_the_key_resumes_as_false_and_is_refused_as_true():
    from robustagg.launch.identity import diff_fingerprints

    old = {"seed": 0, "trainer.batch_size": 32}
    assert diff_fingerprints(old, {**old, KEY: False}) == {}
    assert diff_fingerprints(old, {**old, KEY: True}) == {KEY: (False, True)}


@pytest.mark.slow
def test_simulated_and_processes_hosting_several_workers_agree_with_the_flag_on(tmp_path):
    # 5 workers on 2 processes (blocks 3 + 2: each batches its own block), an omniscient attack
    common = ["threat.n=5", "threat.f=1", "aggregator=trimmed_mean", "attack=alie", "trainer.steps=4",
              "trainer.eval_every=0", "trainer.param_check_every=2", f"{KEY}=true", "trainer.collective_timeout_s=300"]
    train(_cfg(*common, "trainer.mode=simulated"), out_dir=tmp_path / "sim", quiet=True)
    train(_cfg(*common, "trainer.mode=processes", "trainer.processes=2"), out_dir=tmp_path / "proc", quiet=True)
    train(_cfg(*common[:-2], "trainer.mode=simulated", "trainer.collective_timeout_s=300"), out_dir=tmp_path / "loop",
          quiet=True)
    sim, proc, loop = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("sim", "proc", "loop"))
    for k in sim:  # vmap over 5 or over 3 and 2 rows: equal up to float32 rounding (bit for bit on the MLP here)
        torch.testing.assert_close(sim[k], proc[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sim[k], loop[k], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# auto (the default): decided before launch, wherever the run is built


FAST = ("trainer.mode=simulated", "trainer.steps=2", "trainer.eval_every=0", "trainer.param_check_every=0")


def test_auto_is_the_default_and_batches_dsgd_with_an_mlp(tmp_path):
    plan = validate(_cfg(), out_dir=str(tmp_path))
    assert plan.cfg["trainer"]["batched_gradients"] is True and plan.fingerprint[KEY] is True
    assert plan.job().settings.batched_gradients is True
    assert plan.batched_gradients == "on (auto: dsgd, MLP without BatchNorm/dropout)"
    assert plan.job().meta["batched_gradients_reason"] == plan.batched_gradients
    plan = validate(_cfg(f"{KEY}=false"), out_dir=str(tmp_path))
    assert plan.fingerprint[KEY] is False and plan.batched_gradients == f"off (set: {KEY}=false)"


@pytest.mark.parametrize("overrides,why", [
    (("protocol=local",), "protocol=local runs sequential local steps"),
    (("model.dropout=0.3",), "the model has dropout at net.2 (Dropout)"),
    (("trainer.precision=bf16",), "trainer.precision=bf16 (autocast is not batched)"),
], ids=["local", "dropout", "bf16"])
def test_auto_keeps_the_loop_where_batching_is_not_valid_and_says_why(tmp_path, overrides, why):
    plan = validate(_cfg(*overrides), out_dir=str(tmp_path))
    assert plan.cfg["trainer"]["batched_gradients"] is False and plan.fingerprint[KEY] is False
    assert plan.job().settings.batched_gradients is False
    assert plan.batched_gradients == f"off (auto: {why})"


def test_auto_in_the_library_takes_the_same_checks_as_true():
    bn = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2), torch.nn.Flatten(),
                             torch.nn.Linear(72, 10))
    img = (torch.randn(2, 1, 8, 8), torch.tensor([0, 1]))
    d = resolve_batched("auto", bn, example=img)
    assert not d.on and d.describe() == "off (auto: the model has BatchNorm at 1 (BatchNorm2d))"
    x = (torch.randn(2, 64), torch.tensor([0, 1]))
    d = resolve_batched("auto", _mlp(), precision="fp16", example=x)
    assert not d.on and "trainer.precision=fp16" in d.reason
    assert not resolve_batched("auto", _mlp(), protocol=LocalRounds(local_steps=2), example=x).on
    assert resolve_batched("auto", _mlp(), example=x).on
    assert not resolve_batched("auto", _mlp()).on  # no example: no dry run, so not on
    assert not resolve_batched("auto", _mlp(), example=x, recorded=False).on  # a loop checkpoint keeps the loop
    assert resolve_batched("auto", _mlp(), example=x, recorded=True).on

    class Branchy(torch.nn.Module):  # only the dry run sees the data-dependent control flow
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 10)

        def forward(self, x):
            return self.lin(x) if float(x.sum()) > 0 else -self.lin(x)

    d = resolve_batched("auto", Branchy(), example=x)
    assert not d.on and d.reason.startswith("a dry run of torch.func.vmap over the model failed")
    # a hand-built Trainer with "auto" decides as the app does
    t = _trainer(_mlp, "auto")
    assert t.batched is not None and t.batched_decision.describe() == "on (auto: dsgd, MLP without BatchNorm/dropout)"
    t = _trainer(lambda: MLP(64, [32], 10, dropout=0.3), "auto")
    assert t.batched is None and t.batched_decision.reason == "the model has dropout at net.2 (Dropout)"
    assert _trainer(_mlp, "auto", precision="bf16").batched is None
    assert _trainer(_mlp, False).batched is None  # the Trainer's own default stays the loop


def test_auto_keeps_the_loop_where_the_batched_gradients_are_not_the_loops_bits(monkeypatch):
    """auto's last check: a probe must give the loop's gradients bit for bit (simulated = processes); one ulp
    of difference in one coordinate keeps the loop, with the reason; the probe leaves no .grad behind."""
    from robustagg.training import batched

    x = (torch.randn(2, 64, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1]))
    model = _mlp()
    exact = batched.BatchedGradients.gradients
    rows, _ = exact(batched.BatchedGradients(model), [x, x])
    if not batched.matches_loop(model, x):  # the premise of the digits-shaped MLP on this build (docs)
        pytest.skip("this build's BLAS batches the 64-input MLP in another order")
    assert all(p.grad is None for p in model.parameters())

    def one_ulp_off(self, batches):
        g, losses = exact(self, batches)
        g = g.clone()
        g[-1, 3] = torch.nextafter(g[-1, 3], torch.tensor(float("inf")))
        return g, losses

    monkeypatch.setattr(batched.BatchedGradients, "gradients", one_ulp_off)
    assert not batched.matches_loop(model, x)
    d = resolve_batched("auto", model, example=x)
    assert not d.on and d.reason.startswith("the batched gradients differ from the per-worker loop's in their last bits")
    assert resolve_batched(True, model, example=x).on  # true batches anyway, within the stated bound


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 7, 32])
def test_auto_keeps_simulated_and_processes_bit_identical_at_the_runs_own_batch_size(tmp_path, batch):
    """The probe is made at the run's batch sizes and vmap widths (a review found the digits MLP batched at 1
    and 7 rows in another order than the loop while a fixed 32-row probe passed): whatever auto decides in
    each mode, the two modes and the loop train the same bits."""
    common = ("threat.n=10", "threat.f=2", "aggregator=trimmed_mean", "attack=alie", "trainer.steps=3",
              "trainer.eval_every=0", "trainer.param_check_every=0", f"trainer.batch_size={batch}",
              "trainer.collective_timeout_s=300")
    train(_cfg(*common, "trainer.mode=simulated"), out_dir=tmp_path / "sim", quiet=True)
    train(_cfg(*common, "trainer.mode=processes"), out_dir=tmp_path / "proc", quiet=True)
    train(_cfg(*common, "trainer.mode=simulated", f"{KEY}=false"), out_dir=tmp_path / "loop", quiet=True)
    sim, proc, loop = ((tmp_path / d / "model.safetensors").read_bytes() for d in ("sim", "proc", "loop"))
    assert sim == proc == loop


def test_run_shapes_names_every_batch_size_and_vmap_width():
    from robustagg.training.batched import run_shapes

    assert run_shapes(32, [100] * 10, 10) == ([32], [1, 10])
    assert run_shapes(32, [100, 5, 5, 100, 100], 5) == ([5, 32], [1, 2, 3, 5])
    assert run_shapes(32, [100] * 10, 1) == ([32], [1])  # a process hosting one worker
    assert run_shapes(8, [], 3) == ([8], [1, 3])  # no Shard (a BatchSource): the batch size


def test_the_probe_declines_what_it_cannot_probe():
    model = _mlp()
    assert not __import__("robustagg.training.batched", fromlist=["x"]).matches_loop(
        model, (torch.zeros(2, 64, dtype=torch.long), torch.tensor([0, 1])))  # token ids: no noise to add
    assert not resolve_batched("auto", model, example=[torch.zeros(2, 64)]).on  # not an (x, y) pair


def test_a_value_other_than_auto_true_false_is_refused_naming_the_key(tmp_path):
    msg = r"trainer.batched_gradients must be one of auto, true, false; got 'maybe'"
    with pytest.raises(ConfigError, match=msg):
        validate(_cfg(f"{KEY}=maybe"), out_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=msg):
        RunSettings(batched_gradients="maybe", key_names={"batched_gradients": KEY}).check()
    with pytest.raises(ConfigError, match=msg):
        _trainer(_mlp, "maybe")
    assert [parse_batched(v) for v in ("auto", "TRUE", "false", True, False)] == ["auto", True, False, True, False]
    assert RunSettings().batched_gradients == "auto"


@pytest.mark.parametrize("overrides", [(), ("model.dropout=0.3",)], ids=["mlp", "dropout"])
def test_a_hand_built_job_with_auto_is_decided_as_the_app_decides(tmp_path, overrides):
    plan = validate(_cfg(*FAST, *overrides), out_dir=str(tmp_path / "run"))
    job = plan.job()
    job.settings.batched_gradients = "auto"  # what a Job built by hand holds by default
    job.meta.pop("batched_gradients_reason")
    job.fingerprint[KEY] = "auto"
    summary = launch(job, quiet=True)
    assert summary["batched_gradients"] is plan.cfg["trainer"]["batched_gradients"]
    assert summary["batched_gradients_reason"] == plan.batched_gradients
    assert job.fingerprint[KEY] is plan.fingerprint[KEY]  # the decision, never auto


def test_the_resolved_value_is_what_the_summary_fingerprint_and_config_record(tmp_path):
    summary = train(_cfg(*FAST, "trainer.checkpoint.every=1"), out_dir=tmp_path, quiet=True)
    assert summary["batched_gradients"] is True
    assert summary["batched_gradients_reason"] == "on (auto: dsgd, MLP without BatchNorm/dropout)"
    assert json.loads((tmp_path / "summary.json").read_text())["batched_gradients"] is True
    assert "  batched_gradients: true\n" in (tmp_path / "config_resolved.yaml").read_text()
    manifest = json.loads((tmp_path / "checkpoints" / "step-00000002" / "manifest.json").read_text())
    assert manifest["fingerprint"][KEY] is True


def test_auto_resumes_a_loop_checkpoint_with_the_loop_and_an_explicit_change_is_refused(tmp_path):
    run = (*FAST, "trainer.checkpoint.every=1")
    first = train(_cfg(*run, f"{KEY}=false"), out_dir=tmp_path, quiet=True)
    assert first["batched_gradients"] is False
    assert recorded_value(tmp_path / "checkpoints", KEY) is False
    again = train(_cfg(*run, "trainer.steps=3"), out_dir=tmp_path, quiet=True)  # auto, the default
    assert again["resumed_from"] == 2 and again["batched_gradients"] is False
    assert again["batched_gradients_reason"] == "off (auto: resuming a checkpoint written with the per-worker loop)"
    with pytest.raises(ConfigError, match=r"(?s)trainer.batched_gradients.*False.*True"):
        train(_cfg(*run, "trainer.steps=4", f"{KEY}=true"), out_dir=tmp_path, quiet=True)
    # a hand-built Job with auto resumes it with the loop as well
    plan = validate(_cfg(*run, "trainer.steps=4"), out_dir=str(tmp_path))
    job = plan.job()
    job.settings.batched_gradients, job.fingerprint[KEY] = "auto", "auto"
    job.meta.pop("batched_gradients_reason")
    summary = launch(job, quiet=True)
    assert summary["resumed_from"] == 3 and summary["batched_gradients"] is False


def test_an_old_checkpoint_without_the_key_is_recorded_as_the_loop(tmp_path):
    step = tmp_path / "step-00000003"
    step.mkdir()
    (step / "manifest.json").write_text(json.dumps({"step": 3, "fingerprint": {"seed": 0}}))
    assert recorded_value(tmp_path, KEY) is False  # identity.INTRODUCED: the per-worker loop
    assert recorded_value(tmp_path, KEY, resume=str(step)) is False
    assert recorded_value(tmp_path, KEY, resume="never") is None
    assert recorded_value(tmp_path / "missing", KEY) is None
    x = (torch.randn(2, 64), torch.tensor([0, 1]))
    assert not resolve_batched("auto", _mlp(), example=x, recorded=recorded_value(tmp_path, KEY)).on

"""trainer.precision: bf16 autocast on CPU, fp16's per-worker loss scaler (its CPU path), where the
float32 cast and the unscale happen, the state round trip, and the refusal of fp16 on CPU."""

from __future__ import annotations

import io
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
from robustagg.launch import RunSettings
from robustagg.training import Shard, Trainer
from robustagg.training.precision import Precision, parse_precision

CONF = Path(__file__).resolve().parents[1] / "conf"


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=["logger=none", "trainer.progress=false", *overrides])


def _trainer(precision, n=3, dropout=0.3):
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(dropout),
                                torch.nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    red = make_reduction("gather", ra.CoordinateWiseMedian(f=1), LocalComm(n))
    g = torch.Generator().manual_seed(9)
    shards = {r: Shard(torch.randn(24, 6, generator=g), torch.randint(0, 3, (24,), generator=g)) for r in range(n)}
    return Trainer(model, opt, red, shards, batch_size=8, num_classes=3, seed=1, precision=precision)


def test_precision_values_and_the_cpu_refusal_name_the_key_and_the_fix():
    assert parse_precision(32) is Precision.full and parse_precision("bf16") is Precision.bf16
    with pytest.raises(ConfigError, match=r"trainer.precision must be 32, bf16 or fp16; got 'fp8'"):
        parse_precision("fp8")
    with pytest.raises(ConfigError, match=r"trainer.precision=fp16 needs CUDA .* Use trainer.precision=bf16"):
        validate(_cfg("trainer.precision=fp16", "trainer.device=cpu"))
    with pytest.raises(ConfigError, match=r"got 'half'"):
        RunSettings(precision="half").check()
    RunSettings(precision="fp16").check()  # the library accepts fp16 on CPU (slow; for tests)


def test_mixed_precision_submissions_are_unscaled_float32_close_to_the_full_precision_gradient():
    full = _trainer("32", dropout=0.0).worker_gradient(0, 0)[0]
    for precision in ("bf16", "fp16"):
        t = _trainer(precision, dropout=0.0)
        g, _ = t.worker_gradient(0, 0)
        assert g.dtype == torch.float32
        rel = float((g - full).norm() / full.norm())
        # bf16 keeps 8 mantissa bits (relative rounding 2**-9 per value), fp16 11; a scaled
        # (not unscaled) fp16 submission would be 65536 times too large (rel ~ 6.6e4)
        assert 0 < rel < (5e-2 if precision == "bf16" else 5e-3), (precision, rel)
    out = _trainer("fp16", dropout=0.0).step()
    assert out.reduced.matrix.dtype == torch.float32 and bool(torch.isfinite(out.reduced.matrix).all())


def test_fp16_overflow_backs_off_and_recomputes_from_the_same_random_numbers():
    # Initial scale 2**40: 2**40 times a gradient of ~0.1 overflows float16 (max 65504) in the
    # backward pass, so the worker backs off (halving) until its gradient is finite.
    a = _trainer("fp16")
    a.scalers[0].load_state_dict({**a.scalers[0].state_dict(), "scale": 2.0 ** 40})
    g_a, _ = a.worker_gradient(0, 0)
    state = a.scalers[0].state_dict()
    assert bool(torch.isfinite(g_a).all()) and state["scale"] < 2.0 ** 40 and state["_growth_tracker"] == 1
    # a worker that starts at the backed-off scale computes it in one pass: the same bits, and the
    # same RNG stream afterwards (dropout drew its numbers once, not once per attempt)
    b = _trainer("fp16")
    b.scalers[0].load_state_dict({**b.scalers[0].state_dict(), "scale": state["scale"]})
    g_b, _ = b.worker_gradient(0, 0)
    assert torch.equal(g_a, g_b)
    assert torch.equal(a.worker_rng[0], b.worker_rng[0])
    assert b.scalers[0].state_dict() == state


def test_fp16_scaler_state_round_trips_through_the_trainer_state_bit_for_bit():
    a = _trainer("fp16")
    for s in a.scalers.values():  # overflow on the first steps: the scale moves, and differs from a fresh one
        s.load_state_dict({**s.state_dict(), "scale": 2.0 ** 30})
    for _ in range(3):
        a.step()
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    saved = {r: s.state_dict() for r, s in a.scalers.items()}
    assert all(v["scale"] < 2.0 ** 30 and v["_growth_tracker"] == 3 for v in saved.values())
    for _ in range(3):
        a.step()
    b = _trainer("fp16")
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert {r: s.state_dict() for r, s in b.scalers.items()} == saved
    for _ in range(3):
        b.step()
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    assert {r: s.state_dict() for r, s in a.scalers.items()} == {r: s.state_dict() for r, s in b.scalers.items()}
    with pytest.raises(ConfigError, match=r"has a fp16 loss scaler but this trainer runs precision=bf16"):
        buf.seek(0)
        _trainer("bf16").load_state_dict(torch.load(buf, weights_only=True))


def test_bf16_simulated_equals_processes_bit_for_bit_and_differs_from_float32(tmp_path):
    common = ["threat.n=3", "threat.f=1", "aggregator=trimmed_mean", "attack=sign_flip", "model.dropout=0.3",
              "trainer.steps=3", "trainer.eval_every=0", "trainer.param_check_every=0", "trainer.batch_size=8"]
    train(_cfg(*common, "trainer.precision=bf16", "trainer.mode=simulated"), out_dir=tmp_path / "sim", quiet=True)
    train(_cfg(*common, "trainer.precision=bf16", "trainer.mode=processes"), out_dir=tmp_path / "proc", quiet=True)
    train(_cfg(*common, "trainer.precision=32", "trainer.mode=simulated"), out_dir=tmp_path / "f32", quiet=True)
    sim, proc, f32 = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("sim", "proc", "f32"))
    assert all(torch.equal(sim[k], proc[k]) for k in sim)
    assert any(not torch.equal(sim[k], f32[k]) for k in sim)  # autocast was really on

"""robustagg.training.WarmupCosine: hand-computed rates, and a restored schedule continues bit for bit."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from robustagg.errors import ConfigError
from robustagg.training import WarmupCosine, WarmupCosineFactor


def _rates(sched, opt, steps):
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def _opt(lr=1.0):
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)


def test_warmup_then_cosine_by_hand():
    # W = 2, T = 6, base 0.4: warm-up 0.4 * 1/2, 0.4 * 2/2; cosine over L = 4 steps:
    # 0.4 * (1 + cos(pi * k / 4)) / 2 for k = 0..4 -> 0.4, 0.4 * 0.853553.., 0.2, 0.4 * 0.146446.., 0; then 0.
    opt = _opt(0.4)
    got = _rates(WarmupCosine(opt, warmup_steps=2, total_steps=6), opt, 8)
    c = math.cos(math.pi / 4)
    want = [0.2, 0.4, 0.4, 0.4 * (1 + c) / 2, 0.2, 0.4 * (1 - c) / 2, 0.0, 0.0]
    assert got == pytest.approx(want, abs=1e-12)
    assert got[6] == 0.0 and got[7] == 0.0  # exactly zero at and after total_steps


def test_no_warmup_is_torch_cosine_and_a_long_warmup_is_truncated():
    a, b = _opt(), _opt()
    ours = _rates(WarmupCosine(a, warmup_steps=0, total_steps=5), a, 6)
    ref = _rates(torch.optim.lr_scheduler.CosineAnnealingLR(b, T_max=5), b, 6)
    assert ours == pytest.approx(ref, abs=1e-12)
    c = _opt()
    assert _rates(WarmupCosine(c, warmup_steps=10, total_steps=3), c, 3) == pytest.approx([0.1, 0.2, 0.3])


def test_state_dict_restores_the_schedule_exactly_and_pickles():
    a = _opt(0.3)
    sa = WarmupCosine(a, warmup_steps=3, total_steps=11)
    _rates(sa, a, 5)
    state = pickle.loads(pickle.dumps(sa.state_dict()))
    assert state["lr_lambdas"] == [{"warmup_steps": 3, "total_steps": 11}]
    b = _opt(0.3)  # built as a restarted worker builds it, then restored as the trainer restores
    sb = WarmupCosine(b, warmup_steps=0, total_steps=1)  # wrong parameters: the state overrides them
    b.load_state_dict(pickle.loads(pickle.dumps(a.state_dict())))
    sb.load_state_dict(state)
    assert _rates(sb, b, 8) == _rates(sa, a, 8)  # bit for bit, not approximately


def test_negative_lengths_are_refused_with_the_argument_named():
    with pytest.raises(ConfigError, match="warmup_steps"):
        WarmupCosineFactor(-1, 5)
    with pytest.raises(ConfigError, match="total_steps"):
        WarmupCosine(_opt(), warmup_steps=0, total_steps=-2)

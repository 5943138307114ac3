"""MPAF and PoisonedFL: hand cases, the drag and the sign consistency, state round trips, the trainer's parameters hook."""

from __future__ import annotations

import io
import os

import pytest
import torch

import attacks
import robustagg as ra
from robustagg.distributed import LocalComm, make_reduction
from robustagg.errors import ConfigError, NonFiniteInputError, ShapeError
from robustagg.training import ByzantineBehaviour, Shard, Trainer

os.environ.setdefault("WANDB_MODE", "disabled")
torch.set_num_threads(1)

Z = torch.zeros(3, 4, dtype=torch.float64)  # honest rows: only their shape is read


def w(*v):
    return torch.tensor(v, dtype=torch.float64)


# --- MPAF ----------------------------------------------------------------------------------------

def test_mpaf_hand_case_and_base_from_seed():
    a = attacks.MPAF(scale=3.0, base_std=0.5, seed=4)
    params = w(1.0, 2.0, 3.0, 4.0)
    out = a(Z, 2, parameters=params)
    base = 0.5 * torch.randn(4, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    assert torch.equal(out, (3.0 * (params - base)).expand(2, 4))
    assert torch.equal(a.state_dict()["base"], base)
    # the base is drawn once: a second call with other parameters uses the same base
    assert torch.equal(a(Z, 1, parameters=params * 2)[0], 3.0 * (params * 2 - base))
    assert torch.equal(attacks.MPAF(scale=3.0, base_std=0.5, seed=4)(Z, 2, parameters=params), out)
    assert not torch.equal(attacks.MPAF(scale=3.0, base_std=0.5, seed=5)(Z, 2, parameters=params), out)


def test_mpaf_drags_the_mean_aggregate_to_the_base_geometrically():
    # honest gradients 0, one fake client of n = 2: w <- w - lr * (scale / 2) (w - base), so
    # w_t - base = (1 - lr * scale / 2)^t (w_0 - base), here 0.5^t.
    a = attacks.MPAF(scale=2.0, base_std=1.0, seed=0)
    rule = ra.Mean()
    params = w(4.0, -2.0, 1.0, 0.0)
    start = params.clone()
    for _ in range(10):
        b = a(Z[:1], 1, parameters=params)
        params = params - 0.5 * rule(torch.cat([Z[:1], b]))
    base = a.state_dict()["base"]
    assert torch.allclose(params - base, 0.5 ** 10 * (start - base), rtol=1e-12, atol=1e-15)


def test_mpaf_state_round_trip_reset_and_errors():
    a = attacks.MPAF()
    a(Z, 1, parameters=w(1, 2, 3, 4))
    state = a.state_dict()
    b = attacks.MPAF(seed=9)  # another seed: only the loaded state makes it agree
    b.load_state_dict(state)
    assert torch.equal(b(Z, 1, parameters=w(0, 0, 1, 1)), a(Z, 1, parameters=w(0, 0, 1, 1)))
    a.reset()
    assert a.state_dict()["base"] is None
    with pytest.raises(ConfigError, match=r"MPAF reads the current model: pass parameters= \(the \(4,\) flattened"):
        a(Z, 1)
    with pytest.raises(ShapeError, match=r"parameters must be a floating tensor of shape \(d,\) = \(4,\)"):
        a(Z, 1, parameters=w(1, 2))
    with pytest.raises(NonFiniteInputError, match=r"parameters has non-finite"):
        a(Z, 1, parameters=w(1, 2, float("nan"), 4))
    b(Z, 1, parameters=w(1, 2, 3, 4))
    with pytest.raises(ShapeError, match=r"MPAF: the state has d=4 but the model has d=2 parameters; call reset"):
        b(Z[:, :2], 1, parameters=w(1, 2))
    with pytest.raises(ConfigError, match=r"MPAF: cannot load the state of attack 'poisoned_fl'"):
        b.load_state_dict({"attack": "poisoned_fl"})
    with pytest.raises(ConfigError, match=r"MPAF: base_std must be >= 0"):
        attacks.MPAF(base_std=-1.0)
    with pytest.raises(ConfigError, match=r"MPAF: seed must be an integer >= 0"):
        attacks.MPAF(seed=-1)


# --- PoisonedFL ----------------------------------------------------------------------------------

def test_poisoned_fl_sign_is_fixed_and_magnitude_follows_the_last_move():
    a = attacks.PoisonedFL(scale=2.0, lr=0.5, init_magnitude=0.1, period=100, seed=3)
    s = (torch.randint(0, 2, (4,), generator=torch.Generator().manual_seed(3)).double() * 2 - 1)
    w0, w1, w2 = w(0, 0, 0, 0), w(1.0, -1.0, 0.5, 0.0), w(1.0, -3.0, 0.0, 0.25)
    assert torch.equal(a(Z, 2, parameters=w0), (2.0 * 0.1 * s).expand(2, 4))
    assert torch.equal(a(Z, 1, parameters=w1)[0], 2.0 * s * w(2.0, 2.0, 1.0, 0.0))  # |w1 - w0| / 0.5
    assert torch.equal(a(Z, 1, parameters=w2)[0], 2.0 * s * w(0.0, 4.0, 1.0, 0.5))
    assert torch.equal(a.state_dict()["sign"], s) and set(s.tolist()) <= {-1.0, 1.0}


def test_poisoned_fl_scale_decays_only_when_the_model_does_not_follow_minus_s():
    def run(follow: bool) -> attacks.PoisonedFL:
        a = attacks.PoisonedFL(scale=1.0, period=2, decay=0.5, threshold=0.75)
        params = w(0, 0, 0, 0)
        a(Z, 1, parameters=params)  # step 0: draws s, anchors w
        s = a.state_dict()["sign"]
        step = -s if follow else s  # moving along -s: the attack is followed
        for _ in range(4):
            params = params + 0.1 * step
            a(Z, 1, parameters=params)
        return a

    good, bad = run(True), run(False)
    assert good.c == 1.0 and good.last_alignment == 1.0  # adapted at steps 2 and 4, aligned: kept
    assert bad.c == 0.25 and bad.last_alignment == 0.0  # decayed twice: 1 * 0.5 * 0.5


def test_poisoned_fl_state_round_trip_continues_identically():
    g = torch.Generator().manual_seed(0)
    seq = [torch.randn(5, generator=g, dtype=torch.float64) for _ in range(8)]
    z5 = torch.zeros(2, 5, dtype=torch.float64)
    a = attacks.PoisonedFL(period=3)
    for p in seq[:4]:
        a(z5, 1, parameters=p)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = attacks.PoisonedFL(period=3)
    b.load_state_dict(torch.load(buf, weights_only=True))
    for p in seq[4:]:
        assert torch.equal(a(z5, 1, parameters=p), b(z5, 1, parameters=p))
    assert a.state_dict()["c"] == b.state_dict()["c"] and a.step == b.step == 8
    with pytest.raises(ConfigError, match=r"PoisonedFL: malformed state"):
        b.load_state_dict({"attack": "poisoned_fl", "step": -1, "c": 1.0})
    with pytest.raises(ShapeError, match=r"PoisonedFL: the state has d=5 but the model has d=4"):
        b(Z, 1, parameters=w(1, 2, 3, 4))


@pytest.mark.parametrize("ctor, pattern", [
    (lambda: attacks.PoisonedFL(period=0), r"period must be an integer >= 1"),
    (lambda: attacks.PoisonedFL(decay=1.5), r"decay must be in \(0, 1\]"),
    (lambda: attacks.PoisonedFL(threshold=2.0), r"threshold must be in \[0, 1\]"),
    (lambda: attacks.PoisonedFL(lr=0.0), r"lr must be > 0"),
    (lambda: attacks.MPAF(scale=-1.0), r"MPAF: scale must be > 0"),
])
def test_model_aware_constructor_validation(ctor, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ctor()


# --- the trainer's parameters hook ---------------------------------------------------------------

class _Hook:
    """What the wiring's adapter must do for a model-aware attack: forward ``parameters=`` and the state."""

    def __init__(self, attack):
        self.attack = attack

    def __call__(self, honest, f, own, generator, *, parameters=None):
        return self.attack(honest, f, own=own, generator=generator, parameters=parameters)

    def state_dict(self):
        return self.attack.state_dict()

    def load_state_dict(self, state):
        self.attack.load_state_dict(state)


def _trainer(byzantine, n=4):
    torch.manual_seed(123)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    red = make_reduction("gather", ra.CoordinateWiseTrimmedMean(f=1), LocalComm(n))
    g = torch.Generator().manual_seed(7)
    shards = {r: Shard(torch.randn(10, 3, generator=g), torch.randint(0, 2, (10,), generator=g)) for r in range(n)}
    return Trainer(model, opt, red, shards, batch_size=4, num_classes=2, byzantine=byzantine)


def test_trainer_passes_the_current_parameters_only_when_asked():
    seen = []

    def spy(honest, f, own, gen, **kw):
        seen.append(kw)
        return torch.zeros(f, honest.shape[1])

    t = _trainer(ByzantineBehaviour(ranks=[3], gradient_fn=spy, needs_exchange=False, needs_parameters=True))
    before = torch.cat([p.detach().reshape(-1) for p in t.model.parameters()])
    t.step()
    assert list(seen[0]) == ["parameters"] and torch.equal(seen[0]["parameters"], before)
    seen.clear()
    _trainer(ByzantineBehaviour(ranks=[3], gradient_fn=spy, needs_exchange=False)).step()
    assert seen == [{}]  # the four-argument call of before


@pytest.mark.parametrize("name", ["mpaf", "poisoned_fl"])
def test_model_aware_attacks_in_the_trainer_checkpoint_bit_for_bit(name):
    def build():
        attack = attacks.get(name, **({"period": 2} if name == "poisoned_fl" else {}))
        return _trainer(ByzantineBehaviour(ranks=[3], gradient_fn=_Hook(attack), needs_exchange=False,
                                           needs_parameters=True, seed=5))

    a = build()
    for _ in range(3):
        a.step()
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    outs_a = [a.step().reduced.matrix[3].clone() for _ in range(3)]
    b = build()
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    outs_b = [b.step().reduced.matrix[3].clone() for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(outs_a, outs_b))
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    assert all(bool(torch.isfinite(x).all()) and bool(x.abs().sum() > 0) for x in outs_a)

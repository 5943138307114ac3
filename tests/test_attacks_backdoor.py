"""Backdoors (BadNets, DBA, model replacement): the trigger by hand, the batch hook in the trainer, test/asr."""

from __future__ import annotations

import math
import os

import pytest
import torch

import attacks
import robustagg as ra
from robustagg.distributed import LocalComm, make_reduction
from robustagg.errors import ConfigError, ShapeError
from robustagg.training import ByzantineBehaviour, Shard, Trainer, evaluate

os.environ.setdefault("WANDB_MODE", "disabled")
torch.set_num_threads(1)


# --- the trigger by hand -------------------------------------------------------------------------

def test_backdoor_stamps_the_square_on_the_first_ceil_fraction_and_relabels():
    a = attacks.Backdoor(target=2, fraction=0.5, size=2, margin=1, value=0.5)
    x = torch.arange(3 * 25, dtype=torch.float32).reshape(3, 25) / 100  # three flat 5x5 images
    y = torch.tensor([0, 1, 4])
    xp, yp = a.poison_batch(x, y, 5)
    assert yp.tolist() == [2, 2, 4] and y.tolist() == [0, 1, 4]  # ceil(1.5) = 2 poisoned; inputs untouched
    expect = x.clone().reshape(3, 5, 5)
    expect[:2, 2:4, 2:4] = 0.5  # rows/cols 5 - 1 - 2 = 2 .. 3
    assert torch.equal(xp, expect.reshape(3, 25)) and not torch.equal(xp, x)
    assert xp.dtype == x.dtype and yp.dtype == y.dtype


def test_backdoor_image_layouts_and_every_channel():
    a = attacks.Backdoor(size=1, fraction=1.0)
    x4 = torch.zeros(2, 3, 4, 4)
    out = a.stamp(x4)
    assert out[:, :, 3, 3].eq(1.0).all() and out.sum() == 2 * 3  # one pixel in every channel
    x3 = torch.zeros(2, 4, 4)
    assert a.stamp(x3)[:, 3, 3].eq(1.0).all() and a.stamp(x3).sum() == 2
    flat = torch.zeros(2, 16)  # read as (1, 2, 8): the last pixel of a 2x8 image
    b = attacks.Backdoor(size=1, image_shape=[1, 2, 8])
    assert b.stamp(flat)[:, 15].eq(1.0).all() and b.stamp(flat).sum() == 2
    with pytest.raises(ShapeError, match=r"cannot read 12 flat values as a square image; pass image_shape"):
        a.stamp(torch.zeros(1, 12))
    with pytest.raises(ShapeError, match=r"x has 16 values per example but image_shape=\(1, 3, 3\)"):
        attacks.Backdoor(image_shape=(3, 3)).stamp(flat)
    with pytest.raises(ShapeError, match=r"size 3 at margin 2 does not fit in 4x4"):
        attacks.Backdoor(margin=2).stamp(x3)
    with pytest.raises(ShapeError, match=r"x must be a floating tensor"):
        a.stamp(torch.zeros(2, 16, dtype=torch.int64))


def test_dba_parts_partition_the_full_trigger_by_worker_index():
    a = attacks.BackdoorDBA(size=3, parts=2, fraction=1.0)  # rows split [0, 1] and [2]
    x, y = torch.zeros(1, 36), torch.tensor([5])  # one 6x6 image
    full = a.stamp(x).reshape(6, 6)
    parts = [a.poison_batch(x, y, 10, index=i)[0].reshape(6, 6) for i in range(4)]
    assert torch.equal(parts[0], parts[2]) and torch.equal(parts[1], parts[3])  # part i mod 2
    assert parts[0][3:5, 3:].eq(1).all() and parts[0].sum() == 6 and parts[1][5, 3:].eq(1).all() and parts[1].sum() == 3
    assert torch.equal(parts[0] + parts[1], full) and full[3:, 3:].eq(1).all() and full.sum() == 9
    with pytest.raises(ConfigError, match=r"parts=4 must be <= size=3"):
        attacks.BackdoorDBA(parts=4)


def test_model_replacement_boost_is_n_over_f_by_default():
    own = torch.tensor([[1.0, -2.0], [0.5, 0.0]], dtype=torch.float64)
    a = attacks.ModelReplacement()
    assert torch.equal(a(torch.zeros(8, 2, dtype=torch.float64), 2, own=own), own * 5.0) and a.last_boost == 5.0
    assert torch.equal(attacks.ModelReplacement(boost=3.0)(torch.zeros(8, 2, dtype=torch.float64), 2, own=own), own * 3)
    # plain BadNets and DBA pass their own gradient through
    assert torch.equal(attacks.Backdoor()(torch.zeros(3, 2, dtype=torch.float64), 2, own=own), own)
    with pytest.raises(ConfigError, match=r"ModelReplacement: boost must be > 0"):
        attacks.ModelReplacement(boost=0.0)


@pytest.mark.parametrize("ctor, pattern", [
    (lambda: attacks.Backdoor(fraction=1.5), r"Backdoor: fraction must be in \(0, 1\]"),
    (lambda: attacks.Backdoor(fraction=0.0), r"Backdoor: fraction must be > 0"),
    (lambda: attacks.Backdoor(target=-1), r"Backdoor: target must be an integer >= 0"),
    (lambda: attacks.Backdoor(size=0), r"Backdoor: size must be an integer >= 1"),
    (lambda: attacks.Backdoor(value=math.nan), r"Backdoor: value must be a finite number"),
    (lambda: attacks.Backdoor(image_shape=(8,)), r"image_shape must be None or \(C, H, W\)"),
])
def test_backdoor_constructor_validation(ctor, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ctor()


def test_poison_batch_errors():
    a = attacks.Backdoor(target=9)
    with pytest.raises(ConfigError, match=r"target=9 must be below num_classes=3"):
        a.poison_batch(torch.zeros(2, 16), torch.tensor([0, 1]), 3)
    with pytest.raises(ShapeError, match=r"y must be integer labels \(B,\) matching x"):
        a.poison_batch(torch.zeros(2, 16), torch.tensor([0.0, 1.0]), 10)
    with pytest.raises(ConfigError, match=r"index must be an integer >= 0"):
        a.poison_batch(torch.zeros(2, 16), torch.tensor([0, 1]), 10, index=-1)


# --- test/asr ------------------------------------------------------------------------------------

def _argmax_model():
    model = torch.nn.Linear(3, 3, bias=False)
    torch.nn.init.eye_(model.weight)  # predicts the arg-max coordinate
    return model


def test_asr_hand_case():
    model = _argmax_model()
    x = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [2.0, 0.0, 0.0]])
    y = torch.tensor([0, 1, 2, 0])

    def trigger(xb):  # pushes coordinate 2 up by 1.5: wins against 1.0, not against 2.0
        return xb + torch.tensor([0.0, 0.0, 1.5])

    r = evaluate(model, x, y, 3, trigger=trigger, target=2)
    # examples not of class 2: rows 0, 1, 3 -> predictions after the trigger 2, 2, 0: ASR = 2/3
    assert r["test/asr"] == pytest.approx(2 / 3, rel=1e-15) and r["test/acc"] == 1.0
    assert evaluate(model, x, y, 3, batch_size=1, trigger=trigger, target=2)["test/asr"] == r["test/asr"]
    assert "test/asr" not in evaluate(model, x, y, 3)
    assert math.isnan(evaluate(model, x[2:3], y[2:3], 3, trigger=trigger, target=2)["test/asr"])  # only targets
    model.train()
    evaluate(model, x, y, 3, trigger=trigger, target=2)
    assert model.training  # mode restored


def test_asr_with_the_backdoor_stamp_and_errors():
    a = attacks.Backdoor(target=1, size=1)
    model = torch.nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 5.0]]))  # class 1 iff pixel 3 lit
    x, y = torch.rand(6, 4, generator=torch.Generator().manual_seed(0)) * 0.1, torch.tensor([0, 0, 0, 1, 1, 1])
    r = evaluate(model, x, y, 2, trigger=a.stamp, target=a.target)
    assert r["test/asr"] == 1.0 and r["test/acc"] == 0.5
    with pytest.raises(ConfigError, match=r"pass both trigger= and target="):
        evaluate(model, x, y, 2, trigger=a.stamp)
    with pytest.raises(ConfigError, match=r"target must be a class in \[0, 2\); got 2"):
        evaluate(model, x, y, 2, trigger=a.stamp, target=2)
    with pytest.raises(ShapeError, match=r"trigger must keep the batch shape"):
        evaluate(model, x, y, 2, trigger=lambda xb: xb[:1], target=1)


# --- the batch hook in the trainer ---------------------------------------------------------------

def _trainer(byzantine=None, n=4, rule=None, steps_data=10, d=16, classes=3, seed=0, lr=0.1):
    torch.manual_seed(123)
    model = torch.nn.Linear(d, classes)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    red = make_reduction("gather", rule or ra.Mean(), LocalComm(n))
    g = torch.Generator().manual_seed(7)
    shards = {r: Shard(torch.rand(steps_data, d, generator=g) * 0.1, torch.randint(0, classes, (steps_data,), generator=g))
              for r in range(n)}
    return Trainer(model, opt, red, shards, batch_size=4, num_classes=classes, seed=seed, byzantine=byzantine)


def test_batch_poison_hits_only_byzantine_batches_with_their_index():
    seen = []

    def poison(x, y, c, index):
        seen.append((index, x.shape, c))
        return x + 1.0, torch.zeros_like(y)

    t = _trainer(ByzantineBehaviour(ranks=[1, 3], batch_poison_fn=poison))
    out = t.step()
    assert seen == [(0, torch.Size([4, 16]), 3), (1, torch.Size([4, 16]), 3)]
    assert out.byzantine == (1, 3) and t.comm.seq == 2  # no gradient hook: no exchange
    with pytest.raises(ConfigError, match=r"needs gradient_fn, poison_fn, batch_poison_fn or gossip_fn"):
        ByzantineBehaviour(ranks=[1])


def test_model_replacement_in_the_trainer_submits_the_boosted_backdoored_gradient():
    a = attacks.ModelReplacement(target=0, fraction=1.0, size=2)

    def hook(honest, f, own, gen):
        return a(honest, f, own=own, generator=gen)

    t = _trainer(ByzantineBehaviour(ranks=[3], batch_poison_fn=a.poison_batch, gradient_fn=hook))
    out = t.step()
    # reference: worker 3's batch poisoned by hand, its gradient computed on it, times n / f = 4
    ref = _trainer(None)
    idx = ref.samplers[3].next()
    xp, yp = a.poison_batch(ref.shards[3].x[idx], ref.shards[3].y[idx], 3)
    torch.set_rng_state(ref.worker_rng[3])
    g, _ = ref._gradient((xp, yp))
    assert torch.equal(out.reduced.matrix[3], (4.0 * g.double()).to(g.dtype))


def _blobs(n_per: int, seed: int):
    """Three classes of 4x4 images: class c lights the pixel pair of row c (left half); the
    bottom-right 2x2 corner (the trigger) is never lit in clean data."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(3).repeat_interleave(n_per)
    x = 0.1 * torch.rand(len(y), 4, 4, generator=g)
    for c in range(3):
        x[y == c, c, :2] += 1.0
    perm = torch.randperm(len(y), generator=g)
    return x.reshape(len(y), 16)[perm], y[perm]


@pytest.mark.parametrize("name", ["backdoor", "backdoor_dba", "model_replacement"])
def test_backdoors_implant_the_trigger_under_the_mean_and_keep_clean_accuracy(name):
    def run(attack):
        n, f = 6, 2
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        red = make_reduction("gather", ra.Mean(), LocalComm(n))
        shards = {r: Shard(*_blobs(20, seed=r)) for r in range(n)}
        byz = None
        if attack is not None:
            byz = ByzantineBehaviour(ranks=[4, 5], batch_poison_fn=attack.poison_batch,
                                     gradient_fn=lambda h, k, own, gen: attack(h, k, own=own, generator=gen))
        t = Trainer(model, opt, red, shards, batch_size=10, num_classes=3, seed=0, byzantine=byz)
        for _ in range(60):
            t.step()
        xt, yt = _blobs(30, seed=99)
        probe = attack or attacks.Backdoor(target=0, size=2)
        return evaluate(model, xt, yt, 3, trigger=probe.stamp, target=probe.target)

    params = {"target": 0, "size": 2, "value": 2.0}
    if name == "backdoor_dba":
        params["parts"] = 2
    clean, attacked = run(None), run(attacks.get(name, **params))
    assert clean["test/acc"] == 1.0 and attacked["test/acc"] >= 0.95  # clean accuracy barely moves
    assert clean["test/asr"] <= 0.2 and attacked["test/asr"] >= 0.9, (clean["test/asr"], attacked["test/asr"])

"""Random crop + horizontal flip: determinism from the generator, shapes, and correctness against a
loop written from the definition (and a hand-computed flip)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from robustagg.data import DEFAULT_AUGMENT, Augment, random_crop_flip
from robustagg.errors import ConfigError, ShapeError


def reference(x: torch.Tensor, dy, dx, flips, padding: int, fill: float) -> torch.Tensor:
    """Per example, per pixel, straight from the definition."""
    b, c, h, w = x.shape
    out = torch.empty_like(x)
    for k in range(b):
        for i in range(h):
            for j in range(w):
                jj = (w - 1 - j) if flips[k] else j
                r, s = int(dy[k]) + i - padding, int(dx[k]) + jj - padding  # coordinates in the unpadded image
                out[k, :, i, j] = x[k, :, r, s] if (0 <= r < h and 0 <= s < w) else fill
    return out


def test_matches_the_definition_with_the_documented_draw_order():
    x = torch.rand(6, 3, 5, 7, generator=torch.Generator().manual_seed(1))
    got = random_crop_flip(x, torch.Generator().manual_seed(7), padding=2, fill=-1.0)
    g = torch.Generator().manual_seed(7)  # dy, dx, then the flips
    dy, dx = torch.randint(0, 5, (6,), generator=g), torch.randint(0, 5, (6,), generator=g)
    flips = torch.rand(6, generator=g) < 0.5
    assert 0 < int(flips.sum()) < 6  # this seed exercises both branches
    assert torch.equal(got, reference(x, dy, dx, flips, 2, -1.0))


def test_flip_by_hand():
    x = torch.tensor([[[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]]])  # (1, 1, 2, 3)
    seen = set()
    for seed in range(20):
        out = random_crop_flip(x, torch.Generator().manual_seed(seed), padding=0)
        seen.add(tuple(out.flatten().tolist()))
    assert seen == {(1.0, 2.0, 3.0, 4.0, 5.0, 6.0), (3.0, 2.0, 1.0, 6.0, 5.0, 4.0)}  # identity or mirrored rows
    out = random_crop_flip(x, torch.Generator().manual_seed(0), padding=0, flip=False)
    assert torch.equal(out, x)


def test_deterministic_from_the_generator_and_input_untouched():
    x = torch.rand(8, 3, 32, 32)
    keep = x.clone()
    a = random_crop_flip(x, torch.Generator().manual_seed(3))
    b = random_crop_flip(x, torch.Generator().manual_seed(3))
    c = random_crop_flip(x, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c) and torch.equal(x, keep)
    assert a.shape == x.shape and a.dtype == x.dtype
    g = torch.Generator().manual_seed(3)
    random_crop_flip(x, g)
    state = g.get_state()  # a restored stream draws what the uninterrupted one draws next
    nxt = random_crop_flip(x, g)
    g2 = torch.Generator()
    g2.set_state(state)
    assert torch.equal(random_crop_flip(x, g2), nxt)


def test_module_uses_the_default_stream_in_training_and_is_identity_in_eval():
    aug = Augment((3, 8, 8))
    x = torch.rand(5, 3 * 8 * 8)  # flattened, as the trainer's shards hold them
    torch.manual_seed(11)  # the trainer swaps the worker's stream into the default generator
    a = aug(x)
    torch.manual_seed(11)
    assert torch.equal(aug(x), a) and a.shape == x.shape and not torch.equal(a, x)
    assert torch.equal(aug.eval()(x), x)
    assert list(aug.parameters()) == [] and list(aug.buffers()) == []
    model = nn.Sequential(Augment((3, 8, 8)), nn.Flatten(), nn.Linear(192, 2))
    assert model(x).shape == (5, 2)


def test_defaults_and_errors():
    assert DEFAULT_AUGMENT["cifar10"] and DEFAULT_AUGMENT["cifar100"] and not DEFAULT_AUGMENT["mnist"]
    with pytest.raises(ShapeError, match=r"needs a \(B, C, H, W\) floating tensor; got torch.uint8"):
        random_crop_flip(torch.zeros(1, 1, 2, 2, dtype=torch.uint8))
    with pytest.raises(ConfigError, match="padding must be >= 0; got -1"):
        random_crop_flip(torch.zeros(1, 1, 2, 2), padding=-1)
    with pytest.raises(ConfigError, match=r"augmentation needs image data of shape \(C, H, W\)"):
        Augment((10,))


# --- inside the library trainer: the crops follow each worker's checkpointed stream -------------------
def _trainer(augment: bool):
    import robustagg as ra
    from robustagg.distributed import LocalComm, make_reduction
    from robustagg.training import Shard, Trainer

    torch.manual_seed(5)
    head = nn.Sequential(nn.Flatten(), nn.Linear(36, 2))
    model = nn.Sequential(Augment((1, 6, 6), padding=1), head) if augment else nn.Sequential(nn.Identity(), head)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    red = make_reduction("gather", ra.CoordinateWiseMedian(f=1), LocalComm(3))
    g = torch.Generator().manual_seed(8)
    shards = {r: Shard(torch.rand(12, 36, generator=g), torch.randint(0, 2, (12,), generator=g)) for r in range(3)}
    return Trainer(model, opt, red, shards, batch_size=4, num_classes=2, seed=3)


def test_trainer_with_augmentation_resumes_bit_for_bit():
    import io

    a = _trainer(True)
    plain = _trainer(False)
    first = a.step().reduced.matrix
    assert not torch.equal(first, plain.step().reduced.matrix)  # the crops changed the gradients
    a.step()
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    for _ in range(2):
        a.step()
    b = _trainer(True)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    for _ in range(2):
        b.step()
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    assert all(torch.equal(a.worker_rng[r], b.worker_rng[r]) for r in range(3))

"""experiments.data: deterministic splits and partitions, with hand-checked sizes and clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from experiments.config import DataConf
from experiments.data import build_data
from robustagg.data import load_digits, make_synthetic, partition, train_test_split
from robustagg.errors import ConfigError


def _cfg(**kw):
    return OmegaConf.merge(OmegaConf.structured(DataConf), kw)


def _is_partition_of(parts, n_items):
    allidx = np.concatenate(parts)
    return len(allidx) == n_items and len(np.unique(allidx)) == n_items


def test_iid_sizes_and_cover():
    parts = partition(np.zeros(10, dtype=np.int64), 3, "iid", rng=np.random.default_rng(0))
    assert [len(p) for p in parts] == [4, 3, 3]  # array_split of 10 into 3
    assert _is_partition_of(parts, 10)


def test_label_sorted_gives_each_worker_few_labels():
    y = np.repeat(np.arange(10), 20)  # 200 examples, 20 per class
    parts = partition(y, 10, "label_sorted", rng=np.random.default_rng(1), shards_per_worker=2)
    # 20 shards of 10 consecutive sorted labels: each shard holds one class, a worker at most two.
    assert [len(p) for p in parts] == [20] * 10 and _is_partition_of(parts, 200)
    assert all(len(np.unique(y[p])) <= 2 for p in parts)


def test_dirichlet_is_deterministic_skewed_and_covers():
    y = np.repeat(np.arange(5), 40)
    a = partition(y, 4, "dirichlet", rng=np.random.default_rng(3), alpha=0.1)
    b = partition(y, 4, "dirichlet", rng=np.random.default_rng(3), alpha=0.1)
    assert all(np.array_equal(p, q) for p, q in zip(a, b)) and _is_partition_of(a, 200)
    # With alpha = 0.1 most of a class lands on one worker: the largest share per class is big.
    top = [max(int((y[p] == c).sum()) for p in a) for c in range(5)]
    assert sum(top) > 0.6 * 200


def test_long_tail_class_counts():
    y = np.repeat(np.arange(3), 100)
    parts = partition(y, 2, "long_tail", rng=np.random.default_rng(0), imbalance=4.0)
    counts = np.bincount(y[np.concatenate(parts)], minlength=3)
    # keep ceil(100 * 4^(-c/2)): c=0 -> 100, c=1 -> 50, c=2 -> 25
    assert counts.tolist() == [100, 50, 25]


def test_train_test_split_is_stratified():
    y = np.repeat(np.arange(4), 10)
    tr, te = train_test_split(y, 0.25, np.random.default_rng(0))
    # round(0.25 * 10) = 2 (banker's rounding of 2.5) per class in test
    assert np.bincount(y[te]).tolist() == [2, 2, 2, 2] and len(tr) == 32
    assert len(np.intersect1d(tr, te)) == 0


def test_digits_bundle_is_deterministic():
    x, y, c, shape = load_digits()
    assert x.shape == (1797, 64) and c == 10 and shape == (1, 8, 8) and 0.0 <= x.min() and x.max() <= 1.0
    a = build_data(_cfg(), n=10, byzantine_ranks=[8, 9], seed=0)
    b = build_data(_cfg(), n=10, byzantine_ranks=[8, 9], seed=0)
    assert torch.equal(a.train_x, b.train_x) and all(np.array_equal(p, q) for p, q in zip(a.parts, b.parts))
    assert len(a.test_y) == 450 and len(a.train_y) == 1347  # 25% of each class held out
    assert sum(a.sizes()) == 1347
    c2 = build_data(_cfg(), n=10, byzantine_ranks=[8, 9], seed=1)
    assert not all(np.array_equal(p, q) for p, q in zip(a.parts, c2.parts))


def test_byzantine_full_data_and_label_skew():
    d = build_data(_cfg(byzantine_data="full", partition="label_sorted"), n=5, byzantine_ranks=[4], seed=0)
    assert d.sizes()[4] == len(d.train_y)  # the Byzantine worker draws from the whole pool
    assert _is_partition_of(d.parts[:4], len(d.train_y))  # the honest four share the pool
    skew = d.label_skew()
    assert skew[4] == pytest.approx(0.0) and min(skew[:4]) > 0.5


def test_synthetic_with_heterogeneity_shifts_each_worker():
    d = build_data(_cfg(name="synthetic", dim=7, num_classes=3, samples=90, heterogeneity=2.0), n=3,
                   byzantine_ranks=[], seed=0)
    assert d.train_x.shape[1] == 7 and d.num_classes == 3 and d.input_shape == (7,)
    assert d.shifts is not None and torch.allclose(d.shifts.norm(dim=1), torch.full((3,), 2.0))
    s0 = d.shard(0)
    assert torch.allclose(s0.x - d.train_x[torch.from_numpy(d.parts[0])], d.shifts[0].expand_as(s0.x))
    x, y = make_synthetic(dim=2, num_classes=2, samples=5, separation=1.0, rng=np.random.default_rng(0))
    assert y.tolist() == [0, 1, 0, 1, 0]
    with pytest.raises(ConfigError, match="data.samples >= num_classes"):
        make_synthetic(dim=2, num_classes=3, samples=2, separation=1.0, rng=np.random.default_rng(0))


def test_a_worker_without_data_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"data.partition=iid leaves worker\(s\) \[5, 6, 7, 8, 9\] of n=10 with no "
                                          r"training data .*5 in the pool"):
        build_data(_cfg(max_train_samples=5), n=10, byzantine_ranks=[], seed=0)
    with pytest.raises(ConfigError, match="dirichlet .*raise data.alpha"):
        build_data(_cfg(partition="dirichlet", alpha=0.01, max_tries=2, min_samples=50), n=10, byzantine_ranks=[],
                   seed=0)
    with pytest.raises(ConfigError, match="test_fraction"):
        build_data(_cfg(test_fraction=1.0), n=2, byzantine_ranks=[], seed=0)

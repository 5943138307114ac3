"""Data for the trainer: bundled sources, partitions among workers, and the per-worker split.

- :mod:`~robustagg.data.sources`: scikit-learn's digits (bundled, offline) and a synthetic mixture.
- :mod:`~robustagg.data.partition`: ``iid``, ``dirichlet``, ``label_sorted`` and ``long_tail``
  partitions, and a stratified train/test split.
- :mod:`~robustagg.data.bundle`: :class:`DataBundle`, a data set split among n workers.
"""

from .bundle import DataBundle
from .partition import PARTITIONS, partition, train_test_split
from .sources import load_digits, make_synthetic

__all__ = ["DataBundle", "PARTITIONS", "partition", "train_test_split", "load_digits", "make_synthetic"]

"""Data for robust training: readers of the published files, Hugging Face and user data sets,
bundled sources, partitions among workers, and per-worker augmentation.

- :func:`load` reads ``mnist``, ``fashion_mnist``, ``cifar10`` and ``cifar100`` from their published
  files (IDX; CIFAR binary or python version) under a root folder, or the folders other tools
  leave (``<root>/MNIST/raw``, ``<root>/cifar-10-batches-py``, ...), and fetches and verifies them
  with ``download=True`` (:func:`robustagg.data.download.download`; the module is not shadowed
  by a function of the same name). No torchvision.
- :func:`load_hf` loads any Hugging Face data set through the optional ``datasets`` package.
- :func:`from_user` accepts what your own builder returns (tensors or torch Datasets).
- All three return a :class:`LoadedData`; :func:`random_crop_flip` and :class:`Augment` augment
  image batches from the worker's RNG stream.
- :mod:`~robustagg.data.sources`: scikit-learn's digits (bundled, offline) and a synthetic mixture.
- :mod:`~robustagg.data.partition`: ``iid``, ``dirichlet``, ``label_sorted`` and ``long_tail``
  partitions, and a stratified train/test split.
- :mod:`~robustagg.data.bundle`: :class:`DataBundle`, a data set split among n workers.

Example:
    >>> import torch
    >>> d = from_user((torch.rand(6, 1, 4, 4), torch.tensor([0, 1, 0, 1, 0, 1]), torch.rand(2, 1, 4, 4),
    ...                torch.tensor([1, 0])))
    >>> d.input_shape, d.num_classes
    ((1, 4, 4), 2)
"""

from . import download
from .augment import DEFAULT_AUGMENT, Augment, random_crop_flip
from .bundle import DataBundle
from .cifar import RestrictedUnpickler, load_cifar, read_cifar_binary, read_cifar_python, safe_unpickle
from .download import RESOURCES, missing_message, sha256_of
from .digests import CONTENT, verify_content
from .folders import DATASETS, IDX_FILES, resolve, system_root
from .hf import load_hf
from .idx import load_idx_pair, parse_idx, read_idx
from .loaders import NUM_CLASSES, LoadedData, from_user, load, no_root_message
from .partition import PARTITIONS, partition, train_test_split
from .sources import load_digits, make_synthetic

__all__ = [
    "LoadedData", "load", "from_user", "load_hf", "NUM_CLASSES", "DATASETS", "resolve", "system_root", "IDX_FILES",
    "no_root_message", "CONTENT", "verify_content",
    "read_idx", "parse_idx", "load_idx_pair",
    "load_cifar", "read_cifar_binary", "read_cifar_python", "RestrictedUnpickler", "safe_unpickle",
    "download", "missing_message", "RESOURCES", "sha256_of",
    "random_crop_flip", "Augment", "DEFAULT_AUGMENT",
    "DataBundle", "PARTITIONS", "partition", "train_test_split", "load_digits", "make_synthetic",
]

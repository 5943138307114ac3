"""Tiny files in the published formats (IDX for MNIST-like sets, the CIFAR-10 binary version), so
real-data configs run end to end in CI without the real downloads (random pixels and labels)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from test_data_formats import cifar_records, write_idx


def write_mnist_files(root: Path, *, n_train: int = 240, n_test: int = 60, seed: int = 0) -> Path:
    """``root/MNIST/raw/*-ubyte.gz`` (the layout torchvision leaves) with random 28x28 images; returns ``root``."""
    rng = np.random.default_rng(seed)
    folder = root / "MNIST" / "raw"
    arrays = {"train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
              "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
              "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
              "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8)}
    for name, a in arrays.items():
        write_idx(folder / name, a, gz=True)
    return root


def write_cifar10_files(root: Path, *, per_batch: int = 24, n_test: int = 30, seed: int = 0) -> Path:
    """``root/cifar-10-batches-bin/`` (5 training batches and the test batch, binary version); returns ``root``."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-bin"
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(1, 6):
        x, y = rng.integers(0, 256, (per_batch, 3, 32, 32), dtype=np.uint8), rng.integers(0, 10, per_batch)
        (folder / f"data_batch_{i}.bin").write_bytes(cifar_records(x, y))
    x, y = rng.integers(0, 256, (n_test, 3, 32, 32), dtype=np.uint8), rng.integers(0, 10, n_test)
    (folder / "test_batch.bin").write_bytes(cifar_records(x, y))
    return root

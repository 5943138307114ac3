"""Tiny files in the published formats (IDX for MNIST-like sets, the CIFAR-10 binary version), so
real-data configs run end to end in CI without the real downloads (random pixels and labels)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from test_data_formats import cifar_records, write_idx


def write_mnist_files(root: Path, *, n_train: int = 240, n_test: int = 60, seed: int = 0,
                      folder: str = "MNIST/raw") -> Path:
    """``root/<folder>/*-ubyte.gz`` (default: the layout torchvision leaves for MNIST; Fashion-MNIST's
    is ``FashionMNIST/raw``) with random 28x28 images; returns ``root``."""
    rng = np.random.default_rng(seed)
    folder_path = root / folder
    arrays = {"train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
              "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
              "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
              "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8)}
    for name, a in arrays.items():
        write_idx(folder_path / name, a, gz=True)
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


def write_cifar100_files(root: Path, *, n_train: int = 120, n_test: int = 30, seed: int = 0) -> Path:
    """``root/cifar-100-binary/{train,test}.bin`` (records: coarse label, fine label, pixels); returns ``root``."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-100-binary"
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("test", n_test)):
        x = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        (folder / f"{split}.bin").write_bytes(cifar_records(x, rng.integers(0, 20, n), rng.integers(0, 100, n)))
    return root


def write_files(name: str, root: Path) -> Path:
    """Tiny files of ``mnist``, ``fashion_mnist``, ``cifar10`` or ``cifar100`` under ``root``; returns ``root``."""
    if name == "mnist":
        return write_mnist_files(root)
    if name == "fashion_mnist":
        return write_mnist_files(root, folder="FashionMNIST/raw", seed=1)
    if name == "cifar10":
        return write_cifar10_files(root)
    return write_cifar100_files(root)

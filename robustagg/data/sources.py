"""Bundled data: scikit-learn's 8x8 digits (offline) and a seeded synthetic Gaussian mixture.

Inputs are returned flat (``(N, D)`` float32) with int64 labels; image models reshape them.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError

__all__ = ["load_digits", "make_synthetic"]


def load_digits() -> tuple[np.ndarray, np.ndarray, int, tuple[int, ...]]:
    """scikit-learn's handwritten digits: 1797 images of 8x8 pixels, 10 classes, scaled to [0, 1].

    The table is read from the file scikit-learn bundles (``sklearn/datasets/data/digits.csv.gz``)
    the way its ``load_digits`` reads it (``np.loadtxt``, the same bits), located without importing
    scikit-learn, whose import costs about a second of start-up; when the file is not where it is
    expected, through ``sklearn.datasets.load_digits`` itself.

    References: Alpaydin, Kaynak, "Optical Recognition of Handwritten Digits", UCI ML repository, 1998.
    """
    table = _bundled_digits()
    if table is None:
        from sklearn.datasets import load_digits as _load  # type: ignore[import-untyped]

        x, y = _load(return_X_y=True)
    else:
        x, y = table[:, :-1], table[:, -1].astype(int, copy=False)
    return (x / 16.0).astype(np.float32), y.astype(np.int64), 10, (1, 8, 8)


def _bundled_digits() -> np.ndarray | None:
    """``(1797, 65)`` float64: scikit-learn's digits table (pixels, then the label), or ``None`` if not found."""
    import gzip
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sklearn")  # finds the package without running its __init__
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        return None
    with gzip.open(path, mode="rt", encoding="utf-8") as fh:
        table = np.loadtxt(fh, delimiter=",")
    return table if table.ndim == 2 and table.shape[1] == 65 else None


def make_synthetic(*, dim: int, num_classes: int, samples: int, separation: float,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A Gaussian mixture: class ``c``'s mean ``mu_c = separation * u_c`` (``u_c`` uniform on the
    unit sphere), examples ``x = mu_c + N(0, I_dim)``, labels balanced (``samples // C`` each, rest
    to the first classes).

    Raises:
        ConfigError: dim, num_classes or samples below 1, or fewer samples than classes.
    """
    if dim < 1 or num_classes < 2 or samples < num_classes:
        raise ConfigError(f"synthetic data needs data.dim >= 1, data.num_classes >= 2 and data.samples >= "
                          f"num_classes; got dim={dim}, num_classes={num_classes}, samples={samples}.")
    u = rng.standard_normal((num_classes, dim))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    y = np.arange(samples) % num_classes
    x = separation * u[y] + rng.standard_normal((samples, dim))
    return x.astype(np.float32), y.astype(np.int64)

"""The ``data`` config node -> a :class:`robustagg.data.DataBundle` (wiring only).

The sources, partitions and the bundle live in :mod:`robustagg.data`; this module reads the Hydra
node and reports a partition that leaves a worker without data in config terms.

A process that runs many runs (a warm joblib worker of a Hydra sweep, a notebook) reads each data
set once: the arrays of the bundled digits and of the published files (MNIST, Fashion-MNIST,
CIFAR) are kept in an in-process cache keyed by what they are read from, and handed out
read-only; every run indexes them into its own copies (:func:`build_data`), so no run sees
another's changes. Sources that are not pure functions of their key (``data=hf``,
``data=custom``, ``data=synthetic``) are built afresh every time.
"""

from __future__ import annotations

from typing import Optional, Sequence

import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from robustagg.data import (DEFAULT_AUGMENT, DataBundle, LoadedData, from_user, load, load_digits, load_hf, make_synthetic,
                            no_root_message, partition, system_root, train_test_split)
from robustagg.errors import ConfigError

from .config import ByzantineData, DataName, Partition

__all__ = ["build_data", "augment_enabled", "clear_source_cache"]

#: key -> read-only arrays of one source (see :func:`_cached`).
_SOURCES: dict[tuple[object, ...], tuple[np.ndarray, ...]] = {}


def clear_source_cache() -> None:
    """Forget every data set read by :func:`build_data` in this process (the next run reads its files again)."""
    _SOURCES.clear()


def _cached(key: tuple[object, ...], read: Callable[[], tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    """``read()``'s arrays, read once per ``key`` in this process and returned with ``writeable=False``.

    Read-only, so that a run which tried to change the shared arrays in place would fail
    (``ValueError: assignment destination is read-only``) instead of changing the next run's data;
    :func:`build_data` only indexes them (``x[idx]`` copies).
    """
    hit = _SOURCES.get(key)
    if hit is None:
        hit = tuple(np.asarray(a) for a in read())
        for a in hit:
            a.setflags(write=False)
        _SOURCES[key] = hit
    return hit


def _files_key(name: str, root: str) -> tuple[object, ...] | None:
    """The published files of ``name`` under ``root``: ``(folder, ((file, size, mtime_ns), ...))``, or
    ``None`` when they are not there yet (then nothing is cached: :func:`robustagg.data.load` reports or
    downloads them)."""
    from robustagg.data.folders import resolve

    try:
        folder, version = resolve(name, root)
    except Exception:
        return None
    stats = []
    for p in sorted(Path(folder).iterdir()):
        if p.is_file():
            st = p.stat()
            stats.append((p.name, st.st_size, st.st_mtime_ns))
    return (str(Path(folder).resolve()), version, tuple(stats))


def build_data(cfg: object, *, n: int, byzantine_ranks: Sequence[int], seed: int) -> DataBundle:
    """Load the configured data set and partition it among ``n`` workers.

    Args:
        cfg: the ``data`` node (:class:`~experiments.config.DataConf` fields).
        n: number of workers. byzantine_ranks: the Byzantine workers (for ``byzantine_data``).
        seed: the run's seed.

    Raises:
        ConfigError: unknown data set, bad parameters, or a partition that leaves a worker with
            fewer than one example (the message names the workers and how to fix it).
    """
    c = cfg
    rng = np.random.default_rng([int(seed), 0xDA7A])
    name = DataName(getattr(c, "name"))
    groups: Optional[np.ndarray] = None
    shape: tuple[int, ...]
    if name in (DataName.digits, DataName.synthetic):
        if name is DataName.digits:
            x, y, classes, dims = _cached(("digits",), _digits_arrays)
            C, shape = int(classes[0]), tuple(int(s) for s in dims)
        else:
            x, y = make_synthetic(dim=int(getattr(c, "dim")), num_classes=int(getattr(c, "num_classes")),
                                  samples=int(getattr(c, "samples")), separation=float(getattr(c, "separation")),
                                  rng=rng)
            C, shape = int(getattr(c, "num_classes")), (int(getattr(c, "dim")),)
        tr, te = train_test_split(y, float(getattr(c, "test_fraction")), rng)
        xtr_all, ytr_all, xte, yte = x, y, x[te], y[te]
    else:
        C, shape, xtr_all, ytr_all, xte, yte, groups = _external_arrays(c, name)
        if len(yte) == 0:  # the source has no test split: hold out test_fraction of the training set
            tr, te = train_test_split(ytr_all, float(getattr(c, "test_fraction")), rng)
            xte, yte = xtr_all[te], ytr_all[te]
        else:
            tr = np.arange(len(ytr_all), dtype=np.int64)
    test_limit = getattr(c, "max_test_samples", None)
    if test_limit is not None:
        xte, yte = xte[:int(test_limit)], yte[:int(test_limit)]
    x, y = xtr_all, ytr_all
    limit = getattr(c, "max_train_samples")
    if limit is not None:
        tr = np.sort(rng.permutation(tr)[:int(limit)])
    ytr = y[tr]
    byz = sorted(set(int(r) for r in byzantine_ranks))
    full = ByzantineData(getattr(c, "byzantine_data")) is ByzantineData.full and byz
    holders = [r for r in range(n) if r not in byz] if full else list(range(n))
    scheme = Partition(getattr(c, "partition"))
    if scheme is Partition.natural:
        pieces = _natural(None if groups is None else groups[tr], len(holders), name.value)
    else:
        pieces = partition(ytr, len(holders), scheme.value, rng=rng, alpha=float(getattr(c, "alpha")),
                           shards_per_worker=int(getattr(c, "shards_per_worker")),
                           imbalance=float(getattr(c, "imbalance")), num_classes=C,
                           min_samples=int(getattr(c, "min_samples")), max_tries=int(getattr(c, "max_tries")))
    parts: list[np.ndarray] = [np.arange(len(ytr), dtype=np.int64) for _ in range(n)]
    for r, p in zip(holders, pieces):
        parts[r] = p.astype(np.int64)
    need = max(1, int(getattr(c, "min_samples"))) if scheme is Partition.dirichlet else 1
    empty = [r for r, p in enumerate(parts) if len(p) < need]
    if empty:
        hint = {Partition.dirichlet: "raise data.alpha or data.max_tries", Partition.label_sorted:
                "lower data.shards_per_worker", Partition.long_tail: "lower data.imbalance"}.get(scheme, "")
        hint = (hint + ", " if hint else "") + "lower threat.n, or use more data (data.max_train_samples)"
        raise ConfigError(f"data.partition={scheme.value} leaves worker(s) {empty} of n={n} with no training data "
                          f"(fewer than {need} example(s); {len(ytr)} in the pool); {hint}.")
    shifts = None
    het = float(getattr(c, "heterogeneity", 0.0))
    if name is DataName.synthetic and het > 0:
        u = rng.standard_normal((n, x.shape[1]))
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        shifts = torch.from_numpy((het * u).astype(np.float32))
    return DataBundle(train_x=torch.from_numpy(_own(x[tr])), train_y=torch.from_numpy(_own(ytr)),
                      test_x=torch.from_numpy(_own(xte)), test_y=torch.from_numpy(_own(yte)), num_classes=C, input_shape=tuple(shape),
                      parts=parts, shifts=shifts, name=name.value, partition=scheme.value)


def _digits_arrays() -> tuple[np.ndarray, ...]:
    """:func:`robustagg.data.load_digits` as arrays: ``(x, y, [classes], input shape)``."""
    x, y, classes, shape = load_digits()
    return x, y, np.array([classes]), np.array(shape, dtype=np.int64)


def _own(a: np.ndarray) -> np.ndarray:
    """``a`` itself when this run may write to it, else a copy: never hand a cached (read-only) array to torch."""
    return a if a.flags.writeable else a.copy()


def _external_arrays(c: object, name: DataName) -> tuple[int, tuple[int, ...], np.ndarray, np.ndarray, np.ndarray,
                                                         np.ndarray, Optional[np.ndarray]]:
    """``(classes, input shape, train x, train y, test x, test y, groups or None)`` of a non-bundled source.

    The published files are read once per process (:func:`_cached`, keyed by data set, label,
    resolved folder and each file's size and modification time); ``hf`` and ``custom`` every time.
    """
    def read() -> tuple[np.ndarray, ...]:
        loaded = _load_external(c, name)
        groups = () if loaded.groups is None else (loaded.groups.numpy(),)
        return (np.array([loaded.num_classes]), np.array(loaded.input_shape, dtype=np.int64),
                _flat(loaded.train_x), loaded.train_y.numpy(), _flat(loaded.test_x), loaded.test_y.numpy(), *groups)

    root = _root(c, name)
    files = _files_key(name.value, os.fspath(root)) if root else None
    arrays = read() if files is None else _cached(("files", name.value, str(getattr(c, "label")), files), read)
    C, shape = int(arrays[0][0]), tuple(int(s) for s in arrays[1])
    return C, shape, arrays[2], arrays[3], arrays[4], arrays[5], (arrays[6] if len(arrays) > 6 else None)


def _root(c: object, name: DataName) -> Optional[str]:
    """``data.root``, else the folder a system package installed the files in (``None``: neither,
    or a source that has no files)."""
    if name in (DataName.hf, DataName.custom):
        return None
    root = getattr(c, "root", None)
    if root:
        return os.fspath(root)
    found = system_root(name.value)
    return None if found is None else str(found)


def _flat(x: torch.Tensor) -> np.ndarray:
    """``(N, *shape)`` inputs as ``(N, D)`` float32 (uint8 images scaled to ``[0, 1]``)."""
    t = x.reshape(len(x), int(np.prod(x.shape[1:])))
    t = t.to(torch.float32).div_(255.0) if t.dtype == torch.uint8 else t.to(torch.float32)
    return np.ascontiguousarray(t.numpy())


def _load_external(c: object, name: DataName) -> LoadedData:
    """The published files (``data.root``), a Hugging Face data set, or the user's builder."""
    if name is DataName.hf:
        path = getattr(c, "path", None)
        if not path:
            raise ConfigError("data=hf needs data.path (the data set's hub name or a local builder such as parquet).")
        return load_hf(str(path), image_key=str(getattr(c, "image_key")), label_key=str(getattr(c, "label_key")),
                       name=getattr(c, "hf_name", None), partition_key=getattr(c, "partition_key", None))
    if name is DataName.custom:
        target = getattr(c, "_target_", None)
        if not target:
            raise ConfigError("data=custom needs data._target_=my.module.build (a function returning train/test "
                              "tensors or torch Datasets; keyword arguments in data.args).")
        from hydra.utils import get_method

        try:
            fn = get_method(str(target))
        except Exception as exc:
            raise ConfigError(f"data._target_={target!r} cannot be imported: {exc}") from None
        args = dict(getattr(c, "args", {}) or {})
        return from_user(fn(**args), name=str(target))
    root = _root(c, name)
    if not root:
        raise ConfigError(no_root_message(name.value))
    label = str(getattr(c, "label"))
    if label not in ("fine", "coarse"):
        raise ConfigError(f"data.label must be fine or coarse (CIFAR-100's 100 or 20 classes); got {label!r}.")
    return load(name.value, str(root), download=bool(getattr(c, "download")),
                label="fine" if label == "fine" else "coarse")


def _natural(groups: Optional[np.ndarray], parts: int, what: str) -> list[np.ndarray]:
    """``partition=natural``: natural group ``k`` (in sorted key order) goes to worker ``k mod parts``."""
    if groups is None:
        raise ConfigError(f"data.partition=natural needs natural groups, which data={what} does not have; give "
                          "data.partition_key (e.g. writer_id) with data=hf, or use another partition.")
    g = np.unique(groups, return_inverse=True)[1].reshape(-1)
    return [np.flatnonzero(g % parts == w).astype(np.int64) for w in range(parts)]


def augment_enabled(cfg: object) -> bool:
    """Whether ``data`` asks for per-worker crop + flip: ``data.augment``, or when ``null`` the
    data set's default (:data:`robustagg.data.DEFAULT_AUGMENT`: on for CIFAR, off otherwise)."""
    aug = getattr(cfg, "augment", None)
    name = DataName(getattr(cfg, "name")).value
    return bool(DEFAULT_AUGMENT.get(name, False) if aug is None else aug)

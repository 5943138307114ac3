"""Any Hugging Face data set of images (or feature vectors) and integer labels, through the optional
``datasets`` library (``pip install datasets``), from its local cache or local files.

Data sets that record who produced each example (FEMNIST's ``writer_id``, for instance: Caldas et
al., "LEAF: A Benchmark for Federated Settings", 2018) carry a natural partition among clients;
``partition_key`` turns that column into :attr:`~robustagg.data.LoadedData.groups`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..errors import ConfigError, DataFileError
from .loaders import LoadedData

__all__ = ["load_hf"]


def _images(column: Any, key: str, split: str, as_float: bool) -> torch.Tensor:
    try:
        x = np.stack([np.asarray(v) for v in column])
    except ValueError as e:
        raise DataFileError(f"column {key!r} of split {split!r} holds examples of different shapes ({e}); "
                            "resize them to one shape first (datasets' map).") from e
    if x.ndim == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
        x = x.transpose(0, 3, 1, 2)  # (N, H, W, C) -> (N, C, H, W)
    elif x.ndim == 3:
        x = x[:, None]  # grey images (N, H, W) -> (N, 1, H, W)
    t = torch.from_numpy(np.ascontiguousarray(x))
    if x.dtype == np.uint8:
        return t.to(torch.float32).div_(255.0) if as_float else t
    if not np.issubdtype(x.dtype, np.number):
        raise DataFileError(f"column {key!r} of split {split!r} holds {x.dtype} values, not numbers or images.")
    return t.to(torch.float32)


def load_hf(path: str, *, image_key: str = "image", label_key: str = "label", name: Optional[str] = None,
            train_split: str = "train", test_split: Optional[str] = "test", partition_key: Optional[str] = None,
            data_files: Any = None, cache_dir: Optional[str] = None, as_float: bool = True,
            num_classes: Optional[int] = None) -> LoadedData:
    """Load a Hugging Face data set with ``datasets.load_dataset(path, name, data_files=..., cache_dir=...)``.

    Set ``HF_DATASETS_OFFLINE=1`` to use only the local cache (no network call).

    Args:
        path: the data set's hub name (e.g. ``"flwrlabs/femnist"``) or a local folder / builder
            (``"imagefolder"``, ``"parquet"`` with ``data_files``).
        image_key: the input column (images, or numeric vectors). label_key: the integer label column.
        name: the configuration name, if any. train_split, test_split: split names (``test_split=None``:
            the source has no test split and an empty one is returned; split the train set yourself).
        partition_key: a column naming each example's natural group (e.g. ``writer_id``), or ``None``.
        data_files: passed to ``load_dataset``.
        cache_dir: passed to ``load_dataset``.
        as_float: uint8 images as float32 in ``[0, 1]`` (default) or kept uint8.
        num_classes: C; default the label feature's ``num_classes`` or ``max label + 1``.

    Returns:
        A :class:`~robustagg.data.LoadedData`: images ``(N, C, H, W)`` (grey images get ``C = 1``,
        channel-last images are transposed), vectors ``(N, D)``; labels int64; ``groups`` when
        ``partition_key`` is given.

    Raises:
        ConfigError: ``datasets`` is not installed; a split or column is missing (the message lists
            the ones present); labels outside ``[0, num_classes)``.
        DataFileError: examples of different shapes, or a non-numeric input column.
    """
    try:
        import datasets  # type: ignore[import-not-found]  # optional dependency
    except ImportError as e:
        raise ConfigError("data=hf needs the optional 'datasets' package, which is not installed: "
                          "pip install datasets (or pip install 'robustagg[hf]').") from e
    dd = datasets.load_dataset(path, name=name, data_files=data_files, cache_dir=cache_dir)
    splits = list(dd.keys())
    wanted: Sequence[str] = [train_split] + ([test_split] if test_split is not None else [])
    for s in wanted:
        if s not in dd:
            raise ConfigError(f"data set {path!r} has no split {s!r}; its splits are {splits} "
                              "(data.train_split / data.test_split; test_split=null if it has none).")
    train = dd[train_split]
    for key, what in ((image_key, "data.image_key"), (label_key, "data.label_key"), (partition_key,
                                                                                         "data.partition_key")):
        if key is not None and key not in train.column_names:
            raise ConfigError(f"data set {path!r} has no column {key!r} ({what}); its columns are {train.column_names}.")

    def split_xy(ds: Any, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        fmt = ds.with_format("numpy")
        x = _images(fmt[image_key], image_key, split, as_float)
        y = np.asarray(fmt[label_key])
        if not np.issubdtype(y.dtype, np.integer):
            raise ConfigError(f"column {label_key!r} of split {split!r} must hold integer labels; got {y.dtype}.")
        return x, torch.from_numpy(y.astype(np.int64))

    xtr, ytr = split_xy(train, train_split)
    if test_split is not None:
        xte, yte = split_xy(dd[test_split], test_split)
    else:
        xte, yte = xtr[:0].clone(), ytr[:0].clone()
    if num_classes is None:
        feature = getattr(train, "features", {}).get(label_key) if hasattr(train, "features") else None
        num_classes = getattr(feature, "num_classes", None)
    top = int(max(int(ytr.max()), int(yte.max()) if len(yte) else 0))
    classes = int(num_classes) if num_classes is not None else top + 1
    if int(ytr.min()) < 0 or top >= classes:
        raise ConfigError(f"labels of {path!r} span [{int(ytr.min())}, {top}], outside [0, {classes}) (data.num_classes).")
    groups, names = None, ()
    if partition_key is not None:
        keys = np.asarray(train.with_format("numpy")[partition_key])
        uniq, inverse = np.unique(keys, return_inverse=True)
        groups, names = torch.from_numpy(inverse.astype(np.int64).reshape(-1)), tuple(uniq.tolist())
    return LoadedData(train_x=xtr, train_y=ytr, test_x=xte, test_y=yte, num_classes=classes,
                      input_shape=tuple(int(s) for s in xtr.shape[1:]), name=path, groups=groups, group_names=names)

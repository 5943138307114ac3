"""The data readers on tiny files written here in each published format (no network anywhere).

The writers below follow the format descriptions independently of the library's readers: IDX
(LeCun et al. 1998) with ``struct``, CIFAR's binary records byte by byte, and CIFAR's python
batches as Python 2 wrote them (protocol 2, byte-string keys and strings, numpy arrays through
``numpy.core.multiarray._reconstruct``) via a pickler subclass that emits Python 2 ``str``
opcodes and the numpy 1 module names.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import pickletools
import struct
import sys
import tarfile
import types
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch

from robustagg.data import (RestrictedUnpickler, from_user, load, load_hf, missing_message, parse_idx, read_idx,
                            safe_unpickle)
from robustagg.data import download as dl
from robustagg.data.cifar import read_cifar_binary, read_cifar_python
from robustagg.data.folders import IDX_FILES
from robustagg.errors import ConfigError, DataFileError, MissingDataError

RNG = np.random.default_rng(1234)


# ------------------------------------------------------------------------------------------------
# writers
def idx_bytes(arr: np.ndarray) -> bytes:
    codes = {np.dtype(np.uint8): 0x08, np.dtype(">i2"): 0x0B, np.dtype(">f4"): 0x0D}
    code = codes[arr.dtype]
    return bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()


def write_idx(path: Path, arr: np.ndarray, *, gz: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = idx_bytes(arr)
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def write_mnist(folder: Path, *, n_train: int = 300, n_test: int = 60, gz: bool = True) -> dict[str, np.ndarray]:
    arrays = {
        "train-images-idx3-ubyte": RNG.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": RNG.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": RNG.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": RNG.integers(0, 10, n_test, dtype=np.uint8),
    }
    for name, a in arrays.items():
        write_idx(folder / name, a, gz=gz)
    return arrays


def cifar_records(images: np.ndarray, *labels: np.ndarray) -> bytes:
    out = bytearray()
    for i in range(len(images)):
        out += bytes(int(lab[i]) for lab in labels)
        out += images[i].tobytes()  # (3, 32, 32) C order: 1024 red, 1024 green, 1024 blue
    return bytes(out)


class Py2Pickler(pickle._Pickler):  # type: ignore[name-defined]
    """Writes pickles the way Python 2's cPickle wrote the CIFAR batches: every string a
    ``SHORT_BINSTRING``/``BINSTRING`` (a Python 2 ``str``), globals by their numpy 1 module names."""

    dispatch = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]

    def save_py2_str(self, obj):
        data = obj.encode("latin1") if isinstance(obj, str) else bytes(obj)
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[str] = save_py2_str
    dispatch[bytes] = save_py2_str

    def save_global(self, obj, name=None):
        module = obj.__module__.replace("numpy._core", "numpy.core")
        self.write(pickle.GLOBAL + f"{module}\n{name or obj.__qualname__}\n".encode())
        self.memoize(obj)

    dispatch[types.FunctionType] = save_global
    dispatch[type] = lambda self, obj: self.save_global(obj)


def py2_pickle(obj) -> bytes:
    buf = io.BytesIO()
    Py2Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def cifar_py_batch(images: np.ndarray, labels: dict[str, np.ndarray]) -> bytes:
    d = {b"batch_label": b"training batch 1 of 5", b"data": images.reshape(len(images), -1),
         b"filenames": [f"img_{i}.png".encode() for i in range(len(images))]}
    for k, v in labels.items():
        d[k.encode()] = [int(t) for t in v]
    return py2_pickle(d)


def globals_of(data: bytes) -> set[str]:
    return {arg for op, arg, _ in pickletools.genops(data) if op.name in ("GLOBAL", "STACK_GLOBAL", "INST")}


# ------------------------------------------------------------------------------------------------
# IDX
@pytest.mark.parametrize("gz", [False, True])
def test_idx_images_and_labels_roundtrip_gzipped_or_not(tmp_path, gz):
    arrays = write_mnist(tmp_path, gz=gz)
    suffix = ".gz" if gz else ""
    for name, a in arrays.items():
        got = read_idx(tmp_path / f"{name}{suffix}", ndim=a.ndim)
        assert got.dtype == a.dtype and got.shape == a.shape and np.array_equal(got, a)


def test_idx_big_endian_elements_by_hand():
    # int16 258 = 0x0102 and -2 = 0xFFFE big-endian; float32 1.5 = 0x3FC00000.
    data = bytes([0, 0, 0x0B, 1, 0, 0, 0, 2, 0x01, 0x02, 0xFF, 0xFE])
    assert parse_idx(data).tolist() == [258, -2]
    data = bytes([0, 0, 0x0D, 2, 0, 0, 0, 1, 0, 0, 0, 1, 0x3F, 0xC0, 0, 0])
    assert parse_idx(data).tolist() == [[1.5]]
    assert parse_idx(data).dtype.isnative


def test_idx_truncated_file_names_the_file_and_the_expected_size(tmp_path):
    a = RNG.integers(0, 256, (5, 28, 28), dtype=np.uint8)
    p = write_idx(tmp_path / "train-images-idx3-ubyte", a, gz=False)
    p.write_bytes(p.read_bytes()[:-10])
    expected = 16 + 5 * 28 * 28  # 4-byte magic + 3 sizes of 4 bytes + the pixels
    with pytest.raises(DataFileError, match=rf"{p.name} is truncated: {expected - 10} bytes, expected {expected}"):
        read_idx(p)


def test_idx_bad_magic_wrong_ndim_and_trailing_bytes(tmp_path):
    with pytest.raises(DataFileError, match="not an IDX file: magic bytes 504b0304"):
        parse_idx(b"PK\x03\x04" + bytes(20), name="x.zip")
    labels = idx_bytes(np.arange(3, dtype=np.uint8))
    with pytest.raises(DataFileError, match="1-dimensional IDX array; expected 3 dimensions"):
        parse_idx(labels, ndim=3)
    with pytest.raises(DataFileError, match="longer than its header says: 12 bytes, expected 11"):
        parse_idx(labels + b"\x00")


def test_idx_truncated_gzip_is_a_clear_error(tmp_path):
    p = write_idx(tmp_path / "t10k-images-idx3-ubyte", RNG.integers(0, 256, (50, 28, 28), dtype=np.uint8), gz=True)
    p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])
    with pytest.raises(DataFileError, match=rf"{p.name} is a truncated or corrupt gzip file"):
        read_idx(p)


@pytest.mark.parametrize("name,folder,gz", [("mnist", "MNIST/raw", True), ("fashion_mnist", "FashionMNIST/raw", False),
                                            ("mnist", "", False)])
def test_load_mnist_like_from_the_folders_other_tools_leave(tmp_path, name, folder, gz):
    arrays = write_mnist(tmp_path / folder if folder else tmp_path, gz=gz)
    d = load(name, tmp_path)
    assert d.input_shape == (1, 28, 28) and d.num_classes == 10 and d.name == name
    assert d.train_x.shape == (300, 1, 28, 28) and d.train_x.dtype == torch.float32
    assert torch.equal(d.train_x[:, 0], torch.from_numpy(arrays["train-images-idx3-ubyte"]).float() / 255)
    assert torch.equal(d.test_y, torch.from_numpy(arrays["t10k-labels-idx1-ubyte"]).long())
    raw = load(name, tmp_path, as_float=False)
    assert raw.train_x.dtype == torch.uint8 and torch.equal(raw.train_x[:, 0],
                                                            torch.from_numpy(arrays["train-images-idx3-ubyte"]))


def test_mnist_and_fashion_side_by_side_each_load_from_their_own_folder(tmp_path):
    digits = write_mnist(tmp_path / "MNIST" / "raw", n_train=20, n_test=5)
    clothes = write_mnist(tmp_path / "FashionMNIST" / "raw", n_train=30, n_test=5, gz=False)
    m, f = load("mnist", tmp_path, as_float=False), load("fashion_mnist", tmp_path, as_float=False)
    assert torch.equal(m.train_x[:, 0], torch.from_numpy(digits["train-images-idx3-ubyte"]))
    assert torch.equal(f.train_x[:, 0], torch.from_numpy(clothes["train-images-idx3-ubyte"]))


def test_idx_counts_and_label_range_are_checked(tmp_path):
    write_mnist(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(59, dtype=np.uint8), gz=True)
    with pytest.raises(DataFileError, match="holds 60 images but .*t10k-labels-idx1-ubyte.gz holds 59 labels"):
        load("mnist", tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.full(60, 10, dtype=np.uint8), gz=True)
    with pytest.raises(DataFileError, match=r"holds label 10, outside \[0, 10\)"):
        load("mnist", tmp_path)


# ------------------------------------------------------------------------------------------------
# CIFAR binary
def test_cifar_binary_pixel_layout_by_hand(tmp_path):
    # One record: label 7, then red plane (1024), green plane, blue plane, each row-major 32x32.
    rec = bytearray(1 + 3072)
    rec[0] = 7
    rec[1 + 1024 + 2] = 200  # green (c=1), row 0, column 2
    rec[1 + 2048 + 32 * 5 + 1] = 99  # blue (c=2), row 5, column 1
    p = tmp_path / "test_batch.bin"
    p.write_bytes(bytes(rec))
    x, y = read_cifar_binary(p, label_bytes=1)
    assert y.tolist() == [[7]] and x.shape == (1, 3, 32, 32)
    assert x[0, 1, 0, 2] == 200 and x[0, 2, 5, 1] == 99 and int(x.sum()) == 299


def test_load_cifar10_binary_version(tmp_path):
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    train = [(RNG.integers(0, 256, (40, 3, 32, 32), dtype=np.uint8), RNG.integers(0, 10, 40)) for _ in range(5)]
    for i, (x, y) in enumerate(train, 1):
        (folder / f"data_batch_{i}.bin").write_bytes(cifar_records(x, y))
    xt, yt = RNG.integers(0, 256, (30, 3, 32, 32), dtype=np.uint8), RNG.integers(0, 10, 30)
    (folder / "test_batch.bin").write_bytes(cifar_records(xt, yt))
    d = load("cifar10", tmp_path, as_float=False)
    assert d.input_shape == (3, 32, 32) and d.num_classes == 10
    assert torch.equal(d.train_x, torch.from_numpy(np.concatenate([x for x, _ in train])))
    assert torch.equal(d.train_y, torch.from_numpy(np.concatenate([y for _, y in train])))
    assert torch.equal(d.test_x, torch.from_numpy(xt)) and d.test_y.tolist() == yt.tolist()


@pytest.mark.parametrize("label,classes", [("fine", 100), ("coarse", 20)])
def test_load_cifar100_binary_version_fine_and_coarse(tmp_path, label, classes):
    folder = tmp_path / "cifar-100-binary"
    folder.mkdir()
    xs = {s: RNG.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8) for s, n in (("train", 200), ("test", 50))}
    coarse = {s: RNG.integers(0, 20, len(x)) for s, x in xs.items()}
    fine = {s: RNG.integers(0, 100, len(x)) for s, x in xs.items()}
    for s in xs:  # record: coarse label byte, fine label byte, pixels
        (folder / f"{s}.bin").write_bytes(cifar_records(xs[s], coarse[s], fine[s]))
    d = load("cifar100", tmp_path, label=label, as_float=False)
    want = fine if label == "fine" else coarse
    assert d.num_classes == classes
    assert d.train_y.tolist() == want["train"].tolist() and d.test_y.tolist() == want["test"].tolist()
    assert torch.equal(d.train_x, torch.from_numpy(xs["train"]))


def test_truncated_cifar_binary_names_the_file_and_the_record_size(tmp_path):
    p = tmp_path / "test.bin"
    p.write_bytes(bytes(2 * 3074 + 100))
    with pytest.raises(DataFileError, match=r"test.bin is truncated .* 6248 bytes is not a positive multiple of the "
                                            r"3074-byte record .* 2 whole record\(s\) and 100 stray bytes"):
        read_cifar_binary(p, label_bytes=2)


# ------------------------------------------------------------------------------------------------
# CIFAR python version
def test_the_python_batch_fixture_references_exactly_the_globals_of_the_originals():
    data = cifar_py_batch(np.zeros((2, 3, 32, 32), np.uint8), {"labels": np.array([1, 2])})
    assert globals_of(data) == {"numpy.core.multiarray _reconstruct", "numpy ndarray", "numpy dtype"}
    assert data[:2] == b"\x80\x02"  # protocol 2
    assert not any(op.name in ("BINUNICODE", "SHORT_BINBYTES", "BINBYTES") for op, _, _ in pickletools.genops(data))


def test_load_cifar10_python_version(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    train = [(RNG.integers(0, 256, (20, 3, 32, 32), dtype=np.uint8), RNG.integers(0, 10, 20)) for _ in range(5)]
    for i, (x, y) in enumerate(train, 1):
        (folder / f"data_batch_{i}").write_bytes(cifar_py_batch(x, {"labels": y}))
    xt, yt = RNG.integers(0, 256, (10, 3, 32, 32), dtype=np.uint8), RNG.integers(0, 10, 10)
    (folder / "test_batch").write_bytes(cifar_py_batch(xt, {"labels": yt}))
    d = load("cifar10", tmp_path, as_float=False)
    assert torch.equal(d.train_x, torch.from_numpy(np.concatenate([x for x, _ in train])))
    assert d.train_y.tolist() == np.concatenate([y for _, y in train]).tolist()
    assert torch.equal(d.test_x, torch.from_numpy(xt)) and d.test_y.dtype == torch.int64


def test_load_cifar100_python_version(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for s, n in (("train", 120), ("test", 30)):
        x = RNG.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        (folder / s).write_bytes(cifar_py_batch(x, {"fine_labels": np.arange(n) % 100, "coarse_labels": np.arange(n) % 20}))
    fine, coarse = load("cifar100", tmp_path), load("cifar100", tmp_path, label="coarse")
    assert fine.train_y.tolist() == (np.arange(120) % 100).tolist() and fine.num_classes == 100
    assert coarse.test_y.tolist() == (np.arange(30) % 20).tolist() and coarse.num_classes == 20


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_calls_os_system_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    evil = py2_pickle({b"data": _Evil(marker)})  # shaped like a batch, its array replaced by the payload
    assert globals_of(evil) == {f"{os.system.__module__} system"}  # it really references os.system
    with pytest.raises(DataFileError, match=r"refused to unpickle the global (posix|os|nt)\.system"):
        safe_unpickle(evil, name="data_batch_1")
    with pytest.raises(DataFileError, match=r"refused to unpickle the global (posix|os|nt)\.system"):
        safe_unpickle(pickle.dumps(_Evil(marker), protocol=2))
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_Evil(control), protocol=2))  # control: a plain unpickler does run the payload
    assert control.exists() and not marker.exists()
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(evil)
    with pytest.raises(DataFileError, match=r"data_batch_1: only numpy arrays are admitted"):
        load("cifar10", tmp_path)
    assert not marker.exists()


def test_python3_resaved_pickles_and_other_globals_are_refused():
    data = pickle.dumps({b"data": np.zeros((1, 3072), np.uint8)}, protocol=2)  # bytes via _codecs.encode
    with pytest.raises(DataFileError, match=r"_codecs\.encode"):
        safe_unpickle(data)
    with pytest.raises(DataFileError, match=r"global numpy\.load"):
        RestrictedUnpickler(io.BytesIO(b"\x80\x02cnumpy\nload\nq\x00.")).load()


def test_truncated_or_misshapen_python_batches_are_clear_errors(tmp_path):
    good = cifar_py_batch(np.zeros((3, 3, 32, 32), np.uint8), {"labels": np.array([1, 2, 3])})
    p = tmp_path / "data_batch_1"
    p.write_bytes(good[: len(good) - 50])
    with pytest.raises(DataFileError, match=r"data_batch_1 is not a readable CIFAR python batch .* truncated"):
        read_cifar_python(p, label_keys=["labels"])
    p.write_bytes(cifar_py_batch(np.zeros((3, 3, 32, 32), np.uint8), {"labels": np.array([1, 2])}))
    with pytest.raises(DataFileError, match=r"'labels' must be a list of 3 labels; got list of length 2"):
        read_cifar_python(p, label_keys=["labels"])
    p.write_bytes(py2_pickle([1, 2, 3]))
    with pytest.raises(DataFileError, match="a CIFAR python batch is a dict; got list"):
        read_cifar_python(p, label_keys=["labels"])


# ------------------------------------------------------------------------------------------------
# missing files, download (fake network)
def test_missing_data_message_says_which_files_to_place_where(tmp_path):
    with pytest.raises(MissingDataError) as e:
        load("cifar10", tmp_path)
    msg = str(e.value)
    assert f"extract cifar-10-binary.tar.gz (170052171 bytes, sha256 {dl.RESOURCES['cifar10'][0].sha256})" in msg
    assert str(tmp_path / "cifar-10-batches-bin") in msg and "data_batch_5.bin" in msg
    assert str(tmp_path / "cifar-10-batches-py") in msg and "download=True" in msg
    msg = missing_message("mnist", tmp_path)
    assert f"into {tmp_path / 'MNIST' / 'raw'}" in msg and msg.count("-ubyte.gz (") == 4


def test_published_digest_table_is_well_formed():
    for name, resources in {**dl.RESOURCES, **dl.ALTERNATIVES}.items():
        for r in resources:
            assert len(r.sha256) == 64 and int(r.sha256, 16) >= 0 and r.size > 0 and r.urls
            assert all(u.endswith("/" + r.filename) for u in r.urls)
    for name in ("mnist", "fashion_mnist"):
        assert sorted(r.filename for r in dl.RESOURCES[name]) == sorted(f + ".gz" for f in IDX_FILES)


class _Response(io.BytesIO):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _fake_net(table: dict[str, bytes]):
    calls: list[str] = []

    def urlopen(url, timeout=None):
        calls.append(url)
        if url not in table:
            raise urllib.error.URLError("no network in tests")
        return _Response(table[url])

    return urlopen, calls


def test_download_without_network_raises_the_place_by_hand_message(tmp_path):
    urlopen, calls = _fake_net({})
    with pytest.raises(MissingDataError, match=r"could not download train-images-idx3-ubyte.gz:\n.*no network") as e:
        dl.download("mnist", tmp_path, urlopen=urlopen)
    assert len(calls) == 2 and "place its files by hand" in str(e.value)  # both mirrors tried
    assert not list((tmp_path / "MNIST" / "raw").iterdir())  # no partial file left


def _fake_mnist_resources(tmp_path: Path):
    payload = {}
    resources = []
    src = tmp_path / "src"
    write_mnist(src, n_train=30, n_test=10, gz=True)
    for f in IDX_FILES:
        data = (src / f"{f}.gz").read_bytes()
        sha = __import__("hashlib").sha256(data).hexdigest()
        urls = (f"https://mirror-a/{f}.gz", f"https://mirror-b/{f}.gz")
        resources.append(dl.Resource(f"{f}.gz", sha, len(data), urls))
        payload[urls[0]] = b"tampered" + data  # the first mirror serves other bytes
        payload[urls[1]] = data
    return tuple(resources), payload


def test_download_verifies_sha256_and_falls_back_to_the_next_mirror(tmp_path, monkeypatch):
    resources, payload = _fake_mnist_resources(tmp_path)
    monkeypatch.setitem(dl.RESOURCES, "mnist", resources)
    urlopen, calls = _fake_net(payload)
    dest = dl.download("mnist", tmp_path / "data", urlopen=urlopen)
    assert dest == tmp_path / "data" / "MNIST" / "raw" and len(calls) == 8
    assert all(dl.sha256_of(dest / r.filename) == r.sha256 for r in resources)
    monkeypatch.setattr(dl.urllib.request, "urlopen", urlopen)
    d = load("mnist", tmp_path / "data", download=True)  # present and verified: nothing fetched
    assert len(calls) == 8 and d.train_x.shape == (30, 1, 28, 28)


def test_download_refuses_when_every_mirror_serves_other_bytes(tmp_path, monkeypatch):
    resources, payload = _fake_mnist_resources(tmp_path)
    monkeypatch.setitem(dl.RESOURCES, "mnist", resources)
    urlopen, _ = _fake_net({u: b"tampered" for u in payload})
    with pytest.raises(DataFileError, match=r"every mirror of train-images-idx3-ubyte.gz delivered other bytes"):
        dl.download("mnist", tmp_path, urlopen=urlopen)
    assert not any((tmp_path / "MNIST" / "raw").iterdir())


def _tar_gz(members: dict[str, bytes], *, symlink: str | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if symlink is not None:
            info = tarfile.TarInfo(symlink)
            info.type = tarfile.SYMTYPE
            info.linkname = "/etc/passwd"
            tar.addfile(info)
    return buf.getvalue()


def test_download_extracts_the_cifar_binary_archive(tmp_path, monkeypatch):
    x, y = RNG.integers(0, 256, (8, 3, 32, 32), dtype=np.uint8), RNG.integers(0, 10, 8)
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    archive = _tar_gz({f"cifar-10-batches-bin/{n}": cifar_records(x, y) for n in names})
    sha = __import__("hashlib").sha256(archive).hexdigest()
    url = "https://mirror/cifar-10-binary.tar.gz"
    monkeypatch.setitem(dl.RESOURCES, "cifar10", (dl.Resource("cifar-10-binary.tar.gz", sha, len(archive), (url,),
                                                              members_under="cifar-10-batches-bin"),))
    urlopen, _ = _fake_net({url: archive})
    monkeypatch.setattr(dl.urllib.request, "urlopen", urlopen)
    d = load("cifar10", tmp_path, download=True, as_float=False)
    assert d.train_x.shape == (40, 3, 32, 32) and torch.equal(d.test_x, torch.from_numpy(x))


@pytest.mark.parametrize("bad", ["cifar-10-batches-bin/../../escape.bin", "elsewhere/x.bin", "symlink"])
def test_safe_extract_refuses_members_outside_the_folder_and_links(tmp_path, bad):
    members = {"cifar-10-batches-bin/ok.bin": b"1"}
    if bad == "symlink":
        data = _tar_gz(members, symlink="cifar-10-batches-bin/link")
    else:
        data = _tar_gz({**members, bad: b"2"})
    arc = tmp_path / "a.tar.gz"
    arc.write_bytes(data)
    out = tmp_path / "out"
    with pytest.raises(DataFileError, match="refused to extract member"):
        dl.safe_extract(arc, out, members_under="cifar-10-batches-bin")
    assert not out.exists() or not any(out.rglob("*"))
    assert not (tmp_path / "escape.bin").exists()


def test_unknown_data_set_name_lists_the_known_ones(tmp_path):
    with pytest.raises(ConfigError, match="unknown data set 'svhn'; the file-based data sets are mnist, fashion_mnist"):
        load("svhn", tmp_path)


# ------------------------------------------------------------------------------------------------
# your own builder
def test_from_user_accepts_tensors_arrays_dicts_and_datasets():
    xtr, ytr = torch.rand(10, 3), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 4])
    xte, yte = np.zeros((2, 3), np.float32), np.array([1, 0])
    a = from_user((xtr, ytr, xte, yte))
    assert a.num_classes == 5 and a.input_shape == (3,) and a.test_y.dtype == torch.int64
    b = from_user({"train_x": xtr, "train_y": ytr, "test_x": xte, "test_y": yte}, num_classes=7)
    assert b.num_classes == 7 and torch.equal(b.train_x, xtr)
    train = torch.utils.data.TensorDataset(xtr, ytr)
    test = torch.utils.data.TensorDataset(torch.from_numpy(xte), torch.from_numpy(yte))
    c = from_user((train, test))
    assert torch.equal(c.train_x, xtr) and torch.equal(c.train_y, ytr) and c.test_x.shape == (2, 3)


def test_from_user_errors_say_what_is_accepted():
    with pytest.raises(ConfigError, match="returned str. Accepted return values: a LoadedData"):
        from_user("nope")
    with pytest.raises(ConfigError, match="train split has 3 inputs but 2 labels"):
        from_user((torch.rand(3, 2), torch.tensor([0, 1]), torch.rand(1, 2), torch.tensor([0])))
    with pytest.raises(ConfigError, match="labels must be a 1-d integer tensor; got torch.float32"):
        from_user((torch.rand(2, 2), torch.tensor([0.0, 1.0]), torch.rand(1, 2), torch.tensor([0])))
    with pytest.raises(ConfigError, match=r"labels span \[0, 3\]; they must lie in \[0, 2\)"):
        from_user((torch.rand(2, 2), torch.tensor([0, 3]), torch.rand(1, 2), torch.tensor([0])), num_classes=2)


# ------------------------------------------------------------------------------------------------
# Hugging Face (the optional `datasets` package is not installed here: a stand-in module with the
# few methods load_hf calls checks the conversion; the real library is exercised where installed)
class _FakeSplit:
    def __init__(self, columns: dict[str, object]) -> None:
        self.columns = columns
        self.column_names = list(columns)
        self.features: dict[str, object] = {}

    def with_format(self, fmt):
        assert fmt == "numpy"
        return self

    def __getitem__(self, key):
        return self.columns[key]


def _fake_datasets(monkeypatch, splits: dict[str, _FakeSplit]):
    calls = []

    def load_dataset(path, name=None, data_files=None, cache_dir=None):
        calls.append((path, name, data_files, cache_dir))
        return splits

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def test_load_hf_without_the_datasets_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(ConfigError, match="needs the optional 'datasets' package, which is not installed"):
        load_hf("flwrlabs/femnist")


def test_load_hf_converts_channel_last_images_and_the_natural_partition(monkeypatch):
    imgs = RNG.integers(0, 256, (12, 28, 28, 1), dtype=np.uint8)  # channel-last, as PIL -> numpy gives
    writers = np.array(["w2", "w0", "w2", "w1", "w0", "w0", "w1", "w2", "w2", "w0", "w1", "w1"])
    train = _FakeSplit({"image": list(imgs), "character": np.arange(12) % 62, "writer_id": writers})
    calls = _fake_datasets(monkeypatch, {"train": train})
    d = load_hf("flwrlabs/femnist", label_key="character", test_split=None, partition_key="writer_id",
                num_classes=62, cache_dir="/cache")
    assert calls == [("flwrlabs/femnist", None, None, "/cache")]
    assert d.input_shape == (1, 28, 28) and d.num_classes == 62 and len(d.test_x) == 0
    assert torch.equal(d.train_x[:, 0], torch.from_numpy(imgs[..., 0]).float() / 255)
    assert d.group_names == ("w0", "w1", "w2")
    assert [g.tolist() for g in d.group_indices()] == [[1, 4, 5, 9], [3, 6, 10, 11], [0, 2, 7, 8]]


def test_load_hf_missing_split_or_column_lists_what_exists(monkeypatch):
    train = _FakeSplit({"img": [np.zeros((4, 4), np.uint8)] * 2, "label": np.array([0, 1])})
    _fake_datasets(monkeypatch, {"train": train})
    with pytest.raises(ConfigError, match=r"has no split 'test'; its splits are \['train'\]"):
        load_hf("x")
    with pytest.raises(ConfigError, match=r"has no column 'image' \(data.image_key\); its columns are \['img', 'label'\]"):
        load_hf("x", test_split=None)
    d = load_hf("x", image_key="img", test_split=None)
    assert d.input_shape == (1, 4, 4) and d.num_classes == 2 and d.groups is None
    with pytest.raises(ConfigError, match="has no natural groups"):
        d.group_indices()

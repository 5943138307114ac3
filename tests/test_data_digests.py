"""The published content of the MNIST-like IDX files is checked after decompression
(robustagg.data.digests), on small files written here: a file that declares the published
dimensions must have the published size and SHA-256, whatever its compression; a file declaring
another published file's dimensions is refused (swapped names); a file with other dimensions is read
without a digest check, and said to be. The real files are in tests/test_fashion_mnist.py."""

from __future__ import annotations

import gzip
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from robustagg.data import CONTENT, load, load_idx_pair, verify_content
from robustagg.data.digests import claims_published, read_verified
from robustagg.errors import DataFileError
from test_data_formats import idx_bytes, write_idx, write_mnist

ROOT = Path(__file__).resolve().parents[1]
TEST_LABELS = CONTENT["fashion_mnist"]["t10k-labels-idx1-ubyte"]


def _fake_published_labels(n: int = 10000) -> bytes:
    """A labels file with the published dimensions (10,000 labels) but not the published labels."""
    return idx_bytes(np.arange(n, dtype=np.int64).astype(np.uint8) % 10)


def test_table_sizes_follow_from_the_published_headers():
    for name in ("mnist", "fashion_mnist"):
        t = CONTENT[name]
        assert t["train-images-idx3-ubyte"].size == 16 + 60000 * 28 * 28 == 47040016
        assert t["t10k-images-idx3-ubyte"].size == 16 + 10000 * 28 * 28 == 7840016
        assert t["train-labels-idx1-ubyte"].size == 8 + 60000 == 60008
        assert t["t10k-labels-idx1-ubyte"].size == 8 + 10000 == 10008
        assert all(len(c.sha256) == 64 and int(c.sha256, 16) >= 0 for c in t.values())
    # The two data sets share names and dimensions, not content.
    assert {c.sha256 for c in CONTENT["mnist"].values()}.isdisjoint(c.sha256 for c in CONTENT["fashion_mnist"].values())


def test_published_dimensions_with_other_content_are_refused_with_both_digests(tmp_path):
    data = _fake_published_labels()
    assert claims_published("fashion_mnist", "t10k-labels-idx1-ubyte", data)
    with pytest.raises(DataFileError) as e:
        verify_content("fashion_mnist", "t10k-labels-idx1-ubyte", data, path=tmp_path / "t10k-labels-idx1-ubyte.gz")
    msg = str(e.value)
    assert "t10k-labels-idx1-ubyte.gz" in msg and hashlib.sha256(data).hexdigest() in msg and TEST_LABELS.sha256 in msg
    assert f"{len(data)} bytes" in msg and f"{TEST_LABELS.size} bytes" in msg


def test_other_dimensions_are_not_checked():
    small = idx_bytes(np.array([1, 2, 3], dtype=np.uint8))
    assert not claims_published("fashion_mnist", "t10k-labels-idx1-ubyte", small)
    verify_content("fashion_mnist", "t10k-labels-idx1-ubyte", small, path="x")  # nothing to compare with
    assert not claims_published("cifar10", "t10k-labels-idx1-ubyte", _fake_published_labels())  # no table


def test_truncated_gzip_of_a_published_file_names_both_digests(tmp_path):
    data = _fake_published_labels()
    raw = gzip.compress(data)
    p = tmp_path / "t10k-labels-idx1-ubyte.gz"
    p.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataFileError) as e:
        read_verified("fashion_mnist", "t10k-labels-idx1-ubyte", p)
    msg = str(e.value)
    assert str(p) in msg and "truncated or corrupt gzip" in msg and TEST_LABELS.sha256 in msg
    assert msg.count("sha256") == 2


def test_truncated_uncompressed_file_names_both_digests(tmp_path):
    p = tmp_path / "t10k-labels-idx1-ubyte"
    p.write_bytes(_fake_published_labels()[:5000])
    with pytest.raises(DataFileError) as e:
        read_verified("fashion_mnist", "t10k-labels-idx1-ubyte", p)
    assert "5000 bytes" in str(e.value) and TEST_LABELS.sha256 in str(e.value)


def test_load_refuses_a_folder_whose_labels_claim_to_be_published(tmp_path):
    folder = tmp_path / "FashionMNIST" / "raw"
    write_mnist(folder, n_train=40, n_test=10)
    (folder / "t10k-labels-idx1-ubyte.gz").unlink()
    (folder / "t10k-labels-idx1-ubyte").write_bytes(_fake_published_labels())
    with pytest.raises(DataFileError, match="not the published fashion_mnist file t10k-labels-idx1-ubyte"):
        load("fashion_mnist", tmp_path)
    # Without a data set name nothing is compared: the format alone is checked (10 images, 10000 labels).
    with pytest.raises(DataFileError, match="10 images but"):
        load_idx_pair(folder / "t10k-images-idx3-ubyte.gz", folder / "t10k-labels-idx1-ubyte", num_classes=10)


def test_small_files_in_the_format_still_load(tmp_path):
    arrays = write_mnist(tmp_path / "FashionMNIST" / "raw", n_train=30, n_test=6)
    d = load("fashion_mnist", tmp_path, as_float=False)
    assert d.train_x.shape == (30, 1, 28, 28) and d.test_y.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()


def test_app_refuses_a_corrupt_file_in_one_line_and_writes_nothing(tmp_path):
    folder = tmp_path / "data"
    write_mnist(folder, n_train=40, n_test=10)
    write_idx(folder / "t10k-labels-idx1-ubyte", np.zeros(10000, dtype=np.uint8), gz=True)  # published dims
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "experiments.train", "data=fashion_mnist", f"data.root={folder}",
                        "trainer.mode=simulated", "trainer.steps=2", "logger=none", f"out_dir={out}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "WANDB_MODE": "disabled"})
    assert r.returncode == 2, r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if "not the published fashion_mnist file" in ln]
    assert len(err) == 1 and TEST_LABELS.sha256 in err[0] and "Traceback" not in r.stderr
    assert not out.exists(), sorted(str(p) for p in out.rglob("*"))  # not even Hydra's record of the command


def _published_as_written(monkeypatch, **contents: bytes) -> None:
    """Point the table's Fashion-MNIST entries named in ``contents`` at those bytes (their digests),
    so that small files written here can stand in for the published ones."""
    from robustagg.data import digests

    table = dict(CONTENT["fashion_mnist"])
    for key, data in contents.items():
        name = key.replace("_", "-")
        table[name] = digests.Content(size=len(data), sha256=hashlib.sha256(data).hexdigest(), dims=table[name].dims)
    monkeypatch.setitem(digests.CONTENT, "fashion_mnist", table)


def test_a_published_file_under_another_published_name_is_refused_as_swapped(tmp_path, monkeypatch):
    """The test labels under the training labels' name (or the reverse): the files are swapped, and
    read as they are the model would train on the test split."""
    test_labels, train_labels = _fake_published_labels(10000), _fake_published_labels(60000)
    _published_as_written(monkeypatch, t10k_labels_idx1_ubyte=test_labels, train_labels_idx1_ubyte=train_labels)
    for data, name, other in ((test_labels, "train-labels-idx1-ubyte", "t10k-labels-idx1-ubyte"),
                              (train_labels, "t10k-labels-idx1-ubyte", "train-labels-idx1-ubyte")):
        with pytest.raises(DataFileError) as e:
            verify_content("fashion_mnist", name, data, path=tmp_path / f"{name}.gz")
        msg = str(e.value)
        assert f"{name}.gz is the published fashion_mnist file {other}" in msg and "misnamed or swapped" in msg


def test_a_subset_with_another_published_files_dimensions_is_read_unchecked(tmp_path, caplog):
    """10,000 training labels that are not the published test labels: a subset, not a swap."""
    with caplog.at_level("WARNING", logger="robustagg.data.digests"):
        verify_content("fashion_mnist", "train-labels-idx1-ubyte", _fake_published_labels(10000), path="x")
    assert "read without a digest check" in caplog.text


def test_swapped_files_in_a_folder_are_refused_by_load(tmp_path, monkeypatch):
    folder = tmp_path / "FashionMNIST" / "raw"
    write_mnist(folder, n_train=40, n_test=10)
    train_labels = _fake_published_labels(60000)
    _published_as_written(monkeypatch, train_labels_idx1_ubyte=train_labels)
    write_idx(folder / "t10k-labels-idx1-ubyte", np.arange(60000, dtype=np.int64).astype(np.uint8) % 10, gz=True)
    with pytest.raises(DataFileError, match="misnamed or swapped"):
        load("fashion_mnist", tmp_path)


@pytest.mark.parametrize("content", [b"", b"<html>not found</html>", b"\x00\x00"])
def test_a_published_name_without_an_idx_header_names_both_digests(tmp_path, content):
    """An empty file or a saved web page under a .gz name (no gzip magic: read as it is)."""
    p = tmp_path / "t10k-labels-idx1-ubyte.gz"
    p.write_bytes(content)
    with pytest.raises(DataFileError) as e:
        read_verified("fashion_mnist", "t10k-labels-idx1-ubyte", p)
    msg = str(e.value)
    assert "has no IDX header" in msg and hashlib.sha256(content).hexdigest() in msg and TEST_LABELS.sha256 in msg


def test_an_unreadable_file_is_one_error_naming_it(tmp_path, monkeypatch):
    p = tmp_path / "t10k-labels-idx1-ubyte.gz"
    p.write_bytes(gzip.compress(_fake_published_labels()))
    real = Path.read_bytes

    def denied(self: Path) -> bytes:
        if self == p:
            raise PermissionError(13, "Permission denied")
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(DataFileError, match="cannot be read \\(Permission denied\\)"):
        read_verified("fashion_mnist", "t10k-labels-idx1-ubyte", p)


def _gz_with_a_flipped_byte(data: bytes, at: float) -> bytes:
    raw = bytearray(gzip.compress(data))
    raw[int(len(raw) * at)] ^= 0xFF
    return bytes(raw)


@pytest.mark.parametrize("damage", ["middle", "crc", "empty", "cut_to_20", "header"])
def test_a_damaged_gzip_of_a_published_name_names_both_digests(tmp_path, damage):
    """Whatever the damage (a flipped byte in the middle or in the CRC, nothing, 20 bytes, the gzip
    header), the refusal names the file and gives the digest of what decompressed next to the
    published one: a label file smaller than one read piece is not lost whole."""
    data = _fake_published_labels()
    raw = gzip.compress(data)
    damaged = {"middle": _gz_with_a_flipped_byte(data, 0.5), "crc": raw[:-8] + bytes(8), "empty": b"\x1f\x8b",
               "cut_to_20": raw[:20], "header": raw[:3] + b"\xff" + raw[4:]}[damage]
    p = tmp_path / "t10k-labels-idx1-ubyte.gz"
    p.write_bytes(damaged)
    with pytest.raises(DataFileError) as e:
        read_verified("fashion_mnist", "t10k-labels-idx1-ubyte", p)
    msg = str(e.value)
    assert str(p) in msg and TEST_LABELS.sha256 in msg and msg.count("sha256") == 2, msg


def test_what_a_damaged_gzip_decompresses_to_is_kept_up_to_the_damage():
    from robustagg.data.digests import _gunzip_prefix

    data = bytes(range(256)) * 400  # 102,400 bytes
    raw = gzip.compress(data)
    assert _gunzip_prefix(raw) == data
    assert _gunzip_prefix(raw[:-8] + bytes(8)) == data  # a bad CRC: every byte of content came out
    cut = _gunzip_prefix(raw[: len(raw) // 2])
    assert 0 < len(cut) < len(data) and data.startswith(cut)
    two = gzip.compress(data[:5000]) + gzip.compress(data[5000:])  # two members (cat a.gz b.gz, BGZF)
    assert gzip.decompress(two) == data and _gunzip_prefix(two + b"junk") == data
    second_bad = gzip.compress(data[:5000]) + gzip.compress(data[5000:])[:-8] + bytes(8)
    assert _gunzip_prefix(second_bad) == data


def test_the_published_content_in_a_damaged_container_is_named_as_such(tmp_path, monkeypatch):
    """Published content in a gzip with bytes after its stream: said to be the published file in a
    damaged container (the table's entry is pointed at a content written here)."""
    from robustagg.data import digests

    data = _fake_published_labels()
    entry = digests.Content(size=len(data), sha256=hashlib.sha256(data).hexdigest(), dims=(10000,))
    monkeypatch.setitem(digests.CONTENT, "fashion_mnist", {**CONTENT["fashion_mnist"], "t10k-labels-idx1-ubyte": entry})
    p = tmp_path / "t10k-labels-idx1-ubyte.gz"
    p.write_bytes(gzip.compress(data) + b"junk")
    with pytest.raises(DataFileError) as e:
        read_verified("fashion_mnist", "t10k-labels-idx1-ubyte", p)
    assert "decompresses to the published fashion_mnist file t10k-labels-idx1-ubyte" in str(e.value)
    assert "gzip container is damaged" in str(e.value)


def test_a_file_of_a_published_name_with_other_dimensions_is_read_with_a_warning(tmp_path, caplog):
    p = tmp_path / "t10k-labels-idx1-ubyte"
    p.write_bytes(idx_bytes(np.array([1, 2, 3], dtype=np.uint8)))
    with caplog.at_level("WARNING", logger="robustagg.data.digests"):
        assert read_verified("fashion_mnist", "t10k-labels-idx1-ubyte", p) == p.read_bytes()
    assert "read without a digest check" in caplog.text and str(p) in caplog.text


def test_the_checker_says_verified_only_when_every_file_was(tmp_path):
    from experiments.data_files import check

    write_mnist(tmp_path / "FashionMNIST" / "raw", n_train=30, n_test=6)
    line = check("fashion_mnist", str(tmp_path))
    assert "NOT verified" in line and "verified against the published" not in line
    assert all(f in line for f in ("train-images-idx3-ubyte", "t10k-labels-idx1-ubyte"))


@pytest.mark.parametrize("kind, download", [("missing", False), ("file", False), ("file", True),
                                            ("dangling", False), ("dangling", True)])
def test_a_data_root_that_is_not_a_folder_is_refused_naming_data_root(tmp_path, kind, download):
    from robustagg.errors import MissingDataError

    root = tmp_path / "nowhere"
    if kind == "file":
        root.write_text("x")
    if kind == "dangling":
        root.symlink_to(tmp_path / "gone")
    with pytest.raises(MissingDataError) as e:
        load("fashion_mnist", root, download=download)
    msg = str(e.value)
    assert msg.startswith(f"data.root={root} ") and "\n" not in msg
    assert {"missing": "does not exist", "file": "is a file, not a folder", "dangling": "symbolic link to nothing"}[kind] in msg


def test_a_refused_run_keeps_folders_that_existed_before_it(tmp_path):
    """A refusal removes only what the command created: a user's folder named by out_dir, with a
    log file of theirs in it, and the folder above it survive."""
    mine = tmp_path / "runs" / "exp1"
    mine.mkdir(parents=True)
    (mine / "notes.log").write_text("mine")
    r = subprocess.run([sys.executable, "-m", "experiments.train", "data=fashion_mnist",
                        f"data.root={tmp_path / 'nowhere'}", "trainer.mode=simulated", "trainer.steps=2", "logger=none",
                        f"out_dir={mine}"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "data.root=" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert (mine / "notes.log").read_text() == "mine"
    fresh = tmp_path / "runs" / "new" / "exp2"  # created by the command: removed, with runs/new
    r = subprocess.run([sys.executable, "-m", "experiments.train", "data=fashion_mnist",
                        f"data.root={tmp_path / 'nowhere'}", "trainer.mode=simulated", "trainer.steps=2", "logger=none",
                        f"out_dir={fresh}"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and not (tmp_path / "runs" / "new").exists() and mine.is_dir()


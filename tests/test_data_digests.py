"""The published content of the MNIST-like IDX files is checked after decompression
(robustagg.data.digests), on small files written here: a file that declares the published
dimensions must have the published size and SHA-256, whatever its compression; a file with other
dimensions is read without a digest check. The real files are in tests/test_fashion_mnist.py."""

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
    # Hydra's own record of the command (.hydra/, train.log) is all there is: no metrics, no checkpoint.
    written = [p for p in out.rglob("*") if p.is_file() and ".hydra" not in p.parts and p.name != "train.log"]
    assert written == [], written


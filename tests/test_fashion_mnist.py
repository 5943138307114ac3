"""The real Fashion-MNIST files (Xiao, Rasul, Vollgraf 2017), as `make data` installs them (Debian's
dataset-fashion-mnist): their decompressed content is the published one, a damaged copy is refused
with both digests, and a 100-step run with the mean and no attack learns (CI installs the files;
without them this module is skipped with one line)."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.train import train
from robustagg.data import CONTENT, IDX_FILES, load, system_root
from robustagg.data.digests import read_verified
from robustagg.errors import DataFileError

FOLDER = system_root("fashion_mnist")
if FOLDER is None:
    pytest.skip("real Fashion-MNIST not installed: run `make data` (Debian's dataset-fashion-mnist) to run these "
                "tests", allow_module_level=True)

CONF = Path(__file__).resolve().parents[1] / "conf"


def test_installed_files_are_the_published_content():
    for name in IDX_FILES:
        data = read_verified("fashion_mnist", name, FOLDER / f"{name}.gz")
        assert len(data) == CONTENT["fashion_mnist"][name].size


def test_load_gives_the_published_splits_with_balanced_classes():
    d = load("fashion_mnist")
    assert d.train_x.shape == (60000, 1, 28, 28) and d.test_x.shape == (10000, 1, 28, 28)
    assert torch.bincount(d.train_y).tolist() == [6000] * 10 and torch.bincount(d.test_y).tolist() == [1000] * 10
    assert float(d.train_x.min()) == 0.0 and float(d.train_x.max()) == 1.0


def _copy(tmp_path: Path) -> Path:
    dest = tmp_path / "fashion"
    dest.mkdir()
    for name in IDX_FILES:
        shutil.copyfile(FOLDER / f"{name}.gz", dest / f"{name}.gz")
    return dest


def test_one_changed_pixel_is_refused_with_both_digests(tmp_path):
    dest = _copy(tmp_path)
    p = dest / "t10k-images-idx3-ubyte.gz"
    raw = bytearray(gzip.decompress(p.read_bytes()))
    raw[5000] ^= 0x01
    p.write_bytes(gzip.compress(bytes(raw)))
    with pytest.raises(DataFileError) as e:
        load("fashion_mnist", dest)
    msg = str(e.value)
    assert str(p) in msg and CONTENT["fashion_mnist"]["t10k-images-idx3-ubyte"].sha256 in msg and msg.count("sha256") == 2


def test_truncated_archive_is_refused_with_both_digests(tmp_path):
    dest = _copy(tmp_path)
    p = dest / "train-labels-idx1-ubyte.gz"
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(DataFileError) as e:
        load("fashion_mnist", dest)
    assert "truncated or corrupt gzip" in str(e.value)
    assert CONTENT["fashion_mnist"]["train-labels-idx1-ubyte"].sha256 in str(e.value)


def test_the_real_files_under_each_others_names_are_refused(tmp_path):
    """The test split under the training split's names and the reverse (the checker once called
    this folder verified, and a run trained on the 10,000 test images)."""
    dest = tmp_path / "swapped"
    dest.mkdir()
    for a, b in (("train", "t10k"), ("t10k", "train")):
        for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
            (dest / f"{a}-{kind}.gz").symlink_to(FOLDER / f"{b}-{kind}.gz")
    with pytest.raises(DataFileError, match="misnamed or swapped"):
        load("fashion_mnist", dest)


def test_a_flipped_byte_inside_the_real_label_archive_names_both_digests(tmp_path):
    dest = _copy(tmp_path)
    p = dest / "t10k-labels-idx1-ubyte.gz"
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(DataFileError) as e:
        load("fashion_mnist", dest)
    msg = str(e.value)
    assert str(p) in msg and CONTENT["fashion_mnist"]["t10k-labels-idx1-ubyte"].sha256 in msg and msg.count("sha256") == 2


def _cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=["logger=none", "trainer.progress=false", *overrides])


@pytest.mark.slow
def test_hundred_steps_of_the_mean_without_attack_beat_seventy_percent(tmp_path):
    """The benchmark's setup (conf/experiment/fmnist_benchmark.yaml) shortened to 100 steps."""
    cfg = _cfg("+experiment=fmnist_benchmark", "+experiment/rule=mean", "+experiment/heterogeneity=iid",
               "attack=none", "trainer.steps=100", "seed=0")
    s = train(cfg, out_dir=tmp_path / "run", quiet=True)
    assert s["data"] == "fashion_mnist" and s["steps"] == 100 and s["byzantine"] == 0
    assert s["final_test_acc"] > 0.70, s["final_test_acc"]


@pytest.mark.slow
def test_one_reproduction_cell_runs_at_a_few_steps(tmp_path):
    """Fang et al. 2020's sweep (conf/experiment/repro_fang2020_fmnist.yaml): Krum under the Krum
    attack, at its n = 20, f = 4, for 3 steps: the setup composes, validates and trains."""
    cfg = _cfg("+experiment=repro_fang2020_fmnist", "+experiment/rule=krum", "attack=fang_krum", "trainer.steps=3",
               "trainer.eval_every=3", "seed=0")
    s = train(cfg, out_dir=tmp_path / "run", quiet=True)
    assert (s["rule"], s["attack"], s["n"], s["byzantine"], s["steps"]) == ("krum", "fang_krum", 20, 4, 3)
    assert 0.0 <= s["final_test_acc"] <= 1.0


REPRODUCTIONS = ("repro_fang2020_fmnist", "repro_fltrust2021_fmnist", "repro_allouah2023_fmnist",
                 "repro_shejwalkar2021_fmnist")


@pytest.mark.parametrize("experiment", REPRODUCTIONS)
def test_every_rule_of_every_reproduction_sweep_validates(experiment, tmp_path):
    """Each rule of a committed reproduction sweep, with its first attack, passes the app's checks
    before launch (a setting meant for one rule, such as FLTrust's root set, once stopped a whole
    sweep at its first cell)."""
    from omegaconf import OmegaConf

    from experiments.wiring import validate

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        params = OmegaConf.to_container(compose("config", overrides=[f"+experiment={experiment}"],
                                                return_hydra_config=True).hydra.sweeper.params)
    sweep = {str(k): str(v).split(",") for k, v in params.items()}
    fixed = [f"{k}={v[0]}" for k, v in sweep.items() if k != "+experiment/rule"]
    for rule in sweep["+experiment/rule"]:
        cfg = _cfg(f"+experiment={experiment}", f"+experiment/rule={rule}", *fixed)
        plan = validate(cfg, out_dir=str(tmp_path / rule))
        assert (plan.n, plan.f) == (cfg.threat.n, cfg.threat.f), rule

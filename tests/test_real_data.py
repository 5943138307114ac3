"""Real-format data end to end: ``data=mnist|cifar10 data.root=DIR`` with LeNet-5, Adam and the
warm-up cosine schedule, in simulated mode and with real processes, on tiny files written in the
published formats (IDX, CIFAR binary). Simulated and multi-process runs end with the same
parameters and optimizer state bit for bit, also with CIFAR's per-worker augmentation on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from experiments.train import train
from experiments.wiring import build_model_and_optimizer, validate
from real_files import write_cifar10_files, write_mnist_files
from state_equal import assert_state_equal
from robustagg.checkpoint import load_state
from robustagg.data import Augment
from robustagg.errors import ConfigError, MissingDataError

CONF = Path(__file__).resolve().parents[1] / "conf"
STEPS = 4
FAST = ["logger=none", "trainer.progress=false", "threat.n=3", "threat.f=1", "attack=sign_flip",
        f"trainer.steps={STEPS}", "trainer.eval_every=2", f"trainer.checkpoint.every={STEPS}",
        "trainer.collective_timeout_s=60"]
DONE_WHEN = ["model=lenet5", "optimizer=adam", "scheduler=warmup_cosine", "scheduler.warmup_steps=2"]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*FAST, *overrides])


def _end(run: Path):
    state = load_state(run / "checkpoints" / f"step-{STEPS:08d}" / "replicated.pt")
    return load_file(str(run / "model.safetensors")), state["optimizer"], state["scheduler"]


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("data")
    return {"mnist": write_mnist_files(base / "mnist"), "cifar10": write_cifar10_files(base / "cifar")}


def _both_modes(tmp_path, *overrides):
    runs = {}
    for mode in ("simulated", "processes"):
        runs[mode] = tmp_path / mode
        s = train(_cfg(*overrides, f"trainer.mode={mode}"), out_dir=runs[mode], quiet=True)
        assert s["steps"] == STEPS and s["mode"] == mode
    a, b = _end(runs["simulated"]), _end(runs["processes"])
    for name, x, y in zip(("parameters", "optimizer", "scheduler"), a, b):
        assert_state_equal(x, y, name)
    return s, a


@pytest.mark.slow
def test_done_when_command_on_mnist_files_in_both_modes(roots, tmp_path):
    s, (params, opt, sched) = _both_modes(tmp_path, "data=mnist", f"data.root={roots['mnist']}", *DONE_WHEN)
    assert s["data"] == "mnist" and s["partition"] == "iid"
    exp_avg = [v["exp_avg"] for v in opt["state"].values()]
    assert exp_avg and all(v["step"] == STEPS for v in opt["state"].values())  # Adam's moments and counter
    assert sched["last_epoch"] == STEPS and sched["lr_lambdas"] == [{"warmup_steps": 2, "total_steps": STEPS}]
    assert "features.0.weight" in params and tuple(params["features.0.weight"].shape) == (6, 1, 5, 5)


@pytest.mark.slow
def test_cifar10_augmentation_is_on_by_default_and_identical_in_both_modes(roots, tmp_path):
    over = ["data=cifar10", f"data.root={roots['cifar10']}", "model=lenet5"]
    _, (params, _, _) = _both_modes(tmp_path, *over)
    assert "1.features.0.weight" in params  # Sequential(Augment, LeNet5): the crop + flip ran in front
    off = train(_cfg(*over, "data.augment=false", "trainer.mode=simulated"), out_dir=tmp_path / "off", quiet=True)
    assert off["steps"] == STEPS
    unaugmented = load_file(str(tmp_path / "off" / "model.safetensors"))
    assert not torch.equal(unaugmented["features.0.weight"], params["1.features.0.weight"])  # it changed the run


def test_real_data_bundle_is_flat_float32_with_the_image_shape(roots):
    plan = validate(_cfg("data=cifar10", f"data.root={roots['cifar10']}", "model=lenet5", "data.max_test_samples=7"))
    d = plan.data
    assert d.input_shape == (3, 32, 32) and d.train_x.shape == (120, 3072) and d.train_x.dtype == torch.float32
    assert d.test_x.shape == (7, 3072) and float(d.train_x.max()) <= 1.0 and d.num_classes == 10
    assert sum(d.sizes()) == 120  # the published test split is the test set; iid over 3 workers
    model, _, _ = build_model_and_optimizer(d, plan.config(), torch.device("cpu"))
    assert isinstance(model[0], Augment)
    plan = validate(_cfg("data=mnist", f"data.root={roots['mnist']}", "model=lenet5"))
    model, _, _ = build_model_and_optimizer(plan.data, plan.config(), torch.device("cpu"))
    assert not isinstance(model, torch.nn.Sequential)  # MNIST: augmentation off by default


def tiny_builder(n: int = 30, dim: int = 5):
    g = torch.Generator().manual_seed(0)
    return torch.rand(n, dim, generator=g), torch.arange(n) % 3, torch.rand(0, dim), torch.zeros(0, dtype=torch.int64)


def test_own_builder_by_target_and_its_empty_test_split_is_held_out():
    plan = validate(_cfg("data=custom", "data._target_=test_real_data.tiny_builder", "+data.args.n=40"))
    d = plan.data
    assert d.name == "custom" and d.input_shape == (5,) and d.num_classes == 3
    assert len(d.train_y) + len(d.test_y) == 40 and len(d.test_y) > 0


def test_missing_root_and_natural_without_groups_are_clear_errors(roots, tmp_path):
    with pytest.raises(ConfigError, match="data=mnist needs data.root=DIR"):
        validate(_cfg("data=mnist", "model=lenet5"))
    with pytest.raises(ConfigError, match="data.partition=natural needs natural groups"):
        validate(_cfg("data=mnist", f"data.root={roots['mnist']}", "data.partition=natural"))
    with pytest.raises(ConfigError, match="data=custom needs data._target_"):
        validate(_cfg("data=custom"))
    with pytest.raises(MissingDataError, match="place its files by hand"):
        validate(_cfg("data=cifar10", f"data.root={tmp_path}"))


@pytest.mark.slow
@pytest.mark.parametrize("experiment,data,rule,attack", [("allouah2023_mnist", "mnist", "nnm_krum", "ipm"),
                                                          ("cifar10_resnet20", "cifar10", "nnm_trimmed_mean", "alie")])
def test_literature_configs_run_on_tiny_files(roots, tmp_path, experiment, data, rule, attack):
    # one point of each sweep, 2 steps, on the tiny files (the sweep itself needs the real ones)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"+experiment={experiment}", f"+experiment/rule={rule}", f"attack={attack}",
                                           f"data.root={roots[data]}", "trainer.steps=2", "trainer.eval_every=2",
                                           "logger=none", "data.max_tries=1000"])
    s = train(cfg, out_dir=tmp_path, quiet=True)
    assert s["steps"] == 2 and s["data"] == data and s["rule"] == rule.replace("nnm_", "nnm>")
    assert s["attack"] == attack and 0.0 <= s["final_test_acc"] <= 1.0


def test_natural_partition_gives_whole_groups_round_robin():
    from experiments.data import _natural

    # keys 5, 7, 9 become groups 0, 1, 2 (sorted); group k goes to worker k mod 2
    parts = _natural(np.array([5, 5, 7, 9, 7, 9]), 2, "hf")
    assert [p.tolist() for p in parts] == [[0, 1, 3, 5], [2, 4]]


def test_hf_without_the_optional_package_or_a_path_is_a_clear_error():
    with pytest.raises(ConfigError, match="data=hf needs data.path"):
        validate(_cfg("data=hf"))
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="pip install datasets"):
            validate(_cfg("data=hf", "data.path=flwrlabs/femnist"))

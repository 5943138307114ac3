"""conf/: every config file composes against the schema; bad configurations fail before launch.

Nothing here starts a process: :func:`experiments.wiring.validate` is what ``train`` runs first.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

import attacks
import experiments.config  # noqa: F401  (registers the schema)
import robustagg as ra
from experiments.wiring import as_config, build_attack, build_rule, rule_names, validate
from robustagg.errors import AssumptionError, ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ["aggregator", "preaggregation", "attack", "threat", "data", "model", "optimizer", "scheduler", "trainer",
          "logger"]
FAST = ["trainer.steps=1", "logger=none"]


def _compose(overrides=()):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_every_rule_and_attack_has_a_config_file():
    assert _options("aggregator") == sorted(rule_names())
    maps = [n for n in ra.available() if n not in rule_names()]
    assert _options("preaggregation") == sorted(maps + ["none"])
    assert _options("attack") == sorted(attacks.available() + ["none"])


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_config_file_composes_and_builds(group, option):
    cfg = as_config(_compose([f"{group}={option}"]))
    assert cfg.threat.n == 10 and cfg.threat.f == 2
    if group == "aggregator":
        assert cfg.aggregator.f == 2 if "f" in cfg.aggregator else True  # interpolated from threat.f
        assert isinstance(build_rule(cfg), ra.Aggregator)
    if group == "preaggregation" and option != "none":
        assert isinstance(build_rule(cfg), ra.Pipeline)
    if group == "attack":
        att = build_attack(cfg)
        assert (att is None) == (option == "none")
        if att is not None:
            assert att.name == option


def test_experiment_example_composes_and_validates():
    cfg = _compose(["+experiment=example", *FAST])
    assert cfg.trainer.mode.value == "simulated" and cfg.data.partition.value == "dirichlet"
    plan = validate(cfg)
    assert plan.rule_name == "nnm>krum" and plan.attack_name == "sign_flip"


def test_defaults_are_the_documented_run():
    cfg = _compose()
    plan = validate(cfg)
    assert (plan.n, plan.f, plan.byzantine_ranks) == (10, 2, (8, 9))
    assert plan.rule_name == "trimmed_mean" and plan.attack_name == "alie" and plan.data.name == "digits"
    assert cfg.trainer.mode.value == "processes" and cfg.logger.name == "wandb" and cfg.logger.mode == "offline"


def test_stable_user_keys_and_single_source_for_n_and_f():
    cfg = _compose(["aggregator=krum", "preaggregation=nnm", "attack=ipm", "threat.n=11", "threat.f=3",
                    "threat.byzantine=2", "data=synthetic", "data.partition=dirichlet", "trainer.steps=7",
                    "trainer.mode=simulated", "seed=4", "logger=none"])
    assert cfg.aggregator.f == 3 and cfg.preaggregation.f == 3  # f set once, in threat/
    plan = validate(cfg)
    assert plan.n == 11 and plan.byzantine_ranks == (9, 10) and plan.data.name == "synthetic"
    assert plan.cfg["trainer"]["steps"] == 7 and plan.cfg["seed"] == 4 and plan.cfg["trainer"]["mode"] == "simulated"


@pytest.mark.parametrize("override", ["trainer.setps=10", "threat.nn=3", "data.partition=iidd",
                                      "trainer.mode=simulatd", "aggregator.tua=1.0"])
def test_misspelt_keys_and_values_fail_at_composition(override):
    with pytest.raises((HydraException, OmegaConfBaseException)):
        _compose([override])


def test_unknown_rule_or_attack_name_lists_the_available_ones():
    with pytest.raises(HydraException, match=r"(?s)Could not find 'aggregator/krumm'.*trimmed_mean"):
        _compose(["aggregator=krumm"])
    with pytest.raises(HydraException, match=r"(?s)Could not find 'attack/alie2'.*sign_flip"):
        _compose(["attack=alie2"])
    with pytest.raises(ConfigError, match="unknown aggregator 'robustagg.Nope'; available: .*krum"):
        validate(_compose(["aggregator._target_=robustagg.Nope", *FAST]))
    with pytest.raises(ConfigError, match="unknown attack 'attacks.Nope'; available: none, agr_tailored"):
        validate(_compose(["attack._target_=attacks.Nope", *FAST]))
    with pytest.raises(ConfigError, match="CenteredClipping does not take 'tua'; its parameters are tau, iterations"):
        validate(_compose(["aggregator=centered_clipping", "+aggregator.tua=1.0", *FAST]))


def test_requirement_fails_before_launch_with_the_rules_message():
    with pytest.raises(AssumptionError, match=r"Krum requires n >= 2f \+ 3 \(Blanchard et al., NeurIPS 2017\); "
                                              r"got n=6, f=2\. Lower f, add workers, or pass strict=False"):
        validate(_compose(["aggregator=krum", "threat.n=6", *FAST]))
    with pytest.raises(AssumptionError, match=r"Krum requires n >= 2f \+ 3.*got n=5, f=2.*preaggregation bucketing "
                                              r"turns the 10 submissions into 5 rows"):
        validate(_compose(["aggregator=krum", "preaggregation=bucketing", *FAST]))  # ceil(10/2) = 5 rows
    plan = validate(_compose(["aggregator=krum", "threat.n=6", "strict=false", *FAST]))
    assert plan.assumption_violated and "Krum requires" in plan.violations[0]


def test_more_byzantine_than_declared_needs_strict_false():
    with pytest.raises(AssumptionError, match="threat.byzantine=3 actual Byzantine workers exceed the declared "
                                          "threat.f=2.*strict=false"):
        validate(_compose(["threat.byzantine=3", *FAST]))
    plan = validate(_compose(["threat.byzantine=3", "strict=false", *FAST]))
    assert plan.assumption_violated and plan.byzantine_ranks == (7, 8, 9)


def test_other_refusals_before_launch(monkeypatch):
    with pytest.raises(ConfigError, match=r"leaves worker\(s\) \[5, 6, 7, 8, 9\] of n=10 with no training data"):
        validate(_compose(["data.max_train_samples=5", *FAST]))
    # ALIE's z is undefined when s = floor(n/2 + 1) - f <= 0: n = 4, f = 3 gives s = 0.
    with pytest.raises(AssumptionError, match="attack=alie cannot run with n=4 workers of which 3 Byzantine"):
        validate(_compose(["aggregator=mean", "threat.n=4", "threat.f=3", *FAST]))
    with pytest.raises(ConfigError, match="threat.byzantine=4 leaves no honest worker"):
        validate(_compose(["threat.n=4", "threat.f=4", "aggregator=mean", *FAST]))
    with pytest.raises(ConfigError, match="trainer.reduction must be one of auto, gather, sharded"):
        validate(_compose(["trainer.reduction=nope", *FAST]))
    with pytest.raises(ConfigError, match="model=cnn needs image data"):
        validate(_compose(["model=cnn", "data=synthetic", *FAST]))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="torchrun started 3 processes but threat.n=10"):
        validate(_compose(FAST))


def test_the_mean_is_a_baseline_not_a_violation():
    plan = validate(_compose(["aggregator=mean", *FAST]))  # f = 2 declared: advisory only
    assert not plan.assumption_violated and "Mean requires f = 0" in plan.violations[0]


def test_attack_none_or_zero_byzantine_means_everyone_is_honest():
    assert validate(_compose(["attack=none", *FAST])).byzantine_ranks == ()
    assert validate(_compose(["threat.byzantine=0", *FAST])).byzantine_ranks == ()


# One example shape each shipped model accepts (digits are 8x8: LeNet-5 and the ResNets need 28x28 or 32x32).
MODEL_SHAPES = {"mlp": (1, 8, 8), "cnn": (1, 8, 8), "lenet5": (1, 28, 28), "resnet20": (3, 32, 32),
                "resnet18": (3, 32, 32)}


def test_every_model_file_has_a_smoke_shape():
    assert sorted(MODEL_SHAPES) == _options("model")


@pytest.mark.parametrize("model", sorted(MODEL_SHAPES))
def test_every_model_entry_builds_for_its_data_shape(model):
    from experiments.models import instantiate_model

    shape = MODEL_SHAPES[model]
    cfg = as_config(_compose([f"model={model}", *FAST]))
    net = instantiate_model(cfg.model, input_shape=shape, num_classes=7)
    x = torch.zeros(2, int(np.prod(shape)))  # the trainer feeds flat (b, D) rows
    assert net(x).shape == (2, 7)


@pytest.mark.parametrize("optimizer", _options("optimizer"))
@pytest.mark.parametrize("scheduler", _options("scheduler"))
def test_every_optimizer_and_scheduler_entry_validates_and_builds(optimizer, scheduler):
    from experiments.wiring import build_model_and_optimizer

    cfg = as_config(_compose([f"optimizer={optimizer}", f"scheduler={scheduler}", "trainer.steps=40", "logger=none"]))
    plan = validate(cfg)
    _, opt, sched = build_model_and_optimizer(plan.data, plan.config(), torch.device("cpu"))
    assert type(opt).__name__.lower() == optimizer
    assert (sched is None) == (scheduler == "none")
    if scheduler in ("cosine", "warmup_cosine"):  # the length follows trainer.steps (interpolated)
        assert plan.cfg["scheduler"]["T_max" if scheduler == "cosine" else "total_steps"] == 40
    assert plan.fingerprint["optimizer._target_"] == cfg.optimizer._target_  # part of the experiment identity


def test_the_default_optimizer_is_plain_sgd_without_a_schedule():
    cfg = as_config(_compose(FAST))
    assert cfg.optimizer == {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1, "momentum": 0.0,
                             "weight_decay": 0.0, "nesterov": False}
    assert cfg.scheduler == {"_target_": None}


@pytest.mark.parametrize("override,new", [("trainer.lr=0.05", "optimizer.lr"), ("trainer.momentum=0.9", "optimizer.momentum"),
                                          ("trainer.weight_decay=1e-4", "optimizer.weight_decay"),
                                          ("trainer.nesterov=true", "optimizer.nesterov"),
                                          ("trainer.scheduler=cosine", "scheduler=NAME")])
def test_former_trainer_optimizer_keys_fail_with_one_migration_message(override, new):
    with pytest.raises(ConfigError, match="moved out of trainer") as err:
        validate(_compose([override, *FAST]))
    assert f"{override.split('=')[0]}=" in str(err.value) and new in str(err.value)


def test_bad_model_optimizer_and_scheduler_nodes_are_named():
    with pytest.raises(ConfigError, match=r"model robustagg.models.MLP does not take 'widths'"):
        validate(_compose(["+model.widths=[3]", *FAST]))
    with pytest.raises(ConfigError, match=r"model=lenet5 needs images of shape"):
        validate(_compose(["model=lenet5", *FAST]))  # digits are 8x8
    with pytest.raises(ConfigError, match=r"optimizer torch.optim.SGD: Invalid learning rate"):
        validate(_compose(["optimizer.lr=-1", *FAST]))
    with pytest.raises(ConfigError, match=r"optimizer._target_='torch.optim.Nope' cannot be imported|optimizer "
                                          r"torch.optim.Nope"):
        validate(_compose(["optimizer._target_=torch.optim.Nope", *FAST]))
    with pytest.raises(ConfigError, match="_partial_: true"):
        validate(_compose(["optimizer._partial_=false", *FAST]))


def test_any_torch_optimizer_by_override():
    plan = validate(_compose(["optimizer._target_=torch.optim.RMSprop", "~optimizer.nesterov", *FAST]))
    from experiments.wiring import build_model_and_optimizer

    _, opt, _ = build_model_and_optimizer(plan.data, plan.config(), torch.device("cpu"))
    assert isinstance(opt, torch.optim.RMSprop) and opt.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist", "cifar10", "cifar100"])
def test_every_file_data_entry_validates_on_tiny_published_format_files(name, tmp_path):
    from real_files import write_files

    model = "lenet5" if name in ("mnist", "fashion_mnist") else "resnet20"
    plan = validate(_compose([f"data={name}", f"data.root={write_files(name, tmp_path)}", f"model={model}",
                              "threat.n=3", "threat.f=1", *FAST]))
    assert plan.data.name == name and plan.data.input_shape == ((1, 28, 28) if model == "lenet5" else (3, 32, 32))
    assert plan.data.num_classes == (100 if name == "cifar100" else 10)
    assert plan.cfg["data"]["augment"] is None and plan.fingerprint["data.name"] == name

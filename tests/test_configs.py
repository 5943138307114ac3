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
    from attacks.gossip import GOSSIP_ATTACKS  # protocol=gossip's per-receiver attacks (attacks/gossip.py)

    assert _options("attack") == sorted(attacks.available() + list(GOSSIP_ATTACKS) + ["none"])


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


# --- malformed values: one message naming the key, the bad value and the fix, before any process ---------
# override -> words the message must hold (regex). Every case is refused by validate(), which runs before
# any worker process starts (the CLI test in test_train_e2e.py checks that through the real command).
REFUSED = [
    ("trainer.collective_timeout_s=inf", r"trainer\.collective_timeout_s must be a finite number in \[1, 86400\] "
                                         r"\(seconds a collective waits for the others: at least a second, at most "
                                         r"a day\); got inf\. Use e\.g\. trainer\.collective_timeout_s=60"),
    ("trainer.collective_timeout_s=1e15", r"trainer\.collective_timeout_s must be .*; got 1000000000000000\.0\."),
    ("trainer.collective_timeout_s=0", r"trainer\.collective_timeout_s must be .*; got 0\.0\."),
    ("trainer.lr=inf", r"trainer\.lr=inf -> optimizer\.lr"),  # moved: one migration message
    ("optimizer.lr=inf", r"optimizer\.lr must be a finite number in \(0, inf\) \(the server step size\); got inf\."),
    ("optimizer.lr=nan", r"optimizer\.lr must be a finite number in \(0, inf\) .*; got nan\."),
    ("trainer.weight_decay=-1", r"trainer\.weight_decay=-1 -> optimizer\.weight_decay"),
    ("optimizer.weight_decay=-1", r"optimizer\.weight_decay must be a finite number in \[0, inf\) .*; got -1"),
    ("optimizer.momentum=inf", r"optimizer\.momentum must be a finite number in \[0, 1\) .*; got inf"),
    ("trainer.port=-1", r"trainer\.port must be an integer in \[0, 65535\] \(a TCP port, 0 = pick a free one\); "
                        r"got -1\. Use e\.g\. trainer\.port=0\."),
    ("trainer.port=70000", r"trainer\.port must be an integer in \[0, 65535\] .*; got 70000\."),
    ("trainer.threads=0", r"trainer\.threads must be an integer in \[1, 256\] \(torch threads per process\); "
                          r"got 0\. Use e\.g\. trainer\.threads=1"),
    ("seed=-1", r"seed must be an integer in \[0, 2\*\*63\) .*; got -1\. Use e\.g\. seed=0"),
    ("seed=1e20", r"seed must be an integer in \[0, 2\*\*63\) .*; got 1e\+20\."),
    ("seed=9223372036854775808", r"seed must be an integer in \[0, 2\*\*63\) .*; got 9223372036854775808\."),
    ("seed=1.5", r"seed must be an integer .*; got 1\.5\."),
    ("model.hidden=[-5]", r"model\.hidden lists layer widths, each an integer >= 1; got \[-5\]\. Use e\.g\. "
                          r"model\.hidden=\[64\] \(or \[\] for a linear model\)"),
    ("model.hidden=[0]", r"model\.hidden lists layer widths, each an integer >= 1; got \[0\]\."),
    ("model=cnn|model.channels=[8,0]", r"model\.channels lists conv channels, each an integer >= 1; got \[8, 0\]\."),
    ("model.dropout=1.5", r"model\.dropout must be in \[0, 1\); got 1\.5\."),
    ("trainer.master_addr=999.1.1.1", r"trainer\.master_addr='999\.1\.1\.1' is not a valid IPv4 address \(four "
                                      r"numbers 0\.\.255\); use e\.g\. trainer\.master_addr=127\.0\.0\.1"),
    ("trainer.master_addr='bad host!'", r"trainer\.master_addr='bad host!' is neither an IP address nor a host name"),
    ("trainer.master_addr=no-such-host.invalid", r"trainer\.master_addr='no-such-host\.invalid' does not resolve to "
                                                 r"an IPv4 address .*use e\.g\. trainer\.master_addr=127\.0\.0\.1"),
    ("trainer.master_addr=192.0.2.1", r"trainer\.master_addr='192\.0\.2\.1' is not an address of this machine"),
    ("trainer.master_addr=::1", r"trainer\.master_addr='::1' is an IPv6 address; the app's launcher"),
    ("trainer.checkpoint.dir=/proc/x", r"trainer\.checkpoint\.dir=/proc/x cannot be created or written \(/proc: "),
    ("trainer.callbacks=[{_target_: os.remove, path: x}]",
     r"trainer\.callbacks\[0\]\._target_='os\.remove' is refused by Hydra's instantiate policy"),
    ("trainer.callbacks=[{_target_: no_such_module.Recorder}]",
     r"trainer\.callbacks\[0\]\._target_='no_such_module\.Recorder' cannot be imported .*No module named "
     r"'no_such_module'.*an importable class or function"),
    ("trainer.callbacks=[{_target_: math.pi}]", r"trainer\.callbacks\[0\]\._target_='math\.pi' is not callable"),
    ("trainer.callbacks=[{every: 3}]", r"trainer\.callbacks\[0\] needs a _target_"),
    ("+trainer.optimizer=adam", r"unknown key trainer\.optimizer: the schema of trainer \(TrainerConf\) does not "
                                r"declare it.*valid keys: mode, steps, batch_size, lr"),
    ("+trainer.lrr=0.1", r"unknown key trainer\.lrr: .*Did you mean trainer\.lr\?"),
    ("+data.augmentation=true", r"unknown key data\.augmentation: the schema of data \(DataConf\) does not declare"),
    ("+logger.projet=x", r"unknown key logger\.projet: .*Did you mean logger\.project\?"),
    ("+trainer.checkpoint.evry=5", r"unknown key trainer\.checkpoint\.evry: .*Did you mean trainer\.checkpoint\.every"),
    ("+sed=3", r"unknown key sed: the schema of the top level \(TrainConfig\) .*Did you mean seed\?"),
    ("trainer.backend=nccl", r"trainer\.backend=nccl needs CUDA tensors, but trainer\.device is cpu; use "
                             r"trainer\.backend=gloo \(or auto\)"),
    ("trainer.backend=mpi", r"trainer\.backend must be auto, gloo or nccl; got 'mpi'\."),
]


@pytest.mark.parametrize("override,message", REFUSED, ids=[o for o, _ in REFUSED])
def test_malformed_values_are_refused_before_launch(override, message):
    extra = ["trainer.device=cpu"] if "backend" in override else []
    with pytest.raises(ConfigError, match=message) as info:
        validate(_compose([*override.split("|"), *extra, *FAST]))
    assert "\n" not in str(info.value)  # one line


def test_faults_with_an_unknown_option_name_the_nearest_key():
    with pytest.raises(ConfigError, match=r"unknown key faults\.crash\.stepp: the schema of faults\.crash "
                                          r"\(FaultConf\) does not declare it.*Did you mean faults\.crash\.step\?"):
        validate(_compose(["faults=[crash]", "+faults.crash.stepp=3", "trainer.checkpoint.every=1", *FAST]))


def test_a_port_in_use_or_a_checkpoint_dir_that_is_a_file(tmp_path):
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"trainer\.port={port} is already in use on 127\.0\.0\.1; choose a "
                                              r"free port, or trainer\.port=0 to pick one"):
            validate(_compose([f"trainer.port={port}", *FAST]))
        # the simulated mode opens no port: nothing to refuse
        validate(_compose([f"trainer.port={port}", "trainer.mode=simulated", *FAST]))
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for d in (a_file, a_file / "sub"):
        with pytest.raises(ConfigError, match=rf"trainer\.checkpoint\.dir={d} .*{a_file} is a file"):
            validate(_compose([f"trainer.checkpoint.dir={d}", *FAST]))
    fresh = tmp_path / "new" / "ckpt"
    plan = validate(_compose([f"trainer.checkpoint.dir={fresh}", *FAST]))
    assert plan.ckpt_dir == str(fresh) and not (tmp_path / "new").exists()  # checked, nothing left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_deliberately_open_nodes_stay_open(tmp_path):
    # callbacks take whatever their class takes; rule and attack parameters are checked against the
    # class's signature instead of the schema (see test_unknown_rule_or_attack_name_lists_the_available_ones).
    cb = "trainer.callbacks=[{_target_: collections.Counter, anything: 1}]"
    assert validate(_compose([cb, *FAST])).cfg["trainer"]["callbacks"] == [{"_target_": "collections.Counter",
                                                                          "anything": 1}]
    plan = validate(_compose(["aggregator=centered_clipping", "aggregator.tau=3.0", "trainer.port=0",
                              "trainer.master_addr=localhost", "seed=9223372036854775807", *FAST]))
    assert plan.cfg["aggregator"]["tau"] == 3.0 and plan.cfg["seed"] == 2**63 - 1


def test_a_plain_dict_with_an_unknown_key_is_refused_too():
    with pytest.raises(ConfigError, match=r"unknown key trainer\.optimiser: .*valid keys"):
        as_config({"aggregator": {"_target_": "robustagg.Mean"}, "trainer": {"optimiser": "adam"}})


def test_a_group_option_that_does_not_exist_lists_the_options():
    from experiments.config import check_group_choices

    # Hydra alone: the list form names no option (this is what check_group_choices is for)
    with pytest.raises(HydraException, match="Could not load 'faults/crashh'") as info:
        _compose(["faults=[crashh]"])
    assert "crash_between" not in str(info.value)
    with pytest.raises(ConfigError, match=r"^faults=\[crash,crashh\]: conf/faults/ has no option 'crashh' \(did you "
                                          r"mean crash\?\); the options: aggregator_lie, checkpoint_corrupt, "
                                          r"checkpoint_crash, common_mode, compute_corrupt, corrupt, crash, "
                                          r"crash_between, desync, hang, none, nonfinite, partition, rejoin\.$"):
        check_group_choices(["trainer.steps=3", "faults=[crash,crashh]"])
    with pytest.raises(ConfigError, match=r"^\+experiment=exampel: conf/experiment/ has no option 'exampel' \(did "
                                          r"you mean example\?\)"):
        check_group_choices(["+experiment=exampel"])
    with pytest.raises(ConfigError, match=r"^aggregator=krum,krumm: .*'krumm' \(did you mean krum"):
        check_group_choices(["-m", "aggregator=krum,krumm"])
    check_group_choices(["-m", "faults=[crash,desync]", "aggregator=krum,trimmed_mean", "seed=range(3)",
                         "+experiment=rule/krum", "preaggregation=null", "trainer.steps=3", "hydra.run.dir=x"])


def test_the_readme_torchrun_line_is_complete_and_validates(monkeypatch):
    readme = (CONF.parent / "README.md").read_text()
    lines = [ln.split("#")[0].split() for ln in readme.splitlines() if ln.startswith("torchrun ")]
    assert lines, "README lost its torchrun example"
    for words in lines:
        assert "..." not in words
        nproc = next(int(w.split("=")[1]) for w in words if w.startswith("--nproc-per-node="))
        overrides = words[words.index("experiments.train") + 1:]
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(nproc))  # what torchrun sets: world size must equal threat.n
        plan = validate(_compose([o for o in overrides if not o.startswith("hydra.")] + FAST))
        assert plan.n == nproc


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
    with pytest.raises(ConfigError, match=r"optimizer.lr must be a finite number in \(0, inf\) .*; got -1"):
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


def test_a_misspelt_setting_gets_one_line_with_the_nearest_keys():
    from experiments.config import check_setting_keys

    # Hydra alone: six lines, and advice to append the key (which the schema then refuses)
    with pytest.raises(HydraException, match=r"To append to your config use \+trainer.stpes=5"):
        _compose(["trainer.stpes=5"])
    with pytest.raises(ConfigError, match=r"^trainer.stpes=5: 'trainer.stpes' is not a setting of trainer; did you "
                                          r"mean trainer.steps\b.*conf/trainer/default.yaml"):
        check_setting_keys(["trainer.stpes=5"])
    with pytest.raises(ConfigError, match=r"^stpes=5: 'stpes' is not a setting of the configuration; did you mean "
                                          r"trainer.steps\?"):
        check_setting_keys(["stpes=5"])
    with pytest.raises(ConfigError, match=r"did you mean trainer.checkpoint.every\b"):
        check_setting_keys(["-m", "trainer.checkpoint.evrey=3,5"])
    # free nodes, group choices, appended/deleted keys and Hydra's own settings are left to Hydra
    check_setting_keys(["-m", "aggregator=krum", "aggregator.f=1", "optimizer.lr=0.1", "faults.crash.step=3",
                        "+trainer.extra=1", "~scheduler", "hydra.run.dir=x", "+experiment=rule/krum", "seed=range(3)"])


def _leaf_keys(node, prefix=""):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "defaults" or str(k).startswith("_"):
                continue
            yield from _leaf_keys(v, f"{prefix}{k}.")
    elif prefix:
        yield prefix[:-1]


def test_every_key_the_bundled_configs_set_passes_the_setting_check():
    # the check must never refuse a key that conf/ itself uses (group files and global experiment files)
    import yaml

    from experiments.config import check_setting_keys

    checked = 0
    for path in sorted(CONF.rglob("*.yaml")):
        rel = path.relative_to(CONF)
        text = path.read_text()
        if rel.parts[0] in ("hydra", "gossip_consensus") or rel.parts[0].startswith("bench") \
                or path.name == "config.yaml":  # other apps
            continue
        body = yaml.safe_load(text) or {}
        glob = "@package _global_" in text
        keys = [k for k in _leaf_keys(body) if not k.startswith("hydra.")]
        prefix = "" if glob else f"{rel.parts[0]}."
        check_setting_keys([f"{prefix}{k}=1" for k in keys])
        checked += len(keys)
    assert checked > 200

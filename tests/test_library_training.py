"""The trainer as a library-import user meets it (issue 13, item 18): any batch source with a
restorable position, a loss over any batch, and no silently lost attack state."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attacks
import robustagg as ra
from robustagg.distributed import LocalComm, make_reduction
from robustagg.errors import ConfigError
from robustagg.training import AttackAdapter, ByzantineBehaviour, IterableSource, Trainer

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _loader(worker: int):
    """A real DataLoader of dict batches, shuffled per epoch by a generator seeded from (worker, epoch)."""
    g = torch.Generator().manual_seed(worker)
    x, y = torch.randn(40, 3, generator=g), torch.randint(0, 2, (40,), generator=g)
    data = [{"features": x[i], "label": y[i]} for i in range(40)]

    def epoch(e: int):
        return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True,
                                           generator=torch.Generator().manual_seed(1000 * worker + e))

    return IterableSource(epoch)


def _dict_loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch["features"]), batch["label"])


def _trainer(byzantine=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    red = make_reduction("gather", ra.CoordinateWiseMedian(f=1), LocalComm(3))
    return Trainer(model, opt, red, {r: _loader(r) for r in range(3)}, batch_size=8, num_classes=2,
                   batch_loss=_dict_loss, byzantine=byzantine)


def test_a_dataloader_source_and_a_batch_loss_resume_bit_for_bit():
    ref = _trainer()
    for _ in range(12):  # 12 steps cross the 5-batch epochs twice
        ref.step()
    a = _trainer()
    for _ in range(7):
        a.step()
    state = a.state_dict()
    assert state["local"]["workers"][0]["sampler"] == {"epoch": 1, "position": 2}
    b = _trainer()
    b.load_state_dict(state)
    for _ in range(5):
        b.step()
    for p, q in zip(ref.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    assert ref.optimizer_digest() == b.optimizer_digest()


def test_a_shard_that_is_neither_tensors_nor_a_source_is_refused():
    model = torch.nn.Linear(3, 2)
    red = make_reduction("gather", ra.Mean(), LocalComm(1))
    with pytest.raises(ConfigError, match=r"shards\[0\] must be a Shard or a BatchSource.*IterableSource"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), red, {0: [1, 2, 3]}, batch_size=1, num_classes=2)


def test_a_lambda_over_a_stateful_attack_is_refused_and_the_adapter_keeps_its_state():
    mimic = attacks.get("mimic")
    with pytest.raises(ConfigError, match=r"gradient_fn wraps Mimic, which has state.*AttackAdapter"):
        ByzantineBehaviour(ranks=[2], gradient_fn=lambda h, b, own, g: mimic(h, b, generator=g))
    # a lambda over a stateless attack, or over the defender's rule, is fine
    flip, rule = attacks.get("sign_flip"), ra.CenteredClipping()
    ByzantineBehaviour(ranks=[2], gradient_fn=lambda h, b, own, g: flip(h, b, rule=rule))
    t = _trainer(ByzantineBehaviour(ranks=[2], gradient_fn=AttackAdapter(mimic, ra.CoordinateWiseMedian(f=1))))
    for _ in range(3):
        t.step()
    saved, live = t.state_dict()["local"]["attack"], mimic.state_dict()
    assert saved and set(saved) == set(live)
    assert all(torch.equal(saved[k], live[k]) if isinstance(live[k], torch.Tensor) else saved[k] == live[k]
               for k in live)


@pytest.mark.parametrize("extra, where", [([], "outputs"), (["out_dir=given"], "given")])
def test_a_rejected_configuration_leaves_no_run_folder(tmp_path, extra, where):
    p = subprocess.run([sys.executable, "-m", "experiments.train", "trainer.mode=simulated", "logger=none",
                        "aggregator=krum", "threat.n=5", *extra], cwd=tmp_path, env=ENV, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and "Krum requires" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / where).exists() and not (tmp_path / "outputs").exists(), list(tmp_path.rglob("*"))


def test_out_dir_given_leaves_no_stray_hydra_folder(tmp_path):
    p = subprocess.run([sys.executable, "-m", "experiments.train", "trainer.mode=simulated", "logger=none",
                        "trainer.steps=2", "trainer.eval_every=0", "trainer.progress=false", "out_dir=mine"],
                       cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / "mine" / "summary.json").is_file() and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("arg, words", [("run_name=../x", "must be a plain folder name"),
                                        ("run_name=a/b", "must be a plain folder name"),
                                        ("run_name=.hidden", "must be a plain folder name"),
                                        ("trainer.stpes=5", "did you mean trainer.steps")])
def test_a_bad_run_name_or_setting_key_is_refused_in_one_line(tmp_path, arg, words):
    p = subprocess.run([sys.executable, "-m", "experiments.train", arg, "trainer.mode=simulated",
                        "logger=none"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "x").exists()

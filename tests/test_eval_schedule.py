"""When the trainer evaluates (issue 28, learning curves): at step 0 when a curve is asked for, then
every ``eval_every`` steps and at the end, without touching the training trajectory; and the app's
defaults give a curve dense enough to read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

import robustagg as ra
from robustagg.distributed import LocalComm, make_reduction
from robustagg.training import Trainer, evaluate, fit
from robustagg.training.trainer import Shard

ROOT = Path(__file__).resolve().parents[1]


def _trainer() -> Trainer:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    red = make_reduction("gather", ra.CoordinateWiseMedian(f=1), LocalComm(3))
    g = torch.Generator().manual_seed(1)
    shards = {r: Shard(torch.randn(30, 4, generator=g), torch.randint(0, 3, (30,), generator=g)) for r in range(3)}
    return Trainer(model, opt, red, shards, batch_size=6, num_classes=3)


def _run(t: Trainer, steps: int, every: int) -> tuple[list[int], object]:
    x, y = torch.randn(20, 4, generator=torch.Generator().manual_seed(2)), torch.arange(20) % 3
    seen: list[int] = []
    summary = fit(t, steps=steps, evaluate=lambda: evaluate(t.model, x, y, 3), eval_every=every,
                  on_record=lambda rec: seen.append(int(rec["step"])) if rec["kind"] == "test" else None)
    return seen, summary


def test_a_curve_starts_at_step_0_and_the_end_only_run_does_not() -> None:
    assert _run(_trainer(), 6, 2)[0] == [0, 2, 4, 6]  # it was [2, 4, 6]: no untrained point
    assert _run(_trainer(), 5, 2)[0] == [0, 2, 4, 5]
    assert _run(_trainer(), 6, 0)[0] == [6]  # eval_every=0: only at the end, as documented


def test_evaluating_leaves_the_training_trajectory_untouched() -> None:
    plain, dense = _trainer(), _trainer()
    _run(plain, 6, 0)
    _run(dense, 6, 1)  # 7 evaluations, dropout in the model
    for p, q in zip(plain.model.parameters(), dense.model.parameters()):
        assert torch.equal(p, q)
    assert plain.optimizer_digest() == dense.optimizer_digest()


def test_a_resumed_run_does_not_evaluate_its_first_step_again_and_best_ignores_step_0() -> None:
    a = _trainer()
    _run(a, 3, 2)
    b = _trainer()
    b.load_state_dict(a.state_dict())
    assert _run(b, 3, 2)[0] == [4, 6]
    t = _trainer()
    seen, summary = _run(t, 4, 2)
    assert seen == [0, 2, 4]
    assert summary.best_test_acc == pytest.approx(max(summary.best_test_acc, summary.final_test_acc))


@pytest.mark.parametrize("path, points", [("conf/trainer/default.yaml", 20),
                                          ("conf/experiment/integrity_vs_suppression_quick.yaml", 10),
                                          ("conf/experiment/integrity_vs_suppression.yaml", 10)])
def test_default_schedules_give_a_readable_curve(path: str, points: int) -> None:
    cfg = yaml.safe_load((ROOT / path).read_text())
    trainer = cfg.get("trainer", cfg)
    steps = int(trainer["steps"])
    every = int(trainer["eval_every"])
    assert every > 0 and 1 + steps // every >= points, (steps, every)  # step 0, then every `every` steps

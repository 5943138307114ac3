"""Start-up work a run does not need stays out of it (issue 19): lazy imports, the Gram warm-up only where used.

Each import check runs in a fresh interpreter (``sys.modules`` of the test process is shared by
every test). No timing assertions: what is imported, and whether the warm-up runs, are facts.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


ENV = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


def _loaded_after(code: str, modules: list[str]) -> dict[str, bool]:
    probe = f"{code}\nimport sys\nprint(repr({{m: m in sys.modules for m in {modules!r}}}))"
    env = ENV
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return eval(proc.stdout.strip().splitlines()[-1])  # a dict literal of bools


def test_importing_the_packages_loads_no_scipy_stats_sklearn_numba_or_wandb():
    loaded = _loaded_after("import robustagg, attacks, experiments.train",
                           ["scipy.stats", "scipy.special", "sklearn", "numba", "wandb"])
    assert loaded == {"scipy.stats": False, "scipy.special": False, "sklearn": False, "numba": False,
                      "wandb": False}


def test_importing_experiments_train_leaves_the_garbage_collector_alone():
    # the start-up pause belongs to the command line only: a script or a test importing the module
    # keeps its collector running and nothing frozen
    probe = "import gc, experiments.train\nprint(gc.isenabled(), gc.get_freeze_count(), experiments.train._GC_PAUSED)"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "0", "False"]


def test_the_command_line_trains_with_the_collector_running_and_exits_with_everything_written(tmp_path):
    # python -m experiments.train pauses the collector while torch and its compiler stack are
    # imported; by the first step the start-up objects are frozen and collection runs again (a
    # training loop without a collector would keep every reference cycle it makes). It ends
    # without the interpreter's teardown, but after the atexit handlers (logging's flush of
    # train.log, one registered by the run) and with stdout flushed: status 0, nothing half-written.
    state = tmp_path / "gc.json"
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "experiments.train", "trainer.mode=simulated", "trainer.steps=2", "logger=none",
           "trainer.eval_every=0", "trainer.progress=false", "threat.n=3", "threat.f=1", "threat.byzantine=1",
           "aggregator=coordinate_median", "attack=sign_flip", f"hydra.run.dir={run}",
           f"trainer.callbacks=[{{_target_: lifecycle_helpers.RecordGc, path: '{state}', step: 1}}]"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recorded = json.loads(state.read_text())
    assert recorded["enabled"] is True
    assert recorded["frozen"] > 100_000  # torch's objects (about 350,000 here), not a handful
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert (tmp_path / "gc.json.atexit").read_text() == "ran"
    assert "[experiments.train][INFO] - summary: {" in (run / "train.log").read_text()  # the last line logged
    assert "final_test_acc" in proc.stdout  # the summary table, printed last
    train_steps = [ln for ln in (run / "metrics.jsonl").read_text().splitlines() if '"kind": "train"' in ln]
    assert len(train_steps) == 2, train_steps


def test_alie_z_is_scipys_normal_quantile_bit_for_bit():
    from scipy.stats import norm

    import attacks

    checked = 0
    for n in range(2, 160):
        for f in range(n):
            s = math.floor(n / 2 + 1) - f
            if s <= 0:
                continue
            assert attacks.alie_z(n, f) == float(norm.ppf((n - s) / n)), (n, f)
            checked += 1
    assert checked > 5000


def test_alie_z_at_p_zero_is_minus_infinity_as_before():
    # n = 2, f = 0: s = 2 = n, so Phi^-1(0) = -inf (what scipy.stats.norm.ppf returned)
    import attacks

    assert attacks.alie_z(2, 0) == -math.inf


@pytest.mark.parametrize("aggregator, attack, expected", [
    ("trimmed_mean", "alie", False),     # coordinate-wise rule, statistics-only attack
    ("mean", "none", False),
    ("coordinate_median", "sign_flip", False),
    ("krum", "alie", True),              # distance-based rule
    ("trimmed_mean", "fang_krum", True),  # the attack computes Krum scores
    ("trimmed_mean", "min_max", True),   # the attack computes pairwise distances
])
def test_gram_warm_up_only_where_a_gram_matrix_can_be_computed(aggregator, attack, expected):
    from robustagg.functional.gram import needs_warm_up

    from experiments.bench_train import compose, overrides
    from experiments.wiring import build_byzantine, build_rule, validate

    cfg = compose(overrides(10, 2, aggregator, attack, True))
    plan = validate(cfg, out_dir=".")
    rule = build_rule(cfg)
    byz = build_byzantine(plan.byzantine_ranks, cfg, rule, attack_kind=plan.attack_kind, attack_name=plan.attack_name)
    assert needs_warm_up(rule, byz) is expected


def test_gram_warm_up_for_a_pipeline_with_nnm():
    import robustagg as ra
    from robustagg.functional.gram import needs_warm_up

    assert needs_warm_up(ra.Pipeline(pre=[ra.get("bucketing", f=1)], rule=ra.get("trimmed_mean", f=1)), None) is False
    assert needs_warm_up(ra.Pipeline(pre=[ra.get("nnm", f=1)], rule=ra.get("trimmed_mean", f=1)), None) is True


def test_digits_read_without_sklearn_are_sklearns_digits_bit_for_bit():
    import numpy as np
    from sklearn.datasets import load_digits as sk_load

    from robustagg.data.sources import _bundled_digits, load_digits

    assert _bundled_digits() is not None  # the fast path is the one taken here
    x, y, classes, shape = load_digits()
    ref_x, ref_y = sk_load(return_X_y=True)
    assert x.dtype == np.float32 and y.dtype == np.int64 and (classes, shape) == (10, (1, 8, 8))
    np.testing.assert_array_equal(x, (ref_x / 16.0).astype(np.float32))
    np.testing.assert_array_equal(y, ref_y.astype(np.int64))


def test_building_the_digits_data_imports_no_sklearn():
    loaded = _loaded_after("from robustagg.data.sources import load_digits\nload_digits()", ["sklearn"])
    assert loaded == {"sklearn": False}

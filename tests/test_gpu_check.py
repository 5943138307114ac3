"""scripts/gpu_check.sh without CUDA (its refusal), scripts/compare_curves.py on hand-made curves, and the
NCCL placement check (one GPU per process) with torch's CUDA queries faked: no GPU is needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.wiring import validate
from robustagg.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _metrics(run: Path, losses, steps=None):
    run.mkdir(parents=True)
    recs = [{"kind": "train", "step": s, "train/loss": v} for s, v in zip(steps or range(1, len(losses) + 1), losses)]
    recs.append({"kind": "test", "step": len(losses), "test/acc": 0.5})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run


def _compare(a, b, *extra):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_curves.py"), str(a), str(b), *extra],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_without_cuda_says_skipped_and_exits_0(tmp_path):
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "out")], cwd=tmp_path,
                       env={**ENV, "PY": sys.executable}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "no CUDA device: skipped" in p.stdout
    assert not (tmp_path / "out").exists()  # nothing was run, nothing written


def test_compare_curves_passes_within_and_fails_past_the_tolerance(tmp_path):
    a = _metrics(tmp_path / "a", [2.0, 1.0, 0.5])
    b = _metrics(tmp_path / "b", [2.0, 1.01, 0.5])  # step 2: |1 - 1.01| / 1.01 = 9.90e-3
    ok = _compare(a, b, "--tol", "0.01", "--labels", "cpu", "cuda")
    assert ok.returncode == 0, ok.stderr
    assert "max relative difference of train/loss (cpu vs cuda): 9.901e-03 (tolerance 0.01): ok" in ok.stdout
    assert "     2       1.000000       1.010000   9.90e-03" in ok.stdout  # both curves are printed
    bad = _compare(a, b, "--tol", "0.005")
    assert bad.returncode == 1 and "FAIL" in bad.stdout
    nan = _compare(a, _metrics(tmp_path / "nan", [2.0, float("nan"), 0.5]))
    assert nan.returncode == 1 and "inf" in nan.stdout


def test_compare_curves_refuses_runs_that_logged_different_steps(tmp_path):
    p = _compare(_metrics(tmp_path / "a", [2.0, 1.0]), _metrics(tmp_path / "b", [2.0, 1.0, 0.5]))
    assert p.returncode == 2 and "logged different steps" in p.stderr


def test_nccl_with_more_processes_than_gpus_is_refused_before_launch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["logger=none", "threat.n=4", "threat.f=1", "aggregator=trimmed_mean",
                                           "trainer.device=cuda", "trainer.processes=2"])
    with pytest.raises(ConfigError, match=r"trainer.backend=nccl needs one GPU per process .* start 2 processes on "
                                          r"1 GPU\(s\)\. Use trainer.processes=1"):
        validate(cfg)

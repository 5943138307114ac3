"""A fresh run's resume line is information, not a warning (issue 28, "Noise")."""

from __future__ import annotations

import logging
from pathlib import Path

from hydra import compose, initialize_config_dir

from experiments.train import train
from robustagg.launch.identity import FRESH_START

CONF = Path(__file__).resolve().parents[1] / "conf"


def test_a_fresh_run_logs_its_resume_line_at_info(tmp_path, caplog):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["logger=none", "trainer.progress=false", "trainer.steps=1",
                                           "trainer.mode=simulated", "trainer.eval_every=0", "threat.n=4",
                                           "threat.f=1", "trainer.checkpoint.every=1"])
    with caplog.at_level(logging.INFO):
        train(cfg, out_dir=tmp_path / "run", quiet=True)
        again = train(cfg, out_dir=tmp_path / "run", quiet=True)
    # "no checkpoint folder yet" or, when the run's lock made the folder first, "no committed checkpoint in"
    fresh = [r for r in caplog.records if r.getMessage().startswith("resume: ") and r.getMessage().endswith(FRESH_START)]
    assert [r.levelno for r in fresh] == [logging.INFO]
    found = [r for r in caplog.records if r.getMessage().startswith("resume: found step-00000001")]
    assert [r.levelno for r in found] == [logging.WARNING] and again["steps"] == 1  # a resume stays visible

"""The command line, as a user types it: the README's first command (short), a bad configuration.
Each test runs real subprocesses (seconds); the torchrun path is in tests/test_resume_cli.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _run(args, tmp_path, timeout=240, env=None):
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env or ENV, capture_output=True, text=True,
                          timeout=timeout)


def test_first_readme_command_short(tmp_path):
    # `python -m experiments.train`: digits, 10 worker processes, 2 Byzantine (ALIE), trimmed mean;
    # shortened to 3 steps.
    run = tmp_path / "run"
    p = _run(["-m", "experiments.train", "trainer.steps=3", "trainer.eval_every=0", f"hydra.run.dir={run}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "final_test_acc" in p.stdout and "trimmed_mean vs alie (n=10, f=2, 2 Byzantine)" in p.stdout
    s = json.loads((run / "summary.json").read_text())
    assert s["steps"] == 3 and s["n"] == 10 and s["byzantine_ranks"] == [8, 9] and s["mode"] == "processes"
    assert (run / "model.safetensors").exists() and (run / "metrics.jsonl").exists()
    assert (run / ".hydra" / "config.yaml").exists()


def test_bad_configuration_exits_with_one_message(tmp_path):
    p = _run(["-m", "experiments.train", "aggregator=krum", "threat.n=6", f"hydra.run.dir={tmp_path / 'run'}"],
             tmp_path)
    assert p.returncode == 2
    assert "error: Krum requires n >= 2f + 3 (Blanchard et al., NeurIPS 2017); got n=6, f=2." in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "run" / "summary.json").exists()


CLI_REFUSED = [
    ("+trainer.optimizer=adam", "error: unknown key trainer.optimizer: the schema of trainer (TrainerConf)"),
    ("optimizer.lr=inf", "error: optimizer.lr must be a finite number in (0, inf) (the server step size); got inf."),
    ("seed=1e20", "error: seed must be an integer in [0, 2**63)"),
    ("trainer.threads=0", "error: trainer.threads must be an integer in [1, 256] (torch threads per process); got 0."),
    ("trainer.threads=1000000", "error: trainer.threads must be an integer in [1, 256] (torch threads per process); "
                                "got 1000000."),  # it used to crash the process and exhaust the process table
    ("trainer.membership=[{workers:[4,5,6,7,8,9],absent:[2,4]}]",  # it used to fail after step 1 ran
     "error: trainer.membership leaves 4 of the n=10 workers from step 2 on: Trimmed mean requires n >= 2f + 1"),
    ("model.hidden=[0]", "error: model.hidden lists layer widths, each an integer >= 1; got [0]."),
]


def _no_worker_started(run: Path) -> None:
    for name in ("evidence", "detections.jsonl", "config_resolved.yaml", "metrics.jsonl", "summary.json"):
        assert not (run / name).exists(), name


@pytest.mark.parametrize("override,message", CLI_REFUSED, ids=[o for o, _ in CLI_REFUSED])
def test_a_malformed_override_exits_2_before_any_worker(override, message, tmp_path):
    run = tmp_path / "run"
    p = _run(["-m", "experiments.train", override, "trainer.mode=simulated", "logger=none", f"hydra.run.dir={run}"],
             tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    assert message in p.stderr and "Traceback" not in p.stderr
    _no_worker_started(run)


def test_a_port_in_use_exits_2_before_any_worker(tmp_path):
    import socket

    run = tmp_path / "run"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        p = _run(["-m", "experiments.train", f"trainer.port={port}", "threat.n=3", "threat.f=0", "aggregator=mean",
                  "attack=none", "logger=none", "trainer.checkpoint.every=1", f"hydra.run.dir={run}"], tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    assert f"error: trainer.port={port} is already in use on 127.0.0.1" in p.stderr and "Traceback" not in p.stderr
    _no_worker_started(run)
    assert not (run / "checkpoints").exists()


def test_a_sweep_skips_configurations_that_break_a_requirement(tmp_path):
    p = _run(["-m", "experiments.train", "-m", "aggregator=krum,bulyan", "threat.n=6", "logger=none",
              f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    reasons = [json.loads((tmp_path / "sweep" / str(i) / "skipped.json").read_text())["reason"] for i in (0, 1)]
    assert reasons[0].startswith("Krum requires n >= 2f + 3") and reasons[1].startswith("Bulyan requires n >= 4f + 3")


# torchrun: joining torchrun's group (n = 2, processes mode, the run to its last step) is checked by
# tests/test_resume_cli.py::test_howto_torchrun_restart_restores_the_committed_checkpoint, whose one
# torchrun launch of the same configuration also survives a crash (one launch instead of two).

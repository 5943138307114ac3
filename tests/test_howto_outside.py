"""docs/howto/add-an-attack.md, "First route", run as printed: an attack in the user's own package,
outside the repository, named by ``attack._target_`` with its folder on ``PYTHONPATH`` (issue 28)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from robustagg.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "howto" / "add-an-attack.md").read_text()
SECTION = PAGE.split("## First route", 1)[1].split("\n## ", 1)[0]


def _package(home: Path) -> Path:
    """``~/mywork/mypkg/__init__.py`` from the page's python block, under ``home``."""
    (code,) = re.findall(r"```python\n(.*?)```", SECTION, flags=re.S)
    pkg = home / "mywork" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(code)
    return pkg.parent


def test_the_first_route_is_the_first_section_of_the_how_to():
    assert PAGE.index("## First route") < PAGE.index("## The calling convention")
    assert "#first-route-your-own-package-outside-the-repository" in (ROOT / "docs/howto/add-a-rule.md").read_text()


def test_an_attack_outside_the_repository_runs_as_printed(tmp_path):
    _package(tmp_path)
    (command,) = re.findall(r"```bash\n(.*?)\n```", SECTION, flags=re.S)
    assert command.startswith("PYTHONPATH=$HOME/mywork python -m experiments.train ")
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HOME=str(tmp_path), WANDB_MODE="disabled", PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
    # as printed, in the repository root; only the run folder is moved out of the checkout
    p = subprocess.run(["bash", "-c", f"{command} hydra.run.dir={run}"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["attack"] == "mypkg.Shift" and summary["steps"] == 20 and summary["byzantine"] == 2
    assert "mypkg.Shift" in p.stdout


def test_its_parameters_are_checked_against_the_class(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(_package(tmp_path)))
    from experiments.wiring import validate

    base = ["attack=none", "attack._target_=mypkg.Shift", "trainer.mode=simulated", "logger=none"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        wrong_key = compose("config", overrides=[*base, "+attack.sigma=1"])
        wrong_type = compose("config", overrides=[*base, "+attack.delta=big"])
    with pytest.raises(ConfigError, match=r"attack Shift does not take 'sigma'; its parameters are delta"):
        validate(wrong_key)
    with pytest.raises(ConfigError, match=r"^attack\.delta=big: attack\.delta \(mypkg\.Shift's parameter\) takes a "
                                          r"number"):
        validate(wrong_type)

"""Every printed command that starts a project app composes (issue 28, "Printed commands that are wrong").

Collects each fenced shell block of ``README.md`` and ``docs/`` and, in it, every command that starts
an app of ``experiments/`` (``python -m experiments.X ...``, ``torchrun ... -m experiments.X ...``,
``make run ARGS='...'``). Each is checked as its app would check it, without training:

- a Hydra app: the app's own command-line checks (``experiments.train`` and ``experiments.tour``:
  :func:`experiments.config.check_command_line`), then Hydra's composition of the overrides
  (each sweep at its first value), then the schema's types (:func:`experiments.wiring.as_config`
  and the ``_target_`` nodes);
- an argparse app (``experiments.report`` ...): its parser, stopped right after parsing;
- a report command after a sweep in the same block reads that sweep's folder, and a sweep's
  comment "N runs" is the product of its sweep's choices.

Compose only: about a second in all.
"""

from __future__ import annotations

import argparse
import importlib
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

#: Hydra apps: module -> (config folder, config name).
HYDRA_APPS = {"train": (CONF, "config"), "tour": (CONF, "config"), "bench": (CONF / "bench", "bench"),
              "bench_distributed": (CONF / "bench_distributed", "bench_distributed"),
              "bench_train": (CONF / "bench_train", "bench_train"),
              "bench_recovery": (CONF / "bench_recovery", "bench_recovery"),
              "bench_state_sharding": (CONF / "bench_state_sharding", "bench_state_sharding"),
              "gossip_consensus": (CONF / "gossip_consensus", "gossip_consensus")}
#: Hydra's own flags that take a value.
VALUED_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-path", "-cp",
                "--config-dir", "-cd", "--info", "-i"}
FENCE = re.compile(r"^\s*```\s*(\w*)\s*$")


@dataclass
class Command:
    """One printed command: where it is, the app, its arguments, and its trailing comment."""

    where: str
    app: str
    args: list[str]
    comment: str
    block: int

    def __str__(self) -> str:
        return f"{self.where}: python -m experiments.{self.app} {' '.join(self.args)}"


def _blocks(page: Path) -> list[tuple[int, str]]:
    """``(line number, text)`` of each fenced shell block of ``page`` (continuation lines joined)."""
    lines, out, i = page.read_text().splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith("```"):
            j += 1
        if m.group(1) in ("bash", "sh", "shell", "console", ""):
            out.append((i + 1, "\n".join(lines[i + 1:j]).replace("\\\n", " ")))
        i = j + 1
    return out


def _command(tokens: list[str]) -> Optional[tuple[str, list[str]]]:
    """``(app, args)`` when ``tokens`` start an app of ``experiments/``, else ``None``."""
    while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0]):
        tokens = tokens[1:]  # environment assignments: WANDB_MODE=online python -m ...
    if not tokens:
        return None
    if tokens[0] == "make" and "run" in tokens[1:]:
        args = [t.partition("=")[2] for t in tokens[1:] if t.startswith("ARGS=")]
        return "tour", shlex.split(args[0]) if args else []
    if tokens[0] in ("python", "python3", "torchrun") and "-m" in tokens:
        at = tokens.index("-m")
        if at + 1 < len(tokens) and tokens[at + 1].startswith("experiments."):
            return tokens[at + 1].removeprefix("experiments."), tokens[at + 2:]
    return None


def collect() -> list[Command]:
    """Every command of :data:`PAGES` that starts an app of ``experiments/``."""
    found = []
    for page in PAGES:
        for k, (line, text) in enumerate(_blocks(page)):
            for row in text.splitlines():
                body, _, comment = row.partition(" #")
                if "experiments." not in body and "make run" not in body:
                    continue
                tokens = shlex.split(body, comments=True)
                for part in " ".join(shlex.quote(t) for t in tokens).replace(" '&&' ", "\n").splitlines():
                    got = _command(shlex.split(part))
                    if got is not None:
                        found.append(Command(f"{page.relative_to(ROOT)}:{line}", got[0],
                                             [a for a in got[1] if a != "..."], comment.strip(), hash((page, k))))
    return found


COMMANDS = collect()


def _first_of_each_sweep(overrides: list[str]) -> list[str]:
    """Each sweep override (``a=x,y``, ``seed=range(3)``) at its first value, as Hydra's launcher would start it."""
    out = []
    for text, o in zip(overrides, OverridesParser.create().parse_overrides(overrides)):
        if o.is_sweep_override():
            first = next(iter(o.sweep_string_iterator()))
            out.append(f"{text.split('=', 1)[0]}={first}")
        else:
            out.append(text)
    return out


def _split_flags(args: list[str]) -> tuple[list[str], list[str]]:
    flags, overrides, skip = [], [], False
    for a in args:
        if skip:
            flags.append(a)
            skip = False
        elif a.startswith("-"):
            flags.append(a)
            skip = a in VALUED_FLAGS
        else:
            overrides.append(a)
    return flags, overrides


def _compose(app: str, overrides: list[str]):
    folder, name = HYDRA_APPS[app]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(folder), version_base="1.3"):
        return compose(name, overrides=overrides, return_hydra_config=True)


def check(cmd: Command) -> None:
    """Check ``cmd`` as its app would before starting anything (see the module docstring)."""
    if cmd.app in HYDRA_APPS:
        flags, overrides = _split_flags(cmd.args)
        unknown = [f for f in flags if f.startswith("-") and f not in VALUED_FLAGS | {"-m", "--multirun"}]
        assert not unknown, f"{cmd}: flags {unknown} are not Hydra's"
        if cmd.app in ("train", "tour"):
            from experiments.config import check_command_line

            check_command_line(overrides)
            if cmd.app == "tour":
                from experiments.tour import BASE

                overrides = [*BASE, *overrides]
        cfg = _compose(cmd.app, _first_of_each_sweep(overrides))
        if cmd.app in ("train", "tour"):
            from experiments.optim import moved_keys
            from experiments.value_types import check_target_types
            from experiments.wiring import TARGET_NODES, as_config

            plain = OmegaConf.to_container(cfg, resolve=False)
            plain.pop("hydra")
            typed = as_config(plain)
            moved_keys(typed.trainer)
            for key in TARGET_NODES:
                check_target_types(typed.get(key), key)
        return
    module = importlib.import_module(f"experiments.{cmd.app}")

    class Parsed(Exception):
        pass

    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop  # type: ignore[method-assign]
    try:
        with pytest.raises(Parsed):
            module.main(list(cmd.args))
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]


def test_the_pages_print_commands_of_every_kind():
    apps = {c.app for c in COMMANDS}
    assert {"train", "tour", "report", "bench", "bench_train", "bench_recovery"} <= apps, apps
    assert len(COMMANDS) >= 50


@pytest.mark.parametrize("cmd", COMMANDS, ids=str)
def test_every_printed_command_composes(cmd):
    check(cmd)


def _sweep_size(cmd: Command) -> int:
    """How many jobs ``cmd`` (a multirun) starts: the experiment's sweep, with the command line's sweeps on top."""
    _, overrides = _split_flags(cmd.args)
    cfg = _compose(cmd.app, _first_of_each_sweep(overrides))
    params = {str(k): str(v) for k, v in (OmegaConf.select(cfg, "hydra.sweeper.params") or {}).items()}
    params.update({o.partition("=")[0]: o.partition("=")[2] for o in overrides})
    sizes = []
    for key, value in params.items():
        o = OverridesParser.create().parse_overrides([f"{key}={value}"])[0]
        sizes.append(len(list(o.sweep_string_iterator())) if o.is_sweep_override() else 1)
    return math.prod(sizes)


SWEEPS = [c for c in COMMANDS if c.app == "train" and {"-m", "--multirun"} & set(c.args)]


@pytest.mark.parametrize("cmd", [c for c in SWEEPS if re.search(r"\b[\d,]+ runs\b", c.comment)], ids=str)
def test_a_sweep_has_the_number_of_runs_its_comment_says(cmd):
    said = int(re.search(r"\b([\d,]+) runs\b", cmd.comment).group(1).replace(",", ""))
    assert _sweep_size(cmd) == said, f"{cmd}: the comment says {said} runs"


def test_a_report_command_reads_the_folder_of_the_sweep_before_it():
    checked = 0
    last: dict[int, str] = {}
    for cmd in COMMANDS:
        exp = [a.partition("=")[2] for a in cmd.args if a.startswith("+experiment=")]
        if cmd in SWEEPS and exp:
            last[cmd.block] = exp[0]
        if cmd.app == "report" and cmd.args and cmd.args[0].startswith("multirun/"):
            name = cmd.args[0].split("/")[1]
            assert (CONF / "experiment" / f"{name}.yaml").is_file(), f"{cmd}: no experiment {name}"
            sweep = OmegaConf.to_container(_compose("train", [f"+experiment={name}"]).hydra.sweep, resolve=False)
            assert str(sweep["dir"]).startswith(f"multirun/{name}/"), f"{cmd}: {name} writes {sweep['dir']}"
            if cmd.block in last:
                assert name == last[cmd.block], f"{cmd}: the sweep printed before it writes multirun/{last[cmd.block]}/"
            checked += 1
    assert checked >= 4

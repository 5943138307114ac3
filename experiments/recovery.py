"""Fault tolerance around the worker group: checks before launch, the supervisor's bookkeeping, shrink.

- :func:`check_faults`, :func:`checkpoint_dir`, :func:`config_hash`, :func:`code_revision`: what
  :func:`experiments.wiring.validate` adds to a :class:`~experiments.wiring.Plan`.
- :class:`Attempt`: what the launcher tells every worker about this start of the group (restart
  count, why, what to resume, the shrink that preceded it).
- :func:`record_failure`: after a failed attempt, turn the survivors' evidence files into one
  detection record (``detections.jsonl``) and archive them (``evidence/attempt-<k>/``).
- :func:`shrink_plan`: the plan that continues without the lost workers, if the rule allows it.
- :func:`truncate_metrics` and :func:`summary_from_records`: keep ``metrics.jsonl`` equal to the
  restored trajectory and recompute the summary over all of it.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

import robustagg as ra
from robustagg.checkpoint import append_jsonl, atomic_write_bytes, read_jsonl
from robustagg.errors import AssumptionError, AssumptionWarning, ConfigError
from robustagg.training import Fault, read_evidence, summarise_evidence

from .config import Mode
from .wiring import Plan, build_rule

__all__ = ["check_faults", "checkpoint_dir", "code_revision", "config_hash", "Attempt", "record_failure",
           "shrink_plan", "truncate_metrics", "summary_from_records", "last_step_reached"]


def check_faults(cfg: DictConfig, n: int, *, under_torchrun: bool = False) -> list[Fault]:
    """The configured faults, checked against this run (workers, steps, checkpoints, mode).

    Raises:
        ConfigError: a bad kind or option, a worker or step that does not exist, a checkpoint
            fault at a step without a checkpoint, ``corrupt`` without the gather reduction, faults
            in the simulated mode, or ``on_failure=shrink`` where the app does not launch workers.
    """
    tr = cfg.trainer
    steps, every = int(tr.steps), int(tr.checkpoint.every)
    faults = []
    for name, node in cfg.faults.items():
        d = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items()}  # type: ignore[union-attr]
        fault = Fault(name=str(name), **d)  # raises ConfigError for bad kinds and options
        if not 0 <= fault.rank < n:
            raise ConfigError(f"faults.{name}: rank {fault.rank} does not exist among n={n} workers.")
        if fault.step > steps:
            raise ConfigError(f"faults.{name}: step {fault.step} is after the last step (trainer.steps={steps}).")
        if fault.kind.startswith("checkpoint") and (every == 0 or (fault.step % every and fault.step != steps)):
            raise ConfigError(f"faults.{name}: no checkpoint is written at step {fault.step} (trainer.checkpoint.every="
                              f"{every}, trainer.steps={steps}); use a multiple of every, or the last step.")
        faults.append(fault)
    if faults and Mode(tr.mode) is not Mode.processes:
        raise ConfigError("fault injection needs trainer.mode=processes: faults kill, stall or desynchronise real "
                          "worker processes (the simulated mode hosts every worker in one process).")
    if str(tr.on_failure) == "shrink" and (Mode(tr.mode) is not Mode.processes or under_torchrun):
        raise ConfigError("trainer.on_failure=shrink needs the app's own launcher (trainer.mode=processes, not under "
                          "torchrun): it restarts the surviving workers as a smaller group.")
    return faults


def checkpoint_dir(cfg: DictConfig, out_dir: str) -> str:
    """The checkpoint folder (``trainer.checkpoint.dir`` or ``<out_dir>/checkpoints``), absolute.

    The folder is not created here. When it will be written (an explicit ``trainer.checkpoint.dir``,
    checkpoints, faults or restarts) a write test creates and removes a temporary folder in it, or
    in its nearest existing parent, so nothing is left behind.

    Raises:
        ConfigError: the folder or one of its parents is a file, it cannot be created or written
            (``/proc``, a read-only mount, no permission), ``resume=never`` on a folder with committed
            checkpoints, or ``resume`` names a folder that is not a committed checkpoint.
    """
    d = cfg.trainer.checkpoint.dir
    path = Path(str(d)) if d else Path(out_dir) / "checkpoints"
    tr = cfg.trainer
    writes = bool(d) or int(tr.checkpoint.every) > 0 or bool(cfg.faults) or int(tr.max_restarts) > 0
    _check_folder(path, "trainer.checkpoint.dir" if d else "the checkpoint folder <run dir>/checkpoints",
                  write_test=writes)
    resume = str(cfg.trainer.resume)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0  # torchrun restart: own checkpoints
    if resume == "never" and not restarted and path.is_dir() and any(
            p.is_dir() and p.name.startswith("step-") and "." not in p.name for p in path.iterdir()):
        raise ConfigError(f"trainer.resume=never but {path} already holds committed checkpoints of another run; "
                          "continue it with trainer.resume=auto, or choose another trainer.checkpoint.dir.")
    if resume not in ("auto", "never") and not (Path(resume) / "manifest.json").is_file():
        raise ConfigError(f"trainer.resume={resume!r} is not a committed checkpoint folder (no manifest.json); "
                          "use auto, never, or a folder such as <dir>/step-00000040.")
    return str(path.resolve())


def _check_folder(path: Path, key: str, *, write_test: bool) -> None:
    """Refuse a folder that is a file, sits under a file, or cannot be created or written (see checkpoint_dir)."""
    shown = f"{key}={path}" if key.startswith("trainer.") else f"{key} ({path})"
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{shown} cannot be a folder: {probe} is a file; choose another folder (it is created "
                          "if missing), or leave trainer.checkpoint.dir null for <run dir>/checkpoints.")
    if not write_test:
        return
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=probe))
    except OSError as exc:
        raise ConfigError(f"{shown} cannot be created or written ({probe}: {exc.strerror or exc}); choose a "
                          "writable folder, or leave trainer.checkpoint.dir null for <run dir>/checkpoints.") from None


def code_revision() -> str:
    """The git commit of the checkout robustagg is imported from, else ``robustagg <version>``."""
    git = Path(ra.__file__).resolve().parents[1] / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if head.startswith("ref:"):
            ref = head.split(None, 1)[1]
            if (git / ref).is_file():
                return (git / ref).read_text().strip()
            for line in (git / "packed-refs").read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0]
        return head
    except OSError:
        return f"robustagg {getattr(ra, '__version__', 'unknown')}"


#: Configuration keys that do not change the trajectory (left out of the config hash).
_VOLATILE = {("trainer", "resume"), ("trainer", "max_restarts"), ("trainer", "progress"), ("trainer", "port"),
             ("trainer", "checkpoint"), ("trainer", "on_failure"), ("trainer", "shrink_shards"), ("out_dir",),
             ("faults",), ("logger",), ("trainer", "collective_timeout_s"), ("trainer", "straggler_factor")}


def config_hash(container: dict[str, Any]) -> str:
    """SHA-256 of the resolved configuration without the keys that do not change the trajectory."""
    c = copy.deepcopy(container)
    for path in _VOLATILE:
        node = c
        for k in path[:-1]:
            node = node.get(k, {})
        node.pop(path[-1], None)
    return hashlib.sha256(json.dumps(c, sort_keys=True, default=str).encode()).hexdigest()


def shrink_plan(plan: Plan, lost: list[int], *, reason: str = "") -> tuple[Plan, dict[str, Any]]:
    """The plan that continues ``plan`` without the workers ``lost`` (worker ids), and its lineage record.

    Normalisation follows the survivors: the rule receives ``n' = n - len(lost)`` rows (the mean
    becomes the mean of the n' surviving gradients, not their sum over the old n); the effective
    batch becomes ``n' x batch_size`` and the learning rate is left as configured (recorded). The
    lost workers' data is dropped, or dealt round-robin to the survivors (``trainer.shrink_shards``).
    Byzantine workers among the lost are gone; the survivors keep their roles and worker ids.

    Raises:
        AssumptionError: the rule's requirement fails for n' and the declared f (strict runs); the
            message is the requirement's.
        ConfigError: no honest worker would be left.
    """
    cfg = plan.config()
    lost_set = {int(w) for w in lost}
    keep = [r for r, w in enumerate(plan.identities) if w not in lost_set]
    survivors = [plan.identities[r] for r in keep]
    old_n, new_n = plan.n, len(keep)
    byz = tuple(i for i, r in enumerate(keep) if r in plan.byzantine_ranks)
    if len(byz) >= new_n:
        raise ConfigError(f"cannot continue after losing worker(s) {sorted(lost_set)}: no honest worker is left "
                          f"among the {new_n} survivors.")
    rule = build_rule(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AssumptionWarning)
        try:
            violations = rule.check(new_n)
        except AssumptionError as exc:
            raise AssumptionError(f"{exc} Cannot shrink from n={old_n} to the n={new_n} surviving workers after "
                                  f"losing worker(s) {sorted(lost_set)}; the run stops.") from None
    parts = [plan.data.parts[r] for r in keep]
    policy = str(cfg.trainer.shrink_shards)
    if policy == "redistribute":
        import numpy as np

        extra = np.concatenate([plan.data.parts[r] for r in range(old_n) if r not in keep] or [np.zeros(0, np.int64)])
        parts = [np.concatenate([p, extra[i::new_n]]) for i, p in enumerate(parts)]
    shifts = None if plan.data.shifts is None else plan.data.shifts[keep]
    data = dataclasses.replace(plan.data, parts=parts, shifts=shifts)
    new_cfg = copy.deepcopy(plan.cfg)
    new_cfg["threat"].update({"n": new_n, "byzantine": len(byz), "ranks": list(byz)})
    b = int(cfg.trainer.batch_size)
    new = dataclasses.replace(plan, cfg=new_cfg, n=new_n, byzantine_ranks=byz, data=data, identities=tuple(survivors),
                              violations=plan.violations + list(violations),
                              assumption_violated=plan.assumption_violated or bool(violations))
    record = {"event": "shrink", "old_n": old_n, "new_n": new_n, "lost_workers": sorted(lost_set),
              "survivors": survivors, "byzantine_ranks": list(byz), "shards": policy,
              "shard_sizes": [int(len(p)) for p in parts], "normalisation": f"mean over the {new_n} survivors",
              "effective_batch": [old_n * b, new_n * b], "lr_rule": f"unchanged (lr={cfg.trainer.lr})",
              "violations": list(violations), "reason": reason}
    return new, record


@dataclass
class Attempt:
    """One start of the worker group, as the launcher tells every worker.

    Attributes:
        number: restarts so far (0: the first start).
        reason: why this start happened (the failure that ended the previous attempt).
        resume: ``auto``, ``never`` or a checkpoint folder (restarts always use ``auto``).
        fallback: a checkpoint folder ``auto`` uses when the run's folder holds none yet.
        last_step: the highest step the previous attempt reached (for ``steps_replayed``).
        shrink: the lineage record of the elastic shrink that preceded this start, or ``None``.
    """

    number: int = 0
    reason: str = ""
    resume: str = "auto"
    fallback: str = ""
    last_step: Optional[int] = None
    shrink: Optional[dict[str, Any]] = None


def last_step_reached(out_dir: Path) -> int:
    """The highest step in ``metrics.jsonl`` and the evidence files of ``out_dir`` (0 if none)."""
    steps = [int(r.get("step", 0)) for r in read_jsonl(Path(out_dir) / "metrics.jsonl") if r.get("kind") == "train"]
    steps += [int(e.get("step_id", 0)) for e in read_evidence(Path(out_dir) / "evidence")]
    return max(steps, default=0)


def record_failure(out_dir: Path, attempt: int, *, lost: list[int], message: str, archive: bool) -> dict[str, Any]:
    """Append the detection record of a failed attempt to ``detections.jsonl``; archive its evidence.

    Args:
        out_dir: the run directory (``evidence/`` and ``detections.jsonl`` live there).
        attempt: the failed attempt's number.
        lost: worker ids gone without evidence (killed, exited, terminated).
        message: the launcher's one-line account of the failure.
        archive: move ``evidence/rank-*.json`` to ``evidence/attempt-<k>/`` (a restart follows).

    Returns:
        the detection record (see :func:`robustagg.training.summarise_evidence`).
    """
    folder = Path(out_dir) / "evidence"
    evidence = read_evidence(folder)
    record = summarise_evidence(evidence, attempt=attempt, lost=lost)
    record.update({"source": "failure", "launcher": message.splitlines()[0][:500] if message else ""})
    append_jsonl(Path(out_dir) / "detections.jsonl", record)
    if archive and evidence:
        dest = folder / f"attempt-{attempt}"
        dest.mkdir(parents=True, exist_ok=True)
        for p in folder.glob("rank-*.json"):
            shutil.move(str(p), str(dest / p.name))
    return record


def truncate_metrics(path: Path, step: int) -> None:
    """Keep only the records of ``metrics.jsonl`` up to ``step`` (the restored trajectory), atomically."""
    path = Path(path)
    if not path.is_file():
        return
    keep = [r for r in read_jsonl(path) if int(r.get("step", 0)) <= step]
    atomic_write_bytes(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in keep).encode())


def summary_from_records(summary: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """Recompute the trajectory-wide summary fields from every record of ``metrics.jsonl`` (in place)."""

    def mean(vals: list[Any]) -> float:
        v = [float(x) for x in vals if isinstance(x, (int, float)) and math.isfinite(float(x))]
        return sum(v) / len(v) if v else math.nan

    train = [r for r in records if r.get("kind") == "train"]
    tests = [r for r in records if r.get("kind") == "test"]
    summary["mean_kappa_hat"] = mean([r.get("agg/kappa_hat") for r in train])
    summary["byz_accepted_rate"] = mean([r["agg/byz_accepted"] for r in train if "agg/byz_accepted" in r])
    summary["dropped_rows"] = int(sum(int(r.get("agg/dropped", 0)) for r in train))
    accs = [r["test/acc"] for r in tests if isinstance(r.get("test/acc"), (int, float))]
    if accs:
        summary["best_test_acc"] = max(accs)

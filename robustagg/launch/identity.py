"""A run's identity: the experiment fingerprint, and the check that resume cannot mix experiments.

The *fingerprint* of an experiment is a flat ``{dotted key: value}`` map of every setting that
changes the trajectory (the configuration minus :data:`EXCLUDED`). It is written into every
committed manifest. Before any process starts, :func:`check_resume` reads the newest committed
manifest of the checkpoint folder (untrusted input: parsed defensively, never unpickled) and
compares: a difference is refused with one message listing every differing key with both values,
unless the caller allows it (``resume_changes="allow"``), in which case the change is returned for
the lineage ("record the changed experiment", design brief).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from ..checkpoint import CheckpointStore
from ..errors import CheckpointError, ConfigError

__all__ = ["EXCLUDED", "INTRODUCED", "fingerprint", "fingerprint_hash", "code_revision", "ResumeCheck", "check_resume",
           "check_resume_from", "diff_fingerprints", "OPTIMIZER_PREFIX", "FIXED_ON_RESUME", "optimizer_changes",
           "unapplied_changes", "FRESH_START", "resume_log_level", "FOLLOWS_STEPS", "recorded_value"]

#: Keys (dotted prefixes) left out of the fingerprint: they do not change the trajectory. ``trainer.steps``
#: extends or shortens a run; the rest are logging, transport, supervision and fault-injection settings,
#: and where the data files are read from (``data.root``, ``data.download``: the same files elsewhere).
EXCLUDED: tuple[str, ...] = (
    "trainer.steps", "trainer.resume", "trainer.resume_changes", "trainer.max_restarts", "trainer.progress",
    "trainer.port", "trainer.master_addr", "trainer.checkpoint", "trainer.on_failure", "trainer.shrink_shards",
    "trainer.collective_timeout_s", "trainer.straggler_factor", "trainer.eval_every", "trainer.param_check_every",
    "trainer.metrics", "trainer.measure_bias", "trainer.start_method", "trainer.rejoin",
    "trainer.peer_copy", "out_dir", "run_name", "faults", "logger",
    "data.root", "data.download",
)


def _flatten(node: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(node, Mapping) and node:
        for k in sorted(node, key=str):
            _flatten(node[k], f"{prefix}.{k}" if prefix else str(k), out)
    else:
        if isinstance(node, float) and not math.isfinite(node):
            node = repr(node)
        out[prefix] = node if isinstance(node, (str, int, float, bool, type(None))) else json.loads(
            json.dumps(node, default=str))


def fingerprint(config: Mapping[str, Any], *, excluded: Iterable[str] = EXCLUDED) -> dict[str, Any]:
    """The experiment's identity: ``{dotted key: value}`` of ``config`` without the ``excluded`` prefixes.

    Args:
        config: the resolved configuration as plain containers (nested dicts and lists).
        excluded: dotted key prefixes to leave out (default :data:`EXCLUDED`).

    Returns:
        a flat dict, JSON-serialisable, sorted by key. Lists are values (``model.hidden: [64]``).

    Example:
        >>> fingerprint({"trainer": {"lr": 0.1, "steps": 5}, "seed": 0})
        {'seed': 0, 'trainer.lr': 0.1}
    """
    flat: dict[str, Any] = {}
    _flatten(copy.deepcopy(dict(config)), "", flat)
    ex = tuple(excluded)
    keep = {k: v for k, v in flat.items() if not any(k == e or k.startswith(e + ".") for e in ex)}
    return dict(sorted(keep.items()))


def fingerprint_hash(fp: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of a fingerprint's canonical JSON."""
    return hashlib.sha256(json.dumps(dict(fp), sort_keys=True, default=str).encode()).hexdigest()


def code_revision() -> str:
    """The git commit of the checkout robustagg is imported from, else ``robustagg <version>``."""
    import robustagg as ra

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


#: Keys added to the configuration after checkpoints were already being written, with the value that
#: gives the trajectory those older runs had: a checkpoint whose fingerprint lacks one is compared as
#: if it held that value (so an old run resumes under new code when the new key keeps its default,
#: and is refused, naming the key, when it does not).
INTRODUCED: dict[str, Any] = {
    "protocol._target_": "robustagg.protocols.DSGD",  # the protocol seam (issue 15): dsgd was the only trainer
    "trainer.processes": 0,                             # one process per worker
    "trainer.precision": "32",                          # float32 forward passes
    "trainer.batched_gradients": False,                 # the per-worker gradient loop
    "trainer.membership": [],                           # no scheduled absences (issue 17's reference runs)
}


def recorded_value(ckpt_dir: str | Path, key: str, *, resume: str = "auto") -> Any:
    """The value of ``key`` in the fingerprint of the checkpoint a run would resume, or ``None``.

    Used before launch to settle a setting whose default depends on the run being resumed
    (``trainer.batched_gradients=auto`` keeps the resumed checkpoint's value). Only reads
    manifests (untrusted: a manifest that does not parse is skipped, never an exception); it does
    not verify the checkpoint, which :func:`check_resume` does after.

    Args:
        ckpt_dir: the run's checkpoint folder (may not exist).
        key: a fingerprint key (e.g. ``"trainer.batched_gradients"``).
        resume: ``trainer.resume``: ``"auto"`` reads the newest committed checkpoint of
            ``ckpt_dir`` whose manifest parses, ``"never"`` nothing, anything else is one checkpoint
            folder.

    Returns:
        the recorded value; a checkpoint whose fingerprint lacks ``key`` gives the historical value
        of :data:`INTRODUCED` (``None`` when ``key`` is not there either); ``None`` when nothing is
        resumed or no manifest holds a fingerprint.

    Example:
        >>> recorded_value("/nonexistent", "trainer.batched_gradients") is None
        True
    """
    if resume == "never":
        return None
    if resume == "auto":
        root = Path(ckpt_dir)
        if not root.is_dir():
            return None
        store = CheckpointStore(root)
        folders = store.candidates()
    else:
        if not Path(resume).is_dir():
            return None
        store, folders = CheckpointStore(Path(resume).parent), [Path(resume)]
    for path in folders:
        try:
            manifest = store.read_manifest(path)
        except (CheckpointError, OSError):
            continue
        old = manifest.get("fingerprint")
        if isinstance(old, dict):
            return old[key] if key in old else INTRODUCED.get(key)
        return None
    return None


#: The prefix of the keys ``resume_changes="allow"`` applies to the restored optimizer: a changed
#: ``optimizer.<name>`` sets ``<name>`` in every restored param group (``lr``, ``momentum``,
#: ``weight_decay``, ``betas``, ...), since the restored optimizer state would otherwise overwrite it.
OPTIMIZER_PREFIX = "optimizer."
#: Keys that cannot change on resume, even allowed: the restored state belongs to the old value.
FIXED_ON_RESUME: tuple[str, ...] = ("optimizer._target_", "optimizer._partial_")


def optimizer_changes(changes: Mapping[str, Any]) -> dict[str, Any]:
    """``{param-group key: new value}`` of the allowed changes under :data:`OPTIMIZER_PREFIX`.

    Args:
        changes: ``{key: (checkpoint value, current value)}`` (:func:`diff_fingerprints`).

    Example:
        >>> optimizer_changes({"optimizer.lr": (0.1, 0.5), "seed": (0, 1)})
        {'lr': 0.5}
    """
    return {k[len(OPTIMIZER_PREFIX):]: new for k, (_, new) in changes.items()
            if k.startswith(OPTIMIZER_PREFIX) and k not in FIXED_ON_RESUME}


def unapplied_changes(changes: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Why some allowed changes could not reach the restored run (``[]``: every one can).

    ``optimizer._target_`` and ``optimizer._partial_`` cannot change (the restored optimizer state
    is the old optimizer's); ``optimizer.lr`` cannot change under a learning-rate scheduler
    (``scheduler._target_`` set): the restored scheduler keeps its own base rates and would
    override the new value.
    """
    out = [f"{k}: {a!r} -> {b!r} cannot change on resume (the restored optimizer state belongs to {a!r})"
           for k, (a, b) in changes.items() if k in FIXED_ON_RESUME]
    if f"{OPTIMIZER_PREFIX}lr" in changes and current.get("scheduler._target_") not in (None, "", "None"):
        a, b = changes[f"{OPTIMIZER_PREFIX}lr"]
        out.append(f"optimizer.lr: {a!r} -> {b!r} cannot change on resume under scheduler "
                   f"{current.get('scheduler._target_')!r} (the restored scheduler's base rates would override it)")
    return out


def diff_fingerprints(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (checkpoint value, current value)}`` for every key whose values differ (missing: ``"<absent>"``).

    A key of :data:`INTRODUCED` that the checkpoint (``old``) lacks counts as its historical value.

    Example:
        >>> diff_fingerprints({"a": 1}, {"a": 1, "trainer.processes": 0})
        {}
        >>> diff_fingerprints({"a": 1}, {"a": 1, "trainer.processes": 4})
        {'trainer.processes': (0, 4)}
    """
    absent = "<absent>"
    old = {**{k: v for k, v in INTRODUCED.items() if k not in old and k in new}, **old}
    keys = sorted(set(old) | set(new))

    def same(a: Any, b: Any) -> bool:
        # a checkpoint written before FOLLOWS_STEPS recorded the length it then had: a whole number
        return a == b or (b == FOLLOWS_STEPS and isinstance(a, int) and not isinstance(a, bool))

    return {k: (old.get(k, absent), new.get(k, absent)) for k in keys if not same(old.get(k, absent), new.get(k, absent))}


#: The fingerprint's value of a key whose configured value is ``${trainer.steps}`` (a schedule's length
#: that follows the run's: ``scheduler.T_max``), so that extending a run does not change the experiment.
FOLLOWS_STEPS = "${trainer.steps}"

#: How every "nothing to resume" line ends (:func:`resume_log_level`).
FRESH_START = "starting at step 0"


def resume_log_level(message: str) -> int:
    """The logging level of the one resume line :func:`check_resume` (or the launcher) wrote.

    A fresh start ("resume: no checkpoint folder yet ...; starting at step 0") is what every new run
    does: ``logging.INFO``. Anything else (resuming from a checkpoint, newer checkpoints skipped, a
    changed experiment continued, ``resume=never`` moving to a fresh folder) changes what runs:
    ``logging.WARNING``, so that it shows even where INFO is hidden.
    """
    import logging

    return logging.INFO if message.endswith(FRESH_START) else logging.WARNING


@dataclass
class ResumeCheck:
    """What :func:`check_resume` found in the checkpoint folder.

    Attributes:
        checkpoint: the newest committed checkpoint that verifies (its folder name), or ``None``.
        step: its step (0 when none).
        rejected: ``[(folder name, reason)]`` for every newer committed checkpoint that does not verify.
        changes: ``{key: (checkpoint value, current value)}`` accepted under ``resume_changes="allow"``.
        message: one line for the user ("resume: ...").
    """

    checkpoint: Optional[str] = None
    step: int = 0
    rejected: list[tuple[str, str]] = field(default_factory=list)
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    message: str = ""


def check_resume(ckpt_dir: str | Path, current: Mapping[str, Any], *, resume_changes: str = "refuse",
                 record: bool = True) -> ResumeCheck:
    """Before any process starts: find what ``resume=auto`` would continue, and refuse a mixed experiment.

    Only reads the folder (plus, with ``record``, one ``lineage.jsonl`` line per rejected checkpoint
    or accepted change). The checkpoint folder is untrusted: a manifest that is not JSON is a
    rejection with its reason, never an exception.

    Args:
        ckpt_dir: the run's checkpoint folder (may not exist yet).
        current: the fingerprint of the experiment about to run (:func:`fingerprint`).
        resume_changes: ``"refuse"`` (default) or ``"allow"`` (continue the changed experiment;
            the change is recorded in the lineage).
        record: append the rejections and an accepted change to ``lineage.jsonl``.

    Returns:
        a :class:`ResumeCheck`.

    Raises:
        ConfigError: ``resume_changes`` is neither value; every committed checkpoint is rejected
            (the message lists each reason), or none is left but some were set aside by an earlier
            start (``step-N.rejected-k``); or the experiment differs from the checkpoint's and
            changes are refused (the message lists every differing key, both values, and the fixes).
    """
    if resume_changes not in ("refuse", "allow"):
        raise ConfigError(f"trainer.resume_changes must be refuse or allow; got {resume_changes!r}.")
    root = Path(ckpt_dir)
    result = ResumeCheck()
    if not root.is_dir():
        result.message = f"resume: no checkpoint folder yet ({root}); {FRESH_START}"
        return result
    store = CheckpointStore(root)
    candidates = store.candidates()
    chosen: Optional[tuple[Path, dict[str, Any]]] = None
    for path in candidates:
        problems = store.verify(path)
        if not problems:
            try:
                chosen = (path, store.read_manifest(path))
                break
            except CheckpointError as exc:  # changed since verify read it
                problems = [str(exc)]
        result.rejected.append((path.name, "; ".join(problems)))
    if record:
        for name, why in result.rejected:
            store.append_lineage({"event": "rejected", "checkpoint": name, "reason": why, "by": "pre-launch check"})
    if chosen is None:
        if result.rejected:
            lines = "\n".join(f"  - {n}: {w}" for n, w in result.rejected)
            raise ConfigError(f"{root} holds {len(result.rejected)} committed checkpoint(s) and none verifies, so "
                              f"resuming would silently start over on top of them:\n{lines}\nFix: restore the "
                              f"files, resume from a checkpoint elsewhere (trainer.resume=PATH), or start over in a "
                              f"new folder with trainer.resume=never (the old files are kept).")
        aside = [p.name for p in store.rejected()]
        if aside:
            lines = "\n".join(f"  - {n}" for n in aside)
            raise ConfigError(f"{root} holds no committed checkpoint, only {len(aside)} set aside by an earlier "
                              f"start because they did not verify or load (reasons in {root / 'lineage.jsonl'}):\n"
                              f"{lines}\nResuming would silently start over on top of them. Fix: restore the files, "
                              f"resume from a checkpoint elsewhere (trainer.resume=PATH), or start over in a new "
                              f"folder with trainer.resume=never (the old files are kept).")
        result.message = f"resume: no committed checkpoint in {root}; {FRESH_START}"
        return result
    path, manifest = chosen
    result.checkpoint, result.step = path.name, int(manifest.get("step", 0))
    _compare(result, path, manifest, current, resume_changes, store if record else None)
    skipped = f" (skipped {len(result.rejected)} newer that did not verify)" if result.rejected else ""
    changed = f"; continuing with {len(result.changes)} changed key(s), recorded" if result.changes else ""
    result.message = (f"resume: found {path.name} in {root} (verified){skipped}; resuming from step "
                      f"{result.step}{changed}")
    return result


def check_resume_from(folder: str | Path, current: Mapping[str, Any], *, resume_changes: str = "refuse",
                      lineage: Optional[str | Path] = None) -> ResumeCheck:
    """Before any process starts: the check of :func:`check_resume` for an explicit checkpoint
    folder (``trainer.resume=PATH``): it must verify, and its experiment must be this one.

    Args:
        folder: the checkpoint folder to start from (e.g. ``<dir>/step-00000040``).
        current: the fingerprint of the experiment about to run.
        resume_changes: ``"refuse"`` or ``"allow"`` (the change is recorded in ``lineage``).
        lineage: the run's own checkpoint folder, whose ``lineage.jsonl`` records an accepted
            change (``None``: not recorded).

    Returns:
        a :class:`ResumeCheck` (``checkpoint`` is the folder's path).

    Raises:
        ConfigError: the folder does not verify (every reason listed), or its experiment differs
            and changes are refused (every differing key with both values, and the fixes).
    """
    path = Path(folder)
    store = CheckpointStore(path.parent)
    problems = store.verify(path)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"trainer.resume={str(folder)!r} does not verify, so the run cannot start from it:\n{lines}\n"
                          f"Fix: restore the files, pass another checkpoint folder, or trainer.resume=auto / never.")
    manifest = store.read_manifest(path)
    result = ResumeCheck(checkpoint=str(path), step=int(manifest.get("step", 0)))
    _compare(result, path, manifest, current, resume_changes, None if lineage is None else CheckpointStore(Path(lineage)))
    changed = f"; continuing with {len(result.changes)} changed key(s), recorded" if result.changes else ""
    result.message = f"resume: from {folder} (verified; the same experiment){changed}"
    return result


def _compare(result: ResumeCheck, path: Path, manifest: Mapping[str, Any], current: Mapping[str, Any],
             resume_changes: str, record: Optional[CheckpointStore]) -> None:
    """Fill ``result.changes`` from the manifest's fingerprint, or refuse a mixed experiment."""
    if resume_changes not in ("refuse", "allow"):
        raise ConfigError(f"trainer.resume_changes must be refuse or allow; got {resume_changes!r}.")
    old = manifest.get("fingerprint")
    if isinstance(old, dict):
        changes = diff_fingerprints(old, current)
    elif manifest.get("config_hash") not in (None, fingerprint_hash(current)):
        changes = {"<config_hash>": (manifest.get("config_hash"), fingerprint_hash(current))}
    else:
        changes = {}
    if changes and resume_changes != "allow":
        lines = "\n".join(f"  {k}: {a!r} (checkpoint) -> {b!r} (now)" for k, (a, b) in changes.items())
        raise ConfigError(f"{path} belongs to a different experiment than this command; resuming would "
                          f"mix two experiments. Differing keys:\n{lines}\nFix: run the original command again "
                          f"(keys such as trainer.steps, logging and fault settings may change), start a new run "
                          f"(another run_name or hydra.run.dir), or pass trainer.resume_changes=allow to continue "
                          f"the changed experiment (the change is recorded in lineage.jsonl).")
    stuck = unapplied_changes(changes, current) if changes else []
    if stuck:
        lines = "\n".join(f"  {w}" for w in stuck)
        raise ConfigError(f"{path}: trainer.resume_changes=allow cannot continue with these changes:\n{lines}\n"
                          f"Fix: start a new run (another run_name or hydra.run.dir) with the new values, or keep "
                          f"the checkpoint's values.")
    result.changes = changes
    if changes and record is not None:
        record.append_lineage({"event": "experiment_changed", "checkpoint": path.name, "step": result.step,
                               "changes": {k: [a, b] for k, (a, b) in changes.items()}})

"""Committed checkpoints of a :class:`~robustagg.training.Trainer` and the coordinated restore.

**Save** (:class:`Checkpointer`, every K steps and at the end, on every rank)::

    state <- trainer.state_dict()                 (taken first: the protocol changes nothing in it)
    every rank: its own file rank-<p>.pt into ckpt/step-N.tmp/ (rank 0 also replicated.pt);
                temp name, fsync, rename
    vote "checkpoint-files"                        every rank's files are durable
    (each file carries an identity record: its name, the step, the run id, the workers it holds)
    rank 0: manifest.json last (sizes, SHA-256, lineage, HMAC with a key), rename
            step-N.tmp -> step-N, LATEST
    vote "checkpoint-commit"                       everyone knows step N is committed

**Restore** (:func:`restore`, on every rank before training)::

    rank 0: remove stale step-*.tmp ; pick the newest checkpoint that verifies (newer ones that
            do not are set aside with the reason) ; propose its step
    vote "restore-choose"                          every rank takes rank 0's proposal
    every rank: check the manifest (paths, format, HMAC, step), read its own files once
                (replicated.pt and the file(s) of the workers it hosts), check their digests on
                those bytes, parse them (no pickled code), compare their identity with the
                manifest, and load them into the trainer (its previous state kept aside)
    vote "restore-verify"                          all good -> done; any bad -> every rank rolls
                                                   back, rank 0 sets it aside with the reason and
                                                   picks the previous one
    rank 0: lineage.jsonl record (restored from, steps replayed, restart count, why)

Votes are control-plane collectives (:meth:`~robustagg.distributed.Communicator.vote`): they do not
count in the data-plane sequence number, so a resumed run's headers carry exactly the numbers an
uninterrupted run's do. The checkpoint folder must be visible to every rank (one machine, or a
shared file system).

Guarantee (tested with real processes killed by SIGKILL): on CPU, with the same world size, one
torch thread per process and deterministic kernels, a run restored from a committed checkpoint
ends with parameters and optimizer state bit-for-bit equal to an uninterrupted run.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from ..checkpoint import Checkpoint, CheckpointStore, read_jsonl, save_state
from ..errors import CheckpointError, NothingToRestoreError

if TYPE_CHECKING:  # pragma: no cover
    from .faults import FaultInjector
    from .trainer import Trainer

__all__ = ["Checkpointer", "Restored", "restore", "FAULT_LOG", "REPLICATED", "IDENTITY"]

#: Name of the fired-faults log in the checkpoint folder.
FAULT_LOG = "faults.jsonl"
#: The file holding the state every rank shares (written by rank 0).
REPLICATED = "replicated.pt"
_NONE, _EXPLICIT, _REFUSE = -1, -2, -3


#: Key of the identity record every file written by :class:`Checkpointer` carries inside it.
IDENTITY = "identity"


def _rank_file(p: int) -> str:
    return f"rank-{p}.pt"


def _identity(name: str, step: int, run_id: Any, workers: Optional[list[int]] = None) -> dict[str, Any]:
    """What a file says about itself: its name, step, run id and the workers it holds (``None``: replicated)."""
    return {"file": name, "step": int(step), "run_id": run_id, "kind": "replicated" if workers is None else "rank",
            "workers": None if workers is None else sorted(int(w) for w in workers)}


def _identity_problems(part: Any, name: str, manifest: Mapping[str, Any]) -> list[str]:
    """Why the parsed file ``name`` does not belong to the checkpoint ``manifest`` describes."""
    where = f"step {manifest.get('step')}/{name}"
    if not isinstance(part, dict):
        return [f"{where}: holds a {type(part).__name__}, not a state dict"]
    ident = part.get(IDENTITY)
    if not isinstance(ident, dict):
        return [f"{where}: carries no identity record (not written by this version's Checkpointer)"]
    problems = []
    if ident.get("file") != name:
        problems.append(f"{where}: the file says it is {ident.get('file')!r}")
    if ident.get("step") != manifest.get("step"):
        problems.append(f"{where}: the file holds step {ident.get('step')!r}, "
                        f"the manifest says {manifest.get('step')!r}")
    if ident.get("run_id") != manifest.get("run_id"):
        problems.append(f"{where}: the file is from run {ident.get('run_id')!r}, the manifest from run "
                        f"{manifest.get('run_id')!r}")
    if name in (manifest.get("reconstructed") or {}):  # a lost rank's shard a rescue rebuilt
        if ident.get("kind") != "shard" or not isinstance(part.get("optimizer_shard"), dict):
            problems.append(f"{where}: a {ident.get('kind')!r} file, not a rebuilt optimizer-state shard")
        return problems
    if name == REPLICATED:
        if ident.get("kind") != "replicated":
            problems.append(f"{where}: a {ident.get('kind')!r} file, not the replicated state")
        if part.get("step") != manifest.get("step"):
            problems.append(f"{where}: the trainer state inside is at step {part.get('step')!r}")
    else:
        listed = sorted((manifest.get("hosts") or {}).get(name) or [])
        workers = part.get("workers")
        try:
            held = sorted(int(w) for w in workers) if isinstance(workers, dict) else None
        except (TypeError, ValueError):
            held = None
        if ident.get("kind") != "rank" or ident.get("workers") != listed or held != listed:
            problems.append(f"{where}: holds workers {held} (says {ident.get('workers')}), the manifest lists {listed}")
    return problems


class Checkpointer:
    """Writes committed checkpoints of a trainer (see the module docstring for the protocol).

    Args:
        store: the :class:`~robustagg.checkpoint.CheckpointStore`.
        every: write after every ``every`` completed steps (0: only :meth:`save` calls by hand).
        meta: manifest fields every checkpoint carries (run id, roles, config hash, code revision,
            mode, restart count, ...); ``parent``, ``world_size``, ``hosts``, ``replayed`` and
            ``faults_fired`` are filled in here.
        injector: fault injection at the checkpoint hooks, or ``None``.
        parent: the checkpoint the run was restored from (lineage of the first commit).
        guard: ``guard(step)`` called on rank 0 after every rank's files are durable and before
            the manifest is written; it raises to refuse the commit (the membership fence,
            :meth:`robustagg.launch.quorum.Membership.claim_commit`). ``None``: no fence.

    Raises:
        CheckpointError: ``every`` is negative.
    """

    def __init__(self, store: CheckpointStore, *, every: int, meta: Optional[Mapping[str, Any]] = None,
                 injector: Optional["FaultInjector"] = None, parent: Optional[str] = None,
                 guard: Optional[Callable[[int], None]] = None) -> None:
        if every < 0:
            raise CheckpointError(f"checkpoint every must be >= 0 steps; got {every}.")
        self.store = store
        self.every = int(every)
        self.meta = dict(meta or {})
        self.injector = injector
        self.parent = parent
        self.guard = guard
        self.last_saved: Optional[int] = None
        self._hosts: Optional[dict[str, list[int]]] = None

    def due(self, step: int) -> bool:
        """True when the checkpoint after ``step`` completed steps is scheduled."""
        return self.every > 0 and step > 0 and step % self.every == 0 and step != self.last_saved

    def _host_map(self, trainer: "Trainer") -> dict[str, list[int]]:
        comm = trainer.comm
        if self._hosts is None:
            mine = [trainer.identities[r] for r in comm.local_ranks]
            hosts = getattr(comm, "hosts", None)
            if comm.num_processes == 1:
                self._hosts = {_rank_file(0): mine}
            elif hosts is not None and len(hosts) != comm.num_processes:
                # several workers per process (fixed blocks, worker id = rank: no shrink renumbers them)
                self._hosts = {_rank_file(p): [w for w, h in enumerate(hosts) if h == p]
                               for p in range(comm.num_processes)}
            else:  # one worker per process: each process tells its worker id
                ids = comm.vote(mine[0], op="checkpoint-hosts")
                self._hosts = {_rank_file(p): [w] for p, w in enumerate(ids)}
        return self._hosts

    def save(self, trainer: "Trainer") -> Optional[Checkpoint]:
        """Write and commit the checkpoint of the trainer's current step (every rank calls it).

        Returns:
            the committed :class:`~robustagg.checkpoint.Checkpoint` on rank 0, ``None`` elsewhere.

        Raises:
            CollectiveError: a rank failed during the protocol (nothing is committed then).
            CheckpointError: a rank's file is missing at commit time.
            QuorumLostError: the ``guard`` refused the commit (rank 0; nothing is committed).
        """
        comm, store, inj = trainer.comm, self.store, self.injector
        step = trainer.step_id
        state = trainer.state_dict()
        hosts = self._host_map(trainer)
        staging = store.staging(step)
        if inj is not None:
            inj.checkpoint_files(step, staging)
        run_id = self.meta.get("run_id")
        mine = _rank_file(comm.rank)
        if comm.is_main:
            save_state(staging / REPLICATED, {**state["replicated"], IDENTITY: _identity(REPLICATED, step, run_id)})
        save_state(staging / mine, {**state["local"], IDENTITY: _identity(mine, step, run_id, hosts[mine])})
        comm.vote(1, op="checkpoint-files")
        committed: Optional[Checkpoint] = None
        if comm.is_main:
            if self.guard is not None:
                self.guard(step)  # the membership fence: refused -> no manifest, nothing committed
            lineage = store.lineage()
            meta = {**self.meta, "world_size": comm.world_size, "hosts": hosts, "parent": self.parent,
                    "replayed": [r["steps_replayed"] for r in lineage if r.get("steps_replayed")],
                    "faults_fired": [r.get("id") for r in read_jsonl(store.root / FAULT_LOG)]}
            hook = None if inj is None else (lambda path: inj.checkpoint_commit(step, path))
            committed = store.commit(step, meta, [REPLICATED, *hosts], before_rename=hook)
        comm.vote(1, op="checkpoint-commit")
        self.parent = store.name(step)
        self.last_saved = step
        if inj is not None:
            inj.checkpoint_committed(step, store.root / store.name(step))
        return committed


@dataclass
class Restored:
    """What :func:`restore` did.

    Attributes:
        step: completed steps of the restored state (0: nothing restored, a fresh start).
        checkpoint: the folder name restored from, or ``None``.
        skipped: why newer candidates were not used (missing file, SHA-256 mismatch, a path
            outside the folder, a file of another step or run, a file that cannot be loaded, ...).
        record: the lineage record written (rank 0, when a checkpoint was loaded, this is a
            restart, or a candidate was skipped; ``{}`` otherwise).
        manifest: the manifest of the checkpoint loaded (every rank; ``{}`` when none was).
        fresh: this process's workers that started with fresh own state, the checkpoint never
            having had them (``restore(new_workers=True)``).
    """

    step: int = 0
    checkpoint: Optional[str] = None
    skipped: list[str] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)
    fresh: list[int] = field(default_factory=list)


def new_workers_of(manifest: Mapping[str, Any], worker_ids: Sequence[int]) -> list[int]:
    """The workers of ``worker_ids`` the checkpoint ``manifest`` describes never had (in neither its
    ``identities`` nor its ``hosts``): a resume into a larger group starts them fresh."""
    had = {int(w) for w in manifest.get("identities") or []}
    had |= {int(w) for ids in (manifest.get("hosts") or {}).values() for w in ids}
    return [int(w) for w in worker_ids if int(w) not in had]


def _own_files(manifest: Mapping[str, Any], worker_ids: list[int]) -> list[str]:
    hosts = manifest.get("hosts") or {}
    files = [f for f, ids in hosts.items() if set(int(i) for i in ids) & set(worker_ids)]
    covered = {int(i) for f in files for i in hosts[f]}
    missing = [w for w in worker_ids if w not in covered]
    if missing:
        raise CheckpointError(f"the checkpoint holds no state for worker(s) {missing}; it has workers "
                              f"{sorted(int(i) for ids in hosts.values() for i in ids)}.")
    return files


def _pick(store: CheckpointStore, excluded: set[str], skipped: list[str]) -> Optional[Path]:
    """Rank 0: the newest candidate that verifies; newer failing ones are set aside with the reason."""
    for path in store.candidates():
        if path.name in excluded:
            continue
        problems = store.verify(path)
        if not problems:
            return path
        skipped.extend(problems)
        excluded.add(path.name)
        store.reject(path)
    return None


def _read_state(trainer: "Trainer", ck: Checkpoint, names: list[str]) -> dict[str, Any]:
    """This process's state from ``names`` of ``ck``: each file read once, its digest checked on
    those bytes, parsed without code execution, and its identity compared with the manifest.

    Raises:
        CheckpointError: any of that fails (the message says which file and why).
    """
    worker_ids = [trainer.identities[r] for r in trainer.comm.local_ranks]
    parts = {name: ck.load(name) for name in names}
    problems = [p for name, part in parts.items() for p in _identity_problems(part, name, ck.manifest)]
    if problems:
        raise CheckpointError("; ".join(problems))
    workers: dict[int, Any] = {}
    local: dict[str, Any] = {}
    for name in names:
        if name == REPLICATED:
            continue
        part = parts[name]
        if not local:
            local = {k: v for k, v in part.items() if k not in ("workers", IDENTITY)}
        for wid, w in part["workers"].items():
            if int(wid) in worker_ids:
                workers[int(wid)] = w
    replicated = {k: v for k, v in parts[REPLICATED].items() if k != IDENTITY}
    if replicated.get("optimizer_sharding"):  # every rank's shard: the new slicing may cut them otherwise
        # (and the shards a rescue rebuilt for lost ranks, robustagg.training.shard_recovery)
        others = [f for f in [*(ck.manifest.get("hosts") or {}), *(ck.manifest.get("reconstructed") or {})]
                  if f not in parts]
        more = {name: ck.load(name) for name in others}
        problems = [p for name, part in more.items() for p in _identity_problems(part, name, ck.manifest)]
        if problems:
            raise CheckpointError("; ".join(problems))
        replicated["optimizer_shards"] = [p["optimizer_shard"] for p in [*parts.values(), *more.values()]
                                          if isinstance(p, dict) and "optimizer_shard" in p]
    return {"replicated": replicated, "local": {**local, "workers": workers}}


def _diagnose(ck: Checkpoint) -> list[str]:
    """Rank 0, after another rank refused ``ck``: the problems of every file it lists (read, digest,
    unpickling, identity), so that the lineage says why."""
    out: list[str] = []
    for name in ck.manifest.get("files", {}):
        try:
            out.extend(_identity_problems(ck.load(name), name, ck.manifest))
        except CheckpointError as exc:
            out.append(str(exc))
    return out


def _nothing_loads(store: CheckpointStore, skipped: list[str], tried: int) -> str:
    """Rank 0's refusal when committed checkpoints exist but none loads (a lineage record too)."""
    aside = [p.name for p in store.rejected()]
    if tried:
        store.append_lineage({"event": "refused", "time": time.time(), "reason": "no committed checkpoint loads",
                              "skipped": skipped})
        head = (f"none of the {tried} committed checkpoint(s) in {store.root} loads, so training would silently "
                f"start over from step 0 on top of them:")
        lines = "".join(f"\n  - {s}" for s in skipped)
    else:
        head = (f"{store.root} holds no committed checkpoint that loads, only checkpoints set aside by an "
                f"earlier start (reasons in {store.root / 'lineage.jsonl'}):")
        lines = "".join(f"\n  - {n}" for n in aside)
    return (f"{head}{lines}\nThey were set aside as step-N.rejected-k/. Fix: restore the files, resume from a "
            f"checkpoint elsewhere (trainer.resume=PATH), or start over in a new folder with trainer.resume=never "
            f"(the old files are kept).")


def restore(trainer: "Trainer", store: CheckpointStore, *, request: str = "auto", fallback: Optional[str] = None,
            restart: int = 0, reason: str = "", last_step: Optional[int] = None,
            extra: Optional[Mapping[str, Any]] = None, new_workers: bool = False) -> Restored:
    """Agree with every rank on one verified committed checkpoint, load it, record the lineage.

    Every rank of the group calls it, before training (see the module docstring).

    Args:
        trainer: the freshly built trainer (its state is replaced when a checkpoint is loaded).
        store: the run's checkpoint store (lineage, fired faults and checkpoints live there).
        request: ``"auto"`` (the newest checkpoint that verifies, falling back to older ones),
            ``"never"`` (start fresh), or the path of one checkpoint folder (it must verify).
        fallback: with ``"auto"``, a checkpoint folder to use when ``store`` holds none (a run
            started from an explicit path and restarted before its first commit).
        restart: restarts so far (0 on the first start); recorded.
        reason: why this start happened (the failure that caused the restart); recorded.
        last_step: the highest step the failed attempt reached (for ``steps_replayed``).
        extra: more fields for the lineage record (e.g. an elastic shrink's old and new n).
        new_workers: a hosted worker the checkpoint never had (absent from its manifest's
            ``identities``: a resume into a larger group, ``resume_changes=allow``) keeps the fresh
            own state the trainer was built with (data position 0, its RNG stream from the seed
            and its id, no momentum); ``Restored.fresh`` lists them. ``False``: refused like any
            other missing worker. A worker the checkpoint had is never started fresh.

    Returns:
        a :class:`Restored`. Its lineage record carries ``time`` (``time.time()`` seconds, when the
        restore ended) and ``restore_s`` (seconds since this call began on rank 0: cleaning the
        staging folders, choosing and verifying, every rank's read, check and load, the votes).

    Any problem with a checkpoint on any rank (a digest, a path or symlink rule, a file whose
    identity does not match the manifest, code the unpickler refuses, state that does not fit the
    trainer, missing state of a hosted worker) rejects it: with ``"auto"`` the previous committed
    one is tried and the reason lands in ``Restored.skipped`` and the lineage record; the trainer
    is rolled back to its state before the attempt.

    Raises:
        CheckpointError: an explicit path (``request`` or ``fallback``) is rejected on some rank
            (the message gives this rank's reasons); or, with ``"auto"``, committed checkpoints
            exist (or were set aside by an earlier start) and none loads on every rank: the run
            stops with every reason rather than train from step 0 on top of them
            (:class:`~robustagg.errors.NothingToRestoreError`).
        CollectiveError: a rank failed during the protocol.
    """
    started = time.time()
    comm = trainer.comm
    main = comm.is_main
    explicit = None if request in ("auto", "never") else str(request)
    skipped: list[str] = []
    excluded: set[str] = set()
    snapshot: Optional[dict[str, Any]] = None
    if main:
        store.clean_staging()
    while True:
        proposal = _NONE
        if main and request != "never":
            if explicit is not None:
                proposal = _EXPLICIT
            else:
                path = _pick(store, excluded, skipped)
                if path is not None:
                    proposal = int(path.name.split("-")[1])
                elif fallback:
                    proposal, explicit = _EXPLICIT, str(fallback)
                elif excluded or store.rejected():
                    proposal = _REFUSE  # checkpoints exist and none loads: never a silent start from 0
        choice = comm.vote(proposal, op="restore-choose")[0]
        if choice == _REFUSE:
            if main:
                raise NothingToRestoreError(_nothing_loads(store, skipped, len(excluded)))
            comm.vote(0, op="restore-refused")  # rank 0 raises the reason first; this waits until it is gone
            raise NothingToRestoreError("rank 0 found no committed checkpoint that loads (its message lists why)")
        if choice == _NONE:
            ck, step = None, 0
            break
        if choice == _EXPLICIT:
            explicit = explicit or str(fallback or request)
            where = Path(explicit)
        else:
            where = store.root / store.name(choice)
        # Every rank reads, checks and applies its own files *before* the vote, so that any failure
        # (digest, identity, unpickling refused, a structure that does not fit the trainer) is a
        # verdict like a hash mismatch: the checkpoint is rejected and the previous one tried.
        problems, touched, here = [], False, None
        try:
            problems = store.verify(where, [])  # the manifest alone: paths, format, HMAC, step
            if not problems:
                here = Checkpoint(where, store.read_manifest(where))
                hosted = [trainer.identities[r] for r in comm.local_ranks]
                fresh = new_workers_of(here.manifest, hosted) if new_workers else []
                names = [REPLICATED, *_own_files(here.manifest, [w for w in hosted if w not in fresh])]
                state = _read_state(trainer, here, names)
                if snapshot is None:
                    snapshot = copy.deepcopy(trainer.state_dict())
                if fresh:  # their own state as built; a process hosting only new workers keeps all of its own
                    own = snapshot["local"]
                    if not state["local"]["workers"]:
                        state["local"] = {k: v for k, v in own.items() if k != "optimizer_shard"}
                    state["local"]["workers"] = {**state["local"]["workers"],
                                                 **{w: own["workers"][w] for w in fresh}}
                touched = True
                trainer.load_state_dict(state)
        except CheckpointError as exc:
            problems = [str(exc)]
        except Exception as exc:  # a verified file whose content does not fit: wrong keys, types, shapes
            problems = [f"{where.name}: its state does not fit this trainer ({type(exc).__name__}: {str(exc)[:300]})"]
        verdicts = comm.vote(0 if problems else 1, op="restore-verify")
        if all(verdicts) and here is not None:
            ck, step = here, here.step
            break
        if touched and snapshot is not None:
            trainer.load_state_dict(snapshot)  # back to the state it had before this attempt
        bad = [p for p, v in enumerate(verdicts) if not v]
        if choice == _EXPLICIT:
            raise CheckpointError(f"checkpoint {where} does not verify on rank(s) {bad}: "
                                  f"{'; '.join(problems) or 'see those ranks'}")
        if main:
            # the folder is shared: rank 0 can name what the other ranks refused
            why = problems or (_diagnose(here) if here is not None else [])
            skipped.extend(why or [f"{where.name}: rank(s) {bad} refused their files (see their logs)"])
            excluded.add(where.name)
            store.reject(where)
    result = Restored(step=step, checkpoint=None if ck is None else ck.path.name, skipped=skipped,
                      manifest={} if ck is None else dict(ck.manifest))
    if ck is not None and new_workers:
        result.fresh = new_workers_of(ck.manifest, [trainer.identities[r] for r in comm.local_ranks])
    if main and (ck is not None or restart > 0 or skipped):
        if ck is not None and ck.path.parent == store.root:
            store.set_latest(ck.path.name)
        reached = step if last_step is None else max(int(last_step), step)
        record = {"event": "restore", "time": time.time(), "restart": int(restart), "reason": reason,
                  "restored_from": None if ck is None else step,
                  "checkpoint": None if ck is None else str(ck.path),
                  "source": None if ck is None else "disk",  # a grow record's "sources" names peers
                  "steps_replayed": [step + 1, reached] if reached > step else [],
                  "skipped": skipped, "world_size": comm.world_size, "request": request, **dict(extra or {})}
        record["restore_s"] = record["time"] - started  # choose, verify, load, agree (every rank)
        store.append_lineage(record)
        result.record = record
    return result


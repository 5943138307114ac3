"""Where a lost rank's optimizer-state shard comes from, without replaying steps (issue 31).

With ``trainer.state_sharding=optimizer`` rank r alone holds the optimizer state of slice r
(:mod:`~robustagg.training.state_sharding`). A rank that dies takes that state with it. Three
sources can give it back to the survivors of ``trainer.on_failure=shrink``:

(a) **the last committed checkpoint**, re-sliced onto the survivors; every step since it is
    replayed (always available; the default).
(b) **redundant copies**, ``trainer.shard_redundancy=k``: slice s is also held by the ranks
    ``s+1, ..., s+k-1`` (mod world), which apply the same server step to it
    (:meth:`~robustagg.training.state_sharding.OptimizerShard.local_step`): every rank holds the
    whole aggregate after the reduction, so a copy costs compute and memory, no communication, and
    is bit-equal to the owner's state (same floating-point operations on the same inputs). Up to
    ``k - 1`` lost ranks are covered whenever no k consecutive ranks die together.
(c) **a parity shard per group**, ``trainer.shard_parity=g``: slices are grouped ``g`` at a
    time (``[0, g), [g, 2g), ...``; at least two groups). After every step the bytes of every
    slice's state (:func:`~robustagg.training.state_sharding.shard_bytes`) are XOR-ed per group in
    one all-reduce; rank ``first slice of the next group`` (cyclically) keeps group j's parity.
    One lost slice per group is the XOR of the parity and the group's other slices; two lost
    slices of one group, or a lost slice together with its group's parity holder, are beyond it.

**The boundary the survivors agree on.** Each rank snapshots its whole trainer state (the
checkpoint's replicated and own parts, plus the copies and parity it holds) at the start of every
step and keeps the last two. When the launcher sees a worker die it asks every survivor (a
``.requested`` file the survivors' watcher threads poll for) to write its snapshots to ``<checkpoint dir>/rescue/attempt-<k>/rank-<r>.pt``. No survivor can be
more than one step ahead of another (a step's parameter all-gather needs every rank), so the
newest step every survivor has a snapshot of is a common boundary T; at T every survivor's state
is complete (its step's parity all-reduce and gather returned).

:func:`recover` (the launcher, between attempts) then writes a regular committed checkpoint of
step T: the replicated state and every survivor's own file from their snapshots, and one
``shard-<s>.pt`` per lost slice from its source. The restarted, shrunk group restores it like any
commit (re-sliced onto the new world size) and replays only the steps past T that some rank had
logged (zero when the failure came before any survivor finished step T + 1).

**Checks and what they cannot do.** Every copy of a slice that survives (the owner's and the
holders') must be that slice's (its coordinates, its pieces) and is compared byte for byte; a
disagreement refuses the reconstruction (a corrupted or lying copy: the run falls back to the last
commit and its replay). The lost slice's own copies can be compared only when two of them survive
(k >= 3); with k = 2 its one surviving copy is used as it is. Parity alone cannot see a wrong
value: a corrupted survivor shard XOR-ed into the parity yields a wrong reconstruction that passes
every byte check (``tests/test_shard_recovery.py`` shows it). Anything the source cannot cover
(two lost slices of one parity group, all k holders of a slice, a survivor that wrote no rescue
file before the launcher stopped it) falls back to the last commit with the steps since it
replayed, and the lineage says why.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

from ..checkpoint import CheckpointStore, load_state, read_jsonl, save_state
from ..errors import CheckpointError
from .shard_protection import copy_holders, parity_groups, parity_holder
from .state_sharding import _pieces, shard_bytes, shard_from_bytes

__all__ = ["plan_recovery", "recover", "rescue_folder"]

#: The folder (under the checkpoint directory) the survivors' rescue files of an attempt go to.
RESCUE = "rescue"


def _digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.numpy().tobytes(), digest_size=16).hexdigest()


class _Sized:
    """Stands for a parameter of ``n`` elements where only its size is needed (no allocation)."""

    def __init__(self, n: int) -> None:
        self.n = int(n)

    def numel(self) -> int:
        return self.n


def _sized(sizes: Sequence[int]) -> list[Any]:
    return [_Sized(n) for n in sizes]


def rescue_folder(ckpt_dir: str | Path, attempt: int) -> Path:
    """``<ckpt_dir>/rescue/attempt-<attempt>``: where the survivors of that attempt write their snapshots."""
    return Path(ckpt_dir) / RESCUE / f"attempt-{int(attempt)}"


def _shard_problem(exp: Any, s: int, bounds: Sequence[tuple[int, int]], sizes: Sequence[int], rank: int
                   ) -> Optional[str]:
    """Why ``exp``, rank ``rank``'s copy of slice ``s``, is not a shard of that slice (``None``: it is):
    its range and its pieces must be the slicing's, each piece's state a dict of tensors."""
    if not 0 <= s < len(bounds):
        return f"rank {rank} holds a copy of slice {s}, which the world of {len(bounds)} does not have"
    a, b = bounds[s]
    want = _pieces(_sized(sizes), a, b)
    try:
        got = [(int(p["param"]), int(p["lo"]), int(p["hi"])) for p in exp["pieces"]]
        ok = (int(exp["start"]), int(exp["end"])) == (a, b) and got == want and all(
            isinstance(p["state"], dict) and all(v is None or isinstance(v, torch.Tensor) for v in p["state"].values())
            for p in exp["pieces"])
    except (KeyError, TypeError, ValueError):
        ok = False
    return None if ok else (f"rank {rank}'s shard of slice {s} is not that slice's (coordinates [{a}, {b}) in "
                            f"{len(want)} piece(s))")


def _template(parts: Mapping[int, Mapping[str, Any]], param_groups: Sequence[int], T: int) -> dict[int, Any]:
    """Per optimizer group, ``{key: (dtype, per_coordinate, shape)}`` from the survivors' own shards at T."""
    out: dict[int, Any] = {}
    for p in parts.values():
        snap = next(s for s in p["snapshots"] if s["step"] == T)
        for piece in snap["state"]["local"]["optimizer_shard"]["pieces"]:
            grp = param_groups[int(piece["param"])]
            if grp in out:
                continue
            out[grp] = {k: ((None, False, ()) if v is None else (v.dtype, v.dim() > 0, tuple(v.shape)))
                        for k, v in piece["state"].items()}
    return out


def plan_recovery(parts: Mapping[int, Mapping[str, Any]], lost: Sequence[int], world: int, k: int, g: int
                  ) -> tuple[Optional[int], dict[int, tuple[dict[str, Any], str, int]], list[str]]:
    """Choose the common boundary T and a source for every lost slice, from the survivors' rescue files.

    Args:
        parts: each surviving rank's rescue payload (:meth:`ShardProtection.payload`).
        lost: the ranks (= slices) that died. world, k, g: the failed group's slicing and settings.

    Returns:
        ``(T, {slice: (shard export, source sentence, bytes read)}, problems)``; with problems the
        reconstruction is refused (``T`` may be ``None``) and the caller falls back to the last commit.
    """
    survivors = [r for r in range(world) if r not in set(lost)]
    missing = [r for r in survivors if r not in parts]
    if missing:
        return None, {}, [f"survivor rank(s) {missing} left no rescue state (stopped before writing it)"]
    if not survivors:
        return None, {}, ["no rank survived"]
    T = min(max(s["step"] for s in parts[r]["snapshots"]) for r in survivors) if all(
        parts[r]["snapshots"] for r in survivors) else None
    if T is None or any(all(s["step"] != T for s in parts[r]["snapshots"]) for r in survivors):
        return None, {}, [f"the survivors' snapshots share no step: {[[s['step'] for s in parts[r]['snapshots']] for r in survivors]}"]
    at = {r: next(s for s in parts[r]["snapshots"] if s["step"] == T) for r in survivors}
    own = {r: at[r]["state"]["local"]["optimizer_shard"] for r in survivors}
    held: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for r in survivors:
        held.setdefault(r, []).append((r, own[r]))
        for s, exp in at[r]["copies"].items():
            held.setdefault(int(s), []).append((r, exp))
    bounds = [(int(a), int(b)) for a, b in parts[survivors[0]]["bounds"]]
    sizes = [int(n) for n in parts[survivors[0]]["param_sizes"]]
    problems = [why for s, copies in sorted(held.items()) for r, exp in copies
                if (why := _shard_problem(exp, s, bounds, sizes, r)) is not None]
    if problems:
        return T, {}, problems
    for s, copies in sorted(held.items()):  # every surviving copy of a slice must agree byte for byte
        digests = {r: _digest(shard_bytes(e)) for r, e in copies}
        if len(set(digests.values())) > 1:
            problems.append(f"slice {s}: its copies on ranks {sorted(digests)} disagree byte for byte (a corrupted "
                            f"or lying copy); which one is right cannot be told")
    out: dict[int, tuple[dict[str, Any], str, int]] = {}
    for s in sorted(lost):
        if k > 1:
            if s in held:
                r, exp = held[s][0]
                out[s] = (exp, f"the redundant copy on rank {r}", int(shard_bytes(exp).numel()))
            else:
                problems.append(f"slice {s}: all {k} holders {copy_holders(s, world, k)} are lost")
            continue
        if g > 0:
            j = s // g
            group = parity_groups(world, g)[j]
            h = parity_holder(j, world, g)
            others = [o for o in group if o != s]
            if any(o in set(lost) for o in others):
                problems.append(f"slice {s}: parity group {j} {group} lost {sorted(o for o in group if o in set(lost))}, "
                                f"one parity reconstructs one slice per group")
                continue
            if h in set(lost):
                problems.append(f"slice {s}: the parity of group {j} was on rank {h}, which is lost too")
                continue
            parity = at[h]["parity"].get(j)
            if parity is None:
                problems.append(f"slice {s}: rank {h} holds no parity of group {j} at step {T} (no step taken yet)")
                continue
            data = parity.clone()
            for o in others:
                b = shard_bytes(own[o])
                data[:b.numel()] ^= b
            d = int(bounds[-1][1])
            a, b_ = bounds[s]
            params = parts[survivors[0]]["param_groups"]
            template = _template(parts, params, T)
            pieces = _pieces(_sized(sizes), a, b_)
            try:
                exp = shard_from_bytes(data, pieces, {i: template.get(params[i], {}) for i, _, _ in pieces}, d, a, b_)
            except CheckpointError as exc:
                problems.append(f"slice {s}: {exc}")
                continue
            out[s] = (exp, f"the parity of group {j} on rank {h} XOR slices {others}",
                      int(parity.numel() + sum(shard_bytes(own[o]).numel() for o in others)))
            continue
        problems.append(f"slice {s}: no redundant copy and no parity is kept")
    return T, out, problems


def _payload_problem(p: Any, name: str, run_id: Optional[str]) -> Optional[str]:
    """Why a rescue file's payload cannot be used (``None``: its shape is sound)."""
    if not isinstance(p, dict):
        return f"{name}: holds a {type(p).__name__}, not a rescue payload"
    try:
        world, rank = int(p["world"]), int(p["rank"])
        bounds = [(int(a), int(b)) for a, b in p["bounds"]]
        snaps = p["snapshots"]
        ok = (0 <= rank < world == len(bounds) and isinstance(snaps, list) and len(snaps) <= 2
              and all(isinstance(x, dict) and isinstance(x.get("step"), int) and isinstance(x.get("state"), dict)
                      and x["state"].get("replicated", {}).get("step") == x["step"] for x in snaps)
              and isinstance(p.get("meta"), dict) and isinstance(p.get("param_sizes"), list)
              and isinstance(p.get("param_groups"), list) and int(p["k"]) >= 1 and int(p["g"]) >= 0)
    except (KeyError, TypeError, ValueError) as exc:
        return f"{name}: not a rescue payload ({type(exc).__name__}: {exc})"
    if not ok:
        return (f"{name}: not a rescue payload (rank, world, bounds, snapshots or settings out of shape, or a "
                f"snapshot whose step is not its state's)")
    if name != f"rank-{rank}.pt":
        return f"{name}: says it is rank {rank}"
    if run_id is not None and p["meta"].get("run_id") != run_id:
        return f"{name}: written by run {p['meta'].get('run_id')!r}, not this run ({run_id!r})"
    return None


def recover(ckpt_dir: str | Path, attempt: int, lost: Sequence[int], *, last_step: Optional[int] = None,
            run_id: Optional[str] = None, world: Optional[int] = None) -> dict[str, Any]:
    """Turn the survivors' rescue files of ``attempt`` into a committed checkpoint of their common step.

    Args:
        ckpt_dir: the run's checkpoint directory. attempt: the attempt that failed.
        lost: its lost ranks. last_step: the newest step any rank logged (steps past T are replayed).
        run_id: the run's id; a rescue file of another run is not used.
        world: the failed group's size (the launcher's; a file that claims another is not used).

    The rescue files are untrusted input: one that does not parse, has the wrong shape, names
    another rank or run, or disagrees with the others on the slicing or the settings, and any
    error while planning or writing, makes the reconstruction fall back (with the reason); nothing
    is committed from it.

    Returns:
        The lineage record appended (``event`` ``shard_recovery``): ``step`` T, ``sources`` per lost
        slice, ``bytes_read``, ``seconds``, ``steps_recomputed``; or, when it fell back,
        ``fallback`` with every reason (nothing written then but the record).
    """
    t0 = time.perf_counter()
    store = CheckpointStore(Path(ckpt_dir))
    folder = rescue_folder(ckpt_dir, attempt)
    parts: dict[int, dict[str, Any]] = {}
    unreadable = []
    for f in sorted(folder.glob("rank-*.pt")) if folder.is_dir() else []:
        try:
            p = load_state(f)
        except CheckpointError as exc:
            unreadable.append(str(exc))
            continue
        why = _payload_problem(p, f.name, run_id)
        if why is None and world is not None and int(p["world"]) != int(world):
            why = f"{f.name}: claims a world of {p['world']}, the failed group had {world}"
        if why is None:
            parts[int(p["rank"])] = p
        else:
            unreadable.append(why)
    record: dict[str, Any] = {"event": "shard_recovery", "time": time.time(), "attempt": int(attempt),
                              "lost_slices": sorted(int(r) for r in lost)}
    if not parts:
        record.update(fallback=["no survivor wrote a rescue file"] + unreadable, step=None)
        store.append_lineage(record)
        shutil.rmtree(folder, ignore_errors=True)
        return record
    first = next(iter(parts.values()))
    world, k, g = int(first["world"]), int(first["k"]), int(first["g"])
    if len(first["snapshots"]) and len(first["param_sizes"]) > 10_000_000:
        unreadable.append("the rescue files list more than 10^7 parameter tensors")
    settings = {(int(p["world"]), int(p["k"]), int(p["g"]), str(p["bounds"]), str(p["param_sizes"])) for p in parts.values()}
    T: Optional[int] = None
    shards: dict[int, tuple[dict[str, Any], str, int]] = {}
    problems = list(unreadable)
    if len(settings) > 1:
        problems.append("the rescue files disagree on the slicing or the settings")
    elif any(not 0 <= int(r) < world for r in lost):
        problems.append(f"lost ranks {sorted(int(r) for r in lost)} are not ranks of the world of {world}")
    if not problems:
        try:
            T, shards, planned = plan_recovery(parts, lost, world, k, g)
            problems += planned
            if not problems and T is not None:
                problems += _check_replicated(parts, T, lost, world)
        except Exception as exc:  # untrusted files: whatever breaks the plan refuses it
            problems.append(f"the rescue files do not fit together ({type(exc).__name__}: {str(exc)[:200]})")
    latest = max((int(p.name.split("-")[1]) for p in store.candidates()), default=None)
    if problems or T is None:
        record.update(fallback=[p[:300] for p in problems[:8]] + ([f"... and {len(problems) - 8} more"]
                                                                   if len(problems) > 8 else []), step=T)
        store.append_lineage(record)
        shutil.rmtree(folder, ignore_errors=True)  # the snapshots are of no further use (the evidence is kept)
        return record
    reached = T if last_step is None else max(int(last_step), T)
    record.update(step=T, steps_recomputed=reached - T)
    if latest is not None and latest >= T:
        record["written"] = f"not needed: {store.name(latest)} is committed already"
    else:
        record.update(source="copy" if k > 1 else "parity", sources={str(s): src for s, (_, src, _) in shards.items()},
                      bytes_read=sum(n for _, _, n in shards.values()))
        try:
            _write_commit(store, parts, shards, T, world, lost)
        except Exception as exc:  # a staging folder left behind is removed by the next restore
            record.update(fallback=[f"the rebuilt commit could not be written ({type(exc).__name__}: "
                                    f"{str(exc)[:200]})"], step=T)
            store.append_lineage(record)
            shutil.rmtree(folder, ignore_errors=True)
            return record
        record["written"] = store.name(T)
    record["seconds"] = time.perf_counter() - t0
    store.append_lineage(record)
    shutil.rmtree(folder, ignore_errors=True)
    return record


def _check_replicated(parts: Mapping[int, Mapping[str, Any]], T: int, lost: Sequence[int], world: int) -> list[str]:
    """The survivors' replicated state at T (parameters first) must agree bit for bit."""
    snaps = {r: next(s for s in p["snapshots"] if s["step"] == T) for r, p in parts.items() if r not in set(lost)}
    ranks = sorted(snaps)
    ref = snaps[ranks[0]]["state"]["replicated"]["model"]
    bad = [r for r in ranks[1:] if any(not torch.equal(ref[n], snaps[r]["state"]["replicated"]["model"][n]) for n in ref)]
    return [f"the survivors' parameters at step {T} differ (ranks {bad} against rank {ranks[0]})"] if bad else []


def _write_commit(store: CheckpointStore, parts: Mapping[int, Mapping[str, Any]],
                  shards: Mapping[int, tuple[dict[str, Any], str, int]], T: int, world: int, lost: Sequence[int]) -> None:
    from .resume import FAULT_LOG, IDENTITY, REPLICATED, _identity, _rank_file

    survivors = sorted(r for r in parts if r not in set(lost))
    snaps = {r: next(s for s in parts[r]["snapshots"] if s["step"] == T) for r in survivors}
    meta = dict(parts[survivors[0]]["meta"])
    run_id = meta.get("run_id")
    staging = store.staging(T)
    save_state(staging / REPLICATED, {**snaps[survivors[0]]["state"]["replicated"],
                                      IDENTITY: _identity(REPLICATED, T, run_id)})
    hosts = {}
    for r in survivors:
        name = _rank_file(r)
        workers = sorted(int(w) for w in snaps[r]["state"]["local"]["workers"])
        hosts[name] = workers
        save_state(staging / name, {**snaps[r]["state"]["local"], IDENTITY: _identity(name, T, run_id, workers)})
    rebuilt = {}
    for s, (exp, src, _) in shards.items():
        name = f"shard-{s}.pt"
        rebuilt[name] = {"slice": int(s), "source": src}
        save_state(staging / name, {"optimizer_shard": exp,
                                    IDENTITY: {"file": name, "step": T, "run_id": run_id, "kind": "shard", "workers": None}})
    latest = store.latest_name()
    meta.update({"world_size": world, "hosts": hosts, "parent": latest, "reconstructed": rebuilt,
                 "replayed": [r["steps_replayed"] for r in store.lineage() if r.get("steps_replayed")],
                 "faults_fired": [r.get("id") for r in read_jsonl(store.root / FAULT_LOG)]})
    store.commit(T, meta, [REPLICATED, *hosts, *rebuilt])

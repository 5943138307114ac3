"""In-memory peer copies of a lost worker's own committed state (``trainer.peer_copy``).

Gemini (Wang et al., "GEMINI: Fast Failure Recovery in Distributed Training with In-Memory
Checkpoints", SOSP 2023) keeps checkpoints in the CPU memory of peer machines so that recovery
does not depend on (slow, possibly lost) persistent storage. Here the part that a rejoining
worker cannot get from a live peer's *training* state is its **own** state: its data position,
momentum buffer, RNG streams and per-worker protocol state (the replicated state already comes
from a live peer, :mod:`~robustagg.launch.grow`). With ``trainer.peer_copy=true``:

- **who holds what**: the ring of the original worker ids; a member holds the copies of the
  non-members that follow it up to the next member (:func:`holder_of`). With everybody present that
  is "worker i holds worker i+1's"; after worker 5 of 0..5 is lost, worker 4 holds it.
- **when the copy is taken**: the app's launcher restarts every survivor after a membership loss
  (abort and restore), so a copy held in a survivor's memory before the failure dies with it. The
  copy is therefore taken when the survivors restore: the holder reads the lost worker's file of
  the restored commit (the last commit the lost worker took part in), checks its SHA-256 against
  that manifest, and keeps the bytes. An absent worker's own state does not change while it is
  absent, so the copy stays the *last committed* one; every checkpoint the survivors commit
  records it (``absent_parts`` in the manifest: commit, file, size, SHA-256), so its digest stays a
  committed fact after the commit that held the file is pruned.
  Copies of present peers are not kept: any loss restarts the group, so they could never be used.
- **when it is used**: the replacement, once admitted, reads its own state from disk (the newest
  committed checkpoint that verifies and holds it) and receives the holder's copy over the new
  process group; it takes the peer's copy when the disk copy is older or missing, after checking
  size and SHA-256 against the newest committed record of its part (:func:`committed_record`). A
  copy that does not match is refused with evidence (``evidence/rejoin-<w>.json``, a
  ``peer_copy_refused`` lineage record) and the disk copy is used if there is one.

What it buys here: a replacement rejoins although the disk copy of its state was pruned
(``trainer.checkpoint.keep``), lost or corrupted after the survivors restored. What it does not
buy here: recovery without reading the disk (the survivors restore from disk), and a copy of a
worker whose holder was lost with it (the next survivor in the ring holds it only from the next
restore on).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from ..checkpoint import Checkpoint, CheckpointStore, parse_state, sha256_bytes
from ..errors import CheckpointError

__all__ = ["HeldPart", "PeerMemory", "holder_of", "absent_records", "committed_record", "held", "choose_own_state"]

_HELD: list["PeerMemory"] = []


def holder_of(worker: int, members: Sequence[int], ring: Sequence[int]) -> int:
    """The member that holds ``worker``'s copy: the nearest member before it in the cyclic ``ring``.

    Example:
        >>> holder_of(5, [0, 1, 2, 3, 4], range(6)), holder_of(0, [1, 2, 3], range(6)), holder_of(3, range(6), range(6))
        (4, 3, 2)

    Raises:
        ValueError: ``worker`` is not in ``ring`` or no member is.
    """
    order = [int(w) for w in ring]
    live = {int(m) for m in members}
    if int(worker) not in order or not live & set(order):
        raise ValueError(f"holder_of: worker {worker} or no member of {sorted(live)} is in the ring {order}.")
    i = order.index(int(worker))
    for k in range(1, len(order) + 1):
        c = order[(i - k) % len(order)]
        if c in live:
            return c
    raise AssertionError("unreachable")  # pragma: no cover


@dataclass
class HeldPart:
    """One worker's own-state file of one commit, held in a peer's memory.

    Attributes:
        worker: whose state it is.
        holder: the worker id keeping it.
        checkpoint: the commit's folder name (``step-NNNNNNNN``).
        step: its step (completed optimizer steps).
        file: the file's name in that commit.
        size: the file's size in bytes.
        sha256: the manifest's SHA-256 of the file (hex).
        payload: the file's bytes.
    """

    worker: int
    holder: int
    checkpoint: str
    step: int
    file: str
    size: int
    sha256: str
    payload: bytes = field(repr=False)

    def record(self) -> dict[str, Any]:
        """The committed facts about the part (no payload): what ``absent_parts`` stores."""
        out = asdict(self)
        del out["payload"], out["holder"], out["worker"]
        return out


class PeerMemory:
    """The copies one worker (``me``) holds, by worker id. :func:`held` returns this process's."""

    def __init__(self, me: int) -> None:
        self.me = int(me)
        self.parts: dict[int, HeldPart] = {}
        _HELD[:] = [self]

    def seed(self, store: CheckpointStore, checkpoint: str, members: Sequence[int], ring: Sequence[int]) -> list[str]:
        """At restore: copy the own state of every non-member this worker holds from ``checkpoint``
        (the file of that commit, or the one its ``absent_parts`` names), digest-checked.

        Args:
            store: the run's checkpoint store.
            checkpoint: the restored commit's folder name.
            members: the worker ids of the restored group.
            ring: the original worker ids.

        Returns:
            the problems met (a part that could not be read or verified is not held).

        Raises:
            CheckpointError: the restored commit's manifest cannot be read.
        """
        problems: list[str] = []
        manifest = store.read_manifest(store.root / checkpoint)
        for w in ring:
            if int(w) in members or holder_of(int(w), members, ring) != self.me:
                continue
            rec = _record_in(manifest, checkpoint, int(w))
            if rec is None:
                problems.append(f"{checkpoint} holds no committed own state of worker {w}")
                continue
            try:
                where = store.root / str(rec["checkpoint"])
                data = Checkpoint(where, store.read_manifest(where)).read_bytes(str(rec["file"]))
            except CheckpointError as exc:
                problems.append(f"worker {w}'s own state ({rec['checkpoint']}/{rec['file']}): {exc}")
                continue
            self.parts[int(w)] = HeldPart(worker=int(w), holder=self.me, payload=data, **{
                k: rec[k] for k in ("checkpoint", "step", "file", "size", "sha256")})
        return problems

    def message(self, worker: int) -> Optional[dict[str, Any]]:
        """What the holder sends a replacement: ``{"holder", "record", "payload"}`` or ``None``."""
        part = self.parts.get(int(worker))
        if part is None:
            return None
        return {"holder": self.me, "record": part.record(), "payload": part.payload}


def held() -> Optional[PeerMemory]:
    """This process's :class:`PeerMemory` (the last one made), or ``None``: for tools and tests."""
    return _HELD[0] if _HELD else None


def _record_in(manifest: dict[str, Any], name: str, worker: int) -> Optional[dict[str, Any]]:
    """The committed record of ``worker``'s own-state file in one manifest: its own file, else ``absent_parts``."""
    for fname, ids in (manifest.get("hosts") or {}).items():
        if int(worker) in [int(i) for i in ids] and len(ids) == 1:
            info = manifest["files"][fname]
            return {"checkpoint": name, "step": int(manifest["step"]), "file": fname, "size": int(info["size"]),
                    "sha256": str(info["sha256"])}
    rec = (manifest.get("absent_parts") or {}).get(str(int(worker)))
    return dict(rec) if isinstance(rec, dict) else None


def absent_records(store: CheckpointStore, checkpoint: str, members: Sequence[int], ring: Sequence[int]
                   ) -> dict[str, dict[str, Any]]:
    """The ``absent_parts`` manifest field of commits made by ``members``: for each absent worker of
    ``ring``, the committed record of its own state in (or carried by) ``checkpoint``.

    Returns:
        ``{str(worker id): {"checkpoint", "step", "file", "size" (bytes), "sha256"}}``.

    Raises:
        CheckpointError: the manifest of ``checkpoint`` cannot be read.
    """
    manifest = store.read_manifest(store.root / checkpoint)
    out = {}
    for w in ring:
        if int(w) not in members:
            rec = _record_in(manifest, checkpoint, int(w))
            if rec is not None:
                out[str(int(w))] = rec
    return out


def committed_record(store: CheckpointStore, worker: int) -> Optional[dict[str, Any]]:
    """The newest committed record of ``worker``'s own state: from the newest checkpoint whose manifest
    verifies and either holds the worker's file or carries it in ``absent_parts``; ``None`` if none."""
    for path in store.candidates():
        if store.verify(path, []):
            continue
        rec = _record_in(store.read_manifest(path), path.name, int(worker))
        if rec is not None:
            return rec
    return None



def choose_own_state(worker: int, disk: Optional[tuple[dict[str, Any], str]], peer: Optional[dict[str, Any]],
                     record: Optional[dict[str, Any]]
                     ) -> tuple[Optional[dict[str, Any]], str, str, Optional[dict[str, Any]]]:
    """The replacement's choice between its disk copy and a peer's in-memory copy.

    Args:
        worker: the replacement's worker id.
        disk: ``(local state, checkpoint name)`` from :func:`~robustagg.launch.grow.own_state_from_disk`, or ``None``.
        peer: the holder's :meth:`PeerMemory.message`, or ``None``.
        record: :func:`committed_record` (what the peer's bytes must match).

    Returns:
        ``(local state or None, source, checkpoint name, refusal evidence or None)``; ``source`` is
        ``"disk"`` or ``"peer-memory <holder>"`` (``""`` when neither is usable). The peer's copy is
        taken only when it is newer than the disk copy (or there is none) and its size and SHA-256
        equal the committed record's.
    """
    disk_step = -1 if disk is None else int(disk[1].split("-")[1])
    refused: Optional[dict[str, Any]] = None
    if peer is not None and int(peer["record"]["step"]) > disk_step:
        payload, man = peer["payload"], peer["record"]
        got: dict[str, Any] = {"size": len(payload), "sha256": sha256_bytes(payload)}
        want: Optional[dict[str, Any]] = None
        if record is not None:
            want = {"checkpoint": record["checkpoint"], "size": int(record["size"]), "sha256": str(record["sha256"])}
        if want is not None and want["checkpoint"] == man["checkpoint"] and got == {k: want[k] for k in got}:
            from ..training.resume import IDENTITY

            part = parse_state(payload, f"peer-memory copy of worker {worker}'s {man['checkpoint']}/{man['file']}")
            local = {k: v for k, v in part.items() if k not in ("workers", IDENTITY)}
            local["workers"] = {int(worker): part["workers"][int(worker)]}
            return local, f"peer-memory {peer['holder']}", str(man["checkpoint"]), None
        refused = {"kind": "peer_copy_refused", "worker": int(worker), "holder": int(peer["holder"]),
                   "claimed": dict(man), "received": got, "committed": want,
                   "message": (f"worker {worker} refused the in-memory copy of its own state held by worker "
                               f"{peer['holder']} ({man['checkpoint']}/{man['file']}): received size {got['size']}, "
                               f"SHA-256 {got['sha256'][:12]}..., the committed record says "
                               + ("nothing" if want is None else
                                  f"{want['checkpoint']} size {want['size']}, SHA-256 {want['sha256'][:12]}...")
                               + ("; using the older disk copy " + disk[1] if disk is not None else
                                  "; no disk copy either: it cannot take part"))}
    if disk is not None:
        return disk[0], "disk", disk[1], refused
    return None, "", "", refused

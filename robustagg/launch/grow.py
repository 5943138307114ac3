"""Grow and heal: a replacement for a lost worker joins the running group at a step boundary.

With ``on_failure="shrink"`` and ``rejoin=True`` the app's launcher starts, next to the survivors'
attempt, one replacement process per lost worker id (:func:`run_joiner`). The protocol:

1. the joiner (after ``seconds`` of a ``rejoin`` fault, else at once) writes ``join/<e>/<w>`` in
   the membership store and waits;
2. after every step the survivors vote on "every joiner of the next group asked" (rank 0 reads
   the store; one control-plane vote, so all of them see the same answer after the same step
   ``B``); joiners with the same ``join_step`` form one group, groups are admitted in
   ``join_step`` order (:func:`next_group`), each by a grow of its own, and a joiner admitted
   later asks again under each epoch an earlier grow installed (:func:`join_when_admitted`);
3. at ``B`` every survivor keeps its trainer state in memory, rank 0 installs epoch ``e + 1`` =
   members ∪ joiners (decided by every member of epoch ``e``, sealed first, compare-and-set),
   and every process of epoch ``e + 1`` leaves its process group and forms a new one of the new
   size (torch process groups cannot grow), ranks in worker-id order, rendezvous through the store;
4. the job is recomputed for the new n (:func:`~robustagg.launch.job.grow_job`: normalisation,
   effective batch, the rule's requirement), every process rebuilds its parts; survivors load
   their own state; the lowest survivor (a live peer) broadcasts the replicated state
   (parameters, optimizer, scheduler, rule and protocol state, ...) with a manifest of its
   SHA-256; the joiner checks the digest of the bytes it received against that manifest, loads
   them, and takes its own data position, momentum and RNG streams from the newest committed
   checkpoint that holds its worker id (digest-checked by :meth:`~robustagg.checkpoint.Checkpoint.load`),
   or with ``trainer.peer_copy`` from the in-memory copy of the survivor that holds it in the
   ring when that is newer or the disk copy is missing (:func:`share_peer_copies`,
   :mod:`~robustagg.launch.peer`); every rank learns where each joiner's state came from
   (:func:`gather_reports`); a joiner that has none (its peer copy refused and no disk copy, or the
   live peer's bytes not matching its manifest) leaves with evidence, and the others install epoch
   ``e + 2`` without it (:func:`install_leave`) and go on at that size;
5. before anyone trains, every rank compares parameter and optimizer-state digests
   (:meth:`~robustagg.training.Trainer.check_parameters`); the lineage gets a ``grow`` record.

What is not claimed: the trajectory is not the one of an uninterrupted run (availability does not
preserve it; with a deterministic grow step it is the one of the reference schedule,
:mod:`~robustagg.launch.schedule`); the joiner's own data stream resumes at its last committed position; a joiner that
arrives after the last step finds the run over (``done/<e>``) and exits.
"""

from __future__ import annotations

import io
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import torch

from ..checkpoint import Checkpoint, CheckpointStore, sha256_bytes
from ..errors import CheckpointError, QuorumLostError
from .quorum import Membership, fmt_members

if TYPE_CHECKING:  # pragma: no cover
    from ..training import Trainer

__all__ = ["Regroup", "GrowWatch", "ask_to_join", "wait_for_grow", "install_grow", "install_leave", "wait_for_epoch",
           "form_group",
           "send_state", "receive_state", "own_state_from_disk", "mark_done", "share_peer_copies", "gather_reports",
           "join_when_admitted", "next_group"]


@contextmanager
def _collective(what: str) -> Iterator[None]:
    """Raise a failed collective of the grow as :class:`~robustagg.distributed.comm.CollectiveError`.

    gloo reports a peer that died in the middle of a transfer as a bare ``RuntimeError``
    ("Connection closed by peer"); as a collective error it is what it is, a consequence, and the
    launcher names the process that died (:func:`~robustagg.distributed.launch.spawn`) instead.
    """
    from ..distributed.comm import CollectiveError

    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:
        raise CollectiveError(f"{what} failed: {exc}") from exc


class Regroup(Exception):
    """Raised out of :func:`~robustagg.training.fit` by :class:`GrowWatch` at the agreed step boundary."""

    def __init__(self, step: int) -> None:
        super().__init__(f"regroup after step {step}")
        self.step = int(step)


def _join_key(ms: Membership, epoch: int, worker: int) -> str:
    return ms._k("join", int(epoch), int(worker))


class GrowWatch:
    """A ``fit`` callback of the survivors: after each step, vote whether every joiner has asked.

    Args:
        ms: the run's membership. epoch: the survivors' epoch. joiners: worker ids expected.
        last_step: no grow after this step (the run ends there).
        at_step: admit the joiners exactly after this many completed steps: rank 0 waits there
            (at most ``wait_s`` seconds) for every request, and no vote is taken before (0: at
            the first boundary after every joiner asked, a vote after every step).
        wait_s: how long rank 0 waits at ``at_step``.
    """

    def __init__(self, ms: Membership, epoch: int, joiners: Sequence[int], *, last_step: int, at_step: int = 0,
                 wait_s: float = 120.0) -> None:
        self.ms, self.epoch, self.last_step = ms, int(epoch), int(last_step)
        self.joiners = tuple(int(w) for w in joiners)
        self.at_step, self.wait_s = int(at_step), float(wait_s)

    def _asked(self) -> bool:
        return all(self.ms._has(_join_key(self.ms, self.epoch, w)) for w in self.joiners)

    def __call__(self, trainer: "Trainer", out: Any) -> None:
        step = trainer.step_id
        if step >= self.last_step or (self.at_step and step != self.at_step):
            return
        ready = 0
        if trainer.is_main:
            deadline = time.monotonic() + (self.wait_s if self.at_step else 0.0)
            while not self._asked() and time.monotonic() < deadline:
                time.sleep(0.02)
            ready = int(self._asked())
        if trainer.comm.vote(ready, op="grow")[0]:
            raise Regroup(step)


def ask_to_join(ms: Membership, epoch: int, worker: int) -> None:
    """The joiner's request (``join/<epoch>/<worker>``)."""
    ms.store.set(_join_key(ms, epoch, worker), "1")


def mark_done(ms: Membership, epoch: int) -> None:
    """Rank 0 at the end of the run: a joiner still waiting under ``epoch`` may exit."""
    ms.store.set(ms._k("done", int(epoch)), "1")


def wait_for_epoch(ms: Membership, epoch: int, *, timeout_s: float, poll_s: float = 0.02) -> tuple[int, ...]:
    """A survivor other than rank 0 at the grow boundary: wait for rank 0 to install ``epoch``.

    Raises:
        QuorumLostError: it did not appear within ``timeout_s``.
    """
    deadline = time.monotonic() + float(timeout_s)
    while time.monotonic() < deadline:
        if ms._has(ms._k("epoch", int(epoch))):
            return ms.members(int(epoch))
        time.sleep(poll_s)
    raise QuorumLostError(f"membership epoch {epoch} was not installed within {timeout_s:g} s.")


def wait_for_grow(ms: Membership, epoch: int, worker: int, *, timeout_s: float, poll_s: float = 0.05
                  ) -> Optional[tuple[int, ...]]:
    """The joiner waits for epoch ``epoch + 1`` to list it; ``None`` when the run ended first.

    Raises:
        QuorumLostError: epoch ``epoch + 1`` was installed without this worker, or nothing
            happened within ``timeout_s``.
    """
    nxt = ms._k("epoch", int(epoch) + 1)
    deadline = time.monotonic() + float(timeout_s)
    while time.monotonic() < deadline:
        if ms._has(nxt):
            members = ms.members(int(epoch) + 1)
            if int(worker) not in members:
                raise QuorumLostError(f"worker {worker} asked to join epoch {epoch}, but epoch {epoch + 1} was "
                                      f"installed without it: {fmt_members(members)}.")
            return members
        if ms._has(ms._k("done", int(epoch))):
            return None
        time.sleep(poll_s)
    raise QuorumLostError(f"worker {worker} asked to join epoch {epoch} and was not admitted within {timeout_s:g} s.")


def join_when_admitted(ms: Membership, epoch: int, worker: int, *, timeout_s: float
                       ) -> Optional[tuple[int, tuple[int, ...]]]:
    """The joiner: ask to join ``epoch``; while grows admit other joiners first, ask again under each new epoch.

    Several replacements of one attempt may be admitted at different boundaries (their ``join_step``):
    an epoch installed without this worker that keeps every member of the one it asked under is
    an earlier grow, so it asks again under that epoch.

    Returns:
        ``(e, members of e + 1)``: the epoch it was admitted from and the members that admitted it;
        ``None`` when the run ended first.

    Raises:
        QuorumLostError: a newer epoch dropped members (not a grow), or nothing happened within
            ``timeout_s`` (in all).
    """
    e = int(epoch)
    deadline = time.monotonic() + float(timeout_s)
    while True:
        ask_to_join(ms, e, worker)
        try:
            members = wait_for_grow(ms, e, worker, timeout_s=max(0.1, deadline - time.monotonic()))
        except QuorumLostError:
            if not ms._has(ms._k("epoch", e + 1)) or not set(ms.members(e)) <= set(ms.members(e + 1)):
                raise
            e += 1  # another grow came first: ask the grown group
            continue
        return None if members is None else (e, members)


def next_group(joiners: Sequence[dict[str, Any]], pending: Sequence[int]) -> tuple[list[int], int]:
    """The pending joiners admitted at the next grow and its ``at_step``: those with the smallest
    ``at_step`` (0, "whenever ready", first).

    Example:
        >>> next_group([{"worker": 4, "at_step": 8}, {"worker": 5, "at_step": 6}], [4, 5])
        ([5], 6)
    """
    at = {int(j["worker"]): int(j.get("at_step", 0)) for j in joiners}
    first = min(at.get(int(w), 0) for w in pending)
    return sorted(int(w) for w in pending if at.get(int(w), 0) == first), first


def install_grow(ms: Membership, epoch: int, joiners: Sequence[int]) -> tuple[int, ...]:
    """Rank 0 of the survivors, after every member voted at the boundary: epoch ``e + 1`` = members ∪ joiners.

    Raises:
        QuorumLostError: another membership was installed as epoch ``e + 1`` first.
    """
    want = tuple(sorted(set(ms.members(epoch)) | {int(w) for w in joiners}))
    return _install_next(ms, epoch, want, f"grow epoch {epoch} to {fmt_members(want)}")


def install_leave(ms: Membership, epoch: int, leaving: Sequence[int]) -> tuple[int, ...]:
    """Rank 0 of a grown group in which some joiners cannot take part: epoch ``e + 1`` = members - ``leaving``.

    Every member of epoch ``e`` learnt the same reports (:func:`gather_reports`), so the decision is
    theirs, as a grow's is: ``e`` is sealed first, then the next epoch is compare-and-set.

    Raises:
        QuorumLostError: another membership was installed as epoch ``e + 1`` first.
    """
    want = tuple(w for w in ms.members(epoch) if w not in {int(x) for x in leaving})
    return _install_next(ms, epoch, want, f"leave worker(s) {sorted(leaving)} out of epoch {epoch}")


def _install_next(ms: Membership, epoch: int, want: tuple[int, ...], what: str) -> tuple[int, ...]:
    """Seal epoch ``e`` and compare-and-set epoch ``e + 1`` to ``want``; the installed members.

    Raises:
        QuorumLostError: another membership was installed as epoch ``e + 1`` first (``what`` says
            what this rank tried).
    """
    import json

    ms.seal(epoch)
    got = tuple(int(w) for w in json.loads(ms.store.compare_set(ms._k("epoch", int(epoch) + 1), "",
                                                                json.dumps(list(want))).decode()))
    if got != want:
        raise QuorumLostError(f"cannot {what}: epoch {epoch + 1} is already {fmt_members(got)}.")
    return got


def form_group(ms: Membership, epoch: int, members: Sequence[int], me: int, *, backend: str, timeout_s: float) -> None:
    """Leave the current process group (if any) and join epoch ``epoch``'s: ranks in worker-id order.

    Raises:
        CollectiveError: the new group could not be formed within ``timeout_s``.
    """
    import torch.distributed as dist

    from ..distributed import destroy_group
    from ..distributed.comm import CollectiveError

    destroy_group()
    order = sorted(int(w) for w in members)
    store = dist.PrefixStore(ms._k("group", int(epoch)), ms.store)
    try:
        dist.init_process_group(backend=backend, store=store, rank=order.index(int(me)), world_size=len(order),
                                timeout=timedelta(seconds=float(timeout_s)))
    except RuntimeError as exc:
        raise CollectiveError(f"worker {me} could not form the group of epoch {epoch} {fmt_members(order)} within "
                              f"{timeout_s:g} s ({type(exc).__name__}: {exc})") from exc



def send_state(state: Optional[dict[str, Any]], *, src: int, src_worker: int) -> dict[str, Any]:
    """Broadcast the replicated state from process rank ``src`` of the (new) group; every rank calls it.

    Args:
        state: the trainer's ``state_dict()["replicated"]`` on rank ``src``, ``None`` elsewhere.
        src: the sending process rank (a live peer: a survivor, never a joiner).
        src_worker: its worker id (recorded in the manifest).

    Returns:
        on every rank: ``{"manifest": {"sha256", "size", "step", "from_worker"}, "payload": bytes}``.

    Raises:
        CollectiveError: the broadcast failed (a peer died in the transfer).
    """
    import torch.distributed as dist

    box: list[Any] = [None]
    if dist.get_rank() == int(src):
        assert state is not None
        buf = io.BytesIO()
        torch.save(state, buf)
        payload = buf.getvalue()
        box = [{"manifest": {"sha256": sha256_bytes(payload), "size": len(payload), "step": int(state["step"]),
                             "from_worker": int(src_worker)}, "payload": payload}]
    with _collective(f"the state transfer from worker {src_worker}"):
        dist.broadcast_object_list(box, src=int(src))
    return dict(box[0])


def receive_state(message: dict[str, Any]) -> dict[str, Any]:
    """The joiner: check the received bytes against the peer's manifest, then parse them (no code runs).

    Raises:
        CheckpointError: size or SHA-256 differ from the peer's manifest, or the bytes do not parse.
    """
    man, payload = message["manifest"], message["payload"]
    if len(payload) != int(man["size"]) or sha256_bytes(payload) != man["sha256"]:
        raise CheckpointError(f"the state received from worker {man['from_worker']} does not match its manifest "
                              f"(size {len(payload)} vs {man['size']}, SHA-256 {sha256_bytes(payload)[:12]}... vs "
                              f"{str(man['sha256'])[:12]}...); refusing to take part.")
    try:
        return dict(torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True))
    except Exception as exc:
        raise CheckpointError(f"the state received from worker {man['from_worker']} does not parse: "
                              f"{type(exc).__name__}: {str(exc)[:200]}") from None


def own_state_from_disk(store: CheckpointStore, worker: int) -> tuple[dict[str, Any], str]:
    """The joiner's own state (data position, momentum, worker and process RNG, attack state) from the
    newest committed checkpoint that verifies and holds ``worker``'s file.

    Returns:
        ``(local state for Trainer.load_state_dict, the checkpoint's folder name)``.

    Raises:
        CheckpointError: no committed checkpoint holds the worker.
    """
    from ..training.resume import IDENTITY

    for path in store.candidates():
        if store.verify(path):
            continue
        manifest = store.read_manifest(path)
        for name, held in (manifest.get("hosts") or {}).items():
            if int(worker) in [int(w) for w in held]:
                part = Checkpoint(path, manifest).load(name)
                local = {k: v for k, v in part.items() if k not in ("workers", IDENTITY)}
                local["workers"] = {int(worker): part["workers"][int(worker)]}
                return local, path.name
    raise CheckpointError(f"no committed checkpoint in {store.root} holds worker {worker}'s state; it cannot rejoin.")


def share_peer_copies(memory: Any, joiners: Sequence[int], holders: Sequence[int], members: Sequence[int],
                      ring: Sequence[int]) -> dict[int, Optional[dict[str, Any]]]:
    """Every rank of the new group (``trainer.peer_copy``): each joiner's holder broadcasts its in-memory copy.

    Args:
        memory: this process's :class:`~robustagg.launch.peer.PeerMemory` (``None`` on a joiner).
        joiners: the joiners' worker ids.
        holders: the worker ids of the group that restored and took the copies (the attempt's).
        members: the new epoch's worker ids (process ranks in their sorted order).
        ring: the original worker ids (who holds whom, :func:`~robustagg.launch.peer.holder_of`).

    Returns:
        ``{joiner: the holder's message or None}`` on every rank, one broadcast per joiner.
    """
    import torch.distributed as dist

    from .peer import holder_of

    order = sorted(int(w) for w in members)
    out: dict[int, Optional[dict[str, Any]]] = {}
    for w in sorted(int(j) for j in joiners):
        src = order.index(holder_of(w, holders, ring))
        box: list[Any] = [memory.message(w) if memory is not None and dist.get_rank() == src else None]
        with _collective(f"the peer copy of worker {w}'s own state"):
            dist.broadcast_object_list(box, src=src)
        out[w] = box[0]
    return out


def gather_reports(mine: Optional[dict[str, Any]]) -> list[Optional[dict[str, Any]]]:
    """Every rank of the new group: each joiner's report of where its own state came from
    (``{"worker", "source", "checkpoint", "refused"}``; survivors pass ``None``)."""
    import torch.distributed as dist

    box: list[Any] = [None] * dist.get_world_size()
    with _collective("the joiners' reports"):
        dist.all_gather_object(box, mine)
    return list(box)

"""The training loop: steps, per-step ``agg/*`` metrics, periodic ``test/*`` evaluation, the run summary.

Every process runs :func:`fit` (the collectives need all of them); only the main process (rank 0)
computes metrics, evaluates, logs to its sinks and shows the progress bar.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

import torch
from tqdm.auto import tqdm  # type: ignore[import-untyped]

from ..distributed.lifeline import beat
from ..errors import LyingAggregatorError
from ..errors import Interrupted
from .evidence import StragglerLog
from .trainer import StepOutput, Trainer

if TYPE_CHECKING:  # pragma: no cover
    from .resume import Checkpointer

__all__ = ["Sink", "JsonlSink", "RunSummary", "step_record", "fit"]

EvalFn = Callable[[], dict[str, float]]


class Sink(Protocol):
    """Where records go: ``log(record, step)`` per record, ``close()`` once at the end.

    A sink may also have ``sync()``: :func:`fit` calls it before every checkpoint commit, so the
    records of the steps a checkpoint covers are durable before it is (a kill right after a
    commit loses no record).
    """

    def log(self, record: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


class JsonlSink:
    """Appends one JSON object per record to a ``.jsonl`` file (flushed per line, fsynced by :meth:`sync`).

    Non-finite floats are written as ``null`` (NaN) or the strings ``"inf"``/``"-inf"`` so that
    every line is strict JSON. A record whose ``(kind, step)`` the file already holds is skipped,
    so a resumed run never writes a step twice (e.g. the final evaluation of a run killed after it).

    Args:
        path: the file (its parent is created); appended to if it exists. A symbolic link at
            ``path`` is replaced by a regular file, never written through
            (:func:`robustagg.checkpoint.open_for_writing`).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._seen = {(str(r.get("kind")), int(r.get("step", 0))) for r in _read_records(self.path)}
        from ..checkpoint import open_for_writing

        self._fh = os.fdopen(open_for_writing(self.path, append=True), "a", encoding="utf-8")  # no link followed

    def log(self, record: dict[str, Any], step: int) -> None:
        key = (str(record.get("kind")), int(record.get("step", step)))
        if key in self._seen:
            return
        self._seen.add(key)
        with storage_errors(self.path):
            self._fh.write(json.dumps({k: _jsonable(v) for k, v in record.items()}, allow_nan=False) + "\n")
            self._fh.flush()

    def sync(self) -> None:
        """Make every record written so far durable (fsync); called before a checkpoint commits.

        Raises:
            StorageError: the disk is full or the file cannot be written (naming the file).
        """
        if not self._fh.closed:
            with storage_errors(self.path):
                self._fh.flush()
                os.fsync(self._fh.fileno())

    def close(self) -> None:
        if not self._fh.closed:
            try:
                self.sync()
            finally:
                try:
                    self._fh.close()
                except OSError:
                    pass  # the buffer could not be written: sync already said why


def storage_errors(path: Path) -> Any:
    """:func:`robustagg.checkpoint.storage_errors` (imported late: the checkpoint module imports torch)."""
    from ..checkpoint import storage_errors as convert

    return convert(path)


def _read_records(path: Path) -> list[dict[str, Any]]:
    from ..checkpoint import read_jsonl

    return read_jsonl(path)


@dataclass
class RunSummary:
    """The numbers a run is judged by (written as ``summary.json``).

    Attributes:
        final_test_acc, best_test_acc: top-1 accuracy at the last evaluation and the best one.
        final_test_loss: loss at the last evaluation.
        worst_class_acc: lowest per-class accuracy at the last evaluation.
        mean_kappa_hat: mean of the finite per-step ``agg/kappa_hat``.
        byz_accepted_rate: mean ``agg/byz_accepted`` over the steps where Byzantine workers attacked.
        steps: optimizer steps taken. wall_seconds: of the loop. seconds_per_step: their ratio.
        dropped_rows: submissions left out by the integrity layer (detected faults).
        assumption_violated: the run broke the rule's requirement on purpose (strict=False).
        extra: further numbers (under a mixing protocol: ``final_consensus_distance``,
            ``final_test_acc_worst_node``, ``final_test_acc_average_model``; ``final_test_acc`` is
            then the honest nodes' mean accuracy).
    """

    final_test_acc: float = math.nan
    best_test_acc: float = math.nan
    final_test_loss: float = math.nan
    worst_class_acc: float = math.nan
    mean_kappa_hat: float = math.nan
    byz_accepted_rate: float = math.nan
    steps: int = 0
    wall_seconds: float = 0.0
    seconds_per_step: float = math.nan
    dropped_rows: int = 0
    assumption_violated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Flat dict (``extra`` merged in)."""
        d = asdict(self)
        extra = d.pop("extra")
        d.update(extra)
        return d


def _step_metrics() -> Optional[Callable[..., dict[str, float]]]:
    try:
        from ..metrics import step_metrics
    except ImportError:  # pragma: no cover - metrics ships with the library
        return None
    return step_metrics


def step_record(out: StepOutput, trainer: Trainer) -> dict[str, Any]:
    """The per-step record of the main process (keys of ``metrics.md``).

    Keys: ``kind="train"``, ``step`` (steps completed), ``train/loss`` (mean loss of the honest
    workers' batches), ``train/lr``, ``time/step_s``, ``time/compute_max_s`` and
    ``time/compute_min_s`` (per-rank compute time before the exchange: a straggler shows here),
    ``agg/dropped``, and, when ``trainer.metrics`` is on, from :func:`robustagg.metrics.step_metrics`
    ``agg/kappa_hat``, ``agg/dev_norm``, ``agg/cosine``, ``agg/retained``, ``agg/byz_accepted`` and
    ``agg/honest_weight/<rank>`` (rank of the worker, also when rows were dropped; the label of
    the rule's input row when a protocol transforms the rows), the protocol's per-update numbers
    (``round/*``) and, when measured, ``agg/bias_vs_sync`` and ``agg/bias_vs_sync_rel``.
    """
    red = out.reduced
    ranks = red.members if len(red.members) == len(out.losses) else list(range(len(out.losses)))
    hl = [loss for r, loss in zip(ranks, out.losses) if r not in out.byzantine]
    secs = [h.seconds for h in red.headers]
    rec: dict[str, Any] = {
        "kind": "train", "step": out.step + 1,
        "train/loss": sum(hl) / len(hl) if hl else math.nan,
        "train/lr": float(trainer.optimizer.param_groups[0]["lr"]),
        "time/step_s": out.seconds,
        "time/compute_max_s": max(secs), "time/compute_min_s": min(secs),
        "agg/dropped": len(red.dropped),
    }
    if out.plan is not None and out.plan.info:
        rec.update(out.plan.info)
    if out.bias is not None:
        rec.update(out.bias)
    if out.node_metrics is not None:  # a mixing protocol: no server aggregate (no agg/*), its own numbers
        rec.pop("agg/dropped", None)
        rec.update(out.node_metrics)
        return rec
    metrics = _step_metrics() if trainer.metrics else None  # trainer.metrics=false: no agg/* metrics
    mask = out.honest_mask()
    x = red.rule_rows()
    if metrics is not None and x is not None and bool(mask.any()):
        for k, v in metrics(red.aggregate, x, mask, red.weights).items():
            if k.startswith("agg/honest_weight/"):
                k = f"agg/honest_weight/{red.inputs[int(k.rsplit('/', 1)[1])]}"
            rec[k] = v
        if not out.byzantine:
            rec.pop("agg/byz_accepted", None)
    elif trainer.metrics and red.matrix is None and hasattr(red, "metrics_for") and bool(mask.any()):
        # sharded mode: from all-reduced moments, no row shares; metrics_for takes the (n,) mask
        # over every worker (it picks the kept rows itself), not honest_mask()'s (len(kept),) one
        every = torch.tensor([r not in out.byzantine for r in range(len(red.headers))], dtype=torch.bool)
        rec.update(red.metrics_for(every))
    return rec


def _sync(sinks: Sequence[Sink]) -> None:
    for s in sinks:
        fn = getattr(s, "sync", None)
        if fn is not None:
            fn()


def _mean(values: Sequence[float]) -> float:
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else math.nan


def fit(trainer: Trainer, *, steps: int, evaluate: Optional[EvalFn] = None, eval_every: int = 0,
        sinks: Sequence[Sink] = (), progress: bool = False, param_check_every: int = 0,
        assumption_violated: bool = False, on_record: Optional[Callable[[dict[str, Any]], None]] = None,
        callbacks: Sequence[Callable[[Trainer, StepOutput], None]] = (),
        checkpointer: Optional["Checkpointer"] = None, stragglers: Optional[StragglerLog] = None,
        on_detect: Optional[Callable[[dict[str, Any]], None]] = None) -> RunSummary:
    """Run ``steps`` steps of ``trainer`` and return the run's summary (meaningful on the main rank).

    Call-order contract: every process of the group calls ``fit`` with the same ``steps``,
    ``param_check_every`` and checkpoint schedule (collectives) — ``evaluate``, ``sinks``,
    ``progress``, ``stragglers`` and ``on_detect`` only matter on the main process.

    Schedules count the trainer's global step (``trainer.step_id``), not the steps of this call,
    so a run resumed from a checkpoint evaluates, compares digests and checkpoints at exactly the
    steps an uninterrupted run does.

    Args:
        trainer: a :class:`Trainer`.
        steps: number of optimizer steps (>= 0), counted from the trainer's current step.
        evaluate: ``() -> {"test/acc": ..., ...}``, called on the main process every
            ``eval_every`` steps (0: only at the end) and after the last step; with
            ``eval_every > 0`` also before the first step of a run that starts at step 0 (a
            ``kind="test"`` record at step 0: the untrained model, where a learning curve starts;
            it does not count towards ``best_test_acc``). ``evaluate`` must not change the model,
            the optimizer or any generator the training draws from (:func:`evaluate` runs the
            model in ``eval()`` mode under ``no_grad``), so the schedule never changes the
            trajectory.
        sinks: receive every record (``kind="train"`` per step, ``kind="test"`` per evaluation).
        progress: show a progress bar (main process).
        param_check_every: compare digests of the parameters and optimizer state across ranks
            every K steps and at the end (0: only at the end).
        assumption_violated: recorded as ``assumption/violated`` in every train record.
        on_record: called with every record (e.g. to build a live table).
        callbacks: ``cb(trainer, step_output)`` after every step, on every process.
        checkpointer: writes committed checkpoints on its schedule (after the digest check of that
            step) and once more at the end; ``None``: no checkpoints.
        stragglers: collects every rank's compute time per step (main process).
        on_detect: called (main process) with a detection record when a non-finite submission
            is dropped, a straggler is flagged or the protocol reports one (``StepOutput.detections``):
            ``{"kind", "step", "ranks"/"rank", ...}``.

    Stopping: a rank whose process received a stop request
    (:func:`robustagg.distributed.lifeline.request_stop`, installed as the SIGTERM/SIGINT handler
    of the workers :func:`robustagg.distributed.spawn` starts) announces it in its next step
    header; every rank reads every header, so all of them finish that step, take the final
    committed checkpoint (when ``checkpointer`` is set) and raise
    :class:`~robustagg.errors.Interrupted` after the same step. A request agreed at the last step
    is ignored: the run completes.

    Returns:
        a :class:`RunSummary`.

    Raises:
        Interrupted: a stop was requested (see above); ``step`` is the number of completed steps.
        DesyncError: and whatever else a step raises (integrity, requirement, collective timeout).
    """
    main = trainer.is_main
    kappas: list[float] = []
    accepted: list[float] = []
    summary = RunSummary(assumption_violated=bool(assumption_violated))
    bar = tqdm(total=trainer.step_id + steps, initial=trainer.step_id, disable=not (progress and main), desc="train",
               dynamic_ncols=True, leave=True, mininterval=0.5)  # a resumed run's bar starts at its step
    last_test: dict[str, float] = {}

    def emit(rec: dict[str, Any]) -> None:
        for s in sinks:
            s.log(rec, int(rec["step"]))
        if on_record is not None:
            on_record(rec)

    def run_eval(*, initial: bool = False) -> None:
        nonlocal last_test
        if evaluate is None:
            return
        res = evaluate()
        if not initial:  # the untrained model is where the curve starts, not a result of the run
            last_test = res
            acc = res.get("test/acc", math.nan)
            if math.isnan(summary.best_test_acc) or acc > summary.best_test_acc:
                summary.best_test_acc = acc
        emit({"kind": "test", "step": trainer.step_id, **res})

    busy = [0.0]  # seconds the main rank spent logging and evaluating after the previous step

    def log_step(out: StepOutput, done: int) -> None:
        if stragglers is not None:
            for flag in stragglers.add(done, [h.seconds for h in out.reduced.headers],
                                       arrivals=[h.sent_at for h in out.reduced.headers],
                                       excused={trainer.comm.rank: busy[0]}):
                if on_detect is not None:
                    on_detect({"kind": "straggler", **flag})
        if out.reduced.dropped and on_detect is not None:
            on_detect({"kind": "nonfinite", "step": done, "ranks": list(out.reduced.dropped), "action": "dropped"})
        if on_detect is not None:
            for det in out.detections:  # the protocol's own (e.g. a replica vote's disagreement)
                on_detect(det)
        rec = step_record(out, trainer)
        rec["assumption/violated"] = int(assumption_violated)
        rec["time/elapsed_s"] = time.perf_counter() - t0
        summary.dropped_rows += len(out.reduced.dropped)
        kappas.append(rec.get("agg/kappa_hat", math.nan))
        if "gossip/consensus_distance" in rec:  # a mixing protocol: how far apart the honest nodes ended
            summary.extra["final_consensus_distance"] = rec["gossip/consensus_distance"]
        if out.byzantine and "agg/byz_accepted" in rec:
            accepted.append(rec["agg/byz_accepted"])
        emit(rec)
        if evaluate is not None and eval_every and done % eval_every == 0 and done != end:
            run_eval()
        bar.update(1)
        if done % 10 == 0 or done == end:
            post = {"loss": f"{rec['train/loss']:.3f}"}
            if last_test:
                post["acc"] = f"{last_test['test/acc']:.3f}"
            if math.isfinite(rec.get("agg/kappa_hat", math.nan)):
                post["kappa"] = f"{rec['agg/kappa_hat']:.2g}"
            bar.set_postfix(post, refresh=False)

    t0 = time.perf_counter()
    first = trainer.step_id
    end = first + steps
    beat(first)  # heartbeat for the launcher (a no-op outside spawn()): completed steps
    if main and eval_every and first == 0 and steps > 0:
        run_eval(initial=True)  # step 0 of the learning curve (a resumed run has it already)
    for _ in range(steps):
        out = trainer.step()
        beat(trainer.step_id)
        for cb in callbacks:
            cb(trainer, out)
        done = trainer.step_id
        if param_check_every and done % param_check_every == 0 and done != end:
            trainer.check_parameters()
        if main:
            tl = time.perf_counter()
            log_step(out, done)
            busy[0] = time.perf_counter() - tl  # delays this rank's next header: not a stall
        if out.exclude:  # every rank named the same liars: stop here, the launcher's shrink path removes them
            if main:
                _sync(sinks)  # their detection records are durable before the attempt ends
            bar.close()
            raise LyingAggregatorError(f"step {done}: the aggregate cross-check named rank(s) {out.exclude} as lying "
                                       "aggregators and trainer.on_lying_aggregator=exclude removes them (with "
                                       "trainer.on_failure=shrink the survivors restore the last committed checkpoint "
                                       "without them)", ranks=out.exclude, step=out.step)
        if checkpointer is not None and done != end and checkpointer.due(done):
            if main:
                _sync(sinks)  # the step's records are durable before the commit that covers the step
            checkpointer.save(trainer)
        stop = trainer.stop_request
        if stop is not None and done != end:  # every rank read the same headers: all stop here
            if checkpointer is not None and checkpointer.last_saved != done:
                if main:
                    _sync(sinks)
                checkpointer.save(trainer)  # the final committed checkpoint of an interrupted run
            bar.close()
            raise Interrupted(done, signum=stop[1], checkpointed=checkpointer is not None,
                              detail=f"Rank {stop[0]} received the stop request; every rank stopped after step {done}.")
    trainer.check_parameters()
    if checkpointer is not None and checkpointer.last_saved != trainer.step_id:
        if main:
            _sync(sinks)
        checkpointer.save(trainer)  # the committed end state (on clean exit)
    wall = time.perf_counter() - t0
    if main:
        run_eval()
    bar.close()
    summary.steps = trainer.step_id - first
    summary.wall_seconds = wall
    summary.seconds_per_step = wall / summary.steps if summary.steps else math.nan
    summary.mean_kappa_hat = _mean(kappas)
    summary.byz_accepted_rate = _mean(accepted)
    if last_test:
        summary.final_test_acc = last_test.get("test/acc", math.nan)
        summary.final_test_loss = last_test.get("test/loss", math.nan)
        summary.worst_class_acc = last_test.get("test/worst_class_acc", math.nan)
        if "test/acc_worst_node" in last_test:  # a mixing protocol: every honest node's model was tested
            summary.extra["final_test_acc_worst_node"] = last_test["test/acc_worst_node"]
            summary.extra["final_test_acc_average_model"] = last_test.get("test/acc_average_model", math.nan)
    return summary

"""The multi-process robust trainer (data-parallel only).

Objects, not configuration: the caller builds the model, optimizer, rule, communicator and the
Byzantine behaviour and hands them in (the library never imports ``attacks`` or ``experiments``).

- :class:`Trainer`: one step on every hosted worker (``processes``: one per process; ``simulated``:
  all in one) and its explicit, serialisable state (for committed checkpoints).
- :class:`ByzantineBehaviour`: which ranks are Byzantine and the injected attack callables.
- :func:`fit`: the loop with metrics, evaluation, sinks and the run summary.
- :class:`WarmupCosine` (:mod:`~robustagg.training.schedules`): linear warm-up then cosine decay.
- :func:`evaluate`: accuracy, loss, per-class and worst-class accuracy.
- :class:`Checkpointer` and :func:`restore` (:mod:`~robustagg.training.resume`): committed
  checkpoints and the coordinated restore.
- :class:`Fault` and :class:`FaultInjector` (:mod:`~robustagg.training.faults`): fault injection.
- :func:`write_evidence` and :class:`StragglerLog` (:mod:`~robustagg.training.evidence`): failure
  evidence and the straggler report.

Example (simulated, 3 workers, one Byzantine sending a large row; the median ignores it):
    >>> import torch, robustagg as ra
    >>> from robustagg.distributed import LocalComm, make_reduction
    >>> from robustagg.training import ByzantineBehaviour, Shard, Trainer
    >>> torch.manual_seed(0); model = torch.nn.Linear(2, 2)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> red = make_reduction("gather", ra.CoordinateWiseMedian(f=1), LocalComm(3))
    >>> shards = {r: Shard(torch.randn(8, 2), torch.randint(0, 2, (8,))) for r in range(3)}
    >>> big = ByzantineBehaviour(ranks=[2], gradient_fn=lambda h, b, own, gen: torch.full((b, h.shape[1]), 1e6))
    >>> t = Trainer(model, opt, red, shards, batch_size=4, num_classes=2, byzantine=big)
    >>> out = t.step()
    >>> bool(out.reduced.aggregate.abs().max() < 10), t.step_id
    (True, 1)
"""

from .attack_adapter import AttackAdapter
from .byzantine import BatchPoison, ByzantineBehaviour, GradientAttack, LabelPoison
from .evaluate import evaluate
from .evidence import StragglerLog, failure_kind, read_evidence, summarise_evidence, write_evidence
from .faults import Fault, FaultInjector
from .io import atomic_write, save_model, write_json
from .loop import JsonlSink, RunSummary, Sink, fit, step_record
from .resume import Checkpointer, Restored, restore
from .sampler import ShardSampler, mix_seed
from .schedules import WarmupCosine, WarmupCosineFactor
from .sources import BatchSource, IterableSource
from .state import capture_rng, restore_rng, seed_everything
from .trainer import Shard, StepOutput, Trainer

__all__ = ["AttackAdapter", "ByzantineBehaviour", "GradientAttack", "LabelPoison", "BatchPoison", "evaluate",
           "atomic_write", "save_model", "write_json", "JsonlSink", "RunSummary", "Sink", "fit", "step_record",
           "ShardSampler", "mix_seed", "BatchSource", "IterableSource", "capture_rng", "restore_rng", "seed_everything",
           "Shard", "StepOutput", "Trainer", "Checkpointer", "Restored", "restore", "Fault", "FaultInjector",
           "StragglerLog", "failure_kind", "read_evidence", "summarise_evidence", "write_evidence", "WarmupCosine",
           "WarmupCosineFactor"]

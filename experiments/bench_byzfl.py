"""Side by side with ByzFL: its DSGD step against our simulated trainer step, same model, data, n, f, rule, attack.

``python -m experiments.bench_byzfl`` (optional: needs the ``byzfl`` package on ``PYTHONPATH``; it is
no dependency of this project, and without it the script exits with status 2 and says how to get it)::

    pip download byzfl --no-deps -d /tmp/byzfl-dl
    pip install --no-deps --target /tmp/byzfl-pkgs /tmp/byzfl-dl/byzfl-*.whl
    PYTHONPATH=/tmp/byzfl-pkgs:$PWD python -m experiments.bench_byzfl --clock cpu

Cases, built once and timed interleaved (``--repeats`` rounds of ``--steps`` steps of each case):

- **byzfl**: one iteration of the DSGD branch of ByzFL's benchmark training loop
  (``byzfl/benchmark/train.py``), written out with its own classes because that module imports
  torchvision at top level: every honest ``Client`` computes its gradient on a batch of its
  ``DataLoader`` and returns it with (zero) momentum, the ``ByzantineClient`` crafts the ``f``
  vectors, the ``Server`` aggregates (``TrMean``, f) and takes its optimizer step, and every client
  loads the server's new state. Sequential clients in one process, as ByzFL runs them.
- **ours, metrics off / on**: :class:`~robustagg.training.Trainer` in ``trainer.mode=simulated``
  built as :mod:`experiments.bench_train` builds it (:func:`experiments.bench_train.build_trainer`),
  one ``trainer.step()`` plus :func:`~robustagg.training.step_record` per timed step.
- **floor**: :class:`experiments.bench_train.Floor`, the plain loop (gradients, mean, SGD step).

Same everything where both libraries allow it: the digits MLP of ``conf/model/mlp.yaml`` (ByzFL's
clients and server build a deep copy of our initial model, registered under a name in ByzFL's
model module, which is how ByzFL looks models up), the honest workers' shards of our partition
(each wrapped in a ``DataLoader`` of batch 32 whose batches are our trainer's: a copy of the
worker's :class:`~robustagg.training.ShardSampler`, so both sides draw the same batches), server
SGD (lr 0.1, momentum 0.9), no worker momentum, n = 10 of which f = 2 Byzantine running ALIE
(ByzFL's ``ALittleIsEnough`` with ``tau = -z``, our z of Baruch et al. 2019 for (n, f): both move
every coordinate z standard deviations below the honest mean), the coordinate-wise trimmed mean
with f = 2 (Yin et al., ICML 2018). ``ratio`` = median step time / ours with metrics off.

Importing ByzFL: ``import byzfl`` runs ``byzfl/__init__.py``, which imports ``byzfl.benchmark``
(torchvision, matplotlib, seaborn). When that fails, the package is registered without running its
``__init__`` and only ``byzfl.fed_framework`` (Client, Server, ByzantineClient, which import
``byzfl.aggregators``, ``byzfl.attacks`` and ``byzfl.utils``) is imported: ByzFL's own code, nothing
replaced. Prints one table and writes ``bench_byzfl.csv`` into ``--out`` (default: the working
directory).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import statistics
import sys
import tempfile
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

__all__ = ["MISSING", "ByzflMissing", "import_byzfl", "ByzflDSGD", "SamplerBatches", "run", "main"]

#: What the script prints (and exits 2 with) when ByzFL cannot be imported.
MISSING = ("experiments.bench_byzfl needs the byzfl package (ByzFL, the peer library this benchmark compares with), "
           "which this project does not install. Get it without touching your environment:\n"
           "    pip download byzfl --no-deps -d /tmp/byzfl-dl\n"
           "    pip install --no-deps --target /tmp/byzfl-pkgs /tmp/byzfl-dl/byzfl-*.whl\n"
           "then run with it on the path: PYTHONPATH=/tmp/byzfl-pkgs:$PWD python -m experiments.bench_byzfl")


class ByzflMissing(RuntimeError):
    """ByzFL is not importable; the message (:data:`MISSING` plus the cause) says how to get it."""


def import_byzfl() -> types.SimpleNamespace:
    """ByzFL's step classes: ``Client``, ``Server``, ``ByzantineClient``, its ``models`` module, ``version``, ``how``.

    ``how`` is ``"import byzfl"`` when the package imports whole, else the note of the fallback
    (the package registered without its ``__init__``; see the module docstring).

    Raises:
        ByzflMissing: no ``byzfl`` on the path, or even ``byzfl.fed_framework`` fails to import
            (the message names the failing import).
    """
    spec = importlib.util.find_spec("byzfl")
    if spec is None or not spec.submodule_search_locations:
        raise ByzflMissing(MISSING)
    try:
        from importlib.metadata import version as _version

        ver = _version("byzfl")
    except Exception:
        ver = "unknown"
    how = "import byzfl"
    try:
        importlib.import_module("byzfl")
    except ImportError as exc:
        for name in [m for m in sys.modules if m == "byzfl" or m.startswith("byzfl.")]:
            del sys.modules[name]
        pkg = types.ModuleType("byzfl")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__ = spec
        sys.modules["byzfl"] = pkg
        how = (f"import byzfl failed ({type(exc).__name__}: {exc}); imported byzfl.fed_framework alone, the "
               f"package registered without running byzfl/__init__.py")
    try:
        ff = importlib.import_module("byzfl.fed_framework")
        models = importlib.import_module("byzfl.fed_framework.models")
    except Exception as exc:
        raise ByzflMissing(f"byzfl {ver} is on the path but byzfl.fed_framework does not import: "
                           f"{type(exc).__name__}: {exc}") from None
    return types.SimpleNamespace(Client=ff.Client, Server=ff.Server, ByzantineClient=ff.ByzantineClient,
                                 models=models, version=ver, how=how)


class SamplerBatches:
    """A ``DataLoader`` batch sampler that yields a :class:`~robustagg.training.ShardSampler`'s batches forever."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __iter__(self) -> Any:
        while True:
            yield self.sampler.next().tolist()


class ByzflDSGD:
    """ByzFL's DSGD iteration on our trainer's model, honest shards and batches (see the module docstring).

    Args:
        bz: :func:`import_byzfl`'s namespace. trainer: our :class:`~robustagg.training.Trainer`
            before its first step (its initial model, its shards and a copy of each honest worker's
            sampler are used; it is not stepped here).
        honest: the honest ranks (their shards become ByzFL's honest clients, in rank order).
        f: Byzantine vectors per step (ByzFL's ``f``).
        lr, momentum: the server's SGD. tau: ByzFL ALIE's ``tau`` (``-z`` for ours).
        aggregator: ByzFL's ``aggregator_info`` (default ``{"name": "TrMean", "parameters": {"f": f}}``).
        pre_agg: ByzFL's ``pre_agg_list`` (default none).

    Raises:
        ValueError: ``f`` or ``honest`` outside ByzFL's requirement ``2 f < n``.
    """

    MODEL = "robustagg_bench_model"

    def __init__(self, bz: types.SimpleNamespace, trainer: Any, honest: Sequence[int], *, f: int, lr: float,
                 momentum: float, tau: float, aggregator: Optional[dict[str, Any]] = None,
                 pre_agg: Sequence[dict[str, Any]] = ()) -> None:
        from torch.utils.data import DataLoader, TensorDataset

        if not 0 <= 2 * f < len(honest) + f:
            raise ValueError(f"f={f} with {len(honest)} honest clients: ByzFL's rules need 2 f < n.")
        model0 = copy.deepcopy(trainer.model).cpu()
        self._model0 = model0
        setattr(bz.models, self.MODEL, lambda: copy.deepcopy(model0))  # ByzFL builds models by name
        common = {"model_name": self.MODEL, "device": "cpu"}
        agg = {"name": "TrMean", "parameters": {"f": f}} if aggregator is None else dict(aggregator)
        self.clients = []
        for r in honest:
            s = trainer.shards[r]
            loader = DataLoader(TensorDataset(s.x, s.y),
                                batch_sampler=SamplerBatches(copy.deepcopy(trainer.samplers[r])))
            self.clients.append(bz.Client({**common, "loss_name": "CrossEntropyLoss", "LabelFlipping": False,
                                           "nb_labels": int(trainer.num_classes), "momentum": 0.0,
                                           "training_dataloader": loader, "store_per_client_metrics": False}))
        first = trainer.shards[honest[0]]
        self.server = bz.Server({**common, "test_loader": DataLoader(TensorDataset(first.x[:1], first.y[:1])),
                                 "optimizer_name": "SGD", "optimizer_params": {"momentum": float(momentum)},
                                 "learning_rate": float(lr), "weight_decay": 0.0, "milestones": [],
                                 "learning_rate_decay": 1.0, "aggregator_info": agg,
                                 "pre_agg_list": [dict(p) for p in pre_agg]})
        self.byz = bz.ByzantineClient({"name": "ALittleIsEnough", "f": f, "parameters": {"tau": float(tau)}})
        self._broadcast()

    def _broadcast(self) -> None:
        state = self.server.get_dict_parameters()
        for c in self.clients:
            c.set_model_state(state)

    def model(self) -> Any:
        """A copy of our initial model object holding the server's current parameters (for evaluation)."""
        m = copy.deepcopy(self._model0)
        m.load_state_dict(self.server.model.state_dict())
        return m

    def step(self) -> None:
        """One DSGD iteration, as ByzFL's benchmark loop runs it (evaluation and file writing left out)."""
        for c in self.clients:
            c.compute_gradients()
        honest = [c.get_flat_gradients_with_momentum() for c in self.clients]
        self.server.update_model_with_gradients(honest + self.byz.apply_attack(honest))
        self._broadcast()


def _ours(n: int, f: int, metrics: bool, tmp: str, batched: str = "false") -> tuple[Any, int]:
    """Our simulated trainer for trimmed_mean vs alie at (n, f), and its batch size; ``batched`` is
    ``trainer.batched_gradients`` (``false``: the loop, as the committed comparisons were made;
    ``auto``: the default a researcher gets)."""
    from .bench_train import build_trainer, compose, overrides

    cfg = compose(overrides(n, f, "trimmed_mean", "alie", metrics, extra=(f"trainer.batched_gradients={batched}",)))
    return build_trainer(cfg, tmp), int(cfg.trainer.batch_size)


def run(*, n: int = 10, f: int = 2, warmup: int = 5, repeats: int = 5, steps: int = 20, clock: str = "cpu",
        bz: Optional[types.SimpleNamespace] = None) -> list[dict[str, Any]]:
    """Time every case; one row per case: ``case``, ``median_ms`` (float, per step), ``ratio`` (to ours, metrics
    off), ``timed_steps``, ``n``, ``f``, ``d``, ``clock``, ``byzfl`` (version), ``note``.

    Raises:
        ByzflMissing: ByzFL is not importable (see :func:`import_byzfl`).
    """
    import torch

    from attacks.alie import alie_z
    from robustagg.training import step_record

    from .bench import _clock
    from .bench_train import Floor

    bz = import_byzfl() if bz is None else bz
    torch.set_num_threads(1)
    tick: Callable[[], float] = _clock(clock)
    with tempfile.TemporaryDirectory() as tmp:
        (off, batch), (on, _), (plain, _) = _ours(n, f, False, tmp), _ours(n, f, True, tmp), _ours(n, f, False, tmp)
        default, _ = _ours(n, f, True, tmp, batched="auto")
    floor = Floor(plain, batch)
    honest = [r for r in sorted(off.shards) if r not in set(off.byzantine.ranks)]
    opt = off.optimizer.param_groups[0]
    byzfl = ByzflDSGD(bz, off, honest, f=f, lr=float(opt["lr"]), momentum=float(opt["momentum"]), tau=-alie_z(n, f))
    cases: dict[str, Callable[[], Any]] = {
        "byzfl": byzfl.step,
        "ours, metrics off": lambda: step_record(off.step(), off),
        "ours, metrics on": lambda: step_record(on.step(), on),
        "ours, metrics on, default": lambda: step_record(default.step(), default),
        "floor": floor.step,
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    for _ in range(repeats):
        for name, fn in cases.items():
            for _ in range(steps):
                t0 = tick()
                fn()
                times[name].append((tick() - t0) * 1e3)
    ref = statistics.median(times["ours, metrics off"])
    d = sum(p.numel() for p in off.model.parameters())
    notes = {"byzfl": f"ByzFL {bz.version}: {len(honest)} sequential Client + ByzantineClient(ALIE) + Server(TrMean)",
             "ours, metrics off": "Trainer, simulated mode (LocalComm), trimmed_mean vs alie",
             "ours, metrics on": "the same with trainer.metrics=true (agg/* weights and kappa-hat)",
             "ours, metrics on, default": "the same with trainer.batched_gradients=auto (the default: "
                                          f"{'batched' if default.batched is not None else 'the loop'})",
             "floor": "plain torch loop over all n workers: gradients, mean, SGD"}
    return [{"case": k, "median_ms": statistics.median(v), "ratio": statistics.median(v) / ref,
             "timed_steps": len(v), "n": n, "f": f, "d": d, "clock": clock, "byzfl": bz.version, "note": notes[k]}
            for k, v in times.items()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line: run, print the table, write ``bench_byzfl.csv``; ``2`` (and :data:`MISSING`) without ByzFL."""
    p = argparse.ArgumentParser(prog="python -m experiments.bench_byzfl", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--f", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    p.add_argument("--out", type=Path, default=Path("."))
    a = p.parse_args(argv)
    try:
        bz = import_byzfl()
    except ByzflMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    warnings.simplefilter("ignore")  # the trainer's advisories
    import pandas as pd

    from .bench import machine, write_csv

    rows = run(n=a.n, f=a.f, warmup=a.warmup, repeats=a.repeats, steps=a.steps, clock=a.clock, bz=bz)
    print(f"{machine()}; byzfl {bz.version} ({bz.how})")
    print(f"{'case':<20} {'ms/step':>9} {'/ ours':>7}  note")
    for r in rows:
        print(f"{r['case']:<20} {r['median_ms']:>9.2f} {r['ratio']:>7.2f}  {r['note']}")
    a.out.mkdir(parents=True, exist_ok=True)
    write_csv(pd.DataFrame(rows), a.out / "bench_byzfl.csv")
    print(f"wrote {a.out / 'bench_byzfl.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Batched per-worker gradients against the per-worker loop (docs/performance.md, "Batched per-worker gradients").

For each model, two simulated-mode trainers of the default experiment (digits, n = 10 workers,
CWTM with f = 2, two ALIE workers (``--n``: f = n // 5), SGD lr 0.1, batch 32, seed 0), one with
``trainer.batched_gradients=false`` (the loop), one with ``true``:

- **per step, same parameters**: the two run in lockstep; before every step the batched trainer
  gets the loop trainer's parameters, so both compute the submissions of the same batches at the
  same point; reported: the largest absolute difference of the ``(n, d)`` submission matrices
  (honest rows and the ALIE rows crafted from them) and that over the loop matrix's largest
  absolute entry, the maximum over the steps, and how many steps were bit-identical; for scale, the
  honest rows' spread: the largest coordinate-wise range (max - min over the honest workers) over
  the same largest entry, the median over the steps;
- **whole run**: two independent runs of ``steps`` steps; reported: the final parameters' largest
  absolute and relative difference and both test accuracies.

Models: the digits MLP (``model=mlp``), the SmallCNN (``model=cnn``), and LeNet-5 (``model=lenet5``)
on the digits images upsampled to 28 x 28 (bilinear; LeNet-5 takes 28 x 28 or 32 x 32 inputs).

Usage::

    python -m experiments.batched_compare --steps 100
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import warnings
from typing import Any

import torch

from .bench_train import compose, overrides


def _build(model: str, batched: bool, tmp: str, n: int = 10) -> tuple[Any, Any]:
    """``(trainer, parts)`` of the default experiment with ``model`` (simulated mode, one process)."""
    from robustagg.distributed import LocalComm, make_reduction
    from robustagg.launch import WorkerContext
    from robustagg.training import Trainer

    from .wiring import validate

    extra = [f"model={'mlp' if model == 'lenet5' else model}", f"trainer.batched_gradients={str(batched).lower()}"]
    plan = validate(compose(overrides(n, n // 5, "trimmed_mean", "alie", False, extra=tuple(extra))), out_dir=tmp)
    if model == "lenet5":  # validated as the MLP on 8 x 8 digits; LeNet-5 then gets them upsampled to 28 x 28
        data = plan.data
        plan.cfg["model"] = {"_target_": "robustagg.models.LeNet5", "activation": "relu", "pool": "max"}

        def up(x: torch.Tensor) -> torch.Tensor:
            img = x.reshape(-1, 1, 8, 8)
            return torch.nn.functional.interpolate(img, size=(28, 28), mode="bilinear",
                                                   align_corners=False).reshape(x.shape[0], -1)

        data.train_x, data.test_x, data.input_shape = up(data.train_x), up(data.test_x), (1, 28, 28)
    job = plan.job()
    s = job.settings
    comm = LocalComm(job.n)
    parts = job.build(WorkerContext(job=job, rank=0, local_ranks=tuple(comm.local_ranks), device=torch.device("cpu"),
                                    comm=comm))
    red = make_reduction(str(s.reduction), parts.rule, comm, on_nonfinite=str(s.on_nonfinite))
    tr = Trainer(parts.model, parts.optimizer, red, parts.shards, batch_size=int(s.batch_size),
                 num_classes=int(parts.num_classes), seed=int(s.seed), byzantine=parts.byzantine, metrics=False,
                 batched_gradients=batched)
    return tr, parts


def _flat(tr: Any) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in tr.params])


def compare(model: str, steps: int, n: int = 10) -> dict[str, Any]:
    """One model's per-step and whole-run differences (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        (a, _), (b, _) = _build(model, False, tmp, n), _build(model, True, tmp, n)
        abs_d, rel_d, spread, same = [], [], [], 0
        for _ in range(steps):
            with torch.no_grad():
                for p, q in zip(b.params, a.params):
                    p.copy_(q)
            out = a.step()
            ma, mb = out.reduced.matrix, b.step().reduced.matrix
            honest = ma[out.honest_mask()]
            spread.append(float((honest.max(dim=0).values - honest.min(dim=0).values).max() / ma.abs().max()))
            diff = float((ma - mb).abs().max())
            abs_d.append(diff)
            rel_d.append(diff / float(ma.abs().max()))
            same += int(torch.equal(ma, mb))
        (a, pa), (b, pb) = _build(model, False, tmp, n), _build(model, True, tmp, n)
        for _ in range(steps):
            a.step()
            b.step()
        wa, wb = _flat(a), _flat(b)
        acc_a, acc_b = pa.evaluate()["test/acc"], pb.evaluate()["test/acc"]
    return {"model": model, "n": n, "d": int(wa.numel()), "steps": steps, "step_abs_median": statistics.median(abs_d),
            "step_abs_max": max(abs_d), "step_rel_max": max(rel_d), "honest_spread_rel": statistics.median(spread), "steps_bit_identical": same,
            "final_abs": float((wa - wb).abs().max()), "final_rel": float((wa - wb).abs().max() / wa.abs().max()),
            "acc_loop": acc_a, "acc_batched": acc_b}


def main() -> None:
    """Print one line per model (and a Markdown table)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--n", type=int, default=10, help="workers (f = n // 5 declared and attacking)")
    ap.add_argument("--models", nargs="+", default=["mlp", "cnn", "lenet5"])
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    rows = [compare(m, args.steps, args.n) for m in args.models]
    print("| model | n | d | per step: max abs | per step: max rel | steps bit-identical | final params: max abs "
          "| final: max rel | test acc loop | test acc batched | honest spread (rel) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['n']} | {r['d']:,} | {r['step_abs_max']:.2e} | {r['step_rel_max']:.2e} | "
              f"{r['steps_bit_identical']}/{r['steps']} | {r['final_abs']:.2e} | {r['final_rel']:.2e} | "
              f"{r['acc_loop']:.4f} | {r['acc_batched']:.4f} | {r['honest_spread_rel']:.2f} |")


if __name__ == "__main__":
    main()

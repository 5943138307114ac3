"""Aggregation-kernel benchmark: every rule against the plain mean (the bandwidth floor) and a naive version.

``python -m experiments.bench`` (config ``conf/bench/bench.yaml``) builds, for every ``n`` and ``d``
of the grid, one ``(n, d)`` input (standard normal, ``seed``) and, for every rule and pipeline,

- times the class call ``rule(x)`` (validation included) and the bare kernel ``rule._aggregate(x)``
  after ``warmup`` calls, interleaved with ``x.mean(0)`` on the same input: ``repeats`` rounds,
  median of each; ``ratio_to_mean`` = median rule time / median mean time;
- times a naive implementation (full sorts, per-pair differences, the Weiszfeld loop on the rows)
  ``naive_repeats`` times: ``speedup_vs_naive`` = naive time / rule time;
- measures the peak extra memory of one class call, as a multiple of the input's size: on CPU the
  rise of the process's resident-set high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs``) over the resident set before the call, with glibc told to map every
  block of 128 KiB or more afresh and to return freed memory (``mallopt``/``malloc_trim``), so that
  each large allocation shows up (in a forked child, which keeps these settings out of the timed
  process); on CUDA ``torch.cuda.max_memory_allocated`` over the allocated
  bytes before the call. It counts everything the call allocates, the output included.

Threads: ``threads`` sets ``torch.set_num_threads`` and, through threadpoolctl, the BLAS libraries.
Clock: ``wall`` (``perf_counter``) or ``cpu`` (``process_time``, steadier on a shared machine).
The table is printed and written to ``bench.csv`` in the Hydra run directory.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import math
import os
import platform
import statistics
import struct
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import hydra
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf

import robustagg as ra

COLUMNS = ["rule", "n", "f", "d", "dtype", "device", "median_ms", "ratio_to_mean", "kernel_ms",
           "kernel_ratio_to_mean", "naive_ms", "speedup_vs_naive", "peak_extra_mem_x", "mean_ms", "threads",
           "clock", "note"]

Fn = Callable[[torch.Tensor], torch.Tensor]


# --- naive implementations (what straightforward public code does) ----------------------------------
def _sq_dists(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    dist = torch.zeros(n, n, dtype=torch.float64)
    for i, j in itertools.combinations(range(n), 2):
        dist[i, j] = dist[j, i] = float(((x[i] - x[j]) ** 2).sum())
    return dist


def _median(x: torch.Tensor) -> torch.Tensor:
    s, n = torch.sort(x, dim=0).values, x.shape[0]
    return (s[(n - 1) // 2] + s[n // 2]) / 2


def _meamed(x: torch.Tensor, f: int) -> torch.Tensor:
    dist = (x - _median(x)).abs()
    order = torch.argsort(dist, dim=0, stable=True)[:x.shape[0] - f]
    return torch.gather(x, 0, order).mean(dim=0)


def _krum_scores(dist: torch.Tensor, f: int, idx: list[int]) -> list[float]:
    k = max(len(idx) - f - 2, 0)
    return [sum(sorted(float(dist[i, j]) for j in idx if j != i)[:k]) for i in idx]


def _bulyan(x: torch.Tensor, f: int) -> torch.Tensor:
    dist, remaining, sel = _sq_dists(x), list(range(x.shape[0])), []
    for _ in range(x.shape[0] - 2 * f):
        scores = _krum_scores(dist, f, remaining)
        sel.append(remaining.pop(scores.index(min(scores))))
    return _meamed(x[sel], 2 * f)


def _weiszfeld(x: torch.Tensor, iters: int, nu: float) -> torch.Tensor:
    z = x.mean(dim=0)
    for _ in range(iters):
        w = 1.0 / torch.linalg.vector_norm(x - z, dim=1).clamp(min=nu)
        z = (w[:, None] * x).sum(dim=0) / w.sum()
    return z


def _cclip(x: torch.Tensor, tau: float, iters: int) -> torch.Tensor:
    v = torch.zeros_like(x[0])
    for _ in range(iters):
        u = x - v
        v = v + (u * (tau / torch.linalg.vector_norm(u, dim=1)).clamp(max=1.0)[:, None]).mean(dim=0)
    return v


def _nnm(x: torch.Tensor, f: int) -> torch.Tensor:
    dist = _sq_dists(x)
    dist.fill_diagonal_(-1.0)
    return torch.stack([x[torch.argsort(dist[i], stable=True)[:x.shape[0] - f]].mean(dim=0)
                        for i in range(x.shape[0])])


def _mda(x: torch.Tensor, f: int) -> torch.Tensor:
    dist, n = _sq_dists(x), x.shape[0]
    best = min(itertools.combinations(range(n), n - f), key=lambda c: max(dist[i, j] for i in c for j in c))
    return x[list(best)].mean(dim=0)


def _bucket(x: torch.Tensor, s: int) -> torch.Tensor:
    perm = torch.randperm(x.shape[0])
    return torch.stack([x[perm[i:i + s]].mean(dim=0) for i in range(0, x.shape[0], s)])


def _clip(x: torch.Tensor, tau: float) -> torch.Tensor:
    return x * (tau / torch.linalg.vector_norm(x, dim=1)).clamp(max=1.0)[:, None]


def _arc(x: torch.Tensor, f: int) -> torch.Tensor:
    n = x.shape[0]
    k = min(math.floor(2 * f * (n - f) / n), n - 1)
    norms = torch.linalg.vector_norm(x, dim=1)
    order = torch.argsort(norms, descending=True, stable=True)
    factor = torch.ones(n)
    factor[order[:k]] = (norms[order[k]] / norms[order[:k]]).clamp(max=1.0)
    return x * factor[:, None]


# naive CAF, SMEA, MoNNA, CGE, DnC: (n, d) differences and one power step from a random vector
def _power_step(diffs: torch.Tensor, c: torch.Tensor) -> tuple[float, torch.Tensor]:
    v = torch.randn(diffs.shape[1], dtype=diffs.dtype)
    v = v / torch.linalg.vector_norm(v)
    s = (c[:, None] * diffs * (diffs @ v)[:, None]).sum(dim=0) / c.sum()
    v = s / torch.linalg.vector_norm(s)
    return float(v @ s), v


def _caf(x: torch.Tensor, f: int) -> torch.Tensor:
    n = x.shape[0]
    c, best, best_lam = torch.ones(n, dtype=x.dtype), x.mean(dim=0), math.inf
    for _ in range(n):
        if not float(c.sum()) > n - 2 * f:
            break
        mu = (c[:, None] * x).sum(dim=0) / c.sum()
        diffs = x - mu
        lam, v = _power_step(diffs, c)
        if lam < best_lam:
            best, best_lam = mu, lam
        tau = (diffs @ v) ** 2
        c = c * (1 - tau / tau.max())
    return best


def _smea(x: torch.Tensor, f: int) -> torch.Tensor:
    n = x.shape[0]
    best, best_lam = tuple(range(n - f)), math.inf
    for sub in itertools.combinations(range(n), n - f):
        rows = x[list(sub)]
        lam, _ = _power_step(rows - rows.mean(dim=0), torch.ones(len(sub), dtype=x.dtype))
        if lam < best_lam:
            best, best_lam = sub, lam
    return x[list(best)].mean(dim=0)


def _dnc(x: torch.Tensor, f: int, b: int, iters: int) -> torch.Tensor:
    n, d = x.shape
    good = set(range(n))
    for _ in range(iters):
        sub = x[:, torch.randperm(d)[:min(b, d)]]
        centred = sub - sub.mean(dim=0)
        v = torch.linalg.svd(centred, full_matrices=False).Vh[0]
        good &= set(torch.argsort((centred @ v) ** 2)[:n - f].tolist())
    return x[sorted(good)].mean(dim=0)


#: Largest C(n, f) for which the naive SMEA (one power step per subset on the (n - f, d) rows) is timed.
NAIVE_SMEA_MAX_SUBSETS = 500


# similarity-based rules (part 2): per-pair cosines, whole-tensor clipping, scikit-learn on the result
def _cos_dists(x: torch.Tensor) -> Any:
    n = x.shape[0]
    dist = torch.zeros(n, n, dtype=torch.float64)
    for i, j in itertools.combinations(range(n), 2):
        dist[i, j] = dist[j, i] = 1.0 - float(torch.nn.functional.cosine_similarity(x[i], x[j], dim=0))
    return dist.clamp(min=0.0).numpy()


def _clipped_mean(x: torch.Tensor, keep: Any, tau: float) -> torch.Tensor:
    norms = torch.linalg.vector_norm(x, dim=1)
    return (x * (tau / norms).clamp(max=1.0)[:, None])[torch.as_tensor(keep)].mean(dim=0)


def _largest(labels: Any) -> Any:
    import numpy as np

    ids, counts = np.unique(labels[labels >= 0], return_counts=True)
    return labels == ids[counts.argmax()]


def _signguard(x: torch.Tensor) -> torch.Tensor:
    import numpy as np
    from sklearn.cluster import MeanShift, estimate_bandwidth

    norms = torch.linalg.vector_norm(x, dim=1)
    m = float(np.median(norms.numpy()))
    s1 = ((norms > 0.1 * m) & (norms < 3.0 * m)).numpy()
    cols = x[:, torch.randperm(x.shape[1])[:max(1, x.shape[1] // 10)]]
    feats = torch.stack([(cols > 0).double().mean(1), (cols == 0).double().mean(1), (cols < 0).double().mean(1)], 1)
    feats = (feats / (feats.max(dim=0).values + 1e-8)).numpy()
    bw = estimate_bandwidth(feats, quantile=0.5)
    labels = (MeanShift(bandwidth=bw, bin_seeding=True, cluster_all=False).fit(feats).labels_ if bw > 0
              else np.zeros(x.shape[0], dtype=int))
    return _clipped_mean(x, s1 & _largest(labels), float(norms.median()))  # torch.median: the lower middle


def _clipped_clustering(x: torch.Tensor) -> torch.Tensor:
    from sklearn.cluster import AgglomerativeClustering

    tau = float(torch.linalg.vector_norm(x, dim=1).median())
    labels = AgglomerativeClustering(n_clusters=2, metric="precomputed", linkage="average").fit(_cos_dists(x)).labels_
    return _clipped_mean(x, _largest(labels), tau)


def _flame(x: torch.Tensor, lam: float) -> torch.Tensor:
    from sklearn.cluster import HDBSCAN

    n = x.shape[0]
    st = float(torch.linalg.vector_norm(x, dim=1).median())
    labels = HDBSCAN(min_cluster_size=n // 2 + 1, min_samples=1, metric="precomputed", allow_single_cluster=True,
                     copy=True).fit(_cos_dists(x)).labels_
    return _clipped_mean(x, _largest(labels), st) + lam * st * torch.randn(x.shape[1], dtype=x.dtype)


def _fltrust(x: torch.Tensor) -> torch.Tensor:
    clients, g0 = x[:-1], x[-1]
    ts = torch.relu(torch.nn.functional.cosine_similarity(clients, g0[None], dim=1))
    scaled = clients * (torch.linalg.vector_norm(g0) / torch.linalg.vector_norm(clients, dim=1))[:, None]
    return (ts[:, None] * scaled).sum(dim=0) / ts.sum()


def _foolsgold(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    cs = torch.zeros(n, n, dtype=torch.float64)  # the authors' cosine_similarity - I: own cosine 0
    for i, j in itertools.permutations(range(n), 2):
        cs[i, j] = float(torch.nn.functional.cosine_similarity(x[i], x[j], dim=0))  # history = x at step 1
    v = cs.max(dim=1).values
    for i, j in itertools.permutations(range(n), 2):
        if v[j] > v[i]:
            cs[i, j] *= v[i] / v[j]
    alpha = (1 - cs.max(dim=1).values).clamp(0, 1)
    alpha = (alpha / alpha.max()).clamp(max=0.99)
    alpha = (torch.log(alpha / (1 - alpha)) + 0.5).nan_to_num(neginf=0.0).clamp(0, 1)
    return (alpha.to(x.dtype) @ x) / alpha.sum()


def naive(spec: str, f: int, params: dict[str, Any], n: int = 0) -> Fn | None:
    """The naive implementation of a rule or ``pre>...>rule`` spec (``None``: too slow to time at ``n``)."""
    *pre, rule = spec.split(">")
    if rule == "smea" and math.comb(n, f) > NAIVE_SMEA_MAX_SUBSETS:
        return None
    rules: dict[str, Fn] = {
        "mean": lambda x: x.mean(dim=0),
        "coordinate_median": _median,
        "trimmed_mean": lambda x: torch.sort(x, dim=0).values[f:x.shape[0] - f].mean(dim=0),
        "meamed": lambda x: _meamed(x, f),
        "krum": lambda x: x[int(torch.tensor(_krum_scores(_sq_dists(x), f, list(range(x.shape[0])))).argmin())],
        "multi_krum": lambda x: x[torch.argsort(torch.tensor(_krum_scores(_sq_dists(x), f, list(range(x.shape[0])))),
                                                stable=True)[:x.shape[0] - f]].mean(dim=0),
        "bulyan": lambda x: _bulyan(x, f),
        "geometric_median": lambda x: _weiszfeld(x, params.get("max_iter", 100), params.get("nu", 1e-6)),
        "centered_clipping": lambda x: _cclip(x, params.get("tau", 10.0), params.get("iterations", 3)),
        "mda": lambda x: _mda(x, f),
        "caf": lambda x: _caf(x, f),
        "smea": lambda x: _smea(x, f),
        "monna": lambda x: x[torch.argsort(torch.linalg.vector_norm(x - x[params.get("trusted", 0)], dim=1))
                             [:x.shape[0] - f]].mean(dim=0),
        "cge": lambda x: x[torch.argsort(torch.linalg.vector_norm(x, dim=1))[:x.shape[0] - f]].mean(dim=0),
        "dnc": lambda x: _dnc(x, f, params.get("sub_dim", 10_000), params.get("iterations", 5)),
        # similarity-based rules (part 2)
        "signguard": _signguard,
        "clipped_clustering": _clipped_clustering,
        "flame": lambda x: _flame(x, params.get("lam", 0.001)),
        "fltrust": _fltrust,
        "foolsgold": _foolsgold,
    }
    maps: dict[str, Fn] = {"nnm": lambda x: _nnm(x, f), "bucketing": lambda x: _bucket(x, 2),
                           "clipping": lambda x: _clip(x, 1.0), "arc": lambda x: _arc(x, f)}
    stages = [maps[p] for p in pre] + [rules[rule]]

    def run(x: torch.Tensor) -> torch.Tensor:
        for stage in stages:
            x = stage(x)
        return x

    return run


# --- measurement ---------------------------------------------------------------------------------------
def _clock(kind: str) -> Callable[[], float]:
    """``clock=wall`` (``time.perf_counter``) or ``clock=cpu`` (``time.process_time``).

    Raises:
        ValueError: any other value (a misspelt ``cpu`` must not silently time the wall clock).
    """
    if kind not in ("wall", "cpu"):
        raise ValueError(f"clock={kind!r}: choose clock=wall (elapsed time) or clock=cpu (the process's CPU time).")
    return time.process_time if kind == "cpu" else time.perf_counter


def _timed(fn: Callable[[], Any], clock: Callable[[], float], device: torch.device) -> float:
    t0 = clock()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (clock() - t0) * 1e3


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_extra_memory(fn: Callable[[], Any], x: torch.Tensor) -> float:
    """Peak extra memory of one call of ``fn``, as a multiple of ``x``'s size (NaN where unmeasurable).

    On CPU the call runs in a forked child (Linux), so that the allocator settings it needs and the
    call's side effects (a stateful rule's centre) stay out of the timed process; the child calls
    ``fn`` once before measuring the second call, so that code pages it maps lazily do not count.
    """
    nbytes = x.numel() * x.element_size()
    gc.collect()
    if x.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        del out
        return (torch.cuda.max_memory_allocated() - before) / nbytes
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return math.nan
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: measure, report through the pipe, exit without cleanup
        value = math.nan
        try:
            os.close(read_end)
            libc = ctypes.CDLL(None)
            libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD fixed: every large block is mmapped, then unmapped
            fn()  # once unmeasured: the child maps the library code pages it touches lazily
            gc.collect()
            libc.malloc_trim(0)
            before = _status_bytes("VmRSS:")
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # reset VmHWM to the current resident set
            out = fn()
            value = max(_status_bytes("VmHWM:") - before, 0) / nbytes
            del out
        finally:
            os.write(write_end, struct.pack("d", value))
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as fh:
        data = fh.read()
    os.waitpid(pid, 0)
    return struct.unpack("d", data)[0] if len(data) == 8 else math.nan


def bench_point(cfg: DictConfig, n: int, d: int) -> list[dict[str, Any]]:
    """All rules of ``cfg.rules`` on one ``(n, d)`` input."""
    device = torch.device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    f = n // 5 if cfg.f is None else int(cfg.f)
    gen = torch.Generator().manual_seed(int(cfg.seed))
    x = torch.randn(n, d, generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)
    clock = _clock(cfg.clock)
    params = OmegaConf.to_container(cfg.params, resolve=True) if cfg.params else {}
    rows = []
    for spec in cfg.rules:
        kw = dict(params.get(spec, {}))  # type: ignore[union-attr]
        row: dict[str, Any] = {"rule": spec, "n": n, "f": f, "d": d, "dtype": cfg.dtype, "device": device.type,
                               "threads": torch.get_num_threads(), "clock": cfg.clock, "note": ""}
        try:
            rule = ra.get(spec, f=f, **kw)
            rule(x[:, :8])  # requirement check and lazy set-up on a tiny slice
            rule.reset()
        except (ra.AssumptionError, ra.ConfigError) as exc:
            rows.append({**row, "note": f"skipped: {str(exc).splitlines()[0][:120]}"})
            continue
        for _ in range(int(cfg.warmup)):
            rule(x)
            rule._aggregate(x)
        t_mean, t_rule, t_kernel = [], [], []
        for _ in range(int(cfg.repeats)):
            t_mean.append(_timed(lambda: x.mean(dim=0), clock, device))
            t_rule.append(_timed(lambda: rule(x), clock, device))
            t_kernel.append(_timed(lambda: rule._aggregate(x), clock, device))
        mean_ms, rule_ms, kernel_ms = (statistics.median(t) for t in (t_mean, t_rule, t_kernel))
        row.update(median_ms=rule_ms, ratio_to_mean=rule_ms / mean_ms, kernel_ms=kernel_ms,
                   kernel_ratio_to_mean=kernel_ms / mean_ms, mean_ms=mean_ms)
        ref = naive(spec, f, kw, n) if cfg.naive else None
        if ref is not None:
            naive_ms = statistics.median(_timed(lambda: ref(x), clock, device) for _ in range(int(cfg.naive_repeats)))
            row.update(naive_ms=naive_ms, speedup_vs_naive=naive_ms / rule_ms)
        if cfg.memory:
            row["peak_extra_mem_x"] = peak_extra_memory(lambda: rule(x), x)
        rows.append(row)
    return rows


def run_bench(cfg: DictConfig) -> pd.DataFrame:
    """Run the grid of ``cfg`` and return the table (columns :data:`COLUMNS`)."""
    warnings.simplefilter("ignore", ra.AssumptionWarning)  # the mean's "f >= 1 declared" advisory
    torch.set_num_threads(int(cfg.threads))
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(int(cfg.threads))
    except ImportError:
        pass
    ns, ds = (cfg.quick_ns, cfg.quick_ds) if cfg.quick else (cfg.ns, cfg.ds)
    rows = [r for n in ns for d in ds for r in bench_point(cfg, int(n), int(d))]
    return pd.DataFrame(rows).reindex(columns=COLUMNS)


def machine() -> str:
    """One line describing the machine and the software."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, Python {platform.python_version()}")


def _print(table: pd.DataFrame) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Table(title=f"robustagg kernels ({machine()})",
                caption="mean_ms: the bare x.mean(0), the floor every ratio divides by; the 'mean' row is the "
                        "class call (with its NaN/inf check)")
    shown = ["rule", "n", "f", "d", "mean_ms", "median_ms", "ratio_to_mean", "kernel_ratio_to_mean", "naive_ms",
             "speedup_vs_naive", "peak_extra_mem_x", "note"]
    for col in shown:
        out.add_column(col, justify="left" if col in ("rule", "note") else "right")
    for rec in table.to_dict("records"):
        out.add_row(*["" if isinstance(rec[c], float) and math.isnan(rec[c]) else
                      (f"{rec[c]:.2f}" if isinstance(rec[c], float) else str(rec[c])) for c in shown])
    Console(width=200).print(out)


def write_csv(table: pd.DataFrame, path: Path) -> None:
    """Write ``table`` to ``path`` atomically (temp file, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        table.to_csv(fh, index=False)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


@hydra.main(config_path="../conf/bench", config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: run the grid, print the table, write ``cfg.csv`` in the run directory."""
    try:
        _clock(str(cfg.clock))  # a bad clock is refused before anything is timed
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    table = run_bench(cfg)
    _print(table)
    out_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    write_csv(table, out_dir / cfg.csv)
    print(f"wrote {out_dir / cfg.csv}")


if __name__ == "__main__":
    main()

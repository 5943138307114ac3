"""Distributed robust-reduction benchmark: all-reduce mean vs gather+rule vs sharded+rule.

``python -m experiments.bench_distributed`` spawns ``world`` processes per world size (gloo on
CPU, NCCL on CUDA), and for every ``d`` and rule times one reduction of one ``(d,)`` submission
per rank, three ways:

- ``allreduce``: ``dist.all_reduce`` then divide by the world size (what DDP pays; not robust);
- ``gather``: ``all_gather`` every submission to every rank, stack, run the rule;
- ``sharded``: :func:`robustagg.distributed.sharded.sharded_aggregate`, writing into a
  preallocated ``out=`` buffer;
- ``reduction_r<k>`` (every rule that :func:`~robustagg.distributed.sharded.supports_replication`
  holds for, each ``k`` in ``aggregator_replicas`` up to the world size): the trainer's whole :class:`~robustagg.distributed.ShardedReduction` step (headers, framed
  slices, integrity verdict, the rule, the return exchange) with every slice computed by ``k`` ranks
  and voted on (:mod:`robustagg.distributed.vote`); ``sent_mb`` is what one rank sends per step, and
  ``ratio_to_r1`` its time against ``k = 1`` in the same process group, the ``k`` timed in alternation
  (one call of each per round) so that the machine's load moves them alike (issue 29's cost of no
  trusted aggregator).

Both ``allreduce`` and ``sharded`` reduce into a buffer allocated once before timing, as a
training loop would (gradient buckets, a persistent update buffer): at ``d = 1e7`` a fresh 40 MB
tensor per call is served by fresh mmap pages, whose faults cost tens of milliseconds per call on
a loaded machine. ``gather`` keeps its per-call ``torch.stack`` (a plain gather-then-rule step).

A step's time is the slowest rank's (all-reduced MAX); the table reports the median over
``repeats`` after ``warmup`` runs and the ratio to the all-reduce time measured in the same
process group. Results go to ``bench_distributed.csv`` in the Hydra run directory.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import hydra
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig, OmegaConf

import robustagg as ra
from robustagg.distributed.sharded import sharded_aggregate, supports_replication, supports_sharding

COLUMNS = ["mode", "rule", "world", "d", "backend", "median_ms", "ratio_to_allreduce", "sent_mb", "ratio_to_r1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _timed(fn: Callable[[], Any], repeats: int, warmup: int, device: torch.device) -> float:
    """Median over repeats of the slowest rank's wall time of ``fn`` in milliseconds."""
    return _timed_interleaved([fn], repeats, warmup, device)[0]


def _timed_interleaved(fns: list[Callable[[], Any]], repeats: int, warmup: int,
                       device: torch.device) -> list[float]:
    """:func:`_timed` of several functions in alternation (one call of each per round), so that a
    change of the machine's load hits each alike: the median of each, in milliseconds."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(warmup + repeats):
        for j, fn in enumerate(fns):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= warmup:
                times[j].append(float(elapsed) * 1e3)
    return [statistics.median(t) for t in times]


def _worker(rank: int, world: int, port: int, cfg: dict, out_path: str) -> None:
    torch.set_num_threads(int(cfg["threads"]))
    use_cuda = cfg["backend"] == "nccl"
    device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1)) if use_cuda else torch.device("cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(cfg["backend"], rank=rank, world_size=world)
    dtype = getattr(torch, cfg["dtype"])
    f = cfg["f"] if cfg["f"] is not None else (world - 3) // 4
    rows = []
    for d in cfg["ds"]:
        gen = torch.Generator().manual_seed(1000 * rank + 7)
        local = torch.randn(int(d), generator=gen, dtype=dtype).to(device)
        buf = local.clone()

        def allreduce() -> None:
            buf.copy_(local)
            dist.all_reduce(buf)
            buf.div_(world)

        base = _timed(allreduce, cfg["repeats"], cfg["warmup"], device)
        rows.append(dict(mode="allreduce", rule="mean", world=world, d=int(d), backend=cfg["backend"], median_ms=base))
        for name in cfg["rules"]:
            rule = ra.get(name, f=f)
            rule.check(world)
            gathered = [torch.empty_like(local) for _ in range(world)]

            def gather_rule() -> None:
                dist.all_gather(gathered, local)
                rule(torch.stack(gathered))

            modes: list[tuple[str, Callable[[], None]]] = [("gather", gather_rule)]
            if supports_sharding(rule):
                out = torch.empty_like(local)
                modes.append(("sharded", lambda: sharded_aggregate(rule, local, out=out)))
            for mode, fn in modes:
                if hasattr(rule, "reset"):
                    rule.reset()
                ms = _timed(fn, cfg["repeats"], cfg["warmup"], device)
                rows.append(dict(mode=mode, rule=name, world=world, d=int(d), backend=cfg["backend"], median_ms=ms))
            if supports_replication(rule):
                rows.extend(_replicated_rows(rule, name, local, world, int(d), cfg, device))
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _replicated_rows(rule: Any, name: str, local: torch.Tensor, world: int, d: int, cfg: dict,
                     device: torch.device) -> list[dict[str, Any]]:
    """Time the trainer's sharded reduction step with every slice computed by ``k`` ranks, ``k`` in
    ``cfg["aggregator_replicas"]`` (those up to ``world``)."""
    from robustagg.distributed import ProcessGroupComm, ShardedReduction
    from robustagg.distributed.vote import AggregatorCheck, sent_bytes

    comm = ProcessGroupComm(device=device)
    ks = [int(k) for k in cfg.get("aggregator_replicas", [1, 3]) if int(k) <= world]
    calls = []
    for k in ks:
        red = ShardedReduction(rule, comm, metrics=False)
        red.check = AggregatorCheck(replicas=k, on_mismatch="vote")

        def reduce(red: ShardedReduction = red, step: list[int] = [0]) -> None:
            red.reduce({comm.rank: local}, step=step[0])
            step[0] += 1

        calls.append(reduce)
    times = _timed_interleaved(calls, cfg["repeats"], cfg["warmup"], device)  # r_a = 1 and 3 under the same load
    return [dict(mode=f"reduction_r{k}", rule=name, world=world, d=d, backend=cfg["backend"], median_ms=ms,
                 sent_mb=sent_bytes(d, world, k, local.element_size()) / 1e6) for k, ms in zip(ks, times)]


def run_benchmark(cfg: dict) -> pd.DataFrame:
    """Run the grid in ``cfg`` (keys as in conf/bench_distributed) and return the result table."""
    if cfg.get("quick"):
        cfg = {**cfg, "worlds": [4], "ds": [20_000], "rules": ["trimmed_mean", "krum"], "repeats": 2, "warmup": 1,
               "aggregator_replicas": [1, 3]}
    if cfg["backend"] == "auto":
        cfg = {**cfg, "backend": "nccl" if torch.cuda.is_available() else "gloo"}
    frames = []
    for world in cfg["worlds"]:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            mp.spawn(_worker, args=(int(world), _free_port(), cfg, out), nprocs=int(world), join=True)
            frames.append(pd.DataFrame(json.loads(Path(out).read_text())))
    table = pd.concat(frames, ignore_index=True)
    base = table[table["mode"] == "allreduce"].set_index(["world", "d"])["median_ms"]
    table["ratio_to_allreduce"] = [row.median_ms / base[(row.world, row.d)] for row in table.itertuples()]
    if "sent_mb" not in table:
        table["sent_mb"] = float("nan")
    r1 = table[table["mode"] == "reduction_r1"].set_index(["rule", "world", "d"])["median_ms"]
    table["ratio_to_r1"] = [row.median_ms / r1[(row.rule, row.world, row.d)]
                            if str(row.mode).startswith("reduction_r") and (row.rule, row.world, row.d) in r1.index
                            else float("nan") for row in table.itertuples()]
    return table[COLUMNS]


def _print(table: pd.DataFrame) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="robust reduction vs all-reduce (median ms, slowest rank)")
    for c in COLUMNS:
        t.add_column(c, justify="right" if c in ("world", "d", "median_ms", "ratio_to_allreduce", "sent_mb",
                                                 "ratio_to_r1") else "left")
    for row in table.itertuples(index=False):
        t.add_row(*[f"{v:.2f}" if isinstance(v, float) else str(v) for v in row])
    Console().print(t)


@hydra.main(config_path="../conf/bench_distributed", config_name="bench_distributed", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: run, print and write ``bench_distributed.csv`` in the run directory."""
    table = run_benchmark(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
    _print(table)
    out_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    tmp = out_dir / "bench_distributed.csv.tmp"
    with open(tmp, "w") as fh:
        table.to_csv(fh, index=False)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out_dir / "bench_distributed.csv")
    print(f"wrote {out_dir / 'bench_distributed.csv'}")


if __name__ == "__main__":
    main()

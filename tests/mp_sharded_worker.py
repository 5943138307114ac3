"""Run by tests/test_sharded.py as a script: WORLD gloo processes compare sharded vs gathered rules.

Usage: python tests/mp_sharded_worker.py WORLD D OUT.json
Each rank submits its own row; every rank computes ``sharded_aggregate`` and also the plain rule on
the gathered matrix; rank 0 writes, per rule, whether the two agree bitwise and the max difference.
"""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import robustagg as ra
from robustagg.distributed.sharded import sharded_aggregate
from robustagg.functional.gram import warm_up

RULES = [("mean", {}), ("coordinate_median", {"f": 1}), ("trimmed_mean", {"f": 1}), ("meamed", {"f": 1}),
         ("krum", {"f": 1}), ("multi_krum", {"f": 1}), ("multi_krum", {"f": 1, "m": 2}), ("bulyan", {"f": 1}),
         ("mda", {"f": 1}), ("geometric_median", {"f": 1}), ("centered_clipping", {"tau": 0.5, "f": 1}),
         ("nnm>trimmed_mean", {"f": 1}), ("nnm>krum", {"f": 1}), ("arc>coordinate_median", {"f": 1}),
         ("clipping>mean", {"pre_params": [{"tau": 1.0}]}), ("bucketing>coordinate_median", {"f": 1})]


def rows(world: int, d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(world, d, generator=g) * 0.1 + 1.0
    x[-1] = -50.0  # one far Byzantine-like row
    return x


def worker(rank: int, world: int, d: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    steps = [rows(world, d), rows(world, d).flip(1) * 2.0]  # two steps: the centred-clipping centre evolves
    result = {}
    for name, kw in RULES:
        sharded_rule, plain_rule = ra.get(name, **kw), ra.get(name, **kw)
        equal, max_rel = True, 0.0
        for x in steps:
            got = sharded_aggregate(sharded_rule, x[rank].clone())
            want = plain_rule(x)
            equal = equal and bool(torch.equal(got, want))
            max_rel = max(max_rel, float((got - want).abs().max() / want.abs().max().clamp(min=1e-30)))
        result[f"{name} {kw}"] = {"equal": equal, "max_rel": max_rel}
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    world, d, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    warm_up()  # compile the Gram kernel once here: the forked ranks inherit it instead of each loading it
    # fork: the ranks start from this process's imports (seconds each under spawn, for 7 processes)
    mp.start_processes(worker, args=(world, d, port, out), nprocs=world, join=True, start_method="fork")

"""Workers and a launcher for tests/test_lifecycle.py (a module, so every start method can import them).

Usage as a launcher script (the test signals or kills this process):

    python tests/lifeline_worker.py linger DIR START_METHOD   # 2 workers write DIR/pid-<r> and idle
    python tests/lifeline_worker.py train DIR PORT            # 2 gloo workers run fit() with a Checkpointer

``train`` prints the launcher's exception and exits with its ``exit_code`` when interrupted.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

import robustagg as ra
from robustagg.checkpoint import CheckpointStore
from robustagg.distributed import GatherReduction, ProcessGroupComm, destroy_group, init_group, spawn
from robustagg.errors import Interrupted
from robustagg.training import Checkpointer, Shard, Trainer, fit

#: Long enough for any test to kill the launcher, short enough that a leaked worker ends by itself.
LINGER_S = 300.0


def linger(rank: int, folder: str) -> None:
    """Write this worker's pid, then idle (a long loop the launcher's death must end)."""
    tmp = Path(folder) / f".pid-{rank}"
    tmp.write_text(str(os.getpid()))
    tmp.rename(Path(folder) / f"pid-{rank}")
    end = time.monotonic() + LINGER_S
    while time.monotonic() < end:
        time.sleep(0.2)


def tiny_trainer(comm, injector=None) -> Trainer:
    """A 1-parameter model whose every gradient is 1 (loss = w): cheap, deterministic."""
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    shards = {r: Shard(torch.ones(4, 1), torch.zeros(4, dtype=torch.long)) for r in comm.local_ranks}
    return Trainer(model, opt, GatherReduction(ra.Mean(), comm), shards, batch_size=4, num_classes=1,
                   loss_fn=lambda logits, y: logits.mean(), metrics=False, injector=injector)


def train(rank: int, folder: str, port: int) -> None:
    """Join a 2-rank gloo group and train 'forever' (100000 steps, ~20 ms each) with checkpoints
    only on request (every=0); rank 0 writes DIR/progress (steps done); each rank writes its pid
    and, when interrupted, the step it stopped at (DIR/stopped-<r>)."""
    torch.set_num_threads(1)
    root = Path(folder)
    (root / f"pid-{rank}").write_text(str(os.getpid()))
    init_group(backend="gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60),
               init_method=f"tcp://127.0.0.1:{port}")
    try:
        trainer = tiny_trainer(ProcessGroupComm(timeout_s=60.0))
        ckpt = Checkpointer(CheckpointStore(root / "ckpt"), every=0)

        def slow(t: Trainer, out) -> None:
            time.sleep(0.02)
            if rank == 0:
                (root / ".progress").write_text(str(t.step_id))
                (root / ".progress").replace(root / "progress")

        try:
            fit(trainer, steps=100000, callbacks=[slow], checkpointer=ckpt)
        except Interrupted as exc:
            (root / f"stopped-{rank}").write_text(json.dumps({"step": exc.step, "step_id": trainer.step_id}))
            raise
    finally:
        destroy_group()


def main(argv: list[str]) -> int:
    what, folder = argv[0], argv[1]
    if what == "linger":
        spawn(linger, 2, args=(folder,), start_method=argv[2])
        return 0
    try:
        spawn(train, 2, args=(folder, int(argv[2])), start_method="fork")
    except Interrupted as exc:
        print(str(exc), file=sys.stderr, flush=True)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

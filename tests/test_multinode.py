"""Multi-node: `torchrun --nnodes=2` on one machine, as two nodes on localhost, with the sharded reduction."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> Path:
    """One `torchrun --nnodes=2 --nproc-per-node=2` launch, two agents on localhost, read by both tests.

    No run directory is given: each node resolves its own time-stamped folder (the second node
    starts 1.2 s later, so its ``${now:...}`` second differs); rank 0 must decide the run directory
    and share it. Returns the working directory (``outputs/`` below it).
    """
    pytest.importorskip("torch.distributed.run")
    import time

    cwd = tmp_path_factory.mktemp("two_nodes")
    port = _free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}",
               "-m", "experiments.train", "threat.n=4", "threat.f=1", "threat.byzantine=1", "aggregator=trimmed_mean",
               "attack=sign_flip", "trainer.reduction=sharded", "trainer.steps=3", "trainer.eval_every=3",
               "trainer.checkpoint.every=1", "logger=none", "trainer.progress=false"]
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
        time.sleep(1.2)  # a different ${now:...} second on the second node
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return cwd


@pytest.mark.slow
def test_two_nodes_on_localhost(two_nodes):
    (run,) = {p.parent for p in (two_nodes / "outputs").rglob("summary.json")}
    s = json.loads((run / "summary.json").read_text())
    assert s["steps"] == 3 and s["n"] == 4 and s["mode"] == "processes" and s["byzantine_ranks"] == [3]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in recs] == ["test", "train", "train", "train", "test"]  # step 0, 1, 2, 3, 3
    assert all("agg/kappa_hat" in r for r in recs[1:4])


@pytest.mark.slow
def test_two_nodes_without_a_run_dir_write_one_run(two_nodes):
    """Issue 13, item 3: each node resolves its own time-stamped folder (the second node starts over a
    second later); rank 0 decides the run directory and shares it, so one run folder holds the run."""
    folders = sorted(p.parent for p in (two_nodes / "outputs").rglob(".hydra"))
    summaries = sorted(p.parent for p in (two_nodes / "outputs").rglob("summary.json"))
    assert len(summaries) == 1 and folders == summaries, folders
    (run,) = summaries
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
    assert (run / "checkpoints" / "step-00000003" / "manifest.json").is_file()
    # every rank's files of the last commit are in that one folder, the other node's included
    manifest = json.loads((run / "checkpoints" / "step-00000003" / "manifest.json").read_text())
    assert {f"rank-{r}.pt" for r in range(4)} <= set(manifest["files"]), sorted(manifest["files"])

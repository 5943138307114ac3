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


@pytest.mark.slow
def test_two_nodes_on_localhost(tmp_path):
    pytest.importorskip("torch.distributed.run")
    port = _free_port()
    run = tmp_path / "run"
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}",
               "-m", "experiments.train", "threat.n=4", "threat.f=1", "threat.byzantine=1", "aggregator=trimmed_mean",
               "attack=sign_flip", "trainer.reduction=sharded", "trainer.steps=3", "trainer.eval_every=3",
               "logger=none", "trainer.progress=false", f"hydra.run.dir={run}"]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    s = json.loads((run / "summary.json").read_text())
    assert s["steps"] == 3 and s["n"] == 4 and s["mode"] == "processes" and s["byzantine_ranks"] == [3]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in recs] == ["train", "train", "train", "test"]
    assert all("agg/kappa_hat" in r for r in recs[:3])


@pytest.mark.slow
def test_two_nodes_without_a_run_dir_write_one_run(tmp_path):
    """Issue 13, item 3: each node resolves its own time-stamped folder (the second node starts over a
    second later); rank 0 decides the run directory and shares it, so one run folder holds the run."""
    pytest.importorskip("torch.distributed.run")
    import time

    port = _free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
               "-m", "experiments.train", "threat.n=2", "threat.f=0", "aggregator=mean", "attack=none",
               "trainer.steps=4", "trainer.checkpoint.every=1", "trainer.eval_every=0", "logger=none",
               "trainer.progress=false"]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
        time.sleep(1.2)  # a different ${now:...} second on the second node
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    folders = sorted(p.parent for p in (tmp_path / "outputs").rglob(".hydra"))
    summaries = sorted(p.parent for p in (tmp_path / "outputs").rglob("summary.json"))
    assert len(summaries) == 1 and folders == summaries, folders
    (run,) = summaries
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    assert (run / "checkpoints" / "step-00000004" / "manifest.json").is_file()

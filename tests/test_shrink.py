"""Elastic shrink: continue without the lost workers only when the rule's requirement still holds.

A real 8-process run loses worker 5 to SIGKILL; with ``trainer.on_failure=shrink`` the launcher
restarts the 7 survivors from the last committed checkpoint, and every later step aggregates the
7 submissions into their mean (not their sum over the old 8). With Krum (n >= 2f + 3) at n = 5,
f = 1, losing a worker would leave n = 4: the run stops with the requirement's message.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.train import train
from experiments.wiring import validate
from robustagg.errors import AssumptionError, ConfigError
from robustagg.launch import WorkerContext, shrink_job

CONF = Path(__file__).resolve().parents[1] / "conf"
QUIET = ["logger=none", "trainer.progress=false", "trainer.eval_every=0", "trainer.param_check_every=0",
         "trainer.batch_size=16", "trainer.reduction=gather", "trainer.collective_timeout_s=30"]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*QUIET, *overrides])


class Recorder:
    """Test callback (built from the config in every worker): rank 0 logs what each step aggregated."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, trainer, out) -> None:
        if not trainer.is_main:
            return
        x, agg = out.reduced.matrix, out.reduced.aggregate
        n = x.shape[0]
        rec = {"step": out.step + 1, "world": trainer.comm.world_size, "rows": n,
               "is_mean": bool(torch.equal(agg, x.mean(dim=0))),
               "is_sum_over_8": bool(torch.allclose(agg, x.sum(dim=0) / 8))}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(rec) + "\n")


def test_shrink_from_8_to_7_continues_with_the_mean_over_the_survivors(tmp_path):
    log = tmp_path / "steps.jsonl"
    s = train(_cfg("threat.n=8", "threat.f=0", "aggregator=mean", "attack=none", "trainer.steps=6",
                   "trainer.checkpoint.every=2", "faults=[crash]", "faults.crash.rank=5", "faults.crash.step=4",
                   "trainer.on_failure=shrink", "trainer.max_restarts=1",
                   f"trainer.callbacks=[{{_target_: test_shrink.Recorder, path: '{log}'}}]"),
              out_dir=tmp_path / "run", quiet=True)
    assert (s["n"], s["n_initial"], s["workers"], s["steps"], s["restarts"]) == (7, 8, [0, 1, 2, 3, 4, 6, 7], 6, 1)
    restore_rec, shrink = s["lineage"]
    assert restore_rec["restored_from"] == 2 and restore_rec["world_size"] == 7
    assert (shrink["event"], shrink["old_n"], shrink["new_n"], shrink["step"], shrink["lost_workers"]) == (
        "shrink", 8, 7, 2, [5])
    assert shrink["shards"] == "drop" and shrink["effective_batch"] == [8 * 16, 7 * 16]  # n x b
    assert "fail-stop detected at step 4" in shrink["reason"]
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    before = [r for r in recs if r["world"] == 8]
    after = [r for r in recs if r["world"] == 7]
    assert [r["step"] for r in before] == [1, 2, 3] and [r["step"] for r in after] == [3, 4, 5, 6]
    assert all(r["rows"] == 8 and r["is_mean"] for r in before)
    # after the shrink: 7 rows, aggregate == their mean, which is not their sum divided by the old n
    assert all(r["rows"] == 7 and r["is_mean"] and not r["is_sum_over_8"] for r in after)


def test_shrink_that_breaks_the_requirement_stops_with_its_message(tmp_path):
    with pytest.raises(AssumptionError, match=r"Krum requires n >= 2f \+ 3 \(Blanchard et al., NeurIPS 2017\); "
                                              r"got n=4, f=1\..*Cannot shrink from n=5 to the n=4 surviving"):
        train(_cfg("threat.n=5", "threat.f=1", "aggregator=krum", "attack=none", "trainer.steps=4",
                   "faults=[crash]", "faults.crash.rank=4", "faults.crash.step=2", "trainer.on_failure=shrink",
                   "trainer.max_restarts=1"), out_dir=tmp_path, quiet=True)
    (rec,) = [json.loads(x) for x in (tmp_path / "checkpoints" / "lineage.jsonl").read_text().splitlines()]
    assert rec["event"] == "shrink_refused" and rec["lost_workers"] == [4] and "Krum requires" in rec["reason"]
    assert not (tmp_path / "summary.json").exists()


def _sizes(job, data):
    """Examples each current rank trains on, as the workers build them (``WorkerContext.shard``)."""
    ctx = WorkerContext(job=job, rank=0, local_ranks=tuple(range(job.n)), device=torch.device("cpu"))
    return [len(ctx.shard(r, data.shard)) for r in range(job.n)]


def test_shrink_job_drops_or_redistributes_the_lost_shard_and_keeps_roles():
    base = ["threat.n=8", "threat.f=2", "aggregator=trimmed_mean", "attack=sign_flip", "data=synthetic",
            "trainer.steps=1"]
    plan = validate(_cfg(*base))
    sizes = plan.data.sizes()
    assert plan.byzantine_ranks == (6, 7)
    dropped, rec = shrink_job(plan.job(), [6], reason="test")
    assert dropped.n == 7 and dropped.identities == (0, 1, 2, 3, 4, 5, 7) and dropped.byzantine_ranks == (6,)
    assert _sizes(dropped, plan.data) == sizes[:6] + sizes[7:] and rec["shard_sizes"] == _sizes(dropped, plan.data)
    assert dropped.byzantine_ids == (7,) and dropped.fingerprint == plan.job().fingerprint  # the original experiment
    plan2 = validate(_cfg(*base, "trainer.shrink_shards=redistribute"))
    spread, rec2 = shrink_job(plan2.job(), [2])
    # worker 2's examples are dealt round-robin to the 7 survivors: nothing is lost
    got = _sizes(spread, plan2.data)
    assert sum(got) == sum(sizes) and rec2["shards"] == "redistribute" and rec2["shard_sizes"] == got
    assert all(a >= b for a, b in zip(got, sizes[:2] + sizes[3:]))
    # a second shrink passes on what the lost survivor had received
    again, rec3 = shrink_job(spread, [3])
    assert sum(_sizes(again, plan2.data)) == sum(sizes) == sum(rec3["shard_sizes"])
    # trimmed mean with f = 2 needs n >= 2f + 1 = 5: losing 4 of 8 leaves 4, refused
    with pytest.raises(AssumptionError, match=r"got n=4, f=2"):
        shrink_job(plan.job(), [0, 1, 2, 3])
    with pytest.raises(ConfigError, match="no honest worker is left"):
        shrink_job(validate(_cfg("threat.n=3", "threat.f=1", "threat.byzantine=1", "aggregator=mean", "strict=false",
                                 "attack=sign_flip", "data=synthetic", "trainer.steps=1")).job(), [0, 1])


def test_one_process_per_worker_spelt_out_stays_so_after_a_shrink():
    # trainer.processes=n is one process per worker; the shrunk job of n-1 workers must not carry
    # processes=n (more processes than workers, refused by Job)
    plan = validate(_cfg("threat.n=6", "threat.f=1", "aggregator=trimmed_mean", "attack=sign_flip", "data=synthetic",
                         "trainer.steps=1", "trainer.processes=6"))
    shrunk, _ = shrink_job(plan.job(), [2])
    assert shrunk.n == 5 and shrunk.processes() == 5 and shrunk.hosts() is None

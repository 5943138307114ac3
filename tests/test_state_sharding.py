"""Sharded optimizer state (issue 31): each rank owns its slice's optimizer state.

Real gloo process groups: the parameters of a ``trainer.state_sharding=optimizer`` run are
bit-identical to the unsharded run's (SGD with momentum, Adam, AdamW; coordinate-wise and
distance-based rules), rank 0 holds about 1/world of the optimizer state, and a SIGKILL with a
shrink re-slices the committed shards onto the survivors and trains on bit-equal to the unsharded
run under the same fault. The re-slicing rule itself is checked on hand-made shards.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.train import train
from robustagg.errors import CheckpointError, ConfigError
from robustagg.training.state_sharding import state_for

CONF = Path(__file__).resolve().parents[1] / "conf"
QUIET = ["logger=none", "trainer.progress=false", "trainer.eval_every=0", "trainer.param_check_every=2",
         "trainer.batch_size=16", "trainer.steps=6", "attack=none", "trainer.collective_timeout_s=30",
         "threat.n=4", "threat.f=0", "trainer.mode=processes", "trainer.reduction=sharded"]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*QUIET, *overrides])


def _run(tmp_path, name, *overrides):
    out = tmp_path / name
    s = train(_cfg(*overrides), out_dir=out, quiet=True)
    return s, hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


# --- the re-slicing rule on hand-made shards ------------------------------------------------------
def _shard(param, lo, hi, values, step=3.0):
    return {"pieces": [{"param": param, "lo": lo, "hi": hi,
                        "state": {"exp_avg": torch.tensor(values), "step": torch.tensor(step)}}]}


def test_a_new_slice_is_cut_from_the_shards_that_overlap_it():
    shards = [_shard(0, 0, 3, [0.0, 1.0, 2.0]), _shard(0, 3, 5, [3.0, 4.0]), _shard(1, 0, 2, [9.0, 9.0])]
    st = state_for(shards, 0, 2, 5, torch.zeros(5))
    assert st["exp_avg"].tolist() == [2.0, 3.0, 4.0] and float(st["step"]) == 3.0
    assert state_for(shards, 1, 1, 2, torch.zeros(2))["exp_avg"].tolist() == [9.0]


def test_a_range_no_shard_holds_or_disagreeing_shards_are_refused():
    with pytest.raises(CheckpointError, match=r"no optimizer-state shard holds coordinates \[3, 5\) of parameter 0"):
        state_for([_shard(0, 0, 3, [0.0, 1.0, 2.0])], 0, 0, 5, torch.zeros(5))
    with pytest.raises(CheckpointError, match="disagree on 'step'"):
        state_for([_shard(0, 0, 3, [0.0, 1.0, 2.0]), _shard(0, 3, 5, [3.0, 4.0], step=2.0)], 0, 0, 5, torch.zeros(5))


# --- real process groups ---------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer,rule", [
    (["optimizer=sgd", "optimizer.momentum=0.9", "optimizer.weight_decay=1e-4"], "trimmed_mean"),
    (["optimizer=adam"], "krum"),
    (["optimizer=adamw", "optimizer.weight_decay=0.01"], "geometric_median"),
])
def test_sharded_state_trains_bit_identical_to_the_unsharded_run(tmp_path, optimizer, rule):
    _, ref = _run(tmp_path, "whole", *optimizer, f"aggregator={rule}")
    s, sharded = _run(tmp_path, "sharded", *optimizer, f"aggregator={rule}", "trainer.state_sharding=optimizer")
    assert sharded == ref
    st = s["state_sharding"]
    assert st["mode"] == "optimizer" and st["coordinates"] == -(-st["d"] // 4)  # rank 0's slice: ceil(d / 4)
    # rank 0 holds its slice's state: 1/4 of the unsharded bytes, plus a few per-parameter scalars
    assert 0.2 < st["optimizer_state_bytes"] / st["optimizer_state_bytes_unsharded"] < 0.3


def test_a_sigkill_and_shrink_re_slice_the_committed_shards_and_train_on_bit_equal(tmp_path):
    fault = ["optimizer=adam", "aggregator=coordinate_median", "trainer.checkpoint.every=2", "faults=[crash]",
             "faults.crash.rank=2", "faults.crash.step=4", "trainer.on_failure=shrink", "trainer.max_restarts=1"]
    whole, ref = _run(tmp_path, "whole", *fault)
    s, sharded = _run(tmp_path, "sharded", *fault, "trainer.state_sharding=optimizer")
    assert (s["workers"], s["restarts"], s["steps"]) == ([0, 1, 3], 1, 6) == (whole["workers"], whole["restarts"],
                                                                                 whole["steps"])
    assert sharded == ref  # the 4-way shards of step 2, re-sliced 3 ways, continue as the whole state does


@pytest.mark.parametrize("overrides,message", [
    (["trainer.mode=simulated"], r"state_sharding=optimizer .* needs trainer.mode=processes .* got trainer.mode=simulated"),
    (["trainer.reduction=gather"], r"got trainer.reduction=gather"),
    (["trainer.processes=2"], r"one worker per process .* got trainer.processes=2"),
    (["protocol=async", "protocol.min_arrivals=2"], r"protocol=async needs every member's full row"),
])
def test_state_sharding_outside_its_needs_is_refused(tmp_path, overrides, message):
    with pytest.raises(Exception, match=message):
        train(_cfg("trainer.state_sharding=optimizer", *overrides), out_dir=tmp_path / "run", quiet=True)


def test_an_optimizer_that_is_not_elementwise_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"needs an optimizer that updates each coordinate .* got optimizer._target_=torch.optim.LBFGS"):
        train(_cfg("trainer.state_sharding=optimizer", "optimizer._target_=torch.optim.LBFGS", "~optimizer.momentum",
                   "~optimizer.weight_decay", "~optimizer.nesterov"), out_dir=tmp_path / "run", quiet=True)


def test_a_world_4_commit_resumes_re_sliced_at_world_3_as_the_unsharded_state_does(tmp_path):
    models = {}
    for mode in ("none", "optimizer"):
        first = ["optimizer=adam", "aggregator=coordinate_median", "trainer.checkpoint.every=2", "trainer.steps=4",
                 f"trainer.state_sharding={mode}"]
        _run(tmp_path, f"{mode}-4", *first)
        ck = sorted((tmp_path / f"{mode}-4" / "checkpoints").glob("step-*"))[-1]
        s, models[mode] = _run(tmp_path, f"{mode}-3", *first[:-2], "trainer.steps=6", "threat.n=3",
                               f"trainer.resume={ck}", "trainer.resume_changes=allow", f"trainer.state_sharding={mode}")
        assert (s["n"], s["steps"], s["resumed_from"]) == (3, 6, 4)
    assert models["optimizer"] == models["none"]


def test_the_memory_and_identity_quoted_on_the_docs_page_are_the_committed_benchmark():
    import pandas as pd

    root = Path(__file__).resolve().parents[1]
    t = pd.read_csv(root / "docs" / "results" / "state_sharding.csv")
    page = (root / "docs" / "state-sharding.md").read_text()
    assert t["identical"].all() and set(t["world"]) == {4, 8} and (t["steps"] == 20).all()
    assert f"ResNet-20 ({t['d'].iloc[0]:,} parameters)" in page
    for world in (4, 8):
        row = t[(t["world"] == world) & (t["mode"] == "optimizer")].iloc[0]
        assert f"{row['optimizer_state_bytes']:,} bytes" in page and f"({row['fraction']:.3f})" in page
        assert abs(row["fraction"] - 1 / world) < 0.001  # the per-parameter step counters are all it adds
    assert f"{t['unsharded_bytes'].iloc[0]:,} unsharded" in page


@pytest.mark.parametrize("world", [5, 6])
def test_a_world_4_commit_resumes_re_sliced_in_a_larger_group_whose_new_workers_start_fresh(tmp_path, world):
    models = {}
    first = ["optimizer=adam", "aggregator=coordinate_median", "trainer.checkpoint.every=2", "trainer.steps=2"]
    for mode in ("none", "optimizer"):
        _run(tmp_path, f"{mode}-4", *first, f"trainer.state_sharding={mode}")
        ck = tmp_path / f"{mode}-4" / "checkpoints" / "step-00000002"
        s, models[mode] = _run(tmp_path, f"{mode}-{world}", *first[:-1], "trainer.steps=4", f"threat.n={world}",
                               f"trainer.resume={ck}", "trainer.resume_changes=allow", f"trainer.state_sharding={mode}")
        assert (s["n"], s["steps"], s["resumed_from"]) == (world, 4, 2)
        new = [r for r in s["lineage"] if r["event"] == "new_workers"]
        assert [r["workers"] for r in new] == [list(range(4, world))] and new[0]["own_state"].startswith("fresh")
    assert models["optimizer"] == models["none"]  # the 4 shards re-sliced `world` ways: the whole state's bits


def test_a_missing_own_file_of_a_worker_the_checkpoint_had_is_never_started_fresh(tmp_path):
    first = ["optimizer=adam", "aggregator=coordinate_median", "trainer.checkpoint.every=2", "trainer.steps=2"]
    _run(tmp_path, "four", *first)
    ck = tmp_path / "four" / "checkpoints" / "step-00000002"
    hosts = __import__("json").loads((ck / "manifest.json").read_text())["hosts"]
    assert hosts["rank-3.pt"] == [3]
    (ck / "rank-3.pt").unlink()  # worker 3 was in the commit: its state cannot be made up
    with pytest.raises(ConfigError, match="does not verify"):
        train(_cfg(*first[:-1], "trainer.steps=4", "threat.n=5", f"trainer.resume={ck}",
                   "trainer.resume_changes=allow"), out_dir=tmp_path / "five", quiet=True)


def test_a_replacement_rejoins_a_sharded_group_bit_equal_to_the_unsharded_rejoin(tmp_path):
    # worker 5 SIGKILLed in step 4: the five restore step 2 (re-sliced 5 ways) and go on; its replacement
    # is admitted after step 6 and every member cuts its new slice (6 ways) out of the five shards
    heal = ["threat.n=6", "optimizer=adam", "aggregator=coordinate_median", "trainer.steps=10",
            "trainer.checkpoint.every=2", "trainer.worker_momentum=0.5", "faults=[rejoin]", "faults.rejoin.rank=5",
            "faults.rejoin.step=4", "faults.rejoin.seconds=0.2", "faults.rejoin.join_step=6",
            "trainer.on_failure=shrink", "trainer.rejoin=true", "trainer.max_restarts=1"]
    whole, ref = _run(tmp_path, "whole", *heal)
    s, sharded = _run(tmp_path, "sharded", *heal, "trainer.state_sharding=optimizer")
    grow = next(r for r in s["lineage"] if r["event"] == "grow")
    assert grow["step"] == 6 and grow["sources"]["optimizer_state"].endswith("re-sliced into 6")
    assert s["workers"] == whole["workers"] == [0, 1, 2, 3, 4, 5] and sharded == ref

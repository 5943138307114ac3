"""A lost rank's optimizer-state shard rebuilt from a redundant copy or a parity (issue 31).

The reconstruction rule on real :class:`OptimizerShard` objects (Adam, four slices, steps taken
with the same aggregates as the owners'): a copy and a parity give the lost shard back byte for
byte; what each cannot cover (every holder lost, two slices of one group, the parity's holder
lost) is refused with the reason; a corrupted copy is caught by the copies' comparison, a
corrupted shard under parity is not. Then real gloo processes with a real SIGKILL: the survivors'
snapshots become a commit of the failure's step, nothing is replayed, the rebuilt shard equals
the one the dead rank held (from an uninterrupted run's commit), and the run ends bit-equal to
its ``trainer.membership`` reference.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments.train import train
from robustagg.checkpoint import CheckpointStore
from robustagg.distributed.sharded import shard_bounds
from robustagg.errors import ConfigError
from robustagg.training.shard_protection import (check_protection, copy_holders, held_slices, parity_groups,
                                                 parity_holder)
from robustagg.training.shard_recovery import plan_recovery
from robustagg.training.state_sharding import OptimizerShard, shard_bytes

CONF = Path(__file__).resolve().parents[1] / "conf"
WORLD = 4


# --- the layout: who holds what ---------------------------------------------------------------------
def test_copy_holders_and_parity_groups_are_as_stated():
    assert copy_holders(3, 4, 2) == [3, 0] and held_slices(0, 4, 2) == [3] and held_slices(1, 4, 3) == [0, 3]
    assert parity_groups(5, 2) == [[0, 1], [2, 3], [4]]
    assert [parity_holder(j, 5, 2) for j in range(3)] == [2, 4, 0]  # each outside its own group
    assert [parity_holder(j, 4, 3) for j in range(2)] == [3, 0]


@pytest.mark.parametrize("world,k,g,message", [
    (4, 5, 0, r"shard_redundancy=5: .* use 1 <= k <= 4"),
    (4, 1, 4, r"shard_parity=4: .* at least two groups .* use 2 <= g <= 3"),
    (4, 1, 1, r"shard_parity=1"),
    (2, 1, 2, r"shard_parity=2: .* with 2 ranks use 0 \(off\): a parity needs 3 or more ranks"),
    (4, 2, 2, r"two sources for the same lost shard"),
])
def test_a_protection_the_world_cannot_carry_is_refused(world, k, g, message):
    with pytest.raises(ConfigError, match=message):
        check_protection(world, k, g)


# --- the reconstruction rule on real shards ------------------------------------------------------------
def _shards(steps: int = 3):
    """Four Adam shards of a small model after ``steps`` steps of the same aggregates, and the
    copies each rank would hold (k = 2) and every group's parity (g = 2)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=0.01)
    d = sum(p.numel() for p in params)
    bounds = shard_bounds(d, WORLD)
    own = [OptimizerShard(opt, params, bounds, r) for r in range(WORLD)]
    copies = {r: {s: OptimizerShard(opt, params, bounds, s) for s in held_slices(r, WORLD, 2)} for r in range(WORLD)}
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        agg = torch.randn(d, generator=gen)
        for sh in [*own, *(c for cs in copies.values() for c in cs.values())]:
            sh.local_step(agg)
    exports = [sh.export() for sh in own]
    parity = {}
    for j, group in enumerate(parity_groups(WORLD, 2)):
        data = [shard_bytes(exports[s]) for s in group]
        buf = torch.zeros(max(b.numel() for b in data), dtype=torch.uint8)
        for b in data:
            buf[:b.numel()] ^= b
        parity[j] = buf
    return params, bounds, exports, copies, parity


def _payloads(params, bounds, exports, copies, parity, *, k, g, step=3):
    out = {}
    for r in range(WORLD):
        held_copies = {s: c.export() for s, c in copies[r].items()} if k > 1 else {}
        held_parity = {j: p for j, p in parity.items() if parity_holder(j, WORLD, 2) == r} if g else {}
        snap = {"step": step, "state": {"replicated": {"step": step}, "local": {"optimizer_shard": exports[r]}},
                "copies": held_copies, "parity": held_parity}
        out[r] = {"rank": r, "world": WORLD, "bounds": [list(b) for b in bounds], "k": k, "g": g, "meta": {},
                  "param_sizes": [p.numel() for p in params], "param_groups": [0] * len(params), "snapshots": [snap]}
    return out


def _same(a, b):
    assert [(p["param"], p["lo"], p["hi"]) for p in a["pieces"]] == [(p["param"], p["lo"], p["hi"]) for p in b["pieces"]]
    assert torch.equal(shard_bytes(a), shard_bytes(b))
    for pa, pb in zip(a["pieces"], b["pieces"]):
        assert sorted(pa["state"]) == sorted(pb["state"]) == ["exp_avg", "exp_avg_sq", "step"]
        for key in pa["state"]:
            assert pa["state"][key].dtype == pb["state"][key].dtype and torch.equal(pa["state"][key], pb["state"][key])


@pytest.mark.parametrize("k,g,source", [(2, 0, "the redundant copy on rank 3"),
                                        (1, 2, "the parity of group 1 on rank 0 XOR slices [3]")])
def test_a_lost_shard_is_rebuilt_byte_for_byte(k, g, source):
    params, bounds, exports, copies, parity = _shards()
    parts = _payloads(params, bounds, exports, copies, parity, k=k, g=g)
    del parts[2]  # rank 2 died: its memory is gone
    T, rebuilt, problems = plan_recovery(parts, [2], WORLD, k, g)
    assert problems == [] and T == 3 and list(rebuilt) == [2]
    shard, src, read = rebuilt[2]
    assert src == source and read > 0
    _same(shard, exports[2])
    # the copy stepped on its holder: the same bytes the owner's own steps gave, not merely close
    assert shard["start"] == bounds[2][0] and shard["end"] == bounds[2][1]


@pytest.mark.parametrize("k,g,lost,reason", [
    (2, 0, [1, 2], r"slice 1: all 2 holders \[1, 2\] are lost"),
    (1, 2, [2, 3], r"slice 2: parity group 1 \[2, 3\] lost \[2, 3\], one parity reconstructs one slice per group"),
    (1, 2, [0, 2], r"slice 2: the parity of group 1 was on rank 0, which is lost too"),
])
def test_a_loss_beyond_what_the_source_covers_is_refused_with_the_reason(k, g, lost, reason):
    params, bounds, exports, copies, parity = _shards()
    parts = _payloads(params, bounds, exports, copies, parity, k=k, g=g)
    for r in lost:
        del parts[r]
    _, _, problems = plan_recovery(parts, lost, WORLD, k, g)
    assert any(__import__("re").search(reason, p) for p in problems), problems


def test_a_survivor_without_a_rescue_file_or_without_a_common_step_is_refused():
    params, bounds, exports, copies, parity = _shards()
    parts = _payloads(params, bounds, exports, copies, parity, k=2, g=0)
    del parts[2], parts[1]
    assert "survivor rank(s) [1] left no rescue state" in plan_recovery(parts, [2], WORLD, 2, 0)[2][0]
    parts = _payloads(params, bounds, exports, copies, parity, k=2, g=0)
    parts[0]["snapshots"][0]["step"] = 5  # two steps ahead of the others: impossible in a real group
    assert "share no step" in plan_recovery(parts, [2], WORLD, 2, 0)[2][0]


def test_a_corrupted_copy_is_caught_by_the_copies_comparison_but_parity_alone_cannot_see_it():
    params, bounds, exports, copies, parity = _shards()
    # a wrong value that passes every byte check: slice 3's moment on its owner, off by one ulp
    bad = {**exports[3], "pieces": [{**p, "state": dict(p["state"])} for p in exports[3]["pieces"]]}
    m = bad["pieces"][0]["state"]["exp_avg"].clone()
    m[0] = torch.nextafter(m[0], torch.tensor(1.0))
    bad["pieces"][0]["state"]["exp_avg"] = m
    corrupted = [*exports[:3], bad]
    # copies (k = 2): rank 0 holds a copy of slice 3, and it disagrees with the owner's
    parts = _payloads(params, bounds, corrupted, copies, parity, k=2, g=0)
    del parts[2]
    _, _, problems = plan_recovery(parts, [2], WORLD, 2, 0)
    assert any("slice 3: its copies on ranks [0, 3] disagree byte for byte" in p for p in problems), problems
    # parity (g = 2): the corrupted slice 3 XOR-ed into group 1's parity gives a wrong slice 2, silently
    parts = _payloads(params, bounds, corrupted, copies, parity, k=1, g=2)
    del parts[2]
    _, rebuilt, problems = plan_recovery(parts, [2], WORLD, 1, 2)
    assert problems == [] and not torch.equal(shard_bytes(rebuilt[2][0]), shard_bytes(exports[2]))


@pytest.mark.parametrize("spoil,reason", [
    (lambda parts: b"not a torch file", r"rank-1.pt"),
    (lambda parts: {**parts[1], "world": "four"}, r"rank-1.pt: not a rescue payload"),
    (lambda parts: {**parts[1], "rank": 3}, r"rank-1.pt: says it is rank 3"),
    (lambda parts: {**parts[1], "meta": {"run_id": "other"}}, r"rank-1.pt: written by run 'other', not this run"),
    (lambda parts: {**parts[1], "bounds": [[0, 1]] * WORLD}, r"disagree on the slicing or the settings"),
    (lambda parts: {**parts[1], "snapshots": [{"step": 3, "state": {"replicated": {"step": 3}}, "copies": {},
                                                "parity": {}}]},
     r"the rescue files do not fit together \(KeyError"),
    (lambda parts: {**parts[1], "snapshots": [{**parts[1]["snapshots"][0], "step": 4}]}, r"whose step is not its state's"),
    (lambda parts: {**parts[1], "world": 10**6, "bounds": [[0, 1]] * 10**6}, r"claims a world of 1000000, the failed "
                                                                            r"group had 4"),
    # the lost slice's only surviving copy (k = 2) is another slice's shard: nothing to compare it with,
    # but it is not slice 2's
    (lambda parts: parts[1], r"rank 3's shard of slice 2 is not that slice's \(coordinates"),
])
def test_a_malformed_or_foreign_rescue_file_falls_back_and_commits_nothing(tmp_path, spoil, reason):
    from robustagg.checkpoint import atomic_write_bytes, save_state
    from robustagg.training.shard_recovery import recover, rescue_folder

    params, bounds, exports, copies, parity = _shards()
    parts = _payloads(params, bounds, exports, copies, parity, k=2, g=0)
    folder = rescue_folder(tmp_path, 0)
    folder.mkdir(parents=True)
    for r in (0, 1, 3):
        parts[r]["meta"] = {"run_id": "run"}
    for r in (0, 3):
        save_state(folder / f"rank-{r}.pt", parts[r])
    bad = spoil(parts)
    if isinstance(bad, bytes):
        atomic_write_bytes(folder / "rank-1.pt", bad)
    else:
        save_state(folder / "rank-1.pt", bad)
    if "slice 2 is not" in reason:  # rank 3 hands over its own shard as its copy of slice 2
        parts[3]["snapshots"][0]["copies"] = {2: exports[3]}
        save_state(folder / "rank-3.pt", parts[3])
    rec = recover(tmp_path, 0, [2], run_id="run", world=WORLD)
    assert rec["event"] == "shard_recovery" and any(__import__("re").search(reason, f) for f in rec["fallback"]), rec
    assert not list(tmp_path.glob("step-*")) and not folder.exists()


# --- real processes, a real SIGKILL ------------------------------------------------------------------
QUIET = ["logger=none", "trainer.progress=false", "trainer.eval_every=0", "trainer.param_check_every=2",
         "trainer.batch_size=16", "trainer.steps=6", "attack=none", "trainer.collective_timeout_s=30",
         "threat.n=4", "threat.f=0", "trainer.reduction=sharded", "optimizer=adam", "aggregator=coordinate_median"]
FAULT = ["trainer.mode=processes", "trainer.state_sharding=optimizer", "trainer.checkpoint.every=2", "faults=[crash]",
         "faults.crash.rank=2", "faults.crash.step=4", "trainer.on_failure=shrink", "trainer.max_restarts=1"]
#: worker 2 computed steps 1-3 (it is killed at the start of step 4); steps 4-6 run without it
REFERENCE = ["trainer.mode=simulated", "trainer.membership=[{workers: [2], absent: [4, 7]}]"]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*QUIET, *overrides])


def _model(out: Path) -> str:
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("source,setting", [("copy", "trainer.shard_redundancy=2"), ("parity", "trainer.shard_parity=2")])
def test_a_sigkilled_ranks_shard_is_rebuilt_and_the_run_goes_on_without_replay(tmp_path, source, setting):
    s = train(_cfg(*FAULT, setting), out_dir=tmp_path / "real", quiet=True)
    assert (s["workers"], s["restarts"], s["steps"], s["resumed_from"]) == ([0, 1, 3], 1, 6, 3)
    rec = next(r for r in s["lineage"] if r["event"] == "shard_recovery")
    assert (rec["step"], rec["steps_recomputed"], rec["written"], rec["source"]) == (3, 0, "step-00000003", source)
    restore = [r for r in s["lineage"] if r["event"] == "restore"][-1]
    assert restore["restored_from"] == 3 and restore["steps_replayed"] == []  # the last commit was step 2
    shrink = next(r for r in s["lineage"] if r["event"] == "shrink")
    assert shrink["state_from"].startswith("rebuilt at step 3: slice 2 from ")
    # the rebuilt shard is the one rank 2 held: an uninterrupted run's commit of step 3 says so
    whole = tmp_path / "whole"
    train(_cfg(*FAULT[:2], "trainer.checkpoint.every=3", "trainer.steps=3"), out_dir=whole, quiet=True)
    truth = CheckpointStore(whole / "checkpoints").open(whole / "checkpoints" / "step-00000003").load("rank-2.pt")
    ck = CheckpointStore(tmp_path / "real" / "checkpoints").open(tmp_path / "real" / "checkpoints" / "step-00000003")
    assert ck.manifest["reconstructed"]["shard-2.pt"]["slice"] == 2
    assert torch.equal(shard_bytes(ck.load("shard-2.pt")["optimizer_shard"]), shard_bytes(truth["optimizer_shard"]))
    # and the run that went on is the reference schedule's, bit for bit
    train(_cfg(*REFERENCE), out_dir=tmp_path / "ref", quiet=True)
    assert _model(tmp_path / "real") == _model(tmp_path / "ref")
    assert not (tmp_path / "real" / "checkpoints" / "rescue" / "attempt-0").exists()  # used, then removed


def test_without_a_second_source_the_shrink_replays_from_the_last_commit(tmp_path):
    s = train(_cfg(*FAULT), out_dir=tmp_path / "plain", quiet=True)
    restore = [r for r in s["lineage"] if r["event"] == "restore"][-1]
    assert restore["restored_from"] == 2 and restore["steps_replayed"] == [3, 3]
    assert not any(r["event"] == "shard_recovery" for r in s["lineage"])


def test_two_lost_slices_of_one_parity_group_fall_back_to_the_last_commit_with_the_reason(tmp_path):
    # n = 5, g = 2: groups {0, 1}, {2, 3}, {4}; workers 2 and 3 are killed together at the start of step 4
    two = ["threat.n=5", *FAULT, "faults=[crash,crash_between]", "faults.crash_between.rank=3",
           "faults.crash_between.step=4", "faults.crash_between.where=before_step"]
    s = train(_cfg(*two, "trainer.shard_parity=2"), out_dir=tmp_path / "parity", quiet=True)
    rec = next(r for r in s["lineage"] if r["event"] == "shard_recovery")
    assert rec["fallback"] == [f"slice {k}: parity group 1 [2, 3] lost [2, 3], one parity reconstructs one slice per "
                               "group" for k in (2, 3)]
    restore = [r for r in s["lineage"] if r["event"] == "restore"][-1]
    assert (s["workers"], restore["restored_from"], restore["steps_replayed"]) == ([0, 1, 4], 2, [3, 3])
    shrink = next(r for r in s["lineage"] if r["event"] == "shrink")
    assert shrink["state_from"].startswith("disk: the newest committed checkpoint (shard reconstruction refused: ")
    # what the run then does is exactly what it does without a parity
    train(_cfg(*two), out_dir=tmp_path / "plain", quiet=True)
    assert _model(tmp_path / "parity") == _model(tmp_path / "plain")


@pytest.mark.parametrize("overrides,message", [
    (["trainer.shard_redundancy=2"], r"trainer.shard_redundancy=2 keeps a second source .* needs "
                                     r"trainer.state_sharding=optimizer and trainer.on_failure=shrink"),
    ([*FAULT, "trainer.shard_redundancy=5"], r"trainer.shard_redundancy=5: each slice's state is held by k of the 4"),
    ([*FAULT, "trainer.shard_parity=4"], r"trainer.shard_parity=4: .* at least two groups"),
    ([*FAULT, "trainer.shard_parity=1"], r"trainer.shard_parity=1: a parity group of g >= 2 slices"),
    ([*FAULT, "trainer.shard_parity=2", "trainer.shard_redundancy=2"], r"choose one"),
])
def test_a_shard_protection_outside_its_needs_is_refused_before_any_process_starts(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        train(_cfg("trainer.mode=processes", *overrides), out_dir=tmp_path / "run", quiet=True)
    assert not (tmp_path / "run" / "checkpoints").exists()


# --- the docs quote the committed benchmark ---------------------------------------------------------------
def test_the_tables_and_figures_on_the_docs_page_are_the_committed_benchmark():
    import pandas as pd

    from experiments.bench_recovery import shard_tables

    root = Path(__file__).resolve().parents[1]
    folder = root / "docs" / "results" / "shard_recovery"
    page = (root / "docs" / "state-sharding.md").read_text()
    recovery, memory = shard_tables(folder)
    assert recovery in page and memory in page
    med = pd.read_csv(folder / "recovery_median.csv").set_index("case")
    # what the prose says of them
    assert list(med.loc[["shard_copy", "shard_parity"], "steps_lost"]) == [0, 0]
    assert med.loc["shard_checkpoint", "steps_lost"] == 2 and med.loc["shard_checkpoint", "committed_step"] == 10
    assert med.loc["shard_parity", "rebuild_bytes"] > 1.9 * med.loc["shard_copy", "rebuild_bytes"]
    steps = ", ".join(f"{med.loc[f'unfaulted-shard_{k}', 'step_ms']:.1f}" for k in ("checkpoint", "copy")) + \
        f" and {med.loc['unfaulted-shard_parity', 'step_ms']:.1f} ms a step"
    assert steps in " ".join(page.split())
    mem = pd.read_csv(folder / "memory.csv")
    w8 = mem[mem["world"] == 8].set_index("state")
    assert w8.loc["sharded + parity (g=4)", "held_bytes_all_ranks"] * 4 <= w8.loc["sharded + copy (k=2)",
                                                                                  "held_bytes_all_ranks"] * 1.001

"""The protocol seam: dsgd is today's trainer bit for bit; workers can share processes; the
partial-participation gather carries only the members' rows."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

import robustagg as ra
from experiments.train import train
from experiments.tour import tour
from platform_bits import platform as bits_platform
from robustagg.distributed import GatherReduction, LocalComm
from robustagg.distributed.comm import block_hosts
from robustagg.errors import ShapeError

CONF = Path(__file__).resolve().parents[1] / "conf"
QUIET = ["logger=none", "trainer.progress=false"]

# sha256 (first 16 hex digits) of model.safetensors of every `make run` cell after 8 steps of 16
# examples, computed with the trainer before the protocol seam existed (commit 2548d00, torch
# 2.13 CPU, one thread): protocol=dsgd must keep every one bit for bit. The bits depend on the
# processor's kernels (torch's CPU capability and MKL's code path for the vendor), so the pins are
# kept per platform: the AMD EPYC (Zen 3, AVX2) machine they were first computed on, and the Intel
# Xeon (AVX-512) machine of 2026-12-01, where they were computed at commit f1b0ad8 (whose cells
# equal the AMD pins on AMD). Forcing AVX2 kernels on the Intel machine (ATEN_CPU_CAPABILITY,
# MKL_CBWR, MKL_ENABLE_INSTRUCTIONS) does not reproduce the AMD bits, so one table cannot serve both.
# The AMD EPYC with AVX-512 of 2026-12-02 gives a third table (computed at f1b0ad8 and at cbc5905,
# equal; only mean/gaussian equals the AVX2 machine's pin).
PINNED_BY_PLATFORM = {
    ("AuthenticAMD", "AVX2"): {
        "mean/none": "61b6af6c4d250bc9", "mean/gaussian": "edab5c9c6ff76b41", "mean/alie": "f37ab8a6289c96c6",
        "trimmed_mean/none": "bb9c2ff736c71d95", "trimmed_mean/gaussian": "188de0bcd68624ae",
        "trimmed_mean/alie": "e82326daccbb1a89"},
    ("GenuineIntel", "AVX512"): {
        "mean/none": "f9d8d8c27a0bd546", "mean/gaussian": "acf4132ec3b83fae", "mean/alie": "49789dca968df3ec",
        "trimmed_mean/none": "090664d2a03f1833", "trimmed_mean/gaussian": "f96640e30d34a565",
        "trimmed_mean/alie": "e32641e63fc94e8a"},
    ("AuthenticAMD", "AVX512"): {
        "mean/none": "a90d49dda0d0c536", "mean/gaussian": "edab5c9c6ff76b41", "mean/alie": "0d979bb7e6bedf67",
        "trimmed_mean/none": "743c4e77d10fb1de", "trimmed_mean/gaussian": "3b7d12fd5c66f605",
        "trimmed_mean/alie": "f92b3fda38cec61f"},
}


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*QUIET, *overrides])


@pytest.mark.slow
def test_dsgd_keeps_the_make_run_cells_bit_for_bit(tmp_path):
    platform = bits_platform()
    if platform not in PINNED_BY_PLATFORM:
        pytest.skip(f"no pinned make-run cells for platform {platform}: compute them at a commit whose cells equal "
                    "a known platform's pins and add them to PINNED_BY_PLATFORM")
    rows = tour([f"out_dir={tmp_path}", "trainer.steps=8", "trainer.batch_size=16"], quiet=True)
    got = {f"{r['rule']}/{r['attack']}": hashlib.sha256((Path(r["run_dir"]) / "model.safetensors").read_bytes())
           .hexdigest()[:16] for r in rows}
    assert got == PINNED_BY_PLATFORM[platform]
    assert all(r.get("protocol", "dsgd") == "dsgd" for r in rows)


def test_block_hosts_places_contiguous_balanced_blocks():
    assert block_hosts(5, 2) == (0, 0, 0, 1, 1)
    assert block_hosts(100, 4) == tuple(p for p in range(4) for _ in range(25))
    assert block_hosts(3, 3) == (0, 1, 2)
    for bad in (0, 4, True, 1.5):
        with pytest.raises(ShapeError, match="processes"):
            block_hosts(3, bad)  # type: ignore[arg-type]


def test_a_member_subset_gathers_only_the_members_rows():
    comm = LocalComm(4)
    red = GatherReduction(ra.Mean(), comm)
    rows = {1: torch.tensor([1.0, 2.0]), 3: torch.tensor([3.0, 6.0])}
    out = red.reduce(rows, step=0, members=[1, 3])
    assert out.members == [1, 3] and out.kept == [1, 3] and out.matrix.shape == (2, 2)
    assert torch.equal(out.aggregate, torch.tensor([2.0, 4.0]))
    assert out.row_of(3) == 1
    with pytest.raises(ShapeError, match="hosted worker"):
        comm.all_gather({0: torch.zeros(2)}, members=[1, 3])
    with pytest.raises(ShapeError, match="ascending"):
        comm.all_gather({}, members=[3, 1], like=torch.zeros(2))


def test_a_transform_changes_what_the_rule_receives_and_is_recorded():
    red = GatherReduction(ra.Mean(), LocalComm(3))
    rows = {0: torch.tensor([1.0]), 1: torch.tensor([2.0]), 2: torch.tensor([9.0])}

    def first_two(x, ranks, sums):
        assert ranks == [0, 1, 2] and len(sums) == 3
        return x[:2], [10, 11]

    out = red.reduce(rows, step=0, transform=first_two)
    assert out.inputs == [10, 11] and torch.equal(out.aggregate, torch.tensor([1.5]))
    assert torch.equal(out.rule_rows(), torch.tensor([[1.0], [2.0]]))


@pytest.mark.slow
def test_workers_sharing_processes_train_bit_for_bit_like_simulated(tmp_path):
    # 5 workers on 2 processes (blocks 3 + 2), a stateful omniscient attack and worker momentum:
    # the padded variable-count gather must give every process the same rows as the simulated mode.
    common = ["threat.n=5", "threat.f=1", "aggregator=centered_clipping", "attack=mimic", "trainer.steps=5",
              "trainer.eval_every=0", "trainer.worker_momentum=0.9", "trainer.reduction=gather",
              "trainer.checkpoint.every=2"]
    a = train(_cfg(*common, "trainer.mode=simulated"), out_dir=tmp_path / "sim", quiet=True)
    b = train(_cfg(*common, "trainer.mode=processes", "trainer.processes=2"), out_dir=tmp_path / "proc", quiet=True)
    wa, wb = load_file(str(tmp_path / "sim" / "model.safetensors")), load_file(str(tmp_path / "proc" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a["mean_kappa_hat"] == b["mean_kappa_hat"] and b["processes"] == 2 and a["processes"] == 1
    manifest = sorted((tmp_path / "proc" / "checkpoints").glob("step-*"))[-1] / "manifest.json"
    assert json.loads(manifest.read_text())["hosts"] == {"rank-0.pt": [0, 1, 2], "rank-1.pt": [3, 4]}


@pytest.mark.parametrize("mode", ["processes", "simulated"])
def test_more_processes_than_workers_is_refused_before_anything_starts(tmp_path, mode):
    # simulated mode used to accept trainer.processes=4 for 3 workers without a word
    from robustagg.errors import ConfigError

    with pytest.raises(ConfigError, match="trainer.processes=4 exceeds the n=3"):
        train(_cfg("threat.n=3", "threat.f=0", "aggregator=mean", "attack=none", "trainer.processes=4",
                   "trainer.steps=1", f"trainer.mode={mode}"), out_dir=tmp_path / "x", quiet=True)
    assert not (tmp_path / "x" / "summary.json").exists()


@pytest.mark.parametrize("overrides, words", [
    (["protocol=redundant", "threat.n=9", "trainer.on_failure=shrink"], "trainer.on_failure=shrink"),
    (["protocol=local", "threat.n=10", "protocol.clients_per_round=5", "trainer.on_failure=shrink"],
     "trainer.on_failure=shrink"),
    (["protocol=redundant", "threat.n=9", "protocol.f=5"], "protocol.f=5 differs from threat.f=2"),
    (["protocol=local", "threat.n=10", "protocol.clients_per_round=5", "trainer.measure_bias=true",
      "trainer.mode=processes"], "trainer.measure_bias=true needs trainer.mode=simulated"),
])
def test_protocol_settings_that_cannot_hold_are_refused_before_launch(tmp_path, overrides, words):
    # found by a review run: each of these used to start and then fail, or silently measure nothing
    from robustagg.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(words)):
        train(_cfg(*overrides, "trainer.steps=2"), out_dir=tmp_path / "x", quiet=True)
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())

"""robustagg.distributed: headers, framed exchange, gather reduction, and real gloo process groups.

Multi-process tests fork small gloo groups on localhost (a few seconds each) and check what every
rank sees: the same aggregate, and a clean, named error when a rank desynchronises, sends another
shape, raises, or hangs past the collective timeout.
"""

from __future__ import annotations

import json
import math
import struct
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import robustagg as ra
from robustagg.distributed import (CollectiveError, GatherReduction, Header, LocalComm, ProcessGroupComm,
                                   WorkerFailedError, check_headers, free_port, frame, from_environment, init_group,
                                   destroy_group, make_reduction, reduction_modes, register_reduction, spawn, unframe)
from robustagg.distributed.header import HEADER_LEN
from robustagg.distributed.reduction import Reduction
from robustagg.errors import (AssumptionError, ConfigError, DesyncError, IntegrityError, NonFiniteInputError)


# --- headers and frames -------------------------------------------------------------------------
def test_header_roundtrip_keeps_every_field_bit_exact():
    h = Header(step=7, seq=21, rank=3, tag=0, numel=4810, dtype=2, prev_digest=-(2**63), loss=0.1, seconds=float("nan"))
    back = Header.decode(h.encode())
    assert back.step == 7 and back.seq == 21 and back.rank == 3 and back.numel == 4810 and back.dtype == 2
    assert back.prev_digest == -(2**63) and back.loss == 0.1 and math.isnan(back.seconds)
    with pytest.raises(DesyncError, match="malformed header"):
        Header.decode(torch.zeros(10, dtype=torch.int64))


def test_headers_encoded_in_one_block_decode_to_the_one_by_one_fields_bit_exact():
    from robustagg.distributed.header import decode_headers, encode_headers

    nan_payload = struct.unpack("<d", struct.pack("<q", 0x7FF8_0000_0000_BEEF))[0]  # a NaN with a payload
    hs = [Header(step=7, seq=21, rank=r, tag=0, numel=4810, dtype=2, prev_digest=-(2**63) + r, loss=0.1 * r,
                 seconds=nan_payload, sent_at=1.7e9 + r, stop=15 * r) for r in range(3)]
    block = encode_headers(hs)
    assert block.shape == (3, 12) and all(torch.equal(block[i], h.encode()) for i, h in enumerate(hs))
    back = decode_headers(block)
    one = [Header.decode(h.encode()) for h in hs]
    bits = [[struct.pack("<d", getattr(h, k)) if isinstance(getattr(h, k), float) else getattr(h, k)
             for k in Header.__dataclass_fields__] for h in back]
    assert bits == [[struct.pack("<d", getattr(h, k)) if isinstance(getattr(h, k), float) else getattr(h, k)
                     for k in Header.__dataclass_fields__] for h in one]
    assert struct.pack("<d", back[1].seconds) == struct.pack("<q", 0x7FF8_0000_0000_BEEF)
    assert encode_headers([]).shape == (0, 12) and decode_headers(encode_headers([])) == []
    bad = block.clone()
    bad[2, 0] = 0  # a wrong format marker in one row
    with pytest.raises(DesyncError, match="malformed header"):
        decode_headers(bad)


@pytest.mark.parametrize("field,value,message", [
    ("step", 4, "at step 4, collective 7: step: rank 1 announces step 5 \\(expected step 4\\)"),  # ids 4, 3
    ("seq", 8, "seq: rank 1 has 8 \\(expected 7\\)"),
    ("numel", 6, "numel: rank 1 has 6 \\(expected 5\\)"),
    ("dtype", 2, "dtype: rank 1 has 2 \\(expected 1\\)"),
    ("rank", 0, "row 1 carries rank 0"),
    ("prev_digest", 99, "aggregates applied at step 3 differ: rank 0 digest 0, rank 1 digest 99"),
])
def test_check_headers_names_the_disagreement(field, value, message):
    base = dict(step=3, seq=7, tag=0, numel=5, dtype=1, prev_digest=0)
    h0 = Header(rank=0, **base)
    h1 = Header(**{**base, "rank": 1, field: value})
    with pytest.raises(DesyncError, match=message):
        check_headers([h0, h1], step=3, seq=7, tag=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_frames_roundtrip_bytes_and_checksums(dtype):
    rows = torch.randn(3, 5, generator=torch.Generator().manual_seed(1)).to(dtype)
    buf = torch.stack([frame(r) for r in rows])
    assert buf.dtype == torch.uint8 and buf.shape == (3, 5 * rows.element_size() + 8)
    back, sums = unframe(buf, dtype)
    assert back.dtype == dtype and torch.equal(back, rows)
    assert sums == [ra.integrity.checksum(r) for r in rows]


# --- the gather reduction in one process ----------------------------------------------------------
def _rows(*values):
    return {i: torch.tensor(v, dtype=torch.float32) for i, v in enumerate(values)}


def test_gather_reduction_aggregates_and_reports():
    red = GatherReduction(ra.CoordinateWiseTrimmedMean(f=1), LocalComm(4))
    out = red.reduce(_rows([1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [100.0, -5.0]), step=0, want_weights=True)
    # column 0: drop 1 and 100 -> (2 + 3) / 2 = 2.5 ; column 1: drop -5 and 30 -> (10 + 20) / 2 = 15
    assert out.aggregate.tolist() == [2.5, 15.0]
    assert out.kept == [0, 1, 2, 3] and out.dropped == [] and all(r.ok for r in out.reports)
    assert out.weights is not None and out.weights.shape == (4,) and float(out.weights.sum()) == pytest.approx(1.0)
    assert out.digest == ra.integrity.checksum(out.aggregate) == red.last_digest
    assert [h.rank for h in out.headers] == [0, 1, 2, 3]
    # collectives: header gather (1) + framed data gather (2)
    assert red.comm.seq == 2 and out.seq == 2


def test_nonfinite_rows_abort_or_drop():
    rows = _rows([1.0], [2.0], [float("nan")], [3.0], [4.0])
    with pytest.raises(NonFiniteInputError, match=r"^step 6: submissions of rank\(s\) \[2\] hold NaN or inf"):
        GatherReduction(ra.CoordinateWiseMedian(f=1), LocalComm(5)).reduce(rows, step=5)
    red = GatherReduction(ra.CoordinateWiseMedian(f=1), LocalComm(5), on_nonfinite="drop")
    out = red.reduce(rows, step=5)
    assert out.kept == [0, 1, 3, 4] and out.dropped == [2] and red.faults == [(5, 2)]
    assert out.aggregate.tolist() == [2.5]  # median of 1, 2, 3, 4 (even n: mean of the middle two)
    # After dropping, the rule's requirement is checked on the rows it actually receives.
    tm = GatherReduction(ra.CoordinateWiseTrimmedMean(f=1), LocalComm(3), on_nonfinite="drop")
    with pytest.raises(AssumptionError, match="got n=2, f=1"):
        tm.reduce(_rows([1.0], [float("inf")], [2.0]), step=0)
    with pytest.raises(ConfigError, match="on_nonfinite"):
        GatherReduction(ra.Mean(), LocalComm(2), on_nonfinite="ignore")


class _CorruptingComm(LocalComm):
    """Flips one byte of rank 1's frame in transit (after the sender took its checksum)."""

    def _all_gather(self, local, members, like):
        out = super()._all_gather(local, members, like)
        if out.dtype == torch.uint8:
            out = out.clone()
            out[1, 0] ^= 0x01
        return out


class _DivergedComm(LocalComm):
    """Rank 2 announces another digest for the previous aggregate."""

    def _all_gather(self, local, members, like):
        out = super()._all_gather(local, members, like)
        if out.dtype == torch.int64 and out.shape[-1] == HEADER_LEN:
            out = out.clone()
            out[2, 7] = 12345
        return out


def test_corruption_in_transit_and_divergence_are_detected():
    with pytest.raises(IntegrityError, match=r"rank\(s\) \[1\] do not match their checksums"):
        GatherReduction(ra.Mean(), _CorruptingComm(3)).reduce(_rows([1.0], [2.0], [3.0]), step=0)
    with pytest.raises(DesyncError, match="rank 2 digest 12345.*parameters diverged"):
        GatherReduction(ra.Mean(), _DivergedComm(3)).reduce(_rows([1.0], [2.0], [3.0]), step=1)


def test_reduction_registry():
    assert "gather" in reduction_modes()
    assert isinstance(make_reduction("gather", ra.Mean(), LocalComm(1)), GatherReduction)
    with pytest.raises(ConfigError, match="unknown reduction mode 'nope'; available: .*gather"):
        make_reduction("nope", ra.Mean(), LocalComm(1))
    with pytest.raises(ConfigError, match="already registered"):
        register_reduction("gather")(GatherReduction)
    assert issubclass(GatherReduction, Reduction)


def test_from_environment_and_local_comm_checks():
    assert from_environment({"RANK": "2", "WORLD_SIZE": "4"}).local_rank == 2
    c = LocalComm(2)
    with pytest.raises(ra.ShapeError, match="one tensor for each hosted worker"):
        c.all_gather({0: torch.zeros(1)})
    c.agree(5, what="x", step=0)  # one process: trivially equal


# --- real process groups (gloo, forked) ----------------------------------------------------------
def _group(world, fn, *args, timeout_s=20.0):
    port = free_port()
    spawn(_enter, world, args=(world, port, timeout_s, fn, args), start_method="fork", grace_seconds=1.0)


def _enter(rank, world, port, timeout_s, fn, args):
    torch.set_num_threads(1)
    init_group(backend="gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
               init_method=f"tcp://127.0.0.1:{port}")
    try:
        fn(rank, *args)
    finally:
        destroy_group()


def _reduce_worker(rank, out_dir):
    comm = ProcessGroupComm()
    red = GatherReduction(ra.CoordinateWiseTrimmedMean(f=1), comm)
    values = [[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [100.0, -5.0]]
    agg = []
    for step in range(2):
        out = red.reduce({rank: torch.tensor(values[rank])}, step=step)
        agg.append(out.aggregate.tolist())
    red.verify(step=2)
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps({"agg": agg, "seq": comm.seq}))


def test_four_gloo_ranks_reduce_to_the_same_aggregate(tmp_path):
    _group(4, _reduce_worker, str(tmp_path))
    got = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]
    # Trimmed mean (f=1) per column: (2+3)/2 = 2.5 and (10+20)/2 = 15 on every rank, every step.
    assert all(g["agg"] == [[2.5, 15.0], [2.5, 15.0]] for g in got)
    assert {g["seq"] for g in got} == {5}  # 2 steps x (header + data) + 1 verify


def _desync_worker(rank, kind):
    red = GatherReduction(ra.Mean(), ProcessGroupComm())
    step = 1 if (kind == "step" and rank == 3) else 0
    d = 3 if (kind == "shape" and rank == 1) else 4
    red.reduce({rank: torch.ones(d)}, step=step)


@pytest.mark.parametrize("kind,match", [("step", "step: rank 3 announces step 2"), ("shape", "numel: rank 1 has 3")])
def test_desync_is_a_named_error_on_every_rank_not_an_abort(kind, match):
    with pytest.raises(WorkerFailedError, match=match) as info:
        _group(4, _desync_worker, kind)
    assert info.value.error_type == "DesyncError"
    assert all(f["type"] == "DesyncError" for f in info.value.failures)


def _raising_worker(rank):
    red = GatherReduction(ra.Mean(), ProcessGroupComm())
    for step in range(50):
        if rank == 2 and step == 3:
            raise ValueError("boom at step 3")
        red.reduce({rank: torch.ones(8)}, step=step)


def test_one_raising_worker_ends_the_group_with_its_error():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError, match=r"worker rank 2 failed: ValueError: boom at step 3") as info:
        _group(4, _raising_worker, timeout_s=30.0)
    assert info.value.rank == 2 and info.value.error_type == "ValueError"
    assert time.monotonic() - t0 < 25.0  # ended by the failure, not by the 30 s collective timeout


def _sleepy_worker(rank):
    red = GatherReduction(ra.Mean(), ProcessGroupComm())
    if rank == 1:
        time.sleep(6.0)
    red.reduce({rank: torch.ones(2)}, step=0)


def test_a_hung_rank_makes_the_others_time_out():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError, match="CollectiveError") as info:
        _group(3, _sleepy_worker, timeout_s=1.5)
    assert time.monotonic() - t0 < 6.0  # the timeout ends it; rank 1 is terminated mid-sleep
    assert info.value.failures and all(f["collective"] for f in info.value.failures)
    assert issubclass(CollectiveError, ra.RobustAggError)

"""Evidence files are untrusted input: a planted or damaged ``rank-*.json`` never crashes a reader.

The folder ``evidence/`` is written by the ranks of a run, but anything can land there (a user's
copy ``rank-x.json``, a truncated file, a JSON list, a file whose ``rank`` field disagrees with its
name). :func:`robustagg.training.read_evidence` keeps exactly the well-formed files of the form
``rank-<ASCII decimal>.json`` holding a JSON object, in rank order, and
:func:`robustagg.training.summarise_evidence` then never raises on what it returns.
"""

from __future__ import annotations

import json
from pathlib import Path

from robustagg.training import read_evidence, summarise_evidence


def _write(folder: Path, name: str, payload: object) -> None:
    (folder / name).write_text(payload if isinstance(payload, str) else json.dumps(payload))


def test_planted_and_damaged_files_are_skipped_and_the_good_ones_kept_in_rank_order(tmp_path: Path) -> None:
    _write(tmp_path, "rank-10.json", {"rank": 10, "kind": "timeout", "step": 7, "step_id": 6, "time": 2.0})
    _write(tmp_path, "rank-2.json", {"rank": 2, "kind": "desync", "step": 5, "step_id": 4, "time": 1.0})
    _write(tmp_path, "rank-x.json", {"rank": 3, "kind": "desync", "step": 1})      # not a rank number
    _write(tmp_path, "rank-٣.json", {"rank": 3, "kind": "desync", "step": 1})      # Arabic-Indic digit
    _write(tmp_path, "rank--1.json", {"rank": -1, "kind": "desync", "step": 1})
    _write(tmp_path, "rank-4.json", [1, 2, 3])                                     # not an object
    _write(tmp_path, "rank-5.json", '{"rank": 5, "kind": ')                         # truncated
    _write(tmp_path, "rank-6.json", {"rank": 0, "kind": "desync", "step": 1})      # claims another rank
    _write(tmp_path, "rank-7.json", {"rank": 7, "kind": "desync", "step": "soon"})  # step not a number
    _write(tmp_path, "rank-8.json", {"rank": 8, "kind": ["desync"], "step": 1})    # kind not a string
    _write(tmp_path, "rank-9.json", {"kind": "error", "step": 3})                  # rank missing: from the name
    (tmp_path / "rank-11.json").mkdir()                                            # a folder
    ev = read_evidence(tmp_path)
    assert [e["rank"] for e in ev] == [2, 9, 10]
    assert ev[1]["kind"] == "error" and ev[1]["step"] == 3
    record = summarise_evidence(ev, attempt=1)
    assert (record["kind"], record["step"], record["ranks"]) == ("desync", 5, [2, 9, 10])


def test_a_folder_of_only_bad_files_reads_as_no_evidence(tmp_path: Path) -> None:
    _write(tmp_path, "rank-x.json", {"rank": 0, "kind": "desync", "step": 1})
    _write(tmp_path, "rank-1.json", "null")
    _write(tmp_path, "rank-2.json", {"rank": True, "kind": "desync", "step": 1})   # bool is not a rank
    assert read_evidence(tmp_path) == []
    record = summarise_evidence([], attempt=0, lost=[3])
    assert (record["kind"], record["ranks"], record["lost"]) == ("fail-stop", [], [3])


def test_a_missing_folder_reads_as_no_evidence(tmp_path: Path) -> None:
    assert read_evidence(tmp_path / "absent") == []


def test_a_symlink_an_oversized_file_and_too_deep_a_nesting_are_skipped(tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    _write(tmp_path, "outside.json", {"rank": 1, "kind": "desync", "step": 1})
    folder = tmp_path / "evidence"
    folder.mkdir()
    (folder / "rank-1.json").symlink_to(outside)                                  # points out of the folder
    with open(folder / "rank-2.json", "wb") as fh:                                 # sparse, above 16 MiB
        fh.truncate(16 * 2**20 + 1)
    _write(folder, "rank-3.json", "[" * 200_000 + "]" * 200_000)                   # RecursionError to parse
    _write(folder, "rank-4.json", {"rank": 4, "kind": "timeout", "step": 2})
    assert [e["rank"] for e in read_evidence(folder)] == [4]

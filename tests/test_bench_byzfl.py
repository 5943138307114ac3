"""experiments.bench_byzfl is optional: without ByzFL it exits with status 2 and says how to get it."""

from __future__ import annotations

import importlib.util

import pytest

from experiments import bench_byzfl


def test_without_byzfl_the_message_says_how_to_get_it(capsys, monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "byzfl" else real(name, *a))
    assert bench_byzfl.main(["--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: experiments.bench_byzfl needs the byzfl package")
    for step in ("pip download byzfl --no-deps", "pip install --no-deps --target", "PYTHONPATH="):
        assert step in err
    with pytest.raises(bench_byzfl.ByzflMissing, match="pip download byzfl"):
        bench_byzfl.import_byzfl()


# experiments.byzfl_accuracy: the accuracy side by side (ours vs ByzFL under each rule).

from experiments import byzfl_accuracy  # noqa: E402

TINY = ["--data", "synthetic", "--override", "data.samples=400", "--steps", "2"]


def _hide_byzfl(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "byzfl" else real(name, *a))


def test_accuracy_path_runs_our_side_without_byzfl_and_refuses_the_byzfl_side(tmp_path, capsys, monkeypatch) -> None:
    import pandas as pd

    _hide_byzfl(monkeypatch)
    assert byzfl_accuracy.main([*TINY, "--out", str(tmp_path / "a.csv")]) == 2
    assert "pip download byzfl --no-deps" in capsys.readouterr().err
    out, md = tmp_path / "a.csv", tmp_path / "a.md"
    assert byzfl_accuracy.main([*TINY, "--sides", "ours", "--rules", "trimmed_mean", "caf", "--seeds", "0", "1",
                                "--out", str(out), "--table", str(md)]) == 0
    table = pd.read_csv(out)
    assert list(table.columns) == byzfl_accuracy.COLUMNS and len(table) == 4 and set(table["side"]) == {"ours"}
    assert list(table["rule"]) == ["trimmed_mean"] * 2 + ["caf"] * 2 and list(table["seed"]) == [0, 1, 0, 1]
    assert table["final_test_acc"].between(0, 1).all()
    text = md.read_text()
    assert text.startswith("`python -m experiments.byzfl_accuracy ") and "| trimmed_mean |" in text


def test_both_sides_start_from_the_same_model_data_and_batches(tmp_path) -> None:
    if importlib.util.find_spec("byzfl") is None:
        pytest.skip("byzfl is not on the path (experiments/bench_byzfl.py's docstring says how to get it)")
    rows, gaps = byzfl_accuracy.run(rules=("trimmed_mean", "geometric_median"), seeds=(0,), steps=2, data="synthetic",
                                    extra=("data.samples=400",))
    assert [(r["rule"], r["side"]) for r in rows] == [("trimmed_mean", "ours"), ("trimmed_mean", "byzfl"),
                                                      ("geometric_median", "ours"), ("geometric_median", "byzfl")]
    # same initial weights, shards, batches, ALIE and rule: after one step only float rounding separates them
    assert max(gaps["trimmed_mean"][1]) < 1e-6 and max(gaps["geometric_median"][1]) < 1e-5
    same = byzfl_accuracy.same_rows(rules=("krum", "nnm_trimmed_mean"), steps=2, data="synthetic",
                                    extra=("data.samples=400",))
    assert [(d["rule"], d["steps"], d["differ"], d["other_row"]) for d in same] == [("krum", 2, 0, 0),
                                                                                    ("nnm_trimmed_mean", 2, 0, 0)]


def test_verdict_and_table_on_hand_made_numbers() -> None:
    v = byzfl_accuracy.verdict([0.80, 0.82, 0.84], [0.79, 0.81, 0.83])  # std 0.02 each: bound 2 sqrt(2 * 0.02^2 / 3)
    assert v["ours_std"] == pytest.approx(0.02) and v["diff"] == pytest.approx(0.01)
    assert v["bound"] == pytest.approx(2 * (2 * 0.02 ** 2 / 3) ** 0.5) and v["agree"] is True
    far = byzfl_accuracy.verdict([0.80, 0.82, 0.84], [0.70, 0.72, 0.74])  # 0.10 apart > 0.0327
    assert far["agree"] is False and far["diff"] == pytest.approx(0.10)
    assert byzfl_accuracy.verdict([0.5] * 3, [0.5] * 3)["agree"] is True  # no spread, no difference
    assert byzfl_accuracy.verdict([0.5] * 3, [0.5001] * 3)["agree"] is False  # no spread: any gap is one
    assert byzfl_accuracy.verdict([0.5], [0.5])["agree"] is None  # one seed: no verdict
    rows = [{"rule": rule, "seed": s, "side": side, "final_test_acc": acc}
            for rule, accs in {"a": ([0.80, 0.82, 0.84], [0.79, 0.81, 0.83]),
                               "b": ([0.80, 0.82, 0.84], [0.70, 0.72, 0.74])}.items()
            for side, vals in zip(("ours", "byzfl"), accs) for s, acc in enumerate(vals)]
    lines = byzfl_accuracy.table(rows, {"a": {1: [1e-8]}, "b": {}}).splitlines()
    assert lines[2] == "| a | 0.8200 ± 0.0200 | 0.8100 ± 0.0200 | +0.0100 | 0.0327 | yes | 1.0e-08 |"
    assert lines[3] == "| b | 0.8200 ± 0.0200 | 0.7200 ± 0.0200 | +0.1000 | 0.0327 | **no** | - |"

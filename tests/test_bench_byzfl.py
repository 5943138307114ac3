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

"""Shared test set-up: one torch thread, W&B off, deterministic hypothesis, helper modules importable.

``tests/reference.py`` (float64 references) and ``tests/rule_db.py`` (the rule database) are
imported by the test modules as top-level modules; this file puts ``tests/`` on ``sys.path`` so
that works under pytest's ``--import-mode=importlib``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

torch.set_num_threads(1)

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# CI runs the same examples every time (derandomize) with no per-example deadline (the machines are
# shared and loaded); HYPOTHESIS_PROFILE=explore draws fresh random examples for local bug hunts.
settings.register_profile("ci", deadline=None, derandomize=True, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("explore", deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

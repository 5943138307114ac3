"""Set-up for the doctests in the documentation pages (``pytest docs``, ``--doctest-glob=*.md``).

Every ``>>>`` example in ``docs/**/*.md`` runs as a test. Some pages register example rules or
attacks under new names (the how-to pages); the fixture below restores both registries after each
page, so that those names never leak into other tests that list the registries, whatever order the
test files run in.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
torch.set_num_threads(1)


def _registries() -> list[dict]:
    from robustagg import registry

    out = [registry._REGISTRY]
    try:
        from attacks import registry as attack_registry
    except ImportError:  # the attack zoo is optional for the library's own pages
        return out
    return out + [attack_registry._REGISTRY]


@pytest.fixture(autouse=True)
def _restore_registries() -> Iterator[None]:
    saved = [(reg, dict(reg)) for reg in _registries()]
    yield
    for reg, snapshot in saved:
        reg.clear()
        reg.update(snapshot)

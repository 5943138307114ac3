"""Callbacks the lifecycle tests hand to real worker processes (``trainer.callbacks=[{_target_: ...}]``)."""

from __future__ import annotations

import time
from pathlib import Path


class WaitForFile:
    """After step ``step``, rank 0 waits (at most ``seconds``) until ``path`` exists: the run stays alive
    exactly as long as the test needs, however slow the machine is."""

    def __init__(self, path: str, step: int, seconds: float = 300.0) -> None:
        self.path, self.step, self.seconds = Path(path), int(step), float(seconds)

    def __call__(self, trainer, out) -> None:
        if trainer.is_main and trainer.step_id == self.step:
            deadline = time.monotonic() + self.seconds
            while not self.path.exists() and time.monotonic() < deadline:
                time.sleep(0.05)


class RecordGc:
    """At step ``step``, rank 0 writes the cyclic collector's state to ``path`` as JSON:
    ``{"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}``, and registers an ``atexit``
    handler that writes ``path`` + ``.atexit`` when the process exits."""

    def __init__(self, path: str, step: int = 1) -> None:
        self.path, self.step = Path(path), int(step)

    def __call__(self, trainer, out) -> None:
        import atexit
        import gc
        import json

        if trainer.is_main and trainer.step_id == self.step:
            self.path.write_text(json.dumps({"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}))
            marker = self.path.with_name(self.path.name + ".atexit")
            atexit.register(marker.write_text, "ran")

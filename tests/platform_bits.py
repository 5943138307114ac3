"""What floating-point bits of a training run depend on: the processor's kernels.

torch picks its vectorised kernels by CPU capability and MKL its code path by vendor, so a run's
parameters (and a printed accuracy) can differ in their last bits between an AMD EPYC (AVX2) and an
Intel Xeon (AVX-512) machine. Tests that pin such bits key them by :func:`platform`.
"""

from __future__ import annotations

from pathlib import Path

import torch


def platform() -> tuple[str, str]:
    """(CPU vendor from /proc/cpuinfo, torch's CPU capability), e.g. ``("GenuineIntel", "AVX512")``."""
    vendor = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                vendor = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return vendor, torch.backends.cpu.get_cpu_capability()

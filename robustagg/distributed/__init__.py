"""Robust reduction over a ``torch.distributed`` process group (or all workers in one process).

- :mod:`~robustagg.distributed.comm`: communicators (:class:`ProcessGroupComm` over a real group,
  :class:`LocalComm` for the simulated mode) and the collective sequence number.
- :mod:`~robustagg.distributed.header`: the header exchanged before every reduction (step id,
  sequence number, length, dtype, digest of the previous aggregate), checked for
  desynchronisation; each submission then travels framed with its checksum.
- :mod:`~robustagg.distributed.reduction`: the :class:`Reduction` contract and the registry of
  modes; :mod:`~robustagg.distributed.gather` registers ``mode="gather"`` and
  :mod:`~robustagg.distributed.sharded_reduction` registers ``mode="sharded"`` on the coordinate-slice
  kernels of :mod:`~robustagg.distributed.sharded`.
- :mod:`~robustagg.distributed.launch`: process-group start-up with timeouts and a spawner that
  stops the whole group when one worker fails.

Example (simulated, one process):
    >>> import torch, robustagg as ra
    >>> from robustagg.distributed import LocalComm, make_reduction
    >>> red = make_reduction("gather", ra.CoordinateWiseTrimmedMean(f=1), LocalComm(4))
    >>> rows = {i: torch.tensor([float(v)]) for i, v in enumerate([1, 2, 3, 1000])}
    >>> red.reduce(rows, step=0).aggregate  # drop 1 and 1000, average 2 and 3
    tensor([2.5000])
"""

from .comm import CollectiveError, CollectiveRecord, Communicator, LocalComm, ProcessGroupComm
from .gather import GatherReduction
from .header import Header, check_headers
from .launch import (EnvRank, TerminatedError, WorkerFailedError, default_backend, destroy_group, free_port,
                     from_environment, init_group, raise_on_sigterm, spawn)
from .reduction import (NonFinitePolicy, Reduced, Reduction, frame, make_reduction, reduction_modes, register_reduction,
                        unframe)
from .sharded import supports_sharding
from .sharded_reduction import ShardedReduced, ShardedReduction

__all__ = ["CollectiveError", "CollectiveRecord", "Communicator", "LocalComm", "ProcessGroupComm",
           "GatherReduction", "frame", "unframe", "Header", "check_headers", "EnvRank", "WorkerFailedError",
           "TerminatedError", "raise_on_sigterm",
           "default_backend", "destroy_group", "free_port", "from_environment", "init_group", "spawn",
           "NonFinitePolicy", "Reduced", "Reduction", "make_reduction", "reduction_modes", "register_reduction",
           "ShardedReduced", "ShardedReduction", "supports_sharding"]

"""robustagg: Byzantine-robust aggregation for distributed training.

Rules map stacked worker submissions ``X`` of shape ``(n, d)`` to one update ``(d,)``; each states
its honest-participant requirement and refuses configurations that break it::

    >>> import torch, robustagg as ra
    >>> x = torch.tensor([[2.0], [2.0], [100.0]])
    >>> ra.Mean()(x), ra.CoordinateWiseMedian(f=1)(x)
    (tensor([34.6667]), tensor([2.]))
"""

from . import functional
from ._tensor import as_matrix, check_finite, flatten, nonfinite_rows, unflatten_like
from .aggregators import (Aggregator, Bulyan, CenteredClipping, CoordinateWiseMedian, CoordinateWiseTrimmedMean,
                          GeometricMedian, Krum, Mean, MeaMed, MinimumDiameterAveraging, MultiKrum)
from .aggregators import CAF, CGE, SMEA, DnC, MoNNA
from .aggregators import FLAME, ClippedClustering, FLTrust, FoolsGold, SignGuard
from .errors import (AssumptionError, AssumptionWarning, CheckpointError, ConfigError, DesyncError, IntegrityError,
                     Interrupted, NonFiniteInputError, RobustAggError, ShapeError)
from .preaggregation import ARC, NNM, Bucketing, Clipping, Pipeline, PreAggregator, build_pipeline
from .registry import available, get, lookup
from .requirements import Requirement, lower_bound_kappa

__version__ = "0.1.0"

__all__ = [
    "functional", "as_matrix", "check_finite", "flatten", "nonfinite_rows", "unflatten_like",
    "Aggregator", "Mean", "CoordinateWiseMedian", "CoordinateWiseTrimmedMean", "MeaMed", "Krum", "MultiKrum",
    "Bulyan", "GeometricMedian", "CenteredClipping", "MinimumDiameterAveraging",
    "CAF", "SMEA", "MoNNA", "CGE", "DnC",
    "SignGuard", "ClippedClustering", "FLTrust", "FoolsGold", "FLAME",
    "PreAggregator", "NNM", "Bucketing", "Clipping", "ARC", "Pipeline", "build_pipeline",
    "available", "get", "lookup", "Requirement", "lower_bound_kappa",
    "RobustAggError", "AssumptionError", "AssumptionWarning", "ShapeError", "NonFiniteInputError", "ConfigError",
    "IntegrityError", "DesyncError", "CheckpointError", "Interrupted",
]

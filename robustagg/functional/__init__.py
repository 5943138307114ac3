"""Pure aggregation kernels: ``(n, d) -> (d,)`` (pre-aggregation maps: ``(n, d) -> (m, d)``).

These functions do the math only: they assume a finite ``(n, d)`` floating tensor and valid
hyperparameters. The classes in :mod:`robustagg` validate shapes, finiteness and each rule's
requirement before calling them.
"""

from .coordinate import coordinate_median, mean, meamed, trimmed_mean
from .distance import (bulyan, bulyan_select, krum, krum_scores, mda, mda_select, multi_krum, nnm, nnm_weights,
                       pairwise_sq_distances)
from .preagg import arc, arc_factors, bucketing, clipping, clipping_factors
from .ranked import cge, monna
from .spectral import caf, dnc, smea
from .weiszfeld import centered_clipping, geometric_median

__all__ = ["mean", "coordinate_median", "trimmed_mean", "meamed", "krum", "krum_scores", "multi_krum",
           "bulyan", "bulyan_select", "mda_select", "geometric_median", "centered_clipping", "mda", "nnm", "nnm_weights",
           "pairwise_sq_distances", "bucketing", "clipping", "clipping_factors", "arc", "arc_factors",
           "cge", "monna", "smea", "caf", "dnc"]

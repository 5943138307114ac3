"""Pre-aggregation maps ``(n, d) -> (m, d)`` and their composition with a rule."""

from ..registry import build_pipeline
from .base import PreAggregator
from .maps import ARC, NNM, Bucketing, Clipping
from .pipeline import Pipeline

__all__ = ["PreAggregator", "NNM", "Bucketing", "Clipping", "ARC", "Pipeline", "build_pipeline"]

"""Robust aggregation rules: one class per rule over :mod:`robustagg.functional`."""

from .base import Aggregator
from .coordinate import CoordinateWiseMedian, CoordinateWiseTrimmedMean, Mean, MeaMed
from .geometric import CenteredClipping, GeometricMedian
from .krum import Bulyan, Krum, MultiKrum
from .mda import MinimumDiameterAveraging
from .ranked import CGE, MoNNA
from .spectral import CAF, SMEA, DnC
from .clustering import FLAME, ClippedClustering, SignGuard
from .trust import FLTrust, FoolsGold

__all__ = ["Aggregator", "Mean", "CoordinateWiseMedian", "CoordinateWiseTrimmedMean", "MeaMed", "Krum",
           "MultiKrum", "Bulyan", "GeometricMedian", "CenteredClipping", "MinimumDiameterAveraging",
           "CAF", "SMEA", "MoNNA", "CGE", "DnC", "SignGuard", "ClippedClustering", "FLTrust", "FoolsGold", "FLAME"]

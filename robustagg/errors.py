"""Exception and warning types raised by robustagg.

Every error the library raises derives from :class:`RobustAggError`, so a caller can catch the
library's refusals without catching unrelated bugs. The input-validation errors also derive from
:class:`ValueError` (bad values) and the runtime faults from :class:`RuntimeError`.
"""

from __future__ import annotations


class RobustAggError(Exception):
    """Base class of every error raised by robustagg."""


class AssumptionError(RobustAggError, ValueError):
    """A rule's honest-participant requirement (e.g. ``n >= 2f + 3``) does not hold.

    Raised by a rule configured with ``strict=True`` (the default) when it is checked against a
    number of workers ``n`` for which its declared Byzantine bound ``f`` breaks the requirement.
    """


class ShapeError(RobustAggError, ValueError):
    """Stacked submissions have the wrong shape, dtype or are empty."""


class NonFiniteInputError(RobustAggError, ValueError):
    """At least one submission holds NaN or +-inf; the message names the rows."""


class ConfigError(RobustAggError, ValueError):
    """A hyperparameter or configuration value is out of range or unknown."""


class IntegrityError(RobustAggError, RuntimeError):
    """A submission failed an integrity check (checksum, header, digest) at run time."""


class DesyncError(IntegrityError):
    """Ranks disagree on the step id, collective sequence number, shape or an aggregate digest."""


class CheckpointError(RobustAggError, RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or of an incompatible format."""


class AssumptionWarning(UserWarning):
    """A rule runs past its requirement because ``strict=False`` was passed (breakdown studies), or
    :func:`robustagg.get` built a rule without ``f`` (so for ``f = 0``)."""


class DataFileError(RobustAggError, ValueError):
    """A data file is truncated, corrupt, of the wrong format, or refused (an unsafe pickle).

    The message names the file, what was expected (e.g. the byte size its header implies) and what
    was found.
    """


class MissingDataError(RobustAggError, FileNotFoundError):
    """A data set's files are not on disk (and could not be downloaded).

    The message lists which files to place in which folder, and where they are published.
    """

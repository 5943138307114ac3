"""Exception and warning types raised by robustagg.

Every error the library raises derives from :class:`RobustAggError`, so a caller can catch the
library's refusals without catching unrelated bugs. The input-validation errors also derive from
:class:`ValueError` (bad values) and the runtime faults from :class:`RuntimeError`.
"""

from __future__ import annotations

import signal as _signal


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


class ReplicaVoteError(IntegrityError):
    """A replica group of ``protocol=redundant`` has no bit-identical majority (``on_no_majority=abort``)."""


class LyingAggregatorError(DesyncError):
    """The aggregate cross-check named lying aggregator ranks and ``on_lying_aggregator=exclude`` removes them.

    Attributes:
        ranks: the named ranks (ascending). step: the 0-based step id at which they were named.
    """

    def __init__(self, message: str, *, ranks: "list[int] | tuple[int, ...]" = (), step: int = 0) -> None:
        super().__init__(message)
        self.ranks = sorted(int(r) for r in ranks)
        self.step = int(step)


class CheckpointError(RobustAggError, RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or of an incompatible format."""


class NothingToRestoreError(CheckpointError):
    """Committed checkpoints exist (or were set aside by an earlier start) and none loads on every
    rank: the run stops rather than train from step 0 on top of them; a restart cannot help."""


class StorageError(RobustAggError, OSError):
    """A run file could not be written: a read-only folder, a full disk, a quota, an I/O error.

    The message is one line naming the path and the cause; what was committed before is intact
    (every file is written whole or not at all), so the same command resumes once it can write.

    Args:
        message: the line. code: the ``errno`` of the underlying ``OSError`` (``errno``), or ``None``.
    """

    def __init__(self, message: str, code: "int | None" = None) -> None:
        super().__init__(message)
        self.message = message
        self.errno = code  # type: ignore[misc]

    def __str__(self) -> str:
        return self.message


class QuorumLostError(RobustAggError, RuntimeError):
    """This side of the group holds no strict majority of the last committed membership.

    Raised by :meth:`robustagg.launch.quorum.Membership.decide` on a side of a partition that
    reached at most half of the last committed members (it stops with evidence and commits no
    checkpoint), by :meth:`~robustagg.launch.quorum.Membership.claim_commit` when a commit is
    attempted under a membership epoch that was replaced or for a step already committed in it,
    and by the launcher when no side reached a majority (the run stops).
    """


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


class Interrupted(RobustAggError):
    """The run was stopped on request (SIGTERM, SIGINT) at a step boundary every rank agreed on.

    Raised by :func:`~robustagg.training.fit` on every rank once a stop request travelled in a step
    header (after the final committed checkpoint, when a checkpointer is configured), and by
    :func:`~robustagg.distributed.spawn` in the launcher, which turns its workers' reports into one.

    Args:
        step: completed steps when the run stopped (the step of the final checkpoint), or ``None``
            when the workers could not reach a common boundary (no final checkpoint was taken).
        signum: the signal that asked for the stop (``signal.SIGTERM`` = 15, ``SIGINT`` = 2, ...).
        checkpointed: a committed checkpoint at ``step`` exists.
        detail: one more sentence for the message (what went wrong while stopping).

    Attributes:
        exit_code: the shell convention for death by ``signum``: ``128 + signum`` (143 for
            SIGTERM, 130 for SIGINT), what a command-line entry point should exit with.

    Example:
        >>> str(Interrupted(40, signum=15, checkpointed=True))
        'interrupted at step 40; run the same command to resume (SIGTERM; committed checkpoint at step 40).'
        >>> Interrupted(40, signum=2).exit_code
        130
    """

    def __init__(self, step: "int | None", *, signum: int = 15, checkpointed: bool = False, detail: str = "") -> None:
        self.step = None if step is None else int(step)
        self.signum = int(signum)
        self.checkpointed = bool(checkpointed)
        self.exit_code = 128 + self.signum
        if self.step is None:
            head = ("interrupted before the workers reached a common step boundary (no final checkpoint); run the "
                    "same command to resume from the last committed checkpoint")
        else:
            head = f"interrupted at step {self.step}; run the same command to resume"
        saved = (f"; committed checkpoint at step {self.step}" if self.checkpointed and self.step is not None
                 else "; checkpointing is off, nothing was saved" if self.step is not None else "")
        tail = f" {detail}" if detail else ""
        try:
            name = _signal.Signals(self.signum).name
        except ValueError:
            name = f"signal {self.signum}"
        super().__init__(f"{head} ({name}{saved}).{tail}")

    def __reduce__(self) -> "tuple[object, ...]":
        return (_interrupted, (self.step, self.signum, self.checkpointed, str(self)))


def _interrupted(step: "int | None", signum: int, checkpointed: bool, message: str) -> Interrupted:
    exc = Interrupted(step, signum=signum, checkpointed=checkpointed)
    exc.args = (message,)
    return exc

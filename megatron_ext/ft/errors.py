"""How a rank's run can end when something failed, and the exit code each ending gives.

The fault-tolerance core (``ft/core.py``) turns every failure into exactly one of these, on every
rank alike, so that the entry point prints one line and exits with one code instead of a pile of
tracebacks:

* ``RankLost`` -- raised inside a step: an iteration was abandoned because a rank of the job is
  gone. Never leaves the core: it starts a recovery.
* ``RankEnded`` -- this rank's own exception (a bug in a hook, a bad batch, out of memory) ended
  this process; it counts as lost and the others go on without it (exit 1 here). Its ``message``
  names the rank and the exception.
* ``JobFailed`` -- the job ends on every rank with one error (exit 1): the same exception ended a
  second rank (a deterministic bug is not a hardware fault), or a collective failed where no rank
  was lost. ``report`` is true on the one rank that prints it.
* ``RestartNeeded`` -- nothing consistent is left to continue from in these processes (no copy of a
  lost shard in memory and no checkpoint, or no store): exit 75, restart from the last checkpoint.
* ``NotMember`` -- internal: this rank has no place in the next layout; it waits as a spare.

Pure: no torch import.
"""
from __future__ import annotations

RESTART_EXIT_CODE = 75
"""A wrapper that restarts the job from its last checkpoint keys on this (``EX_TEMPFAIL``)."""
FAILED_EXIT_CODE = 1


class RankLost(RuntimeError):
    """An iteration was abandoned because a rank of the job is gone."""


class RestartNeeded(RuntimeError):
    """The job cannot go on in these processes; the message says why and how to restart.
    ``report``: whether this rank says so (a decision every survivor read is said once)."""

    def __init__(self, message: str, *, report: bool = True) -> None:
        super().__init__(message)
        self.report = report


class RankEnded(RuntimeError):
    """This rank's own exception ended its process; the core has reported it (the store knows this
    rank is lost, and the first line of its output names the rank and the exception)."""

    def __init__(self, message: str, original: BaseException) -> None:
        super().__init__(message)
        self.original = original


class JobFailed(RuntimeError):
    """The job ends on every rank with this one-line error. ``report``: this rank prints it (one
    rank per job does); ``original``: the exception itself on the rank it was raised on; ``code``:
    the exit code the job ends with (1, or 75 when another rank ended it for a restart)."""

    def __init__(self, message: str, *, report: bool, original: BaseException | None = None,
                 code: int = FAILED_EXIT_CODE) -> None:
        super().__init__(message)
        self.report = report
        self.original = original
        self.code = code


class NotMember(Exception):
    """This rank has no place in the layout the others agreed on (it becomes a spare)."""

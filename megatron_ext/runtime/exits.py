"""Leaving a run early on purpose: Megatron-LM's ``--exit-signal-handler``, ``--exit-duration-in-mins``
and ``--exit-interval``.

A job that is about to be preempted or to hit its time limit is sent a signal (Slurm's warning
signal, ``--signal=B:USR1@120`` in the batch script; SIGTERM from most schedulers); the ranks then
agree, at the next iteration boundary, to save a checkpoint and exit 0, so that a requeued job
resumes with nothing lost. The agreement matters: the signal reaches the ranks at different moments
(one may already be in the next iteration's collectives), and a rank that left alone would leave
the others waiting. So every rank contributes its own flags to one all-reduce (MAX) per iteration,
and all leave after the same iteration.

``ExitWatch`` holds the flags; the loop asks ``decide`` after each iteration.
"""
from __future__ import annotations

import logging
import signal
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)

UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def signal_named(name: str) -> signal.Signals:
    """``signal.Signals`` of a name as Megatron-LM's ``--exit-signal`` takes it (``SIGTERM``,
    ``SIGUSR1``, ...); ValueError naming the choices otherwise."""
    try:
        sig = signal.Signals[name]
    except KeyError:
        raise ValueError(f"--exit-signal must name a signal (SIGTERM, SIGUSR1, SIGUSR2, SIGINT, ...), "
                         f"got {name!r}") from None
    if name in UNCATCHABLE:
        raise ValueError(f"--exit-signal {name} cannot be caught; use SIGTERM or SIGUSR1")
    return sig


class ExitWatch:
    """This rank's reasons to leave after the current iteration.

    ``agree``: an all-reduce (MAX) of a list of 0/1 flags over every rank of the job; injected so
    that the decision is testable without a process group."""

    def __init__(self, ck: Any, agree: Callable[[list[int]], list[int]], *, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.interval = ck.exit_interval
        self.duration_s = ck.exit_duration_in_mins * 60.0 if ck.exit_duration_in_mins else None
        self.signal = signal_named(ck.exit_signal) if ck.exit_signal_handler else None
        self.agree = agree
        self.clock = clock
        self.started = clock()
        self.received = False
        self._previous: Any = None

    @property
    def collective(self) -> bool:
        """Whether ``decide`` meets the other ranks every iteration (a signal or a wall clock: both
        differ between ranks)."""
        return self.signal is not None or self.duration_s is not None

    def install(self) -> None:
        """Catch the exit signal (main thread): it only sets a flag; the loop acts on it."""
        if self.signal is not None:
            self._previous = signal.signal(self.signal, self._on_signal)

    def uninstall(self) -> None:
        if self.signal is not None and self._previous is not None:
            signal.signal(self.signal, self._previous)
            self._previous = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received = True

    def decide(self, iteration: int) -> str | None:
        """Why every rank leaves after ``iteration`` (the same answer on every rank), or None."""
        if self.collective:
            over = self.duration_s is not None and self.clock() - self.started > self.duration_s
            got_signal, over_time = self.agree([int(self.received), int(over)])
            if got_signal:
                return f"{self.signal.name} received"
            if over_time:
                return f"--exit-duration-in-mins {self.duration_s / 60:g} reached"
        if self.interval and iteration % self.interval == 0:
            return f"--exit-interval {self.interval}"
        return None

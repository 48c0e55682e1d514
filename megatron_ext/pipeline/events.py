"""Framework-neutral pipeline events, recorded cheaply on each rank.

An event is one span of a rank's time: a forward or backward of (micro-batch, model chunk), a p2p
send or receive, the gradient reduce, the optimizer step, or other work. Events are written into a
preallocated structured numpy array (two clock reads and a few stores per event; nothing is
allocated on the hot path). Micro-batch layouts (per-document token lengths) are stored once per
micro-batch, not per event, and joined to events when a record is read.
"""
from __future__ import annotations

import enum
import time
from typing import Callable

import numpy as np


class Phase(enum.IntEnum):
    FORWARD = 0
    BACKWARD = 1
    SEND = 2
    RECV = 3
    GRAD_REDUCE = 4
    OPTIMIZER = 5
    OTHER = 6

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")


COMPUTE = (Phase.FORWARD, Phase.BACKWARD)


class Call(enum.IntEnum):
    """Which p2p call an event came from; it says which micro-batch each direction carries."""

    NONE = 0
    RECV_FORWARD = 1
    RECV_BACKWARD = 2
    SEND_FORWARD = 3
    SEND_BACKWARD = 4
    SEND_FORWARD_RECV_BACKWARD = 5
    SEND_BACKWARD_RECV_FORWARD = 6
    SEND_FORWARD_RECV_FORWARD = 7
    SEND_BACKWARD_RECV_BACKWARD = 8
    SEND_FORWARD_BACKWARD_RECV_FORWARD_BACKWARD = 9

    @property
    def sends(self) -> tuple[str, ...]:
        """Directions sent: 'F' (activation downstream) and/or 'B' (gradient upstream)."""
        name = self.name
        if not name.startswith("SEND_"):
            return ()
        head = name.split("_RECV_")[0]
        return tuple(d for d, word in (("F", "FORWARD"), ("B", "BACKWARD")) if word in head)

    @property
    def recvs(self) -> tuple[str, ...]:
        name = self.name
        if "RECV_" not in name:
            return ()
        tail = name.split("RECV_", 1)[1]
        return tuple(d for d, word in (("F", "FORWARD"), ("B", "BACKWARD")) if word in tail)


EVENT_DTYPE = np.dtype([("t0", "f8"), ("t1", "f8"), ("phase", "i1"), ("call", "i1"), ("chunk", "i2"),
                        ("microbatch", "i4")])


class EventRecorder:
    """Per-rank event buffer. ``begin`` returns a slot (or -1 when disabled or full); ``end`` closes it."""

    def __init__(self, capacity: int = 4096, *, enabled: bool = True,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._buf = np.zeros(capacity, dtype=EVENT_DTYPE)
        # Column views: item assignment on a 1-D view is cheaper than on a structured record.
        self._t0 = self._buf["t0"]
        self._t1 = self._buf["t1"]
        self._phase = self._buf["phase"]
        self._call = self._buf["call"]
        self._chunk = self._buf["chunk"]
        self._mb = self._buf["microbatch"]
        self._n = 0
        self.enabled = enabled
        self.clock = clock
        self.dropped = 0

    @property
    def capacity(self) -> int:
        return len(self._buf)

    def __len__(self) -> int:
        return self._n

    def begin(self, phase: int, chunk: int = 0, microbatch: int = -1, call: int = 0) -> int:
        if not self.enabled:
            return -1
        i = self._n
        if i >= len(self._buf):
            self.dropped += 1
            return -1
        self._n = i + 1
        self._phase[i] = phase
        self._call[i] = call
        self._chunk[i] = chunk
        self._mb[i] = microbatch
        self._t1[i] = np.nan
        self._t0[i] = self.clock()
        return i

    def end(self, slot: int) -> None:
        if slot >= 0:
            self._t1[slot] = self.clock()

    def set_microbatch(self, slot: int, microbatch: int) -> None:
        if slot >= 0:
            self._mb[slot] = microbatch

    def reset(self) -> None:
        self._n = 0
        self.dropped = 0

    def events(self) -> np.ndarray:
        """A copy of the recorded events (open events have t1 = NaN)."""
        return self._buf[: self._n].copy()


def assign_p2p_microbatches(events: np.ndarray) -> list[dict[str, int]]:
    """For each p2p event, the micro-batch (and chunk) each direction carries.

    A send carries the output of the rank's previous compute op of that phase; a receive feeds its
    next one. Returns, per event, ``{"send_F": mb, "recv_B": mb, ...}`` (empty for compute events).
    """
    n = len(events)
    phases = events["phase"]
    prev_f = prev_b = None
    last: list[tuple[int | None, int | None]] = []
    for i in range(n):
        p = phases[i]
        if p == Phase.FORWARD:
            prev_f = (int(events["microbatch"][i]), int(events["chunk"][i]))
        elif p == Phase.BACKWARD:
            prev_b = (int(events["microbatch"][i]), int(events["chunk"][i]))
        last.append((prev_f, prev_b))
    next_f = next_b = None
    nxt: list[tuple] = [None] * n
    for i in range(n - 1, -1, -1):
        nxt[i] = (next_f, next_b)
        p = phases[i]
        if p == Phase.FORWARD:
            next_f = (int(events["microbatch"][i]), int(events["chunk"][i]))
        elif p == Phase.BACKWARD:
            next_b = (int(events["microbatch"][i]), int(events["chunk"][i]))
    out: list[dict[str, int]] = []
    for i in range(n):
        call = Call(int(events["call"][i]))
        info: dict[str, int] = {}
        for d in call.sends:
            src = last[i][0 if d == "F" else 1]
            if src is not None:
                info[f"send_{d}"], info[f"send_{d}_chunk"] = src
        for d in call.recvs:
            dst = nxt[i][0 if d == "F" else 1]
            if dst is not None:
                info[f"recv_{d}"], info[f"recv_{d}_chunk"] = dst
        out.append(info)
    return out

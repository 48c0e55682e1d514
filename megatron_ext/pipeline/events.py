"""Framework-neutral pipeline events, recorded cheaply on each rank.

An event is one span of a rank's time: a forward or backward of (micro-batch, model chunk), a p2p
send or receive, the gradient reduce, the optimizer step, or other work. Events are written into a
preallocated structured numpy array (two clock reads and a few stores per event; nothing is
allocated on the hot path). Micro-batch layouts (per-document token lengths) are stored once per
micro-batch, not per event, and joined to events when a record is read.

Timing follows the device (``timing_for``). On CPU an op's work is done when its call returns, so
host clock reads are its span. On a GPU a call returns once its kernels are queued: host reads would
charge a receive with the previous op's kernels still running before it. There each begin/end
records a CUDA event on the current stream instead (from pools made once, so still nothing is
allocated per event), and ``events()`` turns them into host-clock seconds after one synchronize.
"""
from __future__ import annotations

import enum
import time
from typing import Any, Callable, Protocol

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
# Spans in which a stage waits for others (its device idle): bubble windows at run time.
WAITS = (Phase.SEND, Phase.RECV, Phase.GRAD_REDUCE)


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


TIMINGS = ("host", "cuda")


def timing_for(device: Any) -> str:
    """The timing a recorder on ``device`` needs: "cuda" (CUDA events) on a GPU, "host" otherwise."""
    return "cuda" if getattr(device, "type", str(device).split(":")[0]) == "cuda" else "host"


EVENT_DTYPE = np.dtype([("t0", "f8"), ("t1", "f8"), ("phase", "i1"), ("call", "i1"), ("chunk", "i2"),
                        ("microbatch", "i4")])


class WaitObserver(Protocol):
    """Told, as they happen, when this rank starts and stops waiting (``WAITS`` phases), and when a
    new iteration starts. Called on the training thread: keep it to a few stores."""

    def wait_begin(self, phase: int, call: int) -> None: ...

    def wait_end(self) -> None: ...

    def iteration_reset(self) -> None: ...


class EventRecorder:
    """Per-rank event buffer. ``begin`` returns a slot (or -1 when disabled or full); ``end`` closes it.

    An ``observer`` (``WaitObserver``) hears every wait begin and end live, also when the buffer is
    full: the engines drive bubble windows through the recorder they already feed.

    ``timing="cuda"`` (see the module docstring) takes ``event_factory`` (default: timing-enabled
    ``torch.cuda.Event``) and ``synchronize`` (default ``torch.cuda.synchronize``); both are
    injectable so the conversion is testable without a GPU."""

    def __init__(self, capacity: int = 4096, *, enabled: bool = True,
                 clock: Callable[[], float] = time.perf_counter, timing: str = "host",
                 event_factory: Callable[[], Any] | None = None,
                 synchronize: Callable[[], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if timing not in TIMINGS:
            raise ValueError(f"timing must be one of {', '.join(TIMINGS)}, got {timing!r}")
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
        self.observer: WaitObserver | None = None
        self._wait_slot: int | None = None   # the slot of the wait the observer was told of
        self.clock = clock
        self.dropped = 0
        self.timing = timing
        if timing == "cuda":
            if event_factory is None or synchronize is None:
                import torch

                if not torch.cuda.is_available():
                    raise RuntimeError("EventRecorder(timing='cuda') needs a CUDA device; "
                                       "pick the timing with timing_for(device)")
                event_factory = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
                synchronize = synchronize or torch.cuda.synchronize
            self._ev0 = [event_factory() for _ in range(capacity)]
            self._ev1 = [event_factory() for _ in range(capacity)]
            self._anchor_event = event_factory()
            self._synchronize = synchronize
            self._anchor_host: float | None = None
            self._resolved = 0  # events [0, _resolved) hold host seconds already

    @property
    def capacity(self) -> int:
        return len(self._buf)

    def __len__(self) -> int:
        return self._n

    def begin(self, phase: int, chunk: int = 0, microbatch: int = -1, call: int = 0) -> int:
        if not self.enabled:
            return -1
        i = self._n
        if self.observer is not None and phase in WAITS:
            self._wait_slot = i if i < len(self._buf) else -1
            self.observer.wait_begin(phase, call)
        if i >= len(self._buf):
            self.dropped += 1
            return -1
        self._n = i + 1
        self._phase[i] = phase
        self._call[i] = call
        self._chunk[i] = chunk
        self._mb[i] = microbatch
        self._t1[i] = np.nan
        if self.timing == "host":
            self._t0[i] = self.clock()
        else:
            if self._anchor_host is None:
                self._anchor()
            self._ev0[i].record()
        return i

    def end(self, slot: int) -> None:
        if self._wait_slot is not None and slot == self._wait_slot:
            self._wait_slot = None
            self.observer.wait_end()
        if slot >= 0:
            if self.timing == "host":
                self._t1[slot] = self.clock()
            else:
                self._ev1[slot].record()
                self._t1[slot] = 0.0  # closed; host seconds once resolved

    def _anchor(self) -> None:
        """Pin device time to the host clock: after a synchronize the anchor event completes at
        (about) the host time read just before it."""
        self._synchronize()
        self._anchor_host = self.clock()
        self._anchor_event.record()

    def _resolve(self) -> None:
        """CUDA events -> host-clock seconds for the events recorded since the last call."""
        if self.timing != "cuda" or self._resolved >= self._n:
            return
        self._synchronize()
        ref, base = self._anchor_event, self._anchor_host
        for i in range(self._resolved, self._n):
            self._t0[i] = base + ref.elapsed_time(self._ev0[i]) / 1e3
            if not np.isnan(self._t1[i]):
                self._t1[i] = base + ref.elapsed_time(self._ev1[i]) / 1e3
        # An event still open stays unresolved (t1 = NaN) and is looked at again next time.
        open_ = np.flatnonzero(np.isnan(self._t1[self._resolved:self._n]))
        self._resolved = self._resolved + int(open_[0]) if len(open_) else self._n

    def reopen(self, slot: int) -> None:
        """The wait of ``slot`` goes on after a pause (DeepSpeed's Send/Recv instruction makes one
        blocking call per tensor; the event spans them all): the observer hears a new begin."""
        if self.observer is not None and slot >= 0 and self._wait_slot is None:
            self._wait_slot = slot
            self.observer.wait_begin(int(self._phase[slot]), int(self._call[slot]))

    def set_microbatch(self, slot: int, microbatch: int) -> None:
        if slot >= 0:
            self._mb[slot] = microbatch

    def reset(self) -> None:
        self._n = 0
        self.dropped = 0
        if self._wait_slot is not None:   # a wait left open by an exception
            self._wait_slot = None
            self.observer.wait_end()
        if self.observer is not None:
            self.observer.iteration_reset()
        if self.timing == "cuda":
            self._anchor_host = None  # re-anchored at the next begin(): no drift across iterations
            self._resolved = 0

    def events(self) -> np.ndarray:
        """A copy of the recorded events in host-clock seconds (open events have t1 = NaN)."""
        self._resolve()
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

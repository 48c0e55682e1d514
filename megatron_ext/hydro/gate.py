"""Cooperative pause/resume points for fused trial bundles (the hooks a bubble scheduler drives).

The fused modules call ``PauseGate.checkpoint(where)`` between layers, in the forward pass (a
forward pre-hook) and in the backward pass (a hook on the layer's output gradient). A controller
on another thread asks for a pause with ``pause()``; the bundle's thread parks at its next
checkpoint, and ``pause()`` returns once it is parked, so the caller knows the guest holds no
compute when it hands the device back. ``resume()`` lets it continue from exactly where it
stopped: nothing is recomputed and no state is lost.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)


class PauseGate:
    def __init__(self, on_checkpoint: Callable[[str], None] | None = None) -> None:
        self._want_pause = threading.Event()
        self._go = threading.Event()
        self._go.set()
        self._parked = threading.Event()
        self._cond = threading.Condition()
        self.parks = 0              # how many times the bundle parked
        self.on_checkpoint = on_checkpoint
        self.checkpoints = 0        # how many checkpoints were passed (for tests and statistics)
        self.parked_at: str | None = None
        self.parked_s = 0.0         # total time spent parked

    def checkpoint(self, where: str) -> None:
        """Called by the bundle's thread between layers. Cheap when no pause is asked for."""
        self.checkpoints += 1
        if self.on_checkpoint is not None:
            self.on_checkpoint(where)
        if not self._want_pause.is_set():
            return
        t0 = time.perf_counter()
        self.parked_at = where
        self._go.clear()
        with self._cond:
            self.parks += 1
            self._parked.set()
            self._cond.notify_all()
        self._go.wait()
        self._parked.clear()
        self.parked_at = None
        self.parked_s += time.perf_counter() - t0

    def request_pause(self) -> None:
        """Ask for a pause without waiting (the bundle parks at its next pause point)."""
        self._want_pause.set()

    def pause(self, timeout_s: float | None = None) -> bool:
        """Ask the bundle to stop at its next checkpoint; True once it is parked there. A bundle that
        is between steps (not running) never reaches a checkpoint: use ``is_parked`` or a timeout."""
        self._want_pause.set()
        return self._parked.wait(timeout_s)

    def advance(self, timeout_s: float | None = None) -> bool:
        """Let a parked bundle run to its next pause point and park there again (single-stepping a
        bundle layer by layer, e.g. to fill a bubble exactly). True once it parked again; False on
        timeout (or when the step ended first: a bundle between steps has no next point)."""
        with self._cond:
            seen = self.parks
            self._want_pause.set()
            self._parked.clear()
            self._go.set()
            return self._cond.wait_for(lambda: self.parks > seen, timeout_s)

    def resume(self) -> None:
        self._want_pause.clear()
        self._go.set()

    @property
    def pause_requested(self) -> bool:
        return self._want_pause.is_set()

    @property
    def is_parked(self) -> bool:
        return self._parked.is_set()

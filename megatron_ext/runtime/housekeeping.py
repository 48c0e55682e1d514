"""Between iterations: Megatron-LM's manual garbage collection (``--manual-gc``) and its emptying of
the CUDA caching allocator (``--empty-unused-memory-level``).

Python's collector, left automatic, runs whenever allocations cross its thresholds: on one rank in
the middle of an iteration while the others wait for it in a collective. ``--manual-gc`` switches it
off for the run and collects at chosen points instead -- every ``--manual-gc-interval`` iterations
(0: never during training) and around each validation unless ``--no-manual-gc-eval`` -- so that every
rank collects at the same point. ``--empty-unused-memory-level`` 1 or 2 hands the allocator's cached
blocks back to the GPU after each iteration (Megatron-LM empties after the forward-backward at 1 and
after the optimizer step too at 2; here both happen after the iteration's step).
"""
from __future__ import annotations

import contextlib
import gc
from typing import Any, Iterator

import torch


class Housekeeping:
    def __init__(self, training: Any, device: torch.device) -> None:
        self.t = training
        self.cuda = device.type == "cuda"
        self._was_enabled = gc.isenabled()

    def start(self) -> None:
        if self.t.manual_gc:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()

    def stop(self) -> None:
        if self.t.manual_gc and self._was_enabled:
            gc.enable()

    def after_iteration(self, iteration: int) -> None:
        if self.t.manual_gc and self.t.manual_gc_interval and iteration % self.t.manual_gc_interval == 0:
            gc.collect()
        if self.cuda and self.t.empty_unused_memory_level >= 1:
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def validation(self) -> Iterator[None]:
        collect = self.t.manual_gc and self.t.manual_gc_eval
        if collect:
            gc.collect()
        try:
            yield
        finally:
            if collect:
                gc.collect()

"""Measuring what the simulator predicts: step time, exposed communication and peak memory.

Used by ``tools/bench_helix.py`` and the tests. Peak memory is read from the profiler's
allocator events (``profile_memory=True``), so it also works on CPU where there is no
``max_memory_allocated``: the peak of the running sum of allocations and frees made during the
step, by any thread -- the quantity the simulator's lifetime model predicts.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Iterable

import torch

from megatron_ext.helix.interconnect import emulation_stats, reset_emulation

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StepSample:
    step_s: float
    exposed_comm_s: float   # time in waits (the real collective, i.e. the slower peer, + the link)
    link_s: float           # the emulated link's share of it
    collectives: int
    interference_s: float = 0.0  # emulated compute slowdown from in-flight collectives (not in exposed)


def peak_bytes_of(fn: Callable[[], object]) -> int:
    """Peak bytes allocated (net of frees) while ``fn`` runs, from profiler allocator events."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def clear_grads(x: torch.Tensor, params: Iterable[torch.nn.Parameter]) -> None:
    for p in params:
        p.grad = None
    x.grad = None


def train_step(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, grad: torch.Tensor,
               params: Iterable[torch.nn.Parameter]) -> None:
    """Forward + backward of one layer with a given output gradient; gradients start empty."""
    clear_grads(x, params)
    fn(x).backward(grad)


def step_peak_bytes(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, grad: torch.Tensor,
                    params: Iterable[torch.nn.Parameter]) -> int:
    """Peak memory of one forward + backward. Old gradients are dropped *before* profiling: a
    free of memory allocated before the profiler started would lower the running sum."""
    params = list(params)
    clear_grads(x, params)
    return peak_bytes_of(lambda: fn(x).backward(grad))


def timed_step(step: Callable[[], None], barrier: Callable[[], None] | None = None) -> StepSample:
    if barrier is not None:
        barrier()
    reset_emulation()
    t0 = time.perf_counter()
    step()
    dt = time.perf_counter() - t0
    st = emulation_stats()
    return StepSample(step_s=dt, exposed_comm_s=st.exposed_s, link_s=st.link_s, collectives=st.collectives,
                      interference_s=st.interference_s)


class ComputeTimer:
    """Times the computation alone of compiled graphs (collectives and waits removed) on inputs
    built from their recorded shapes -- for re-calibrating the simulator's compute scale at the
    moment a measurement is taken (a shared host's load drifts between compile and measure)."""

    def __init__(self, graphs: Iterable[torch.fx.GraphModule], device: torch.device | str = "cpu") -> None:
        from megatron_ext.helix.calibrate import _materialize, compute_only_copy
        from megatron_ext.helix.ir import value_of

        self.runs = []
        for gm in graphs:
            g = compute_only_copy(gm)
            args = [_materialize(value_of(n), torch.device(device)) for n in g.graph.nodes if n.op == "placeholder"]
            self.runs.append((g, args))
        self.samples: list[float] = []

    def run(self) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for g, args in self.runs:
                g(*args)
        dt = time.perf_counter() - t0
        self.samples.append(dt)
        return dt

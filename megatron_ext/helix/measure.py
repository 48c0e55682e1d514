"""Measuring what the simulator predicts: step time, exposed communication and peak memory.

Used by ``tools/bench_helix.py`` and the tests. Peak memory is read from the profiler's
allocator events (``profile_memory=True``), so it also works on CPU where there is no
``max_memory_allocated``: the peak of the running sum of allocations and frees made during the
step -- the quantity the simulator's lifetime model predicts. The profiler sees only the thread
that runs the step; ``step_peak_bytes`` re-runs a step whose accounting does not close.
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


def _profile_memory(fn: Callable[[], object]) -> tuple[int, int]:
    """(peak, net) bytes allocated while ``fn`` runs, from profiler allocator events: the peak of
    the running sum of allocations and frees, and the sum at the end."""
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
    return peak, live


def peak_bytes_of(fn: Callable[[], object]) -> int:
    """Peak bytes allocated (net of frees) while ``fn`` runs, from profiler allocator events."""
    return _profile_memory(fn)[0]


def clear_grads(x: torch.Tensor, params: Iterable[torch.nn.Parameter]) -> None:
    for p in params:
        p.grad = None
    x.grad = None


def train_step(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, grad: torch.Tensor,
               params: Iterable[torch.nn.Parameter]) -> None:
    """Forward + backward of one layer with a given output gradient; gradients start empty."""
    clear_grads(x, params)
    fn(x).backward(grad)


def all_ranks_agree(group=None) -> Callable[[bool], bool]:
    """``agree`` for ``step_peak_bytes`` on several ranks: True only where every rank said True."""
    import torch.distributed as dist

    from megatron_ext.runtime.distributed import collective_device

    def agree(ok: bool) -> bool:
        flag = torch.tensor([int(ok)], device=collective_device(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    return agree


class UnclosedAccounting(RuntimeError):
    """No profiled step had allocator accounting that closed (see ``step_peak_bytes``)."""


def step_peak_bytes(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, grad: torch.Tensor,
                    params: Iterable[torch.nn.Parameter], attempts: int = 20,
                    agree: Callable[[bool], bool] | None = None) -> int:
    """Peak memory of one forward + backward.

    Old gradients are dropped *before* profiling: a free of memory allocated before the profiler
    started would lower the running sum. The profiler records the allocator events of the thread
    that runs the step only; when gloo's worker thread happens to drop the last reference to a
    collective's buffer (a race with the wait), that free is missing and every later running sum
    is too high by its size. Such a step is recognised exactly: its net bytes exceed what the step
    leaves alive (the gradients). Only a step whose accounting closes is measured; a step that
    does not is re-run, up to ``attempts`` times. When the step runs collectives, every rank must
    re-run together: ``agree`` maps this rank's verdict to the verdict of all ranks
    (``all_ranks_agree(group)``)."""
    params = list(params)
    tensors = [x, *params]
    for _ in range(attempts):
        clear_grads(x, params)
        peak, net = _profile_memory(lambda: fn(x).backward(grad))
        kept = sum(t.grad.untyped_storage().nbytes() for t in tensors if t.grad is not None)
        closed = net == kept
        if (agree(closed) if agree is not None else closed):
            return peak
        logger.debug("step_peak_bytes: accounting did not close (net %d bytes, %d kept): re-run", net, kept)
    raise UnclosedAccounting(f"step_peak_bytes: allocator accounting did not close in {attempts} profiled "
                             f"steps (frees made on threads the profiler does not record)")


def forward_peak_bytes(fn: Callable[[], object], attempts: int = 50,
                       agree: Callable[[bool], bool] | None = None) -> int:
    """Peak memory of one forward-only call whose result is dropped at once: a call's accounting
    closes when its running sum ends at zero. A call whose last free of a collective's buffer
    happened on gloo's worker thread (which the profiler does not record) does not close; the call
    is repeated -- every rank together (``agree``), until each rank has one call that closed -- and
    each rank reports the peak of its first closed call."""
    def call() -> None:
        fn()  # the result is dropped here, inside the profiled region

    found: int | None = None
    for _ in range(attempts):
        peak, net = _profile_memory(call)
        if found is None and net == 0:
            found = peak
        if (agree(found is not None) if agree is not None else found is not None):
            return found
    raise UnclosedAccounting(f"forward_peak_bytes: allocator accounting did not close in {attempts} profiled calls")


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

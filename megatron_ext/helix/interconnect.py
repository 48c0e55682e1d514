"""Emulated interconnect: the CPU measurement harness for collectives.

On CPU ranks the real gloo collective runs over loopback, which says nothing about NVLink or
InfiniBand. The emulation keeps the real collective (so results stay exact) and makes its wait
complete no earlier than ``latency + algorithm bytes / bandwidth`` after the issue, where the
collective starts once its group's link is free (collectives of one group share a link, as in
the simulator). Waiting sleeps: it uses no CPU, like a GPU stream waiting on a NIC.

Every figure measured with it is an *emulated* figure; label it so.

The rewrite replaces, in an AOT graph that is executed by Python, each
``wait_tensor(collective)`` with ``emulated_wait(collective, flight)`` where ``flight`` (the
link window: start, deadline) is computed by ``emulated_issue`` right after the collective is
issued.

With ``Interconnect.compute_interference`` > 0 the emulation also charges the compute slowdown
that communication kernels cause on a GPU (they take SMs and memory bandwidth from the kernels
they overlap; a CPU loopback collective takes nothing comparable): at each wait, the compute
thread's time inside the collective's window costs ``share / (1 - share)`` extra seconds
(``simulator.InterferenceLedger``, the rule the simulator applies too), slept before the wait
returns and counted as ``interference_s``, not as exposed communication.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

import torch
import torch.fx as fx

from megatron_ext.helix.cost import Interconnect
from megatron_ext.helix.ir import GraphIR, is_wait
from megatron_ext.helix.simulator import InterferenceLedger

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EmulationStats:
    """What the emulated links did since the last reset (seconds)."""

    collectives: int = 0
    comm_s: float = 0.0        # emulated transfer time issued
    exposed_s: float = 0.0     # time the compute thread sat in waits
    link_s: float = 0.0        # the part of it spent on the emulated link (after the peers arrived)
    waits: int = 0
    interference_s: float = 0.0  # compute slowdown charged at waits (compute_interference); not exposed

    def reset(self) -> None:
        self.collectives = 0
        self.comm_s = self.exposed_s = self.link_s = self.interference_s = 0.0
        self.waits = 0


@dataclasses.dataclass(frozen=True)
class Flight:
    """A collective's window on its emulated link (``time.perf_counter`` seconds)."""

    start: float
    deadline: float
    interference: float = 0.0
    # The collective's input, held until its wait returns (as the process group holds it; not for
    # an all-reduce, which reduces a clone): its last reference then goes on the compute thread,
    # not on gloo's worker thread -- whose frees the profiler does not record (see
    # measure.step_peak_bytes).
    held: list = dataclasses.field(default_factory=list, compare=False, repr=False)


class _Links:
    """Per-process link state: when each group's link is free again, and the compute-slowdown
    ledgers (one per interference share in use)."""

    def __init__(self) -> None:
        self.free_at: dict[str, float] = {}
        self.stats = EmulationStats()
        self.lock = threading.Lock()
        self.ledgers: dict[float, InterferenceLedger] = {}
        self.in_flight: dict[int, float] = {}  # id(flight) -> window start, until its wait

    def reset(self) -> None:
        with self.lock:
            self.free_at.clear()
            self.stats.reset()
            self.ledgers.clear()
            self.in_flight.clear()


LINKS = _Links()


def emulation_stats() -> EmulationStats:
    return LINKS.stats


def reset_emulation() -> None:
    LINKS.reset()


def emulated_issue(issued: torch.Tensor, group: str, seconds: float, interference: float = 0.0,
                   held: torch.Tensor | None = None) -> Flight:
    """Reserve the group's link for ``seconds`` starting now (or when it frees); return the window
    (holding ``held``, the collective's input, until the wait)."""
    if not 0.0 <= interference < 1.0:
        raise ValueError(f"emulated_issue: interference is a share of compute throughput in [0, 1), "
                         f"got {interference}")
    now = time.perf_counter()
    with LINKS.lock:
        start = max(now, LINKS.free_at.get(group, 0.0))
        end = start + seconds
        LINKS.free_at[group] = end
        LINKS.stats.collectives += 1
        LINKS.stats.comm_s += seconds
        flight = Flight(start, end, interference, [] if held is None else [held])
        if interference > 0:
            LINKS.in_flight[id(flight)] = start
    return flight


def _interference_s(flight: Flight, now: float) -> float:
    """Extra compute seconds owed at the wait of ``flight`` reached at ``now`` (see the module doc)."""
    with LINKS.lock:
        LINKS.in_flight.pop(id(flight), None)
        ledger = LINKS.ledgers.setdefault(flight.interference, InterferenceLedger(flight.interference))
        extra = ledger.charge(flight.start, flight.deadline, now)
        # Nothing in flight started before the oldest pending window: older intervals are settled.
        ledger.forget_before(min(LINKS.in_flight.values(), default=now))
    return extra


def emulated_wait(issued: torch.Tensor, flight: Flight | float) -> torch.Tensor:
    """Complete the real collective, then sleep until the emulated transfer is over (and, with
    compute interference, until the slowed compute before the wait would have reached it)."""
    if not isinstance(flight, Flight):
        flight = Flight(float("-inf"), float(flight))
    t0 = time.perf_counter()
    extra = _interference_s(flight, t0) if flight.interference > 0 else 0.0
    out = torch.ops._c10d_functional.wait_tensor.default(issued)
    t1 = time.perf_counter()
    # The slowed compute would have reached this wait at t0 + extra; the collective cannot
    # complete before its peers (t1) nor before the emulated link is done (deadline).
    remaining = max(flight.deadline, t0 + extra) - t1
    if remaining > 0:
        time.sleep(remaining)
    t2 = time.perf_counter()
    slowed = max(0.0, min(t2, t0 + extra) - max(flight.deadline, t1))
    if flight.interference > 0:
        with LINKS.lock:
            ledger = LINKS.ledgers.get(flight.interference)
            if ledger is not None:
                ledger.block(t0, t2)
    LINKS.stats.exposed_s += t2 - t0 - slowed
    LINKS.stats.link_s += max(0.0, t2 - t1 - slowed)
    LINKS.stats.interference_s += slowed
    LINKS.stats.waits += 1
    flight.held.clear()  # gloo's worker dropped its reference long before the link's deadline
    return out


def install_emulation(gm: fx.GraphModule, link: Interconnect,
                      group_size: Callable[[str], int] | None = None) -> int:
    """Rewrite ``gm`` in place so its collectives run over ``link``; returns how many."""
    ir = GraphIR(gm, group_size=group_size)
    count = 0
    for n in ir.collectives():
        coll = n.node
        waits = [u for u in coll.users if is_wait(u)]
        if not waits:
            continue
        seconds = link.time_of(n.collective)
        with gm.graph.inserting_after(coll):
            # What the process group's work holds, as the simulator models it: the input, except
            # for the all-reduce, whose work reduces (and holds) a clone -- its output.
            held = coll.args[0] if n.collective.kind != "all_reduce" and coll.args \
                and isinstance(coll.args[0], fx.Node) else None
            deadline = gm.graph.call_function(emulated_issue, (coll, n.collective.group, seconds,
                                                              link.compute_interference, held))
        for w in waits:
            w.target = emulated_wait
            w.args = (coll, deadline)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


"""Emulated interconnect: the CPU measurement harness for collectives.

On CPU ranks the real gloo collective runs over loopback, which says nothing about NVLink or
InfiniBand. The emulation keeps the real collective (so results stay exact) and makes its wait
complete no earlier than ``latency + algorithm bytes / bandwidth`` after the issue, where the
collective starts once its group's link is free (collectives of one group share a link, as in
the simulator). Waiting sleeps: it uses no CPU, like a GPU stream waiting on a NIC.

Every figure measured with it is an *emulated* figure; label it so.

The rewrite replaces, in an AOT graph that is executed by Python, each
``wait_tensor(collective)`` with ``emulated_wait(collective, deadline)`` where ``deadline`` is
computed by ``emulated_issue`` right after the collective is issued.
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

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EmulationStats:
    """What the emulated links did since the last reset (seconds)."""

    collectives: int = 0
    comm_s: float = 0.0        # emulated transfer time issued
    exposed_s: float = 0.0     # time the compute thread sat in waits
    link_s: float = 0.0        # the part of it spent on the emulated link (after the peers arrived)
    waits: int = 0

    def reset(self) -> None:
        self.collectives = 0
        self.comm_s = self.exposed_s = self.link_s = 0.0
        self.waits = 0


class _Links:
    """Per-process link state: when each group's link is free again."""

    def __init__(self) -> None:
        self.free_at: dict[str, float] = {}
        self.stats = EmulationStats()
        self.lock = threading.Lock()

    def reset(self) -> None:
        with self.lock:
            self.free_at.clear()
            self.stats.reset()


LINKS = _Links()


def emulation_stats() -> EmulationStats:
    return LINKS.stats


def reset_emulation() -> None:
    LINKS.reset()


def emulated_issue(issued: torch.Tensor, group: str, seconds: float) -> float:
    """Reserve the group's link for ``seconds`` starting now (or when it frees); return the deadline."""
    now = time.perf_counter()
    with LINKS.lock:
        start = max(now, LINKS.free_at.get(group, 0.0))
        end = start + seconds
        LINKS.free_at[group] = end
        LINKS.stats.collectives += 1
        LINKS.stats.comm_s += seconds
    return end


def emulated_wait(issued: torch.Tensor, deadline: float) -> torch.Tensor:
    """Complete the real collective, then sleep until the emulated transfer is over."""
    t0 = time.perf_counter()
    out = torch.ops._c10d_functional.wait_tensor.default(issued)
    t1 = time.perf_counter()
    remaining = deadline - t1
    if remaining > 0:
        time.sleep(remaining)
    t2 = time.perf_counter()
    LINKS.stats.exposed_s += t2 - t0
    LINKS.stats.link_s += t2 - t1
    LINKS.stats.waits += 1
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
            deadline = gm.graph.call_function(emulated_issue, (coll, n.collective.group, seconds))
        for w in waits:
            w.target = emulated_wait
            w.args = (coll, deadline)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


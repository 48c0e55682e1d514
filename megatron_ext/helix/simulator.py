"""Makespan and peak-memory simulator of one node order (pure).

The machine model: one compute stream runs nodes in the given order; each process group has a
communication stream (its link) on which its collectives run one after another. A collective
costs a short issue on the compute stream, then ``comm_s`` on its link starting when both the
issue is done and the link is free. A wait blocks the compute stream until its collective ends;
that blocked time is the *exposed* communication.

Memory is simulated from tensor lifetimes: a node allocates its new storage when it runs; a
storage is freed after the last node that uses it or any of its aliases (views, waits, in-place
results), unless it is kept (graph outputs held by the caller, gradients).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

from megatron_ext.helix.cost import CostModel
from megatron_ext.helix.ir import GraphIR, IRNode, Kind

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SimOp:
    name: str
    kind: Kind
    compute_s: float = 0.0          # time on the compute stream (issue time for collectives)
    comm_s: float = 0.0             # collectives: time on the link
    channel: str | None = None      # collectives: process-group name
    wait_of: int | None = None      # waits: index of the collective they complete
    inputs: tuple[int, ...] = ()
    alloc_bytes: int = 0
    alias_of: int | None = None     # index of the op whose storage this output shares
    keep: bool = False              # storage survives the simulated span
    tile: int | None = None
    label: str = ""
    holds_inputs: bool = True       # collectives: the in-flight work reads its inputs until the wait
    host_s: float = 0.0             # collectives: how long the real collective works on this host's cores
    host_share: float = 0.0         # ...and the share of compute throughput it takes meanwhile (CPU ranks)


@dataclasses.dataclass(frozen=True)
class Event:
    name: str
    stream: str       # "compute", "wait" or "comm:<group>"
    start_s: float
    end_s: float
    kind: str
    tile: int | None


@dataclasses.dataclass
class SimResult:
    makespan_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    peak_bytes: int
    events: list[Event]
    # Extra compute time from communication kernels slowing the compute they overlap
    # (``Interconnect.compute_interference``); part of the makespan, not of the exposed communication.
    interference_s: float = 0.0

    @property
    def hidden_comm_s(self) -> float:
        return max(self.comm_s - self.exposed_comm_s, 0.0)


def _root(ops: Sequence[SimOp], i: int) -> int:
    seen = 0
    while ops[i].alias_of is not None:
        i = ops[i].alias_of
        seen += 1
        if seen > len(ops):
            raise ValueError("helix simulator: alias cycle in op list")
    return i


def peak_memory(ops: Sequence[SimOp]) -> int:
    """Peak bytes of live storages over the order (allocations made inside the span only)."""
    roots = [_root(ops, i) for i in range(len(ops))]
    last = list(range(len(ops)))  # a storage nobody uses dies right after it is made
    for i, op in enumerate(ops):
        for j in op.inputs:
            r = roots[j]
            last[r] = max(last[r], i)
    frees: dict[int, list[int]] = {}
    for r in set(roots):
        if not ops[r].keep and ops[r].alloc_bytes:
            frees.setdefault(last[r], []).append(r)
    live = peak = 0
    for i, op in enumerate(ops):
        live += op.alloc_bytes
        peak = max(peak, live)
        for r in frees.get(i, ()):
            live -= ops[r].alloc_bytes
    return peak


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class InterferenceLedger:
    """The compute slowdown that in-flight collectives cause, charged at their waits.

    One rule for the emulated interconnect (wall-clock times) and the simulator (simulated
    times), so their figures stay comparable: at the wait of a collective in flight over
    ``[start, end]``, reached at ``now``, the compute stream's time in ``[start, min(end, now)]``
    -- less the time it sat blocked in waits, less what an earlier wait already charged (two
    collectives in flight at once slow the same compute only once) -- costs
    ``share / (1 - share)`` extra seconds (``Interconnect.compute_interference``).
    """

    def __init__(self, share: float) -> None:
        if not 0.0 <= share < 1.0:
            raise ValueError(f"compute interference is a share of compute throughput in [0, 1), got {share}")
        self.factor = share / (1.0 - share)
        self._blocked: list[tuple[float, float]] = []   # the compute stream sat in a wait
        self._charged: list[tuple[float, float]] = []   # windows already charged

    def charge(self, start: float, end: float, now: float) -> float:
        """Extra compute seconds for the wait, reached at ``now``, of a collective in flight over
        ``[start, end]``."""
        a, b = start, min(end, now)
        if self.factor == 0.0 or b <= a:
            return 0.0
        covered = 0.0
        for x, y in _merge(self._charged + self._blocked):
            covered += max(0.0, min(b, y) - max(a, x))
        self._charged = _merge(self._charged + [(a, b)])
        return self.factor * max(0.0, (b - a) - covered)

    def block(self, start: float, end: float) -> None:
        """The compute stream was blocked in a wait over ``[start, end]`` (computing nothing)."""
        if end > start:
            self._blocked = _merge(self._blocked + [(start, end)])

    def forget_before(self, t: float) -> None:
        """Drop what ends before ``t`` (no collective in flight started earlier)."""
        self._blocked = [iv for iv in self._blocked if iv[1] > t]
        self._charged = [iv for iv in self._charged if iv[1] > t]


def simulate(ops: Sequence[SimOp], record: bool = False, interference: float = 0.0) -> SimResult:
    """Makespan, exposed communication and peak memory of ``ops`` in order; ``interference``:
    the share of compute throughput lost while a collective is in flight (``InterferenceLedger``).
    The host's own share (``SimOp.host_share``, on CPU ranks: gloo reduces and copies on the cores
    the compute needs) is charged by a second ledger over the first ``host_s`` of each collective's
    window, the time the real collective works; the two charges add."""
    t = 0.0
    channel_free: dict[str, float] = {}
    coll_end: dict[int, float] = {}
    coll_start: dict[int, float] = {}
    host_end: dict[int, float] = {}
    compute = comm = exposed = slowed = 0.0
    ledger = InterferenceLedger(interference)
    host = InterferenceLedger(max((o.host_share for o in ops if o.kind == Kind.COLLECTIVE), default=0.0))
    events: list[Event] = []
    for i, op in enumerate(ops):
        if op.kind == Kind.WAIT and op.wait_of is not None:
            end = coll_end.get(op.wait_of, t)
            extra = ledger.charge(coll_start.get(op.wait_of, t), end, t) if op.wait_of in coll_end else 0.0
            if op.wait_of in host_end:
                extra += host.charge(coll_start[op.wait_of], host_end[op.wait_of], t)
            done = max(end, t + extra)
            if end > t:
                exposed += end - t
                if record:
                    events.append(Event(op.name, "wait", t, end, "wait", op.tile))
            if done > max(end, t):
                slowed += done - max(end, t)
                if record:
                    events.append(Event(op.name, "compute", max(end, t), done, "interference", op.tile))
            ledger.block(t, done)
            host.block(t, done)
            t = done
        start = t
        t += op.compute_s
        compute += op.compute_s
        if record and op.compute_s > 0:
            events.append(Event(op.name, "compute", start, t, op.kind.value, op.tile))
        if op.kind == Kind.COLLECTIVE:
            ch = op.channel or "default"
            c_start = max(t, channel_free.get(ch, 0.0))
            c_end = c_start + op.comm_s
            channel_free[ch] = c_end
            coll_end[i] = c_end
            coll_start[i] = c_start
            if op.host_share > 0 and op.host_s > 0:
                host_end[i] = c_start + min(op.host_s, op.comm_s)
            comm += op.comm_s
            if record:
                events.append(Event(op.name, f"comm:{ch}", c_start, c_end, "collective", op.tile))
    # A collective nobody waits for still has to finish before the step is over.
    makespan = max([t, *coll_end.values()]) if coll_end else t
    return SimResult(makespan_s=makespan, compute_s=compute, comm_s=comm, exposed_comm_s=exposed,
                     peak_bytes=peak_memory(ops), events=events, interference_s=slowed)


def _op_from_ir(n: IRNode, cost: CostModel, offset: int) -> SimOp:
    op = SimOp(name=n.name, kind=n.kind, compute_s=cost.compute_s(n),
               inputs=tuple(offset + j for j in n.inputs), alloc_bytes=n.alloc_bytes,
               alias_of=None if n.alias_of is None else offset + n.alias_of, tile=n.tile, label=n.op)
    if n.kind == Kind.COLLECTIVE:
        op.comm_s = cost.collective_s(n.collective)
        op.host_s, op.host_share = host_cost(cost, n.collective)
        op.channel = n.collective.group
        # The functional all-reduce reduces a clone of its input in place: the input may die at
        # the issue. Gathers, scatters and all-to-alls read their input while in flight.
        op.holds_inputs = n.collective.kind != "all_reduce"
    if n.kind == Kind.WAIT and n.wait_of is not None:
        op.wait_of = offset + n.wait_of
    return op


def _hold_collective_inputs(ops: list[SimOp]) -> None:
    """A collective in flight holds its input buffer until its wait returns (the process group's
    work object keeps a reference), so the wait counts as a use of the collective's inputs --
    except for the all-reduce, whose work holds the clone it reduces (its output)."""
    for op in ops:
        if op.kind == Kind.WAIT and op.wait_of is not None and ops[op.wait_of].holds_inputs:
            op.inputs = tuple(dict.fromkeys((*op.inputs, *ops[op.wait_of].inputs)))


def _outputs(ir: GraphIR) -> list[int | None]:
    out = [n for n in ir.nodes if n.node.op == "output"]
    if not out:
        return []
    args = out[0].node.args[0]
    args = args if isinstance(args, (list, tuple)) else (args,)
    return [ir.index(a) if hasattr(a, "op") else None for a in args]


def graph_ops(ir: GraphIR, cost: CostModel, keep_outputs: bool = True) -> list[SimOp]:
    """Ops of one graph; inputs count as pre-existing, outputs are kept."""
    ops = [SimOp(name="<enter>", kind=Kind.OTHER, compute_s=cost.device.graph_overhead_s)]
    ops += [_op_from_ir(n, cost, 1) for n in ir.nodes]
    _hold_collective_inputs(ops)
    if keep_outputs:
        for j in _outputs(ir):
            if j is not None:
                ops[_root(ops, 1 + j)].keep = True
    return ops


def step_ops(fw: GraphIR, bw: GraphIR | None, cost: CostModel) -> list[SimOp]:
    """Ops of a training step: the AOT forward graph, then its backward graph.

    Saved activations (forward outputs read back by the backward placeholders) stay live until
    their last use in the backward; user outputs and gradients are kept.
    """
    ops = graph_ops(fw, cost, keep_outputs=False)
    fw_out = _outputs(fw)
    if bw is None:
        for j in fw_out:
            if j is not None:
                ops[_root(ops, 1 + j)].keep = True
        return ops
    bw_inputs = [n for n in bw.nodes if n.node.op == "placeholder"]
    n_saved = sum(1 for n in bw_inputs if not n.name.startswith("tangents"))
    user_out = fw_out[:len(fw_out) - n_saved]
    saved_out = fw_out[len(fw_out) - n_saved:]
    for j in user_out:
        if j is not None:
            ops[_root(ops, 1 + j)].keep = True
    offset = len(ops) + 1
    ops.append(SimOp(name="<backward>", kind=Kind.OTHER, compute_s=cost.device.graph_overhead_s))
    bw_ops = [_op_from_ir(n, cost, offset) for n in bw.nodes]
    for op in bw_ops:
        if op.kind == Kind.WAIT and op.wait_of is not None and bw_ops[op.wait_of - offset].holds_inputs:
            op.inputs = tuple(dict.fromkeys((*op.inputs, *bw_ops[op.wait_of - offset].inputs)))
    for k, n in enumerate(bw_inputs[:n_saved]):
        j = saved_out[k]
        if j is not None:
            bw_ops[n.index].alias_of = 1 + j
    ops += bw_ops
    for j in _outputs(bw):
        if j is not None:
            ops[_root(ops, offset + j)].keep = True
    return ops


def host_cost(cost: CostModel, info) -> tuple[float, float]:
    """(seconds the real collective ``info`` works on the host, the share of compute throughput
    it takes meanwhile): ``cost.host_collective_s`` and ``cost.host_interference`` where the cost
    model has them (measured on CPU ranks, ``calibrate.measure_host_interference``), else none."""
    share = float(getattr(cost, "host_interference", 0.0) or 0.0)
    fn = getattr(cost, "host_collective_s", None)
    return (float(fn(info)) if share > 0 and fn is not None else 0.0), share


def interference_of(cost: CostModel) -> float:
    """The compute-interference share of the link ``cost`` prices collectives on (0 without one)."""
    link = getattr(cost, "interconnect", None)
    return float(getattr(link, "compute_interference", 0.0) or 0.0)


def simulate_graphs(fw: GraphIR, bw: GraphIR | None, cost: CostModel, record: bool = False) -> SimResult:
    return simulate(step_ops(fw, bw, cost), record=record, interference=interference_of(cost))

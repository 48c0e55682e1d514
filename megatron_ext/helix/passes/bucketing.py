"""Bucketing: merge compatible tile collectives back into one launch where it pays.

Tiling turns one collective into K smaller ones (one per tile stream): more overlap, but K
latencies and smaller messages. A candidate bucket is the K tile collectives that came from the
same original collective (same ordinal in every stream, same group, kind, dtype and reduce op).
Merging it concatenates the K inputs, issues one collective after the last of them, waits where
the first tile waited and slices the results back -- which saves K-1 latencies but delays the
first tiles' data and keeps the concatenated buffer alive.

The simulator prices each candidate alone (makespan and peak-memory change of the whole
training step); a 0/1 knapsack dynamic program then picks the set of merges with the largest
predicted gain whose extra memory fits the budget. The chosen set is re-simulated as a whole;
merges are dropped (smallest gain first) until the combination is no worse than the best single
merge and within budget, because merges can interact through shared links.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from typing import Callable, Sequence

import torch
import torch.fx as fx

from megatron_ext.helix.cost import CostModel
from megatron_ext.helix.ir import CollectiveInfo, GraphIR, Kind, set_tile, value_of
from megatron_ext.helix.passes.checks import check_dependencies, impure_names
from megatron_ext.helix.simulator import SimOp, SimResult, host_cost, interference_of, simulate

logger = logging.getLogger(__name__)

_aten = torch.ops.aten
_DIM0 = ("all_gather", "reduce_scatter", "all_to_all")  # collectives structured along dim 0


@dataclasses.dataclass
class Candidate:
    graph: str                 # which graph of the step ("fw" or "bw")
    colls: list[fx.Node]       # one per tile stream, in stream order
    waits: list[fx.Node]
    info: CollectiveInfo       # of one tile
    op_index: list[int] = dataclasses.field(default_factory=list)   # colls in the step op list
    wait_index: list[int] = dataclasses.field(default_factory=list)
    input_index: list[int] = dataclasses.field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.graph}:{'+'.join(c.name for c in self.colls)}"


@dataclasses.dataclass
class BucketingReport:
    candidates: int = 0
    taken: list[str] = dataclasses.field(default_factory=list)
    refused: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (candidate, why)


def find_candidates(gm: fx.GraphModule, graph_tag: str, group_size: Callable[[str], int] | None = None
                    ) -> tuple[list[Candidate], list[tuple[str, str]]]:
    ir = GraphIR(gm, group_size=group_size)
    streams: dict[int, list] = defaultdict(list)
    for n in ir.collectives():
        if n.tile is not None:
            streams[n.tile].append(n)
    if len(streams) < 2:
        return [], []
    order = sorted(streams)
    out, refused = [], []
    for i in range(min(len(v) for v in streams.values())):
        group = [streams[s][i] for s in order]
        label = f"{graph_tag}:{'+'.join(g.name for g in group)}"
        if len({g.collective.bucket_key for g in group}) > 1:
            refused.append((label, "different group, kind, dtype or reduce op"))
            continue
        waits = [ir.wait_for(g) for g in group]
        if any(w is None for w in waits) or any(len(g.users) != 1 for g in group):
            refused.append((label, "a tile collective has no single wait"))
            continue
        if min(w.index for w in waits) < max(g.index for g in group):
            refused.append((label, "a tile waits before the last tile issues: merging would serialise the streams"))
            continue
        info = group[0].collective
        if info.kind in _DIM0:
            dim0 = {tuple(value_of(g.node.args[0]).shape[:1]) for g in group}
            if len(dim0) > 1:
                refused.append((label, "tiles differ along dim 0"))
                continue
        if info.kind == "broadcast":
            refused.append((label, "broadcast is not bucketed"))
            continue
        out.append(Candidate(graph=graph_tag, colls=[g.node for g in group], waits=[w.node for w in waits],
                             info=info))
    return out, refused


# -- simulation of merges on the step op list ------------------------------------------------------

def _merged_info(c: Candidate) -> CollectiveInfo:
    k = len(c.colls)
    return dataclasses.replace(c.info, in_bytes=c.info.in_bytes * k, out_bytes=c.info.out_bytes * k)


def _renumbered(op: SimOp, inputs: tuple[int, ...], alias_of: int | None, wait_of: int | None) -> SimOp:
    """``op`` with its references renumbered: itself when nothing moved (the simulator does not
    change ops), else a shallow copy (``dataclasses.replace`` costs 4x: this runs once per op per
    candidate and the step graphs hold thousands of ops)."""
    if inputs == op.inputs and alias_of == op.alias_of and wait_of == op.wait_of:
        return op
    new = object.__new__(SimOp)
    new.__dict__.update(op.__dict__, inputs=inputs, alias_of=alias_of, wait_of=wait_of)
    return new


def merged_ops(ops: Sequence[SimOp], merges: Sequence[Candidate], cost: CostModel) -> list[SimOp]:
    """``ops`` with each candidate's K collectives replaced by one bucket (same shape as the FX rewrite)."""
    dev = cost.device
    drop = {i for c in merges for i in (*c.op_index, *c.wait_index)}
    after_coll = {max(c.op_index): c for c in merges}
    at_wait = {min(c.wait_index): c for c in merges}
    new: list[SimOp] = []
    remap: dict[int, int] = {}
    bucket_coll: dict[int, int] = {}
    bucket_cat: dict[int, int] = {}

    def add(op: SimOp) -> int:
        new.append(op)
        return len(new) - 1

    def rm(i: int | None) -> int | None:
        return None if i is None else remap[i]

    for i, op in enumerate(ops):
        if i in at_wait:
            c = at_wait[i]
            w = add(SimOp(name=f"bucket_wait:{c.name}", kind=Kind.WAIT, wait_of=bucket_coll[id(c)],
                          inputs=(bucket_coll[id(c)], bucket_cat[id(c)]), alias_of=bucket_coll[id(c)],
                          compute_s=dev.op_overhead_s,
                          label="wait_tensor"))
            for wi in c.wait_index:
                out_bytes = c.info.out_bytes
                if c.info.kind in _DIM0:  # strided slice -> contiguous copy
                    o = add(SimOp(name=f"unbucket:{ops[wi].name}", kind=Kind.COMPUTE, inputs=(w,),
                                  alloc_bytes=out_bytes, compute_s=dev.op_overhead_s + 2 * out_bytes / dev.mem_bandwidth_Bps,
                                  tile=ops[wi].tile, label="clone"))
                else:
                    o = add(SimOp(name=f"unbucket:{ops[wi].name}", kind=Kind.VIEW, inputs=(w,), alias_of=w,
                                  compute_s=2 * dev.op_overhead_s, tile=ops[wi].tile, label="slice+view"))
                remap[wi] = o
        if i not in drop:
            remap[i] = add(_renumbered(op, tuple(remap[j] for j in op.inputs), rm(op.alias_of), rm(op.wait_of)))
        if i in after_coll:
            c = after_coll[i]
            total = c.info.in_bytes * len(c.colls)
            cat = add(SimOp(name=f"bucket_cat:{c.name}", kind=Kind.COMPUTE,
                            inputs=tuple(remap[j] for j in c.input_index), alloc_bytes=total,
                            compute_s=dev.op_overhead_s * (1 + len(c.colls)) + 2 * total / dev.mem_bandwidth_Bps,
                            label="cat"))
            bucket_cat[id(c)] = cat
            info = _merged_info(c)
            host_s, host_share = host_cost(cost, info)
            bucket_coll[id(c)] = add(SimOp(name=f"bucket:{c.name}", kind=Kind.COLLECTIVE, inputs=(cat,),
                                           alloc_bytes=info.out_bytes, compute_s=dev.op_overhead_s,
                                           comm_s=cost.collective_s(info), channel=info.group,
                                           label=info.kind, host_s=host_s, host_share=host_share))
    return new


def choose_merges(ops: Sequence[SimOp], cands: Sequence[Candidate], cost: CostModel,
                  budget_bytes: int | None, report: BucketingReport) -> tuple[list[Candidate], SimResult]:
    """Knapsack DP over per-candidate simulator estimates, then whole-set verification."""
    share = interference_of(cost)  # price merges under the same compute slowdown as the schedule
    base = simulate(ops, interference=share)
    items = []
    for c in cands:
        r = simulate(merged_ops(ops, [c], cost), interference=share)
        gain = base.makespan_s - r.makespan_s
        extra = max(r.peak_bytes - base.peak_bytes, 0)
        if gain <= 0:
            report.refused.append((c.name, f"no predicted gain ({gain * 1e3:+.3f} ms)"))
        elif budget_bytes is not None and r.peak_bytes > budget_bytes:
            report.refused.append((c.name, f"peak {r.peak_bytes} B over the budget {budget_bytes} B"))
        else:
            items.append((c, gain, extra))
    if not items:
        return [], base
    slack = math.inf if budget_bytes is None else budget_bytes - base.peak_bytes
    if slack == math.inf or sum(e for _, _, e in items) <= slack:
        chosen = [c for c, _, _ in items]
    else:
        unit = max(slack / 256.0, 1.0)
        cap = int(slack // unit)
        best = [0.0] * (cap + 1)
        take: list[list[bool]] = []
        for c, gain, extra in items:
            w = int(math.ceil(extra / unit))
            row = [False] * (cap + 1)
            for room in range(cap, w - 1, -1):
                if best[room - w] + gain > best[room]:
                    best[room] = best[room - w] + gain
                    row[room] = True
            take.append(row)
        chosen, room = [], cap
        for idx in range(len(items) - 1, -1, -1):
            if take[idx][room]:
                c, _, extra = items[idx]
                chosen.append(c)
                room -= int(math.ceil(extra / unit))
        for c, _, _ in items:
            if c not in chosen:
                report.refused.append((c.name, "left out by the memory-budget knapsack"))
    gains = {id(c): g for c, g, _ in items}
    best_single = max(gains[id(c)] for c in chosen) if chosen else 0.0
    chosen.sort(key=lambda c: -gains[id(c)])
    while chosen:
        r = simulate(merged_ops(ops, chosen, cost), interference=share)
        fits = budget_bytes is None or r.peak_bytes <= budget_bytes
        if fits and base.makespan_s - r.makespan_s >= best_single - 1e-12:
            return chosen, r
        dropped = chosen.pop()  # interactions: drop the smallest single gain and re-check
        report.refused.append((dropped.name, "dropped when the chosen set was simulated together"))
    return [], base


# -- the FX rewrite --------------------------------------------------------------------------------

def _fake_call(target, *args):
    vals = fx.node.map_arg(args, value_of)
    fake = torch._guards.detect_fake_mode([v for v in torch.utils._pytree.tree_leaves(vals)
                                           if isinstance(v, torch.Tensor)])
    if fake is None:
        return None
    with fake:
        return target(*vals)


def _call(graph: fx.Graph, target, *args) -> fx.Node:
    node = graph.call_function(target, tuple(args))
    val = _fake_call(target, *args)
    if val is not None:
        node.meta["val"] = val
    return node


def apply_merge(gm: fx.GraphModule, c: Candidate) -> None:
    """Rewrite the K tile collectives of ``c`` into one bucket, in place."""
    g = gm.graph
    pos = {n: i for i, n in enumerate(g.nodes)}
    last = max(c.colls, key=pos.__getitem__)
    first_wait = min(c.waits, key=pos.__getitem__)
    ins = [coll.args[0] for coll in c.colls]
    dim0 = c.info.kind in _DIM0
    cursor = last

    def after(target, *args) -> fx.Node:
        # inserting_after() puts every new node right after the same anchor: chain the anchor.
        nonlocal cursor
        with g.inserting_after(cursor):
            cursor = _call(g, target, *args)
        return cursor

    flats = [after(_aten.reshape.default, x, [value_of(x).shape[0], -1] if dim0 else [-1]) for x in ins]
    cat = after(_aten.cat.default, flats, 1 if dim0 else 0)
    coll = after(last.target, cat, *last.args[1:])
    with g.inserting_before(first_wait):
        wait = _call(g, first_wait.target, coll)
        offset = 0
        for x, w in zip(ins, c.waits):
            shape = list(value_of(w).shape)
            if dim0:
                width = math.prod(shape[1:])
                piece = _call(g, _aten.slice.Tensor, wait, 1, offset, offset + width)
                piece = _call(g, _aten.clone.default, piece)
                out = _call(g, _aten.view.default, piece, shape)
            else:
                width = math.prod(shape)
                piece = _call(g, _aten.slice.Tensor, wait, 0, offset, offset + width)
                out = _call(g, _aten.view.default, piece, shape)
            offset += width
            set_tile(out, None)
            w.replace_all_uses_with(out)
    for w in c.waits:
        g.erase_node(w)
    for coll_node in c.colls:
        g.erase_node(coll_node)


def bucket_graphs(graphs: dict[str, fx.GraphModule], ops: Sequence[SimOp], offsets: dict[str, int],
                  cost: CostModel, budget_bytes: int | None,
                  group_size: Callable[[str], int] | None = None) -> BucketingReport:
    """Pick merges for a training step (its ``ops`` from ``simulator.step_ops``) and apply them.

    ``offsets[tag]`` is where graph ``tag``'s node 0 sits in ``ops``.
    """
    report = BucketingReport()
    cands: list[Candidate] = []
    for tag, gm in graphs.items():
        found, refused = find_candidates(gm, tag, group_size)
        report.refused += refused
        index = {n: i for i, n in enumerate(gm.graph.nodes)}
        for c in found:
            off = offsets[tag]
            c.op_index = [off + index[n] for n in c.colls]
            c.wait_index = [off + index[n] for n in c.waits]
            c.input_index = [off + index[n.args[0]] for n in c.colls]
        cands += found
    report.candidates = len(cands) + len(report.refused)
    if not cands:
        return report
    chosen, _ = choose_merges(ops, cands, cost, budget_bytes, report)
    for tag, gm in graphs.items():
        mine = [c for c in chosen if c.graph == tag]
        if not mine:
            continue
        names = [n.name for n in gm.graph.nodes]
        impure = impure_names(gm.graph)
        replaced = {n.name for c in mine for n in (*c.colls, *c.waits)}
        for c in mine:
            apply_merge(gm, c)
            report.taken.append(c.name)
        check_dependencies(names, gm.graph, impure, replaced=replaced)
        gm.graph.lint()
        gm.recompile()
    return report

"""Segmented round-robin reordering of a tiled AOT graph (forward or backward).

Within one tile stream, the consecutive non-blocking compute and collective-issue nodes between
two waits form a segment; a wait opens the next segment of its stream. The schedule emits
segment 0 of every stream (stream 0, 1, ...), then segment 1 of every stream, and so on, so the
collective that ends one stream's segment is in flight while the other streams compute. Inside a
round, each stream first runs what its collective needs and issues it; the work of the round that
no collective needs (weight gradients, values saved for the backward) runs after every stream has
issued, under the collectives just started -- without it, the last stream's collective of a
backward would have nothing left to hide under. The order is produced by list scheduling (a node
runs only after all its inputs), so every original dependency holds by construction; waits stay
the only synchronisation points.

Nodes that belong to no tile stream (weights, joins, untiled regions) are placed just before the
earliest node that needs them, or -- when only untiled nodes need them -- as soon as they can
run after the streams ahead of them. Impure nodes keep their relative order.

The priorities depend only on the graph (node order, tile ids, node kinds), so every rank
computes the same order.
"""
from __future__ import annotations

import dataclasses
import heapq
import logging
from typing import Iterable

import torch.fx as fx

from megatron_ext.helix.ir import collective_kind, is_wait, set_tile, tile_of
from megatron_ext.helix.passes.checks import DependencyError, check_dependencies, check_graph, impure_names, is_impure

logger = logging.getLogger(__name__)

_INF = float("inf")


@dataclasses.dataclass
class ReorderReport:
    streams: int
    segments: dict[int, int]  # stream -> number of segments
    moved: int                # nodes whose position changed


def infer_tiles(graph: fx.Graph) -> dict[fx.Node, int | None]:
    """Tile stream of each node: its ``helix_tile`` tag, or -- for untagged nodes derived from
    exactly one stream (e.g. collectives inlined from an autograd.Function body) -- that stream."""
    tiles: dict[fx.Node, int | None] = {}
    for n in graph.nodes:
        t = tile_of(n)
        if t is None and n.op not in ("placeholder", "output", "get_attr"):
            seen = {tiles[a] for a in n.all_input_nodes if tiles.get(a) is not None}
            if len(seen) == 1:
                t = seen.pop()
        tiles[n] = t
    return tiles


def feeds_collective(graph: fx.Graph, tiles: dict[fx.Node, int | None], segment: dict[fx.Node, int]) -> set[fx.Node]:
    """Nodes of a stream segment that its collective issue needs (the issue included): the
    segment's critical path. The rest of the segment (weight gradients, values saved for the
    backward) can run while the collective is in flight."""
    crit: set[fx.Node] = set()
    for n in reversed(list(graph.nodes)):
        t = tiles.get(n)
        if t is None or n.op in ("placeholder", "output"):
            continue
        if collective_kind(n) is not None or any(
                u in crit and tiles.get(u) == t and segment.get(u) == segment[n] for u in n.users):
            crit.add(n)
    return crit


def segment_priorities(graph: fx.Graph, tiles: dict[fx.Node, int | None]) -> dict[fx.Node, tuple]:
    """Priority (segment, phase, stream, position, own stream, own position) of every node;
    smaller runs first.

    Phase 0 is a segment's critical path (what its collective needs, the wait that opens it
    included), phase 1 the rest: in each round the streams issue their collectives first, then do
    the work nothing is waiting for -- so weight gradients hide the collectives just issued."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    seg: dict[int, int] = {}
    segment: dict[fx.Node, int] = {}
    for n in nodes:
        t = tiles[n]
        if t is not None and n.op not in ("placeholder", "output"):
            if is_wait(n):
                seg[t] = seg.get(t, 0) + 1  # a wait opens its stream's next segment
            segment[n] = seg.get(t, 0)
    crit = feeds_collective(graph, tiles, segment)
    prio: dict[fx.Node, tuple] = {}
    for n in nodes:
        if n.op == "placeholder":
            prio[n] = (-1, 0, 0, pos[n], 0, pos[n])
        elif n in segment:
            prio[n] = (segment[n], 0 if n in crit else 1, tiles[n], pos[n], tiles[n], pos[n])
    late: list[fx.Node] = []
    for n in reversed(nodes):
        if n in prio:
            continue
        if n.op == "output":
            prio[n] = (_INF, _INF, _INF, pos[n], 0, pos[n])
            continue
        # An untiled node needed by a stream runs just before its earliest consumer.
        users = [prio[u] for u in n.users if u in prio]
        p = min(users) if users else (_INF,)
        if p[0] == _INF:
            late.append(n)
            prio[n] = (_INF, _INF, _INF, pos[n], 0, pos[n])
        else:
            prio[n] = (*p[:5], pos[n])
    # Untiled nodes that only untiled nodes need (joins, weight-gradient sums, untiled regions)
    # run as soon as their inputs are there, which frees tile results early.
    for n in reversed(late):
        ins = [prio[a] for a in n.all_input_nodes]
        p = max(ins) if ins else (-1, 0, 0, pos[n], 0, pos[n])
        prio[n] = (*p[:5], pos[n])
    # A stream's node that another stream's earlier work waits for (through a join: the keys and
    # values a query tile reads whole) runs with that work's priority, not after its own stream's
    # later work; several streams' such nodes run stream after stream (a query tile's keys come
    # from every stream: each stream's work before them runs whole, one stream at a time).
    for n in reversed(nodes):
        if n in segment:
            urgent = [prio[u] for u in n.users if u in prio and prio[u][:4] < prio[n][:4]]
            if urgent:
                prio[n] = (*min(urgent)[:4], tiles[n], pos[n])
    return prio


def lazy_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that read no tensor computed in the graph (a constant fill, a causal mask made from
    one, their casts): they are made just before their first consumer runs, not as early as they
    could be -- a stream's mask would otherwise be allocated whenever its stream stalls."""
    lazy: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "call_function" and not is_impure(n) and all(a in lazy for a in n.all_input_nodes) \
                and collective_kind(n) is None and not is_wait(n):
            lazy.add(n)
    return lazy


def schedule(graph: fx.Graph, prio: dict[fx.Node, tuple]) -> list[fx.Node]:
    """Topological order that always runs the ready node of smallest priority."""
    nodes = list(graph.nodes)
    deps: dict[fx.Node, set[fx.Node]] = {n: set(n.all_input_nodes) for n in nodes}
    impure = [n for n in nodes if is_impure(n)]
    for a, b in zip(impure, impure[1:]):
        deps[b].add(a)
    out_node = nodes[-1]
    for n in nodes[:-1]:
        deps[out_node].add(n)  # the output stays last
    users: dict[fx.Node, list[fx.Node]] = {n: [] for n in nodes}
    for n, ds in deps.items():
        for d in ds:
            users[d].append(n)
    lazy = lazy_nodes(graph) - {out_node}
    lazy = {n for n in lazy if deps[n] <= lazy}  # an impure predecessor makes a node eager
    # a lazy node counts as there for its consumers; it is emitted right before the first of them
    missing = {n: len(ds - lazy) for n, ds in deps.items()}
    ready = [(prio[n], i, n) for i, n in enumerate(nodes) if missing[n] == 0 and n not in lazy]
    heapq.heapify(ready)
    index = {n: i for i, n in enumerate(nodes)}
    order = []
    done: set[fx.Node] = set()

    def emit(n: fx.Node) -> None:
        for d in sorted(deps[n] & lazy, key=index.__getitem__):
            if d not in done:
                emit(d)
        done.add(n)
        order.append(n)

    while ready:
        _, _, n = heapq.heappop(ready)
        emit(n)
        for u in users[n]:
            if u in lazy:
                continue
            missing[u] -= 1
            if missing[u] == 0:
                heapq.heappush(ready, (prio[u], index[u], u))
    for n in nodes:  # lazy nodes nothing reads (dead code): where they were
        if n not in done:
            emit(n)
    if len(order) != len(nodes):
        raise DependencyError("helix reorder: the graph has a cycle")
    return order


def apply_order(graph: fx.Graph, order: Iterable[fx.Node]) -> int:
    """Move nodes into ``order`` in place; returns how many changed position."""
    before = {n: i for i, n in enumerate(graph.nodes)}
    order = list(order)
    prev = None
    for n in order:
        if prev is not None and prev.next is not n:
            prev.append(n)
        prev = n
    return sum(1 for i, n in enumerate(order) if before[n] != i)


def reorder_graph(gm: fx.GraphModule) -> tuple[fx.GraphModule, ReorderReport]:
    """Segmented round-robin reordering in place (returns ``gm``). Pre/post-checked."""
    graph = gm.graph
    problems = check_graph(graph)
    if problems:
        raise DependencyError("helix reorder: input graph is invalid: " + "; ".join(problems))
    tiles = infer_tiles(graph)
    for n, t in tiles.items():
        if t is not None and tile_of(n) is None:
            set_tile(n, t)  # keep the inferred stream for later passes and the summary
    streams = sorted({t for t in tiles.values() if t is not None})
    if len(streams) < 2:
        return gm, ReorderReport(streams=len(streams), segments={}, moved=0)
    names = [n.name for n in graph.nodes]
    impure = impure_names(graph)
    prio = segment_priorities(graph, tiles)
    moved = apply_order(graph, schedule(graph, prio))
    check_dependencies(names, graph, impure)
    graph.lint()
    gm.recompile()
    segs = {s: 1 + sum(1 for n in graph.nodes if tiles.get(n) == s and is_wait(n)) for s in streams}
    logger.debug("helix reorder: %d streams, segments %s, %d nodes moved", len(streams), segs, moved)
    return gm, ReorderReport(streams=len(streams), segments=segs, moved=moved)

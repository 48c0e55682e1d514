"""Tiling pass: split Dynamo's pre-autograd graph into K tile streams along the batch dimension.

Runs before autograd, so aot_autograd derives the tiled backward by itself. Every call reached
by a tiled value is replicated once per tile when its rule (``tiling_rules``) says how; a call
without a rule, or whose rule refuses, gets the tiles joined (concatenated) in front of it and the
reason is logged -- the region after it stays untiled. Tile nodes carry
``meta["custom"]["helix_tile"] = k``, which survives into the AOT forward and backward graphs
and defines the streams the reorder pass interleaves.

Along the sequence dimension the pass tiles only when asked (``seq_tiling``) and only through
calls whose rules prove independence along that dim (attention mixes positions and is refused).

In-place updates (``x.masked_fill_(...)``, ``x += y``, ``F.relu(x, inplace=True)``, ``out=``,
``x[i] = v``) change a tensor that later calls read through the same node *or through its views*.
Tiles are new tensors, so the pass keeps that contract explicitly: an update of a tiled tensor runs
per tile as its out-of-place twin (when the twin has an elementwise rule) or on the joined tiles,
and every later reader of the updated tensor reads the result. When a *view* of the updated storage
taken before the update is read after it (or the storage is a graph input), no per-tile rewrite can
keep the aliasing, and the whole graph stays untiled, with the reason logged.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import operator
from typing import Any, Mapping

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from megatron_ext.helix.ir import op_name, set_tile, value_of
from megatron_ext.helix.passes import tiling_shape_rules  # noqa: F401  (registers the shape, indexing,
#                                                                  collective and autograd.Function rules)
from megatron_ext.helix.passes.tiling_inplace import Aliases, Mutation, mutation_of, storage_key
from megatron_ext.helix.passes.tiling_rules import Plan, Refuse, RuleCtx, _elementwise, find_rule

logger = logging.getLogger(__name__)

_COPY_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr")


@dataclasses.dataclass
class TilingReport:
    tiles: int
    tiled_inputs: dict[str, int] = dataclasses.field(default_factory=dict)
    tiled_calls: int = 0
    joins: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # (node, op, reason)
    reason: str = ""  # why nothing was tiled

    @property
    def applied(self) -> bool:
        return self.tiled_calls > 0

    def missing_rules(self) -> dict[str, int]:
        """Operators that lacked a tiling rule, with how many calls of each were joined: what a
        user must change (or a rule to write) for the graph to overlap further."""
        out: dict[str, int] = {}
        for _, op, why in self.joins:
            if why.startswith("no tiling rule"):
                out[op] = out.get(op, 0) + 1
        return out


class _Untileable(Exception):
    """The graph cannot be tiled soundly at all (the message says why)."""


class _Tiled:
    """A tensor split into ``tiles`` along ``dim``; ``full`` is its join, made at most once."""

    __slots__ = ("dim", "tiles", "full")

    def __init__(self, dim: int, tiles: list[fx.Node], full: fx.Node | None = None) -> None:
        self.dim, self.tiles, self.full = dim, tiles, full


class _TiledTuple:
    """A tuple result computed per tile (``tiles[k]`` is tile k's tuple); item i is tiled along
    ``dims[i]``, or the same in every tile when that is None."""

    __slots__ = ("dims", "tiles")

    def __init__(self, dims: tuple, tiles: list[fx.Node]) -> None:
        self.dims, self.tiles = dims, tiles


def _is_model_state(ph: fx.Node) -> bool:
    """Parameters and buffers are used whole by every tile."""
    ga = ph.meta.get("grapharg")
    if ga is not None:
        if isinstance(getattr(ga, "example", None), torch.nn.Parameter):
            return True
        src = getattr(ga, "source", None)
        name = getattr(src, "name", "")
        name = name() if callable(name) else str(name)
        if "_parameters" in name or "_buffers" in name:
            return True
        if name and not name.startswith("L["):
            return True  # globals and other non-argument tensors are weights, not activations
        if name.startswith("L['self']"):
            return True  # a tensor attribute of the module (a rotary table): state, not an argument
    return isinstance(value_of(ph), torch.nn.Parameter)


def choose_input_dims(gm: fx.GraphModule, tiles: int, input_dims: Mapping[str, int] | None = None,
                      seq_tiling: bool = False, batch_size: int | None = None) -> tuple[dict[str, int], str]:
    """Which placeholders to tile along which dim, or an empty dict and the reason.

    ``batch_size`` known: the first dim of that size of every non-parameter input (so sequence-
    first hidden states ``[s, b, h]`` after a graph break are tiled along ``b``). Otherwise dim 0
    of every non-parameter input whose dim 0 has the most common size (> 1) among inputs; inputs
    of batch size 1 (e.g. shared position ids) are broadcast. With ``seq_tiling``, dim 1 is used
    when the batch cannot be split into ``tiles``.
    """
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if input_dims is not None:
        names = {n.name: n for n in phs} | {str(n.target): n for n in phs}
        out = {}
        for name, d in input_dims.items():
            if name not in names:
                raise ValueError(f"helix tiling: input_dims names {name!r}, not an input of the graph "
                                 f"(inputs: {', '.join(sorted(n.name for n in phs))})")
            out[names[name].name] = d
        return out, ""
    cands = [n for n in phs if isinstance(value_of(n), torch.Tensor) and value_of(n).dim() >= 1
             and not _is_model_state(n)]
    if not cands:
        return {}, "no activation inputs"
    if batch_size is not None and batch_size % tiles == 0:
        out = {}
        for n in cands:
            dims = [d for d, size in enumerate(value_of(n).shape) if size == batch_size]
            if dims:
                out[n.name] = dims[0]
        if out:
            return out, ""
    reason = "inputs have no dim to tile"
    for dim in ((0, 1) if seq_tiling else (0,)):
        if dim == 0 and batch_size is not None and batch_size % tiles:
            # the batch is known not to split: another input's dim 0 (a rotary table) is no batch
            reason = f"batch size {batch_size} is not divisible by {tiles} tiles"
            continue
        sizes = collections.Counter(int(value_of(n).shape[dim]) for n in cands
                                    if value_of(n).dim() > dim and value_of(n).shape[dim] > 1)
        if not sizes:
            continue
        size = max(sizes, key=lambda s: (sizes[s], -s))  # ties: the smaller size (batch <= sequence)
        if size % tiles == 0:
            return {n.name: dim for n in cands if value_of(n).dim() > dim and value_of(n).shape[dim] == size}, ""
        reason = f"{'batch' if dim == 0 else 'sequence'} size {size} is not divisible by {tiles} tiles"
    return {}, reason


def tile_graph(gm: fx.GraphModule, tiles: int = 2, input_dims: Mapping[str, int] | None = None,
               seq_tiling: bool = False, batch_size: int | None = None) -> tuple[fx.GraphModule, TilingReport]:
    """Return a tiled copy of ``gm`` (or ``gm`` itself when nothing can be tiled) and a report.

    The steps, in order: refuse a graph that cannot be tiled at all (:func:`_refusal`); choose the
    inputs to split and along which dim (:func:`choose_input_dims`); copy the graph node by node
    into tile streams (:meth:`_TileStreams.copy`), which leaves the graph untiled when an in-place
    update cannot be kept (:class:`_Untileable`); and wrap the copy as a module (:func:`_finish`).
    """
    report = TilingReport(tiles=tiles)
    report.reason = _refusal(gm, tiles)
    if report.reason:
        return gm, report
    dims, why = choose_input_dims(gm, tiles, input_dims, seq_tiling, batch_size)
    if not dims:
        report.reason = why
        return gm, report
    report.tiled_inputs = dict(dims)
    streams = _TileStreams(gm, tiles, report)
    try:
        for n in gm.graph.nodes:
            streams.copy(n, dims)
    except _Untileable as exc:
        report.reason, report.tiled_calls, report.joins = str(exc), 0, []
        logger.info("helix tiling: graph left untiled: %s", exc)
        return gm, report
    for node in reversed(list(streams.graph.nodes)):
        if node in streams.unused and not node.users:
            streams.graph.erase_node(node)
    return _finish(gm, streams.graph, report), report


_CREATE = (torch.ones, torch.zeros, torch.full)
_CASTS = {("method", "bool"), ("method", "float"), ("method", "to"), ("method", "half"), ("method", "bfloat16")}


def created_pattern(a: fx.Node) -> list[fx.Node] | None:
    """The nodes that make ``a`` from nothing -- a constant fill, at most one triangle (``triu``/
    ``tril``, megatron's causal mask), then casts -- creation first; None for anything else. Such
    a tensor's tiles can be made per tile instead of sliced from the whole."""
    chain, n = [], a
    while True:
        chain.append(n)
        if n.op == "call_function" and n.target in _CREATE:
            if n.all_input_nodes or any(isinstance(v, torch.SymInt) for v in n.args):
                return None
            break
        key = ("method", n.target) if n.op == "call_method" else n.target
        if not (key in _CASTS or key in (torch.triu, torch.tril)) or len(n.all_input_nodes) != 1:
            return None
        if key in _CASTS and any(isinstance(v, fx.Node) for v in (*n.args[1:], *n.kwargs.values())):
            return None
        if key in (torch.triu, torch.tril) and sum(m.target in (torch.triu, torch.tril) for m in chain) > 1:
            return None
        n = n.args[0]
        if not isinstance(n, fx.Node):
            return None
    chain.reverse()
    if len(value_of(chain[0]).shape) < 2 and any(m.target in (torch.triu, torch.tril) for m in chain):
        return None
    return chain


def _refusal(gm: fx.GraphModule, tiles: int) -> str:
    """Why ``gm`` cannot be tiled whatever its inputs, or "". Symbolic sizes are refused because
    a tile's size (``size // tiles``) must be a number the narrow calls can carry."""
    if tiles < 2:
        return "tiles < 2"
    for n in gm.graph.nodes:
        if any(isinstance(v, torch.SymInt) for v in tree_leaves(value_of(n))) or any(
                isinstance(s, torch.SymInt) for v in tree_leaves(value_of(n)) if isinstance(v, torch.Tensor)
                for s in v.shape):
            return "dynamic shapes (compile with dynamic=False)"
    return ""


def _finish(gm: fx.GraphModule, g: fx.Graph, report: TilingReport) -> fx.GraphModule:
    """The tiled graph as a module with ``gm``'s attributes and meta (the compiler reads both), and
    the report's reason when every tiled value was joined before use: tiled in name only."""
    if not report.applied and report.joins:
        node, op, why = report.joins[0]
        report.reason = f"every tiled value was joined before use (first before {node} ({op}): {why})"
    g.lint()
    new = fx.GraphModule(gm, g)
    new.meta.update(getattr(gm, "meta", {}))
    if report.joins:
        logger.info("helix tiling: %d calls tiled into %d streams, %d joins", report.tiled_calls, report.tiles,
                    len(report.joins))
    return new


def _tag(node: fx.Node, src: fx.Node | None, k: int | None) -> fx.Node:
    """Mark ``node`` as tile ``k``'s (None: no stream) and give it ``src``'s source location, so
    the streams and the user's lines survive into the AOT graphs."""
    if src is not None:
        for key in _COPY_META:
            if key in src.meta:
                node.meta[key] = src.meta[key]
    set_tile(node, k)
    return node


class _TileStreams:
    """The tiled copy under construction: ``graph``, and in ``env`` what stands there for each
    node of the original already copied (a node, a :class:`_Tiled` or a :class:`_TiledTuple`).

    Nodes are copied in the original's order, so every step reads only what earlier nodes left in
    ``env``; joins and per-tile slices of a value are made once and shared by its later readers.
    """

    def __init__(self, gm: fx.GraphModule, tiles: int, report: TilingReport) -> None:
        self.gm, self.tiles, self.report = gm, tiles, report
        self.graph = fx.Graph()
        self.env: dict[fx.Node, Any] = {}
        self.split_cache: dict[tuple[fx.Node, int], list[fx.Node]] = {}
        self.unused: set[fx.Node] = set()  # whole copies replaced by per-tile creations (dropped if unread)
        self.aliases: Aliases | None = None   # built at the first in-place update: most graphs have none
        self.same_tensor: dict[fx.Node, set[fx.Node]] = {}  # node -> every node that *is* its tensor (update chains)

    # -- one node ---------------------------------------------------------------------------------
    def copy(self, n: fx.Node, dims: Mapping[str, int]) -> None:
        """Copy ``n`` by the first rule that applies: inputs and the output; in-place updates (which
        must stay visible to later readers); untiled calls as they are; items of tiled tuples per
        tile; any other call per tile by its tiling rule, or on the joined tiles."""
        if n.op == "placeholder":
            self.copy_input(n, dims)
            return
        if n.op == "output":
            self.graph.output(fx.node.map_arg(n.args[0], self.full))
            return
        if n.op == "call_function" and n.target is getattr and not n.users:
            return  # a dead attribute read (Dynamo records ``x._base`` checks): nothing to join for
        tiled = {a: self.env[a] for a in n.all_input_nodes if not isinstance(self.env[a], fx.Node)}
        mut = mutation_of(n)
        if mut is not None:
            self.copy_update(n, mut, tiled)
            return
        if not tiled or n.op == "get_attr":
            self.env[n] = self.graph.node_copy(n, self.full)
            return
        if n.op == "call_function" and n.target is operator.getitem \
                and isinstance(self.env[n.args[0]], _TiledTuple) and isinstance(n.args[1], int):
            self.pick_item(n)
            return
        plan = self.plan_for(n, tiled)
        if plan is not None:
            self.replicate(n, plan)

    def copy_input(self, n: fx.Node, dims: Mapping[str, int]) -> None:
        """Copy the placeholder ``n``; when ``dims`` names it, narrow it per tile along that dim. The
        placeholder itself stands for the joined tiles, so joining a tiled input costs no concatenation."""
        ph = self.graph.node_copy(n)
        if hasattr(n, "_dynamo_source"):  # aot_autograd reads it to map inputs to their sources
            ph._dynamo_source = n._dynamo_source
        self.env[n] = ph
        if n.name not in dims:
            return
        d = dims[n.name]
        size = value_of(n).shape[d]
        if size % self.tiles:
            raise ValueError(f"helix tiling: input {n.name} has size {size} along dim {d}, "
                             f"not divisible by {self.tiles} tiles")
        step = size // self.tiles
        self.env[n] = _Tiled(d, [_tag(self.graph.call_function(torch.narrow, (ph, d, k * step, step)), n, k)
                                 for k in range(self.tiles)], full=ph)

    def pick_item(self, n: fx.Node) -> None:
        """``t[i]`` of a tiled tuple (chunk, max, autograd.Function outputs): item ``i`` of each tile;
        an item that is the same in every tile (its dim None) is taken from tile 0."""
        st = self.env[n.args[0]]
        d = st.dims[n.args[1]]
        items = [_tag(self.graph.call_function(operator.getitem, (t, n.args[1])), n, k) for k, t in enumerate(st.tiles)]
        self.env[n] = items[0] if d is None else _Tiled(d, items)

    def plan_for(self, n: fx.Node, tiled: Mapping[fx.Node, Any]) -> Plan | None:
        """How to run ``n`` per tile, from its rule; None after joining the tiles in front of it
        when it has no rule, takes a whole tiled tuple, or its rule refuses."""
        fn = find_rule(n)
        ctx_dims = {a: (st.dim if isinstance(st, _Tiled) else st.dims) for a, st in tiled.items()}
        try:
            if fn is None:
                raise Refuse(f"no tiling rule for {op_name(n)}")
            if any(isinstance(st, _TiledTuple) for st in tiled.values()):
                raise Refuse("takes a whole tiled tuple")
            return fn(RuleCtx(node=n, dims=ctx_dims, tiles=self.tiles))
        except Refuse as exc:
            self.join(n, str(exc))
            return None

    def join(self, n: fx.Node, reason: str) -> None:
        """Copy ``n`` once on the joined tiles of its inputs, recording and logging ``reason``: the
        region after it stays untiled unless a later input is tiled."""
        self.report.joins.append((n.name, op_name(n), reason))
        logger.info("helix tiling: joining %d tiles before %s (%s): %s", self.tiles, n.name, op_name(n), reason)
        self.env[n] = self.graph.node_copy(n, self.full)

    def replicate(self, n: fx.Node, plan: Plan) -> None:
        """Copy ``n`` once per tile as ``plan`` says (once in all, untagged, for a ``single`` plan:
        a result every tile shares, such as metadata)."""
        outs = []
        detached: dict[fx.Node, fx.Node] = {}
        for k in range(1 if plan.single else self.tiles):
            arg = functools.partial(self.arg_of_tile, plan=plan, k=k, detached=detached)
            args, kwargs = fx.node.map_arg(n.args, arg), fx.node.map_arg(n.kwargs, arg)
            if plan.rewrite is not None:
                args, kwargs = plan.rewrite(k, tuple(args), dict(kwargs))
            node = self.graph.create_node(plan.op or n.op, plan.target if plan.target is not None else n.target,
                                          tuple(args), dict(kwargs))
            outs.append(_tag(node, n, k))
        if plan.single:
            set_tile(outs[0], None)
            self.env[n] = outs[0]
            return
        self.report.tiled_calls += 1
        self.env[n] = (_TiledTuple(tuple(plan.out_dim), outs) if isinstance(plan.out_dim, tuple)
                       else _Tiled(plan.out_dim, outs))

    def arg_of_tile(self, a: fx.Node, plan: Plan, k: int, detached: dict[fx.Node, fx.Node]) -> Any:
        """What tile ``k``'s copy of a call reads for its input ``a``: its own tile, a slice of an
        untiled input the plan splits, a detached input whose gradient must count once (every tile
        after the first; ``detached`` shares one detach per call), or the untiled input whole."""
        st = self.env[a]
        if a in plan.whole:
            return self.full(a)
        if isinstance(st, (_Tiled, _TiledTuple)):
            return st.tiles[k]
        if a in plan.split:
            return self.split(a, plan.split[a], k)
        if a in plan.once and k > 0:
            if a not in detached:
                detached[a] = _tag(self.graph.call_method("detach", (st,)), None, None)
            return detached[a]
        return st

    # -- joins and slices -------------------------------------------------------------------------
    def full(self, a: fx.Node) -> Any:
        """``a`` whole in the new graph: its copy, or its tiles concatenated (once per tiled tensor;
        a tiled tuple's items are joined each time it is asked for)."""
        st = self.env[a]
        if isinstance(st, fx.Node):
            return st
        if isinstance(st, _Tiled):
            if st.full is None:
                st.full = _tag(self.graph.call_function(torch.cat, (list(st.tiles), st.dim)), None, None)
            return st.full
        items = []
        for i, d in enumerate(st.dims):
            parts = [self.graph.call_function(operator.getitem, (t, i)) for t in st.tiles]
            items.append(parts[0] if d is None else self.graph.call_function(torch.cat, (parts, d)))
        return tuple(items)

    def split(self, a: fx.Node, dim: int, k: int) -> fx.Node:
        """Tile ``k`` of the untiled ``a`` along ``dim``, narrowed once per (input, dim) and shared
        by every call that splits it."""
        key = (a, dim)
        if key not in self.split_cache:
            size = int(value_of(a).shape[dim]) // self.tiles
            chain = created_pattern(a)
            if chain is not None:  # made per tile: the whole one is never allocated
                self.split_cache[key] = [self.create_tile(chain, dim, j, size) for j in range(self.tiles)]
                self.unused.update(self.env[m] for m in chain)
            else:
                src = self.full(a)
                self.split_cache[key] = [_tag(self.graph.call_function(torch.narrow, (src, dim, j * size, size)),
                                              None, j) for j in range(self.tiles)]
        return self.split_cache[key][k]

    def create_tile(self, chain: list[fx.Node], dim: int, k: int, size: int) -> fx.Node:
        """Tile ``k`` (rows ``k * size`` on along ``dim``) of the tensor ``chain`` creates from
        nothing: the creation with that dim shrunk, a triangle's diagonal shifted by the rows or
        columns the tile starts at, the casts as they were."""
        fill, *rest = chain
        nd = len(value_of(fill).shape)
        shape = list(value_of(fill).shape)
        shape[dim] = size
        args = (tuple(shape), *fill.args[1:]) if fill.target is torch.full else tuple(shape)
        kwargs = {key: v for key, v in fill.kwargs.items() if key != "size"}
        node = _tag(self.graph.call_function(fill.target, args, kwargs), fill, k)
        for m in rest:
            if m.target in (torch.triu, torch.tril):
                diag = m.kwargs.get("diagonal", m.args[1] if len(m.args) > 1 else 0)
                diag += k * size if dim == nd - 2 else -k * size if dim == nd - 1 else 0
                node = _tag(self.graph.call_function(m.target, (node,), {"diagonal": diag}), m, k)
            else:
                node = _tag(self.graph.create_node(m.op, m.target, (node, *m.args[1:]), dict(m.kwargs)), m, k)
        return node

    # -- in-place updates (the module docstring) --------------------------------------------------
    def copy_update(self, n: fx.Node, mut: Mutation, tiled: Mapping[fx.Node, Any]) -> None:
        """Copy the in-place call ``n`` so that every later reader of the updated tensor reads the
        update; raise :class:`_Untileable` when that cannot be kept."""
        x = mut.target
        same = self.same_tensor_of(n, mut)
        if self.aliases is None:
            self.aliases = Aliases(self.gm)
        st = self.env[x]
        if not tiled and not self.storage_is_tiled(x):
            self.env[n] = self.graph.node_copy(n, self.full)
            return
        problem, _ = self.aliases.stale_reader(n, x, same)
        if problem:
            raise _Untileable(f"in-place {op_name(n)} at {n.name}: {problem}")
        if isinstance(st, _TiledTuple):
            raise _Untileable(f"in-place {op_name(n)} at {n.name} updates a tiled tuple")
        if not isinstance(st, _Tiled):
            self.env[n] = self.graph.node_copy(n, self.full)  # an untiled tensor updated with joined operands
            return
        new = self.update_tiles(n, mut, st)
        for m in same:
            if m in self.env:
                self.env[m] = new

    def same_tensor_of(self, n: fx.Node, mut: Mutation) -> set[fx.Node]:
        """Every node that is the tensor ``n`` updates (``x``, ``x.add_(1)``, ...), ``n`` joining
        the set when it returns that tensor: after the update they must all read the result."""
        x = mut.target
        same = self.same_tensor.setdefault(x, {x})
        if mut.returns_target:
            same.add(n)
            self.same_tensor[n] = same
        return same

    def storage_is_tiled(self, x: fx.Node) -> bool:
        """Whether a node copied so far that shares ``x``'s storage is tiled: an update of an untiled
        view of it must then be checked and rewritten like an update of the tiled value."""
        key = storage_key(x)
        return any(not isinstance(self.env.get(m), fx.Node) for m in self.aliases.by_storage.get(key, ())
                   if m in self.env)

    def update_tiles(self, n: fx.Node, mut: Mutation, st: _Tiled) -> Any:
        """The tiled tensor ``st`` after the update ``n``: its twin run per tile when the twin's
        elementwise rule keeps the tile dim, else the joined tiles with the update written into them."""
        outs = self.per_tile_twin(n, mut, st) if mut.twin is not None and mut.returns_target else None
        if outs is not None:
            self.report.tiled_calls += 1
            new = _Tiled(st.dim, outs)
            self.env[n] = new
            return new
        joined = self.full(mut.target)  # the tiles joined once; the update writes into the join
        why = "no out-of-place twin with an elementwise rule" if mut.twin is None else "twin not tileable"
        self.join(n, f"in-place update: {why}")
        return joined

    def per_tile_twin(self, n: fx.Node, mut: Mutation, st: _Tiled) -> list[fx.Node] | None:
        """The out-of-place twin of ``n`` per tile, cast back to the updated tensor's dtype where the
        twin may promote; None when its elementwise rule refuses, moves the tile dim, or would
        slice the updated tensor itself."""
        ctx_dims = {a: (v.dim if isinstance(v, _Tiled) else v.dims) for a in n.all_input_nodes
                    if not isinstance((v := self.env[a]), fx.Node)}
        try:
            plan = _elementwise(RuleCtx(node=n, dims=ctx_dims, tiles=self.tiles))
        except Refuse:
            return None
        if plan.out_dim != st.dim or mut.target in plan.split:
            return None
        dtype = value_of(mut.target).dtype
        cast = dtype == torch.bool or any(
            value_of(a).dtype not in (dtype, torch.bool) for a in n.all_input_nodes
            if a is not mut.target and isinstance(value_of(a), torch.Tensor))
        op, target = mut.twin
        outs = []
        for k in range(self.tiles):
            arg = functools.partial(self.arg_of_tile, plan=plan, k=k, detached={})
            node = _tag(self.graph.create_node(op, target, tuple(fx.node.map_arg(n.args, arg)),
                                               dict(fx.node.map_arg(n.kwargs, arg))), n, k)
            if cast:  # in-place keeps the dtype of the updated tensor; the twin may promote
                node = _tag(self.graph.call_method("to", (node, dtype)), n, k)
            outs.append(node)
        return outs

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
import inspect
import logging
import operator
from typing import Any, Mapping

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from megatron_ext.helix.ir import op_name, set_tile, value_of
from megatron_ext.helix.passes import tiling_shape_rules  # noqa: F401  (registers the shape, indexing,
#                                                                  collective and autograd.Function rules)
from megatron_ext.helix.passes.tiling_rules import RULES, Plan, Refuse, RuleCtx, _elementwise, find_rule

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
    __slots__ = ("dim", "tiles", "full")

    def __init__(self, dim: int, tiles: list[fx.Node], full: fx.Node | None = None) -> None:
        self.dim, self.tiles, self.full = dim, tiles, full


class _TiledTuple:
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
    return isinstance(value_of(ph), torch.nn.Parameter)


# -- in-place updates ------------------------------------------------------------------------------

# operator.iadd(x, y) on tensors updates x; its out-of-place twin.
_INPLACE_OPERATORS = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv, operator.imod: operator.mod,
    operator.ipow: operator.pow, operator.iand: operator.and_, operator.ior: operator.or_,
    operator.ixor: operator.xor,
}


def _inplace_flag(node: fx.Node) -> bool:
    """``F.relu(x, inplace=True)`` and friends (keyword or positional)."""
    if node.kwargs.get("inplace") is True:
        return True
    try:
        params = list(inspect.signature(node.target).parameters)
    except (TypeError, ValueError):
        return False
    if "inplace" not in params:
        return False
    i = params.index("inplace")
    return len(node.args) > i and node.args[i] is True


@dataclasses.dataclass(frozen=True)
class Mutation:
    """A call that writes into ``target`` (a node of the graph)."""

    target: fx.Node
    returns_target: bool        # the call's result is ``target`` itself (``x.add_(y)``; not setitem)
    twin: tuple[str, Any] | None  # out-of-place (op, target) with the same arguments, if any


def mutation_of(node: fx.Node) -> Mutation | None:
    """What ``node`` updates in place, or None. By name: a tensor method or ``torch`` function whose
    name ends in one ``_`` (not ``operator.and_``), the in-place operators, ``setitem``,
    ``inplace=True``, ``out=`` and ATen overloads whose schema writes an argument."""
    if node.op not in ("call_method", "call_function") or not node.args:
        return None
    first = node.args[0]
    out = node.kwargs.get("out")
    if isinstance(out, fx.Node):
        return Mutation(out, True, None)
    t = node.target
    if node.op == "call_method":
        if isinstance(t, str) and t.endswith("_") and not t.startswith("_") and isinstance(first, fx.Node):
            twin = t[:-1]
            ok = RULES.get(("method", twin)) is _elementwise
            return Mutation(first, True, ("call_method", twin) if ok else None)
        return None
    if t is operator.setitem and isinstance(first, fx.Node):
        return Mutation(first, False, None)
    if t in _INPLACE_OPERATORS and isinstance(first, fx.Node):
        if not isinstance(value_of(first), torch.Tensor):
            return None  # Python numbers: a new value, not an update
        return Mutation(first, True, ("call_function", _INPLACE_OPERATORS[t]))
    if isinstance(t, torch._ops.OpOverload):
        for i, a in enumerate(t._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                arg = node.kwargs.get(a.name, node.args[i] if i < len(node.args) else None)
                if isinstance(arg, fx.Node):
                    return Mutation(arg, True, None)
        return None
    name = getattr(t, "__name__", "")
    torch_fn = bool(name) and (getattr(torch, name, None) is t or getattr(torch.Tensor, name, None) is t)
    if torch_fn and isinstance(first, fx.Node) and name.endswith("_") and not name.endswith("__"):
        twin = getattr(torch, name[:-1], None)
        ok = twin is not None and RULES.get(twin) is _elementwise
        return Mutation(first, True, ("call_function", twin) if ok else None)
    if isinstance(first, fx.Node) and callable(t) and _inplace_flag(node):
        return Mutation(first, True, None)
    return None


def _storage_key(node: fx.Node) -> Any:
    v = value_of(node)
    if not isinstance(v, torch.Tensor):
        return None
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(v.untyped_storage())
    except Exception:  # noqa: BLE001 -- no storage (exotic subclass): treated as unknown
        return None


class _Aliases:
    """Storage aliasing and positions in the original graph, to check in-place updates."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.pos = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.last_use = {n: max((self.pos[u] for u in n.users), default=self.pos[n]) for n in gm.graph.nodes}
        self.by_storage: dict[Any, list[fx.Node]] = collections.defaultdict(list)
        for n in gm.graph.nodes:
            key = _storage_key(n)
            if key is not None:
                self.by_storage[key].append(n)

    def stale_reader(self, node: fx.Node, target: fx.Node, same: set[fx.Node]) -> tuple[str, fx.Node | None]:
        """(problem, alias) when the update ``node`` of ``target`` cannot be rewritten per tile:
        the storage is a graph input, unknown, or one of its other views taken before the update
        is read after it."""
        key = _storage_key(target)
        if key is None:
            return f"the storage of {target.name} is unknown", None
        here = self.pos[node]
        for m in self.by_storage[key]:
            if m.op in ("placeholder", "get_attr"):
                return f"updates the graph input {m.name} in place", m
            if m in same or m is node:
                continue
            if self.pos[m] < here < self.last_use[m]:
                return f"{m.name} views the updated storage and is read afterwards", m
        return "", None


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
    """Return a tiled copy of ``gm`` (or ``gm`` itself when nothing can be tiled) and a report."""
    report = TilingReport(tiles=tiles)
    if tiles < 2:
        report.reason = "tiles < 2"
        return gm, report
    for n in gm.graph.nodes:
        if any(isinstance(v, torch.SymInt) for v in tree_leaves(value_of(n))) or any(
                isinstance(s, torch.SymInt) for v in tree_leaves(value_of(n)) if isinstance(v, torch.Tensor)
                for s in v.shape):
            report.reason = "dynamic shapes (compile with dynamic=False)"
            return gm, report
    dims, why = choose_input_dims(gm, tiles, input_dims, seq_tiling, batch_size)
    if not dims:
        report.reason = why
        return gm, report
    report.tiled_inputs = dict(dims)

    g = fx.Graph()
    env: dict[fx.Node, Any] = {}
    split_cache: dict[tuple[fx.Node, int], list[fx.Node]] = {}

    def tag(node: fx.Node, src: fx.Node | None, k: int | None) -> fx.Node:
        if src is not None:
            for key in _COPY_META:
                if key in src.meta:
                    node.meta[key] = src.meta[key]
        set_tile(node, k)
        return node

    def full(a: fx.Node) -> Any:
        st = env[a]
        if isinstance(st, fx.Node):
            return st
        if isinstance(st, _Tiled):
            if st.full is None:
                st.full = tag(g.call_function(torch.cat, (list(st.tiles), st.dim)), None, None)
            return st.full
        items = []
        for i, d in enumerate(st.dims):
            parts = [g.call_function(operator.getitem, (t, i)) for t in st.tiles]
            items.append(parts[0] if d is None else g.call_function(torch.cat, (parts, d)))
        return tuple(items)

    def split(a: fx.Node, dim: int, k: int) -> fx.Node:
        key = (a, dim)
        if key not in split_cache:
            src = full(a)
            size = int(value_of(a).shape[dim]) // tiles
            split_cache[key] = [tag(g.call_function(torch.narrow, (src, dim, j * size, size)), None, j)
                                for j in range(tiles)]
        return split_cache[key][k]

    aliases: _Aliases | None = None
    same_tensor: dict[fx.Node, set[fx.Node]] = {}  # node -> every node that *is* its tensor (update chains)

    def update(n: fx.Node, mut: Mutation, tiled: dict[fx.Node, Any]) -> None:
        """Copy the in-place call ``n`` so that every later reader of the updated tensor reads the
        update (see the module docstring); raise :class:`_Untileable` when that cannot be kept."""
        nonlocal aliases
        x = mut.target
        same = same_tensor.setdefault(x, {x})
        if mut.returns_target:
            same.add(n)
            same_tensor[n] = same
        if aliases is None:
            aliases = _Aliases(gm)
        key = _storage_key(x)
        tiled_alias = any(not isinstance(env.get(m), fx.Node) for m in aliases.by_storage.get(key, ()) if m in env)
        st = env[x]
        if not tiled and not tiled_alias:
            env[n] = g.node_copy(n, full)
            return
        problem, _ = aliases.stale_reader(n, x, same)
        if problem:
            raise _Untileable(f"in-place {op_name(n)} at {n.name}: {problem}")
        if isinstance(st, _TiledTuple):
            raise _Untileable(f"in-place {op_name(n)} at {n.name} updates a tiled tuple")
        if not isinstance(st, _Tiled):
            env[n] = g.node_copy(n, full)  # an untiled tensor updated with joined operands
            return
        outs = per_tile_twin(n, mut, st) if mut.twin is not None and mut.returns_target else None
        if outs is not None:
            report.tiled_calls += 1
            new: Any = _Tiled(st.dim, outs)
            env[n] = new
        else:
            joined = full(x)  # the tiles joined once; the update writes into the join
            why = "no out-of-place twin with an elementwise rule" if mut.twin is None else "twin not tileable"
            report.joins.append((n.name, op_name(n), f"in-place update: {why}"))
            logger.info("helix tiling: joining %d tiles before %s (%s): in-place update: %s", tiles, n.name,
                        op_name(n), why)
            env[n] = g.node_copy(n, full)
            new = joined
        for m in same:
            if m in env:
                env[m] = new

    def per_tile_twin(n: fx.Node, mut: Mutation, st: _Tiled) -> list[fx.Node] | None:
        ctx_dims = {a: (v.dim if isinstance(v, _Tiled) else v.dims) for a in n.all_input_nodes
                    if not isinstance((v := env[a]), fx.Node)}
        try:
            plan = _elementwise(RuleCtx(node=n, dims=ctx_dims, tiles=tiles))
        except Refuse:
            return None
        if plan.out_dim != st.dim or mut.target in plan.split:
            return None
        dtype = value_of(mut.target).dtype
        cast = dtype == torch.bool or any(
            value_of(a).dtype not in (dtype, torch.bool) for a in n.all_input_nodes
            if a is not mut.target and isinstance(value_of(a), torch.Tensor))
        outs = []
        for k in range(tiles):
            def arg_k(a: fx.Node, k: int = k) -> Any:
                v = env[a]
                if isinstance(v, _Tiled):
                    return v.tiles[k]
                return split(a, plan.split[a], k) if a in plan.split else v

            op, target = mut.twin
            node = tag(g.create_node(op, target, tuple(fx.node.map_arg(n.args, arg_k)),
                                     dict(fx.node.map_arg(n.kwargs, arg_k))), n, k)
            if cast:  # in-place keeps the dtype of the updated tensor; the twin may promote
                node = tag(g.call_method("to", (node, dtype)), n, k)
            outs.append(node)
        return outs

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            ph = g.node_copy(n)
            if hasattr(n, "_dynamo_source"):  # aot_autograd reads it to map inputs to their sources
                ph._dynamo_source = n._dynamo_source
            env[n] = ph
            if n.name in dims:
                d = dims[n.name]
                size = value_of(n).shape[d]
                if size % tiles:
                    raise ValueError(f"helix tiling: input {n.name} has size {size} along dim {d}, "
                                     f"not divisible by {tiles} tiles")
                env[n] = _Tiled(d, [tag(g.call_function(torch.narrow, (ph, d, k * (size // tiles), size // tiles)),
                                        n, k) for k in range(tiles)], full=ph)
            continue
        if n.op == "output":
            g.output(fx.node.map_arg(n.args[0], full))
            continue
        if n.op == "call_function" and n.target is getattr and not n.users:
            continue  # a dead attribute read (Dynamo records ``x._base`` checks): nothing to join for
        tiled = {a: env[a] for a in n.all_input_nodes if not isinstance(env[a], fx.Node)}
        mut = mutation_of(n)
        if mut is not None:
            try:
                update(n, mut, tiled)
            except _Untileable as exc:
                report.reason, report.tiled_calls, report.joins = str(exc), 0, []
                logger.info("helix tiling: graph left untiled: %s", exc)
                return gm, report
            continue
        if not tiled or n.op == "get_attr":
            env[n] = g.node_copy(n, full)
            continue
        # Items of a tiled tuple (chunk, max, autograd.Function outputs) are picked per tile.
        if n.op == "call_function" and n.target is operator.getitem and isinstance(env[n.args[0]], _TiledTuple) \
                and isinstance(n.args[1], int):
            st = env[n.args[0]]
            d = st.dims[n.args[1]]
            items = [tag(g.call_function(operator.getitem, (t, n.args[1])), n, k) for k, t in enumerate(st.tiles)]
            env[n] = items[0] if d is None else _Tiled(d, items)
            continue
        plan: Plan | None = None
        fn = find_rule(n)
        ctx_dims = {a: (st.dim if isinstance(st, _Tiled) else st.dims) for a, st in tiled.items()}
        try:
            if fn is None:
                raise Refuse(f"no tiling rule for {op_name(n)}")
            if any(isinstance(st, _TiledTuple) for st in tiled.values()):
                raise Refuse("takes a whole tiled tuple")
            plan = fn(RuleCtx(node=n, dims=ctx_dims, tiles=tiles))
        except Refuse as exc:
            report.joins.append((n.name, op_name(n), str(exc)))
            logger.info("helix tiling: joining %d tiles before %s (%s): %s", tiles, n.name, op_name(n), exc)
            env[n] = g.node_copy(n, full)
            continue
        outs = []
        detached: dict[fx.Node, fx.Node] = {}
        for k in range(1 if plan.single else tiles):
            def arg_k(a: fx.Node, k: int = k) -> Any:
                st = env[a]
                if isinstance(st, (_Tiled, _TiledTuple)):
                    return st.tiles[k]
                if a in plan.split:
                    return split(a, plan.split[a], k)
                if a in plan.once and k > 0:
                    if a not in detached:
                        detached[a] = tag(g.call_method("detach", (st,)), None, None)
                    return detached[a]
                return st

            args = fx.node.map_arg(n.args, arg_k)
            kwargs = fx.node.map_arg(n.kwargs, arg_k)
            if plan.rewrite is not None:
                args, kwargs = plan.rewrite(k, tuple(args), dict(kwargs))
            node = g.create_node(plan.op or n.op, plan.target if plan.target is not None else n.target,
                                 tuple(args), dict(kwargs))
            outs.append(tag(node, n, k))
        if plan.single:
            set_tile(outs[0], None)
            env[n] = outs[0]
            continue
        report.tiled_calls += 1
        env[n] = _TiledTuple(tuple(plan.out_dim), outs) if isinstance(plan.out_dim, tuple) else _Tiled(plan.out_dim, outs)

    if not report.applied and report.joins:
        node, op, why = report.joins[0]
        report.reason = f"every tiled value was joined before use (first before {node} ({op}): {why})"
    g.lint()
    new = fx.GraphModule(gm, g)
    new.meta.update(getattr(gm, "meta", {}))
    if report.joins:
        logger.info("helix tiling: %d calls tiled into %d streams, %d joins", report.tiled_calls, tiles,
                    len(report.joins))
    return new, report

"""Tiling pass: split Dynamo's pre-autograd graph into K tile streams along the batch dimension.

Runs before autograd, so aot_autograd derives the tiled backward by itself. Every call reached
by a tiled value is replicated once per tile when its rule (``tiling_rules``) says how; a call
without a rule, or whose rule refuses, gets the tiles joined (concatenated) in front of it and the
reason is logged -- the region after it stays untiled. Tile nodes carry
``meta["custom"]["helix_tile"] = k``, which survives into the AOT forward and backward graphs
and defines the streams the reorder pass interleaves.

Along the sequence dimension the pass tiles only when asked (``seq_tiling``) and only through
calls whose rules prove independence along that dim (attention mixes positions and is refused).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import operator
from typing import Any, Mapping

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from megatron_ext.helix.ir import op_name, set_tile, value_of
from megatron_ext.helix.passes.tiling_rules import Plan, Refuse, RuleCtx, find_rule

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
        tiled = {a: env[a] for a in n.all_input_nodes if not isinstance(env[a], fx.Node)}
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
        for k in range(1 if plan.single else tiles):
            def arg_k(a: fx.Node, k: int = k) -> Any:
                st = env[a]
                if isinstance(st, (_Tiled, _TiledTuple)):
                    return st.tiles[k]
                if a in plan.split:
                    return split(a, plan.split[a], k)
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

    g.lint()
    new = fx.GraphModule(gm, g)
    new.meta.update(getattr(gm, "meta", {}))
    if report.joins:
        logger.info("helix tiling: %d calls tiled into %d streams, %d joins", report.tiled_calls, tiles,
                    len(report.joins))
    return new, report

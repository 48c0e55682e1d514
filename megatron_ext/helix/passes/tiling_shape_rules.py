"""Tiling rules for shape manipulation, indexing, concatenation, functional collectives and
autograd.Function nodes (the compute rules and the registry are in :mod:`tiling_rules`; the tiling
pass, their consumer, imports this module to register these).
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from megatron_ext.helix.ir import collective_kind, value_of
from megatron_ext.helix.passes.tiling_rules import (RULES, Plan, Refuse, RuleCtx, RuleFn, _norm, broadcast_plan,
                                                    find_rule, rule)


# -- shape manipulation --------------------------------------------------------------------------

def reshape_tile_dim(src: tuple[int, ...], dst: tuple[int, ...], d: int, tiles: int) -> int:
    """Output dim that carries the input's tile dim ``d`` through a row-major reshape.

    Sound only when the tile dim is the outermost non-trivial dim of its group of merged or split
    dims: then every tile is one contiguous block of the output dim that starts the group.
    """
    outer = math.prod(src[:d])
    acc = 1
    for j, size in enumerate(dst):
        if acc == outer and size != 1:
            if size % tiles:
                raise Refuse(f"reshape puts the tile dim into a dim of size {size}, not divisible by {tiles}")
            return j
        acc *= size
        if acc > outer:
            break
    raise Refuse(f"reshape {src} -> {dst} mixes the tile dim {d} with outer dims")


def _reshape_rule(method: str) -> RuleFn:
    def fn(ctx: RuleCtx) -> Plan:
        x = ctx.node.args[0]
        if ctx.node.target in ("view_as", "reshape_as") and len(ctx.node.args) > 1:
            donor = ctx.node.args[1]
            if x in ctx.dims and ctx.dims.get(donor) == ctx.dims[x] and ctx.shape(donor) == ctx.shape(x):
                return Plan(out_dim=ctx.dims[x])  # x.view_as(y) with y tiled alike: per tile as is
        if x not in ctx.dims or any(a in ctx.dims for a in ctx.node.all_input_nodes if a is not x):
            raise Refuse("the shape donor is tiled")
        src, dst = ctx.shape(x), ctx.out_shape()
        j = reshape_tile_dim(src, dst, ctx.dims[x], ctx.tiles)
        tile_shape = list(dst)
        tile_shape[j] //= ctx.tiles

        def rewrite(k: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return (args[0], tile_shape), {}

        return Plan(out_dim=j, rewrite=rewrite, op="call_method", target=method)

    return fn


for _m in ("view", "view_as"):
    RULES[("method", _m)] = _reshape_rule("view")
for _m in ("reshape", "flatten", "unflatten", "reshape_as"):
    RULES[("method", _m)] = _reshape_rule("reshape")
for _f in (torch.reshape, torch.flatten, torch.unflatten):
    RULES[_f] = _reshape_rule("reshape")


def _perm_rule(ctx: RuleCtx, perm_of: Callable[[int], list[int]]) -> Plan:
    x = ctx.node.args[0]
    d = ctx.dims[x]
    perm = perm_of(len(ctx.shape(x)))  # out dim i takes input dim perm[i]
    return Plan(out_dim=perm.index(d))


@rule(torch.transpose, torch.swapaxes, ("method", "transpose"), ("method", "swapaxes"))
def _transpose(ctx: RuleCtx) -> Plan:
    def perm(n: int) -> list[int]:
        a, b = _norm(ctx.node.args[1], n), _norm(ctx.node.args[2], n)
        p = list(range(n))
        p[a], p[b] = p[b], p[a]
        return p

    return _perm_rule(ctx, perm)


@rule(torch.t, ("method", "t"))
def _t(ctx: RuleCtx) -> Plan:
    return _perm_rule(ctx, lambda n: list(range(n))[::-1])


@rule(torch.permute, ("method", "permute"))
def _permute(ctx: RuleCtx) -> Plan:
    args = ctx.node.args[1:]
    dims = list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else list(args)
    if not dims:
        dims = list(ctx.node.kwargs.get("dims", ()))
    return _perm_rule(ctx, lambda n: [_norm(d, n) for d in dims])


@rule(torch.movedim, ("method", "movedim"), ("method", "moveaxis"))
def _movedim(ctx: RuleCtx) -> Plan:
    def perm(n: int) -> list[int]:
        src, dst = ctx.node.args[1], ctx.node.args[2]
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        src, dst = [_norm(s, n) for s in src], [_norm(s, n) for s in dst]
        rest = [i for i in range(n) if i not in src]
        out: list[int | None] = [None] * n
        for s, t in zip(src, dst):
            out[t] = s
        it = iter(rest)
        return [o if o is not None else next(it) for o in out]

    return _perm_rule(ctx, perm)


@rule(torch.unsqueeze, ("method", "unsqueeze"))
def _unsqueeze(ctx: RuleCtx) -> Plan:
    x = ctx.node.args[0]
    d = ctx.dims[x]
    u = _norm(ctx.arg(1, "dim"), len(ctx.shape(x)) + 1)
    return Plan(out_dim=d + 1 if u <= d else d)


@rule(torch.squeeze, ("method", "squeeze"))
def _squeeze(ctx: RuleCtx) -> Plan:
    x = ctx.node.args[0]
    d = ctx.dims[x]
    s = ctx.shape(x)
    dim = ctx.arg(1, "dim")
    if dim is None:
        removed = [i for i, n in enumerate(s) if n == 1]
    else:
        dims = [dim] if isinstance(dim, int) else list(dim)
        removed = [_norm(i, len(s)) for i in dims if s[_norm(i, len(s))] == 1]
    if d in removed:
        raise Refuse("squeezes the tile dim")
    return Plan(out_dim=d - sum(1 for r in removed if r < d))


@rule(("method", "expand"), ("method", "expand_as"))
def _expand(ctx: RuleCtx) -> Plan:
    x = ctx.node.args[0]
    if any(a in ctx.dims for a in ctx.node.all_input_nodes if a is not x):
        raise Refuse("the shape donor is tiled")
    out = ctx.out_shape()
    j = ctx.dims[x] + len(out) - len(ctx.shape(x))
    tile_shape = list(out)
    tile_shape[j] //= ctx.tiles
    return Plan(out_dim=j, op="call_method", target="expand",
                rewrite=lambda k, args, kwargs: ((args[0], *tile_shape), {}))



# Grouped-query attention repeats each key/value head for its query heads: megatron-core's
# DotProductAttention by ``repeat_interleave`` along the heads dim, other code by ``repeat`` or
# ``expand`` + ``reshape``. Along any other dim than the tile dim every tile repeats alike.
@rule(torch.repeat_interleave, ("method", "repeat_interleave"))
def _repeat_interleave(ctx: RuleCtx) -> Plan:
    x = ctx.node.args[0]
    if x not in ctx.dims:
        raise Refuse("only the repeat counts are tiled")
    if any(a in ctx.dims for a in ctx.node.all_input_nodes if a is not x):
        raise Refuse("repeat counts are tiled")
    dim = ctx.arg(2, "dim")
    if dim is None:
        raise Refuse("repeat_interleave without dim flattens the tile dim")
    d = ctx.dims[x]
    if _norm(dim, len(ctx.shape(x))) == d:
        raise Refuse(f"repeats along the tile dim {d}")
    return Plan(out_dim=d)


@rule(("method", "repeat"))
def _repeat(ctx: RuleCtx) -> Plan:
    x = ctx.node.args[0]
    if any(a in ctx.dims for a in ctx.node.all_input_nodes if a is not x):
        raise Refuse("repeat sizes are tiled")
    sizes = ctx.node.args[1:]
    sizes = list(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)) else list(sizes)
    if any(not isinstance(s, int) for s in sizes):
        raise Refuse("repeat sizes are not constants")
    j = ctx.dims[x] + len(sizes) - len(ctx.shape(x))
    if sizes[j] != 1:
        # [t0, t1] repeated is [t0, t1, t0, t1]; per tile it would give [t0, t0, t1, t1].
        raise Refuse(f"repeats along the tile dim ({sizes[j]} times)")
    return Plan(out_dim=j)

@rule(operator.getitem)
def _getitem(ctx: RuleCtx) -> Plan:
    x, idx = ctx.node.args
    if x not in ctx.dims:
        raise Refuse("only the index is tiled")
    if isinstance(idx, fx.Node) or (isinstance(idx, tuple) and any(isinstance(i, fx.Node) for i in idx)):
        raise Refuse("advanced (tensor) indexing")
    d = ctx.dims[x]
    ndim = len(ctx.shape(x))
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if any(isinstance(i, (list, torch.Tensor)) for i in items):
        raise Refuse("advanced indexing")
    n_real = sum(1 for i in items if i is not None and i is not Ellipsis)
    if Ellipsis in items:
        e = items.index(Ellipsis)
        items = items[:e] + [slice(None)] * (ndim - n_real) + items[e + 1:]
    items += [slice(None)] * (ndim - sum(1 for i in items if i is not None))
    in_dim = out_dim = 0
    for it in items:
        if it is None:
            out_dim += 1
            continue
        if in_dim == d:
            if not (isinstance(it, slice) and it == slice(None)):
                raise Refuse(f"indexes into the tile dim with {it!r}")
            return Plan(out_dim=out_dim)
        in_dim += 1
        if isinstance(it, slice):
            out_dim += 1
    raise Refuse("index parse failed")


def _aligned_plan(ctx: RuleCtx, operands: list[fx.Node]) -> Plan:
    """Operands of the output's rank, aligned dim for dim and *not* broadcast (indexing ops such as
    gather and scatter address rows by position, so a size-1 operand is not repeated): every
    operand is tiled along the output's tile dim or sliced along it."""
    plan = broadcast_plan(ctx, operands)
    size = ctx.out_shape()[plan.out_dim]
    for a in operands:
        if a not in ctx.dims and a not in plan.split and ctx.shape(a)[plan.out_dim] != size:
            raise Refuse(f"{a.name} has size {ctx.shape(a)[plan.out_dim]} along the tile dim, the output {size}")
    return plan


@rule(torch.gather, ("method", "gather"))
def _gather(ctx: RuleCtx) -> Plan:
    x = ctx.node.args[0]
    dim = _norm(ctx.arg(1, "dim"), len(ctx.out_shape()))
    index = ctx.arg(2, "index")
    if not isinstance(index, fx.Node) or len(ctx.shape(index)) != len(ctx.shape(x)):
        raise Refuse("index of another rank")
    plan = _aligned_plan(ctx, [x, index])  # same rank: tiles align dim for dim
    if plan.out_dim == dim:
        raise Refuse("gathers along the tile dim")
    if x not in ctx.dims and x not in plan.split:
        raise Refuse("source is neither tiled nor split")
    return plan


# Router top-k and token (un)permutation. Selecting, sorting or scattering *within* each token's
# row is per tile; along the token dim -- a capacity over the batch's tokens, a sort of all tokens
# by expert -- it mixes rows of different tiles and is refused (the tiles are joined before it).

@rule(torch.scatter, torch.scatter_add, ("method", "scatter"), ("method", "scatter_add"))
def _scatter(ctx: RuleCtx) -> Plan:
    x = ctx.node.args[0]
    dim = _norm(ctx.arg(1, "dim"), len(ctx.out_shape()))
    index = ctx.arg(2, "index")
    src = ctx.arg(3, "src", ctx.node.kwargs.get("value"))
    operands = [a for a in (x, index, src) if isinstance(a, fx.Node) and isinstance(value_of(a), torch.Tensor)]
    if any(len(ctx.shape(a)) != len(ctx.out_shape()) for a in operands):
        raise Refuse("index or source of another rank")
    plan = _aligned_plan(ctx, operands)
    if plan.out_dim == dim:
        raise Refuse(f"scatters along the tile dim {dim}: rows of one tile would land in another's")
    return plan


@rule(torch.topk, ("method", "topk"))
def _topk(ctx: RuleCtx) -> Plan:
    x = ctx.node.args[0]
    if x not in ctx.dims:
        raise Refuse("only k is tiled")
    d = ctx.dims[x]
    if _norm(ctx.arg(2, "dim", -1), len(ctx.shape(x))) == d:
        raise Refuse(f"selects the top k along the tile dim {d} (over the whole batch)")
    return Plan(out_dim=(d, d))


@rule(torch.sort, ("method", "sort"), torch.argsort, ("method", "argsort"))
def _sort(ctx: RuleCtx) -> Plan:
    x = ctx.node.args[0]
    d = ctx.dims[x]
    dim = ctx.arg(1, "dim", -1)
    if not isinstance(dim, int):  # sort(x, descending) positional bool is not a dim
        dim = ctx.node.kwargs.get("dim", -1)
    if _norm(dim, len(ctx.shape(x))) == d:
        raise Refuse(f"sorts along the tile dim {d}: the order mixes tiles")
    name = ctx.node.target if isinstance(ctx.node.target, str) else ctx.node.target.__name__
    return Plan(out_dim=d if name == "argsort" else (d, d))


@rule(torch.index_select, ("method", "index_select"))
def _index_select(ctx: RuleCtx) -> Plan:
    x, index = ctx.node.args[0], ctx.arg(2, "index")
    if x not in ctx.dims or index in ctx.dims:
        raise Refuse("the index is tiled")
    d = ctx.dims[x]
    if _norm(ctx.arg(1, "dim"), len(ctx.shape(x))) == d:
        raise Refuse(f"selects rows along the tile dim {d}: an index may point into another tile")
    return Plan(out_dim=d)


_SAME_FOR_ALL_TILES = frozenset({"dtype", "device", "requires_grad", "ndim", "is_cuda", "layout", "is_leaf"})


@rule(getattr)
def _getattr(ctx: RuleCtx) -> Plan:
    name = ctx.node.args[1]
    if name not in _SAME_FOR_ALL_TILES:
        raise Refuse(f"attribute {name!r} differs between a tile and the whole tensor")
    return Plan(out_dim=None, single=True)


@rule(("method", "dim"), ("method", "is_contiguous"), ("method", "get_device"), ("method", "is_floating_point"))
def _same_metadata(ctx: RuleCtx) -> Plan:
    return Plan(out_dim=None, single=True)


@rule(torch.split, torch.chunk, torch.tensor_split, torch.unbind, ("method", "split"), ("method", "chunk"),
      ("method", "tensor_split"), ("method", "unbind"), ("method", "split_with_sizes"))
def _split(ctx: RuleCtx) -> Plan:
    x = ctx.node.args[0]
    d = ctx.dims[x]
    ndim = len(ctx.shape(x))
    name = ctx.node.target if isinstance(ctx.node.target, str) else ctx.node.target.__name__
    default = 0
    dim = _norm(ctx.arg(1 if name == "unbind" else 2, "dim", default), ndim)
    if dim == d:
        raise Refuse("splits along the tile dim")
    n_out = len(value_of(ctx.node))
    out = d - 1 if (name == "unbind" and dim < d) else d
    return Plan(out_dim=tuple([out] * n_out))


@rule(torch.cat, torch.concat, torch.stack)
def _cat(ctx: RuleCtx) -> Plan:
    tensors = list(ctx.node.args[0])
    out = ctx.out_shape()
    dim = _norm(ctx.arg(1, "dim", 0), len(out))
    plan = broadcast_plan(ctx, [t for t in tensors if isinstance(t, fx.Node)])
    if ctx.node.target is torch.stack:
        # Inputs have one dim fewer: broadcast_plan aligned them at the right; fix the offset.
        d_in = next(ctx.dims[t] for t in tensors if t in ctx.dims)
        plan.out_dim = d_in + 1 if dim <= d_in else d_in
        plan.split = {t: plan.out_dim - (1 if dim <= d_in else 0) for t in plan.split}
    elif plan.out_dim == dim:
        raise Refuse("concatenates along the tile dim")
    return plan


@rule("funcol")
def _funcol_rule(ctx: RuleCtx) -> Plan:
    x = ctx.node.args[0]
    if x not in ctx.dims:
        raise Refuse("collective argument is not the tiled tensor")
    d = ctx.dims[x]
    kind = collective_kind(ctx.node)
    if kind in ("all_gather", "reduce_scatter", "all_to_all") and d == 0:
        raise Refuse(f"{kind} concatenates/splits along dim 0, the tile dim")
    if kind == "all_to_all":
        outs, ins = ctx.node.args[1], ctx.node.args[2]
        if len(set(outs)) > 1 or len(set(ins)) > 1:
            raise Refuse("all-to-all with uneven splits")
    if kind == "broadcast":
        raise Refuse("broadcast is not tiled")
    return Plan(out_dim=d)


def analyse_body(body: fx.GraphModule, in_dims: list[Any], tiles: int) -> list[Any]:
    """Tile dims of a subgraph's outputs given its inputs', if every call in it has a rule that
    needs no literal rewrite (the body is reused as-is for every tile)."""
    dims: dict[fx.Node, Any] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    for p, d in zip(placeholders, in_dims):
        if d is not None:
            dims[p] = d
    for n in body.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            continue
        if n.op == "output":
            def dim_of(a: Any) -> Any:
                if isinstance(a, (list, tuple)):
                    return type(a)(dim_of(x) for x in a)
                return dims.get(a) if isinstance(a, fx.Node) else None
            return dim_of(n.args[0])
        if not any(a in dims for a in n.all_input_nodes):
            continue
        fn = find_rule(n)
        if fn is None:
            raise Refuse(f"no tiling rule for {n.op} {n.target} inside an autograd.Function")
        plan = fn(RuleCtx(node=n, dims=dims, tiles=tiles))
        if plan.rewrite is not None or plan.split:
            raise Refuse(f"{n.target} inside an autograd.Function needs per-tile arguments")
        dims[n] = plan.out_dim
    raise Refuse("body has no output")


_VIEWS = frozenset({"view_as", "view", "alias", "reshape"})


def _through_views(a: Any) -> Any:
    while isinstance(a, fx.Node) and a.op == "call_method" and a.target in _VIEWS:
        a = a.args[0]
    return a


def _attachment(fwd_body: fx.GraphModule, bwd_body: fx.GraphModule) -> bool:
    """A gradient attachment: the forward returns its first input unchanged (through views) as
    its only output, the backward passes the output's gradient through to that input, and the
    gradients of the other inputs do not depend on the output's gradient (megatron's auxiliary
    losses ride on an activation this way). Per tile, only one tile may attach: the other inputs'
    gradients would otherwise be counted once per tile."""
    fph = [n for n in fwd_body.graph.nodes if n.op == "placeholder"]
    bph = [n for n in bwd_body.graph.nodes if n.op == "placeholder"]
    fout = next(n for n in fwd_body.graph.nodes if n.op == "output").args[0]
    bout = next(n for n in bwd_body.graph.nodes if n.op == "output").args[0]
    if not fph or not bph or not isinstance(fout, (tuple, list)) or not isinstance(fout[0], (tuple, list)):
        return False
    outs = fout[0]
    if len(outs) != 1 or _through_views(outs[0]) is not fph[0]:
        return False
    grads = list(bout) if isinstance(bout, (tuple, list)) else [bout]
    if not grads or _through_views(grads[0]) is not bph[0]:
        return False
    seen, stack = set(), list(bph[0].users)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.users)
    return not any(isinstance(gr, fx.Node) and gr in seen for gr in grads[1:])


@rule("autograd_function_apply")
def _autograd_function(ctx: RuleCtx) -> Plan:
    fwd, bwd = ctx.node.args[0], ctx.node.args[1]
    gm = ctx.node.graph.owning_module
    fwd_body, bwd_body = getattr(gm, fwd.target), getattr(gm, bwd.target)
    tensor_args = ctx.node.args[2:]
    in_dims = [ctx.dims.get(a) if isinstance(a, fx.Node) else None for a in tensor_args]
    first = tensor_args[0] if tensor_args else None
    if isinstance(ctx.dims.get(first), int) and all(d is None for d in in_dims[1:]) \
            and _attachment(fwd_body, bwd_body):
        # Tile 0 attaches; the others pass through with the attached inputs detached (gradient 0).
        return Plan(out_dim=(ctx.dims[first],),
                    once=frozenset(a for a in tensor_args[1:] if isinstance(a, fx.Node)))
    outs, saved = analyse_body(fwd_body, in_dims, ctx.tiles)
    if any(s is None for s in saved) and saved:
        raise Refuse("an autograd.Function saves an untiled tensor")
    grad_in = [*outs, *saved]
    grads = analyse_body(bwd_body, list(grad_in), ctx.tiles)
    grads = list(grads) if isinstance(grads, (list, tuple)) else [grads]
    for a, g in zip(tensor_args, grads):
        if isinstance(a, fx.Node) and isinstance(value_of(a), torch.Tensor) and g != ctx.dims.get(a):
            raise Refuse("the backward of an autograd.Function does not keep the tile dim")
    return Plan(out_dim=tuple(outs))

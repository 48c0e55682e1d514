"""Tiling rules: for one call in Dynamo's graph, given which inputs are tiled along which dim,
say along which dim the output is tiled -- or refuse.

A rule is sound when running the call once per tile and concatenating the results equals the
call on the whole tensors. Rules look only at shapes recorded by the tracer, so they are the
same on every rank. Anything not listed has no rule: the tiling pass joins the tiles in front of
it and logs why (never a guess).
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from megatron_ext.helix.ir import collective_kind, is_wait, value_of

Dim = "int | None"


class Refuse(Exception):
    """The call cannot run per tile; the message says why (it is logged)."""


@dataclasses.dataclass
class Plan:
    """How to run a call per tile.

    ``out_dim``: tile dim of the output (a tuple for tuple outputs). ``split``: untiled tensor
    inputs that must be sliced per tile, and along which dim. ``rewrite(k, args, kwargs)``
    adjusts literal arguments (shapes) of tile ``k``; ``op``/``target`` replace the call.
    """

    out_dim: Any
    split: dict[fx.Node, int] = dataclasses.field(default_factory=dict)
    single: bool = False  # the result is the same for every tile (metadata): compute it once
    rewrite: Callable[[int, tuple, dict], tuple[tuple, dict]] | None = None
    op: str | None = None
    target: Any = None


@dataclasses.dataclass
class RuleCtx:
    node: fx.Node
    dims: dict[fx.Node, Any]  # tile dim of each tiled input node
    tiles: int

    def dim(self, a: Any) -> Any:
        return self.dims.get(a) if isinstance(a, fx.Node) else None

    def shape(self, a: Any) -> tuple[int, ...]:
        v = value_of(a) if isinstance(a, fx.Node) else a
        if not isinstance(v, torch.Tensor):
            raise Refuse(f"{getattr(a, 'name', a)} has no recorded tensor shape")
        return tuple(int(s) for s in v.shape)

    def out_shape(self) -> tuple[int, ...]:
        return self.shape(self.node)

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        if name in self.node.kwargs:
            return self.node.kwargs[name]
        return self.node.args[i] if len(self.node.args) > i else default

    def tiled_inputs(self) -> list[fx.Node]:
        return [a for a in self.node.all_input_nodes if a in self.dims]

    def tile_size(self, full: int) -> int:
        if full % self.tiles:
            raise Refuse(f"size {full} is not divisible by {self.tiles} tiles")
        return full // self.tiles


RuleFn = Callable[[RuleCtx], Plan]
RULES: dict[Any, RuleFn] = {}


def rule(*targets: Any) -> Callable[[RuleFn], RuleFn]:
    def register(fn: RuleFn) -> RuleFn:
        for t in targets:
            RULES[t] = fn
        return fn

    return register


def find_rule(node: fx.Node) -> RuleFn | None:
    if node.op == "call_method":
        return RULES.get(("method", node.target))
    if node.op != "call_function":
        return None
    if collective_kind(node) is not None or is_wait(node):
        return _funcol_rule
    if isinstance(node.target, torch._ops.HigherOrderOperator) and node.target.name() == "autograd_function_apply":
        return RULES.get("autograd_function_apply")
    try:
        return RULES.get(node.target)
    except TypeError:  # unhashable target
        return None


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _tensor_args(ctx: RuleCtx) -> list[fx.Node]:
    return [a for a in ctx.node.all_input_nodes if isinstance(value_of(a), torch.Tensor)]


def broadcast_plan(ctx: RuleCtx, operands: list[fx.Node] | None = None) -> Plan:
    """Elementwise with broadcasting: tiled inputs must agree on the output dim; untiled inputs
    that are not broadcast along it are sliced."""
    out = ctx.out_shape()
    o = len(out)
    operands = operands if operands is not None else _tensor_args(ctx)
    out_dim = None
    for a in operands:
        if a in ctx.dims:
            d = ctx.dims[a]
            if not isinstance(d, int):
                raise Refuse(f"input {a.name} is a tiled tuple")
            j = d + o - len(ctx.shape(a))
            if out_dim is not None and j != out_dim:
                raise Refuse(f"inputs tiled along different output dims ({out_dim} and {j})")
            out_dim = j
    if out_dim is None:
        raise Refuse("no tiled tensor operand")
    split = {}
    for a in operands:
        if a in ctx.dims:
            continue
        s = ctx.shape(a)
        j = out_dim - (o - len(s))
        if j < 0 or s[j] == 1:
            continue  # broadcast along the tile dim: every tile uses it whole
        if s[j] != out[out_dim]:
            raise Refuse(f"untiled operand {a.name} has size {s[j]} along the tile dim, output {out[out_dim]}")
        split[a] = j
    return Plan(out_dim=out_dim, split=split)


_ELEMENTWISE_FUNCTIONS = [
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.neg,
    operator.pow, operator.and_, operator.or_, operator.xor, operator.invert, operator.eq, operator.ne,
    operator.lt, operator.le, operator.gt, operator.ge, operator.mod, operator.iadd, operator.imul,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.exp, torch.log, torch.sqrt,
    torch.rsqrt, torch.tanh, torch.sigmoid, torch.relu, torch.erf, torch.abs, torch.where, torch.clamp,
    torch.maximum, torch.minimum, torch.square, torch.logical_and, torch.logical_or, torch.logical_not,
    torch.sin, torch.cos, torch.reciprocal, torch.masked_fill, torch.zeros_like, torch.ones_like,
    torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like, torch.nan_to_num,
    F.gelu, F.relu, F.silu, F.tanh, F.sigmoid, F.dropout, F.softplus, F.leaky_relu, F.elu, F.mish,
    torch._C._nn.gelu, torch._C._nn.silu, torch._C._nn.leaky_relu, torch._C._nn.elu,
]
_ELEMENTWISE_METHODS = [
    "add", "sub", "mul", "div", "neg", "pow", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu",
    "float", "half", "bfloat16", "double", "int", "long", "bool", "to", "clamp", "masked_fill",
    "contiguous", "clone", "detach", "abs", "sign", "eq", "ne", "lt", "gt", "le", "ge", "erf", "square",
    "__add__", "__sub__", "__mul__", "__truediv__", "__radd__", "__rmul__", "__rsub__", "__neg__",
    "reciprocal", "sin", "cos", "where", "logical_not", "logical_and", "type",
]


@rule(*_ELEMENTWISE_FUNCTIONS, *[("method", m) for m in _ELEMENTWISE_METHODS])
def _elementwise(ctx: RuleCtx) -> Plan:
    return broadcast_plan(ctx)


@rule(("method", "type_as"))
def _type_as(ctx: RuleCtx) -> Plan:
    x = ctx.node.args[0]
    if x not in ctx.dims:
        raise Refuse("only the dtype donor is tiled")
    return Plan(out_dim=ctx.dims[x])


def _reduced_dims(ctx: RuleCtx, ndim: int, pos: int = 1) -> list[int] | None:
    dim = ctx.arg(pos, "dim")
    if dim is None:
        return None
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted(_norm(d, ndim) for d in dims)


def _reduction(keep_shape: bool, multi_out: bool = False) -> RuleFn:
    def fn(ctx: RuleCtx) -> Plan:
        x = ctx.node.args[0]
        if x not in ctx.dims:
            raise Refuse("only a non-reduced operand is tiled")
        d = ctx.dims[x]
        ndim = len(ctx.shape(x))
        dims = _reduced_dims(ctx, ndim)
        if dims is None:
            if keep_shape:
                raise Refuse("operates over all dims")
            raise Refuse("reduces over every dim, including the tile dim")
        if d in dims:
            raise Refuse(f"reduces/scans along the tile dim {d}")
        keepdim = bool(ctx.arg(2, "keepdim", False)) or keep_shape
        out = d if keepdim else d - sum(1 for r in dims if r < d)
        return Plan(out_dim=(out, out) if multi_out else out)

    return fn


# (var/std/norm take other arguments at position 2: they have no rule and join the tiles.)
rule(torch.sum, torch.mean, torch.amax, torch.amin, torch.logsumexp, torch.argmax, torch.argmin,
     torch.prod, torch.all, torch.any,
     *[("method", m) for m in ("sum", "mean", "amax", "amin", "logsumexp", "argmax", "argmin",
                                "prod", "all", "any")])(_reduction(False))
rule(torch.softmax, torch.log_softmax, F.softmax, F.log_softmax, torch.cumsum, torch.cumprod,
     *[("method", m) for m in ("softmax", "log_softmax", "cumsum", "cumprod")])(_reduction(True))


@rule(torch.max, torch.min, ("method", "max"), ("method", "min"))
def _max(ctx: RuleCtx) -> Plan:
    if len(ctx.node.args) > 1 and isinstance(ctx.node.args[1], fx.Node):
        return broadcast_plan(ctx)  # torch.max(a, b): elementwise
    if ctx.arg(1, "dim") is None:
        raise Refuse("max over every dim")
    return _reduction(False, multi_out=True)(ctx)


@rule(F.layer_norm, F.rms_norm, F.group_norm)
def _norm_rule(ctx: RuleCtx) -> Plan:
    x = ctx.node.args[0]
    if x not in ctx.dims or any(a in ctx.dims for a in ctx.node.all_input_nodes if a is not x):
        raise Refuse("normalisation weights are tiled")
    shape = ctx.arg(1, "normalized_shape")
    n = len(shape) if isinstance(shape, (list, tuple)) else 1
    d = ctx.dims[x]
    if d >= len(ctx.shape(x)) - n:
        raise Refuse(f"tile dim {d} is a normalised dim")
    return Plan(out_dim=d)


@rule(torch._C._nn.linear, F.linear)
def _linear(ctx: RuleCtx) -> Plan:
    x = ctx.node.args[0]
    if x not in ctx.dims or any(a in ctx.dims for a in ctx.node.all_input_nodes if a is not x):
        raise Refuse("a weight or bias is tiled")
    d = ctx.dims[x]
    if d >= len(ctx.shape(x)) - 1:
        raise Refuse("tile dim is the contraction dim")
    return Plan(out_dim=d)


def _matmul_plan(ctx: RuleCtx, a: fx.Node, b: fx.Node, extra: list[fx.Node] = ()) -> Plan:
    sa, sb, out = ctx.shape(a), ctx.shape(b), ctx.out_shape()
    if len(sa) < 2 or len(sb) < 2:
        raise Refuse("1-D matmul operand")
    o = len(out)
    da, db = ctx.dim(a), ctx.dim(b)
    want = None
    if da is not None:
        if da == len(sa) - 1:
            raise Refuse("left operand tiled along the contraction dim")
        want = o - 2 if da == len(sa) - 2 else da + o - len(sa)
    if db is not None:
        if db == len(sb) - 2:
            raise Refuse("right operand tiled along the contraction dim")
        j = o - 1 if db == len(sb) - 1 else db + o - len(sb)
        if want is not None and j != want:
            raise Refuse("operands tiled along different output dims")
        want = j
    if want is None:
        raise Refuse("no tiled operand")
    split = {}
    for x, s, is_left in ((a, sa, True), (b, sb, False)):
        if x in ctx.dims:
            continue
        if want >= o - 2:
            # Row/column tiling: the other operand is used whole -- unless it was needed tiled.
            if (want == o - 2 and not is_left) or (want == o - 1 and is_left):
                continue
            raise Refuse("operand tiling does not match its role")
        j = want - (o - len(s))
        if j >= 0 and s[j] != 1:
            if s[j] != out[want]:
                raise Refuse(f"untiled operand {x.name} has size {s[j]} along the tile dim")
            split[x] = j
    for x in extra:  # baddbmm/addmm input: broadcast to the output
        if x in ctx.dims:
            if ctx.dims[x] + o - len(ctx.shape(x)) != want:
                raise Refuse("added operand tiled along another dim")
            continue
        s = ctx.shape(x)
        j = want - (o - len(s))
        if j >= 0 and s[j] != 1:
            if s[j] != out[want]:
                raise Refuse(f"added operand {x.name} has size {s[j]} along the tile dim")
            split[x] = j
    return Plan(out_dim=want, split=split)


@rule(torch.matmul, operator.matmul, torch.bmm, torch.mm, ("method", "matmul"), ("method", "bmm"),
      ("method", "__matmul__"), ("method", "mm"))
def _matmul(ctx: RuleCtx) -> Plan:
    return _matmul_plan(ctx, ctx.node.args[0], ctx.node.args[1])


@rule(torch.baddbmm, torch.addmm, ("method", "baddbmm"), ("method", "addmm"))
def _baddbmm(ctx: RuleCtx) -> Plan:
    inp, b1, b2 = ctx.node.args[0], ctx.arg(1, "batch1" if "bmm" in str(ctx.node.target) else "mat1"), \
        ctx.arg(2, "batch2" if "bmm" in str(ctx.node.target) else "mat2")
    return _matmul_plan(ctx, b1, b2, extra=[inp] if isinstance(inp, fx.Node) else [])


@rule(torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)
def _sdpa(ctx: RuleCtx) -> Plan:
    q, k, v = ctx.node.args[:3]
    dq, dk, dv = ctx.dim(q), ctx.dim(k), ctx.dim(v)
    nd = len(ctx.shape(q))
    if dq is not None and dq == nd - 2 and dk is None and dv is None:
        if ctx.arg(5, "is_causal", False):
            raise Refuse("causal attention with query tiles would shift the causal mask")
        mask = ctx.arg(3, "attn_mask")
        split = {}
        if isinstance(mask, fx.Node) and mask not in ctx.dims:
            s = ctx.shape(mask)
            j = dq - (nd - len(s))
            if j >= 0 and s[j] != 1:
                split[mask] = j
        return Plan(out_dim=dq, split=split)
    if dq is None or dq != dk or dq != dv or dq >= nd - 2:
        raise Refuse("query, key and value are not tiled along the same batch dim")
    return broadcast_plan(ctx, [a for a in ctx.node.all_input_nodes])


@rule(F.embedding, torch.embedding)
def _embedding(ctx: RuleCtx) -> Plan:
    ids, weight = (ctx.node.args[0], ctx.node.args[1]) if ctx.node.target is F.embedding else \
        (ctx.node.args[1], ctx.node.args[0])
    if weight in ctx.dims or ids not in ctx.dims:
        raise Refuse("embedding table is tiled")
    return Plan(out_dim=ctx.dims[ids])


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


@rule(torch.gather, ("method", "gather"))
def _gather(ctx: RuleCtx) -> Plan:
    x = ctx.node.args[0]
    dim = _norm(ctx.arg(1, "dim"), len(ctx.out_shape()))
    index = ctx.arg(2, "index")
    if not isinstance(index, fx.Node) or len(ctx.shape(index)) != len(ctx.shape(x)):
        raise Refuse("index of another rank")
    plan = broadcast_plan(ctx, [x, index])  # same rank: tiles align dim for dim
    if plan.out_dim == dim:
        raise Refuse("gathers along the tile dim")
    if x not in ctx.dims and x not in plan.split:
        raise Refuse("source is neither tiled nor split")
    return plan


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


@rule("autograd_function_apply")
def _autograd_function(ctx: RuleCtx) -> Plan:
    fwd, bwd = ctx.node.args[0], ctx.node.args[1]
    gm = ctx.node.graph.owning_module
    fwd_body, bwd_body = getattr(gm, fwd.target), getattr(gm, bwd.target)
    tensor_args = ctx.node.args[2:]
    in_dims = [ctx.dims.get(a) if isinstance(a, fx.Node) else None for a in tensor_args]
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

"""Tiling rules: for one call in Dynamo's graph, given which inputs are tiled along which dim,
say along which dim the output is tiled -- or refuse.

A rule is sound when running the call once per tile and concatenating the results equals the
call on the whole tensors. Rules look only at shapes recorded by the tracer, so they are the
same on every rank. Anything not listed has no rule: the tiling pass joins the tiles in front of
it and logs why (never a guess).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from megatron_ext.helix.ir import collective_kind, is_wait, value_of

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
    # Untiled inputs whose gradient must be counted once: every tile after the first gets them
    # detached (a gradient attachment such as an auxiliary loss riding on an activation).
    once: frozenset = frozenset()
    rewrite: Callable[[int, tuple, dict], tuple[tuple, dict]] | None = None
    # Tiled inputs every tile reads whole (joined): the keys and values of a query tile.
    whole: frozenset = frozenset()
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
        return RULES.get("funcol")
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
    operator.lt, operator.le, operator.gt, operator.ge, operator.mod,
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


# In-place variants (``x.add_``, ``operator.iadd``) have no rule here: the tiling pass rewrites them
# through these out-of-place twins, keeping every later reader of the updated tensor right.
@rule(*_ELEMENTWISE_FUNCTIONS, *[("method", m) for m in _ELEMENTWISE_METHODS])
def _elementwise(ctx: RuleCtx) -> Plan:
    return broadcast_plan(ctx)


@rule(("method", "type_as"))
def _type_as(ctx: RuleCtx) -> Plan:
    x = ctx.node.args[0]
    if x not in ctx.dims:
        # Only the dtype donor is tiled (megatron's router casts its untiled probabilities to the
        # logits' dtype): every tile has the donor's dtype, so the cast runs once, untiled.
        return Plan(out_dim=None, single=True)
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


# torch.nn.RMSNorm / LayerNorm modules (megatron's local spec) trace to the torch.* functions.
@rule(F.layer_norm, F.rms_norm, torch.layer_norm, torch.rms_norm, F.group_norm, torch.group_norm)
def _norm_rule(ctx: RuleCtx) -> Plan:
    x = ctx.node.args[0]
    if x not in ctx.dims or any(a in ctx.dims for a in ctx.node.all_input_nodes if a is not x):
        raise Refuse("normalisation weights are tiled")
    if ctx.node.target in (F.group_norm, torch.group_norm):
        # Groups are taken over every dim but the batch (argument 1 is the number of groups).
        if ctx.dims[x] != 0:
            raise Refuse(f"group norm normalises over dim {ctx.dims[x]}, the tile dim")
        return Plan(out_dim=0)
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
    if want == o - 2 and db is not None and db >= len(sb) - 2:
        # Row tiles of the left operand against a right operand tiled along its own rows or columns
        # (attention's scores and context under sequence tiling: a query tile against every key):
        # row i of the product reads row i of the left and all of the right, so each tile reads
        # the right operand joined.
        return dataclasses.replace(_matmul_plan(_without(ctx, b), a, b, extra), whole=frozenset({b}))
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


def _without(ctx: RuleCtx, a: fx.Node) -> RuleCtx:
    """``ctx`` with ``a`` seen as untiled (a plan that reads it joined)."""
    return RuleCtx(node=ctx.node, dims={k: v for k, v in ctx.dims.items() if k is not a}, tiles=ctx.tiles)


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

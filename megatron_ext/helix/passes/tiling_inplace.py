"""What a call updates in place, and whether the tiling pass can keep that update visible.

Tiles are new tensors, so an in-place update of a tiled value must reach every later reader by
hand (``tiling.py``'s module docstring has the contract). This module answers the two questions
the pass asks of such a call: what it writes and whether an out-of-place twin computes the same
(:func:`mutation_of`), and whether another view of the same storage, taken before the update, is
read after it -- which no per-tile rewrite can keep (:class:`Aliases`).
"""
from __future__ import annotations

import collections
import dataclasses
import inspect
import operator
from typing import Any

import torch
import torch.fx as fx

from megatron_ext.helix.ir import value_of
from megatron_ext.helix.passes.tiling_rules import RULES, _elementwise

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


def storage_key(node: fx.Node) -> Any:
    """A key equal for every node whose example value shares one storage, or None when unknown."""
    v = value_of(node)
    if not isinstance(v, torch.Tensor):
        return None
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(v.untyped_storage())
    except Exception:  # noqa: BLE001 -- no storage (exotic subclass): treated as unknown
        return None


class Aliases:
    """Storage aliasing and positions in the original graph, to check in-place updates."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.pos = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.last_use = {n: max((self.pos[u] for u in n.users), default=self.pos[n]) for n in gm.graph.nodes}
        self.by_storage: dict[Any, list[fx.Node]] = collections.defaultdict(list)
        for n in gm.graph.nodes:
            key = storage_key(n)
            if key is not None:
                self.by_storage[key].append(n)

    def stale_reader(self, node: fx.Node, target: fx.Node, same: set[fx.Node]) -> tuple[str, fx.Node | None]:
        """(problem, alias) when the update ``node`` of ``target`` cannot be rewritten per tile:
        the storage is a graph input, unknown, or one of its other views taken before the update
        is read after it."""
        key = storage_key(target)
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

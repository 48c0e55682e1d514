"""Pre/post checks shared by the passes: a transformed graph must keep every dependency.

``check_dependencies(before, after)`` compares two orders of (mostly) the same graph: every input
precedes its user, every wait follows its collective and precedes every user of its result,
impure nodes keep their relative order, and no node went missing (unless the pass says it
replaced it). Passes call it on their own output and raise :class:`DependencyError` on failure;
tests call it too.
"""
from __future__ import annotations

import logging
import operator
from typing import Iterable

import torch
import torch.fx as fx

from megatron_ext.helix.ir import check_topological, collective_kind, is_emulated_issue, is_wait

logger = logging.getLogger(__name__)


class DependencyError(RuntimeError):
    """A pass produced a graph that breaks a dependency of the original."""


def is_impure(node: fx.Node) -> bool:
    """Side-effecting calls whose relative order must not change (mutations, RNG state)."""
    if node.op not in ("call_function", "call_method"):
        return False
    if collective_kind(node) is not None or is_wait(node):
        return False  # the passes order these deliberately (identically on every rank)
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.is_mutable or node.is_impure()
    return node.is_impure()


def check_graph(graph: fx.Graph) -> list[str]:
    problems = check_topological(graph)
    for n in graph.nodes:
        # A collective's buffer may only be read through its wait: anything else would read
        # data that is still in flight.
        if collective_kind(n) is not None:
            early = [u.name for u in n.users
                     if not is_wait(u) and u.target is not operator.getitem and not is_emulated_issue(u)]
            if early:
                problems.append(f"{', '.join(early)} read {n.name} before its wait")
    nodes = list(graph.nodes)
    if nodes and nodes[-1].op != "output":
        problems.append("the output node is not last")
    return problems


def check_dependencies(before_names: Iterable[str] | None, after: fx.Graph,
                       impure_order: list[str] | None = None, replaced: Iterable[str] = ()) -> None:
    """Raise :class:`DependencyError` when ``after`` breaks a dependency.

    ``before_names``: node names of the original graph (all must survive except ``replaced``);
    ``impure_order``: names of impure nodes in their original order.
    """
    problems = check_graph(after)
    names = [n.name for n in after.nodes]
    if before_names is not None:
        missing = set(before_names) - set(names) - set(replaced)
        if missing:
            problems.append(f"nodes lost: {sorted(missing)[:5]}")
    if impure_order:
        pos = {n: i for i, n in enumerate(names)}
        seq = [pos[n] for n in impure_order if n in pos]
        if seq != sorted(seq):
            problems.append("impure nodes changed their relative order")
    if problems:
        raise DependencyError("; ".join(problems[:10]))


def impure_names(graph: fx.Graph) -> list[str]:
    return [n.name for n in graph.nodes if is_impure(n)]

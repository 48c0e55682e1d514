"""Graph IR over FX graphs: what each node is, what it depends on, what it allocates.

Works on Dynamo's pre-autograd graph (torch-level calls, ``meta["example_value"]``) and on the
AOT forward and backward graphs (ATen ops, ``meta["val"]``). Every node is classified as compute,
collective issue, wait, view/metadata or other. Collectives carry their process group *name*
(a string that is identical on every rank), never a process-group object, so that everything
derived from the IR is rank-independent. This module imports no ``torch.distributed``: group
sizes that the graph does not state come from an injected resolver.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import operator
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

logger = logging.getLogger(__name__)

TILE_KEY = "helix_tile"  # node.meta["custom"][TILE_KEY] = tile stream index


class Kind(str, enum.Enum):
    COMPUTE = "compute"
    COLLECTIVE = "collective"
    WAIT = "wait"
    VIEW = "view"
    OTHER = "other"


_FUNCOL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional")
# op name -> normalised collective kind
_COLLECTIVES = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}
_WAITS = ("wait_tensor",)

# Dynamo-level (torch API) calls that return an alias of their first tensor argument.
_VIEW_METHODS = frozenset({
    "view", "view_as", "transpose", "permute", "t", "unsqueeze", "squeeze", "expand", "expand_as",
    "narrow", "select", "split", "chunk", "unbind", "unflatten", "detach", "swapaxes", "movedim",
    "as_strided", "diagonal", "tensor_split", "split_with_sizes", "unfold", "__getitem__", "T",
})
_VIEW_FUNCTIONS = frozenset({
    torch.transpose, torch.permute, torch.t, torch.unsqueeze, torch.squeeze, torch.narrow,
    torch.select, torch.split, torch.chunk, torch.unbind, torch.detach, torch.swapaxes,
    torch.movedim, torch.tensor_split, torch.as_strided, torch.diagonal,
})
# Not views by schema, but they hand back the storage of their input (memory accounting).
_ATEN_STORAGE_ALIASES = frozenset({"aten::_unsafe_view", "aten::alias", "aten::_reshape_alias",
                                   "aten::lift_fresh"})
# Metadata-only calls: no storage, negligible time.
_METADATA = frozenset({operator.getitem, getattr, "size", "stride", "dim", "numel", "sym_size",
                       "sym_stride", "sym_numel"})


def op_name(node: fx.Node) -> str:
    """Stable, rank-independent name of what a node calls (used in keys and logs)."""
    t = node.target
    if node.op == "call_method":
        return f"method.{t}"
    if node.op != "call_function":
        return node.op
    if isinstance(t, torch._ops.OpOverload):
        return f"{t._schema.name}.{t._overloadname}"
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name
    if isinstance(t, torch._ops.HigherOrderOperator):
        return f"higher_order.{t.name()}"
    mod = getattr(t, "__module__", None) or ""
    return f"{mod}.{getattr(t, '__name__', repr(t))}".lstrip(".")


def _funcol_name(node: fx.Node) -> str | None:
    t = node.target
    if node.op != "call_function":
        return None
    if isinstance(t, torch._ops.OpOverload) and t.namespace in _FUNCOL_NAMESPACES:
        return t._schema.name.split("::", 1)[1]
    if isinstance(t, torch._ops.OpOverloadPacket) and t._qualified_op_name.split("::")[0] in _FUNCOL_NAMESPACES:
        return t._qualified_op_name.split("::", 1)[1]
    return None


def collective_kind(node: fx.Node) -> str | None:
    """``all_reduce``/``all_gather``/``reduce_scatter``/``all_to_all``/``broadcast`` or None."""
    name = _funcol_name(node)
    if name is None:
        return None
    return _COLLECTIVES.get(name.removesuffix("_coalesced"))


def _emulation_helper(node: fx.Node) -> str | None:
    """``emulated_issue``/``emulated_wait`` of the CPU interconnect emulation (interconnect.py)."""
    t = node.target
    if node.op == "call_function" and getattr(t, "__module__", "") == "megatron_ext.helix.interconnect":
        return getattr(t, "__name__", None)
    return None


def is_wait(node: fx.Node) -> bool:
    return _funcol_name(node) in _WAITS or _emulation_helper(node) == "emulated_wait"


def is_emulated_issue(node: fx.Node) -> bool:
    return _emulation_helper(node) == "emulated_issue"


def group_name_of(node: fx.Node) -> str | None:
    """Process-group name of a collective node (last positional argument or ``group_name=``)."""
    if collective_kind(node) is None:
        return None
    if "group_name" in node.kwargs:
        return str(node.kwargs["group_name"])
    return str(node.args[-1])


def reduce_op_of(node: fx.Node) -> str | None:
    kind = collective_kind(node)
    if kind == "all_reduce":
        return str(node.kwargs.get("reduce_op", node.args[1]))
    if kind == "reduce_scatter":
        return str(node.kwargs.get("reduce_op", node.args[1]))
    return None


def value_of(node: Any) -> Any:
    """The example value a tracer recorded for a node (FakeTensor, tuple, SymInt...) or None."""
    if not isinstance(node, fx.Node):
        return None
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("example_value")


def tensors_of(node: fx.Node) -> list[torch.Tensor]:
    return [v for v in tree_leaves(value_of(node)) if isinstance(v, torch.Tensor)]


def tensor_bytes(t: torch.Tensor) -> int:
    return int(t.numel()) * t.element_size()


def tile_of(node: fx.Node) -> int | None:
    custom = node.meta.get("custom")
    if isinstance(custom, dict) and TILE_KEY in custom:
        return int(custom[TILE_KEY])
    return None


def set_tile(node: fx.Node, tile: int | None) -> None:
    custom = dict(node.meta.get("custom") or {})
    if tile is None:
        custom.pop(TILE_KEY, None)
    else:
        custom[TILE_KEY] = int(tile)
    node.meta["custom"] = custom


def _alias_arg(node: fx.Node) -> int | None:
    """Index (in ``node.all_input_nodes``) of the input whose storage the output shares, or None."""
    if not node.all_input_nodes:
        return None
    t = node.target
    if is_wait(node):
        return 0
    if node.op == "call_function" and isinstance(t, torch._ops.OpOverload):
        schema = t._schema
        if t._schema.name in _ATEN_STORAGE_ALIASES:
            return 0
        if any(r.alias_info is not None for r in schema.returns):
            first = node.args[0] if node.args else None
            if isinstance(first, fx.Node):
                return node.all_input_nodes.index(first)
            return 0
        return None
    if node.op == "call_method" and t in _VIEW_METHODS:
        return 0
    if node.op == "call_method" and t.endswith("_") and not t.startswith("_"):
        return 0  # in-place method: output is its self argument
    if node.op == "call_function" and t in _VIEW_FUNCTIONS:
        return 0
    return None


def classify(node: fx.Node) -> Kind:
    if node.op in ("placeholder", "output", "get_attr"):
        return Kind.OTHER
    if collective_kind(node) is not None:
        return Kind.COLLECTIVE
    if is_wait(node):
        return Kind.WAIT
    t = node.target
    if node.op == "call_function" and t is operator.getitem:
        return Kind.OTHER
    if is_emulated_issue(node):
        return Kind.OTHER
    if t in _METADATA:
        return Kind.OTHER
    if node.op == "call_function" and isinstance(t, torch._ops.OpOverload):
        if t.is_view or t._schema.name in _ATEN_STORAGE_ALIASES:
            return Kind.VIEW
        return Kind.COMPUTE
    if (node.op == "call_method" and t in _VIEW_METHODS) or (node.op == "call_function" and t in _VIEW_FUNCTIONS):
        return Kind.VIEW
    if node.op in ("call_function", "call_method", "call_module"):
        # Calls that take no tensor and return none (grad-mode switches, ctx objects) are metadata.
        if not tensors_of(node) and not any(tensors_of(a) for a in node.all_input_nodes):
            return Kind.OTHER
        return Kind.COMPUTE
    return Kind.OTHER


@dataclasses.dataclass(frozen=True)
class CollectiveInfo:
    kind: str
    group: str
    group_size: int
    dtype: torch.dtype
    in_bytes: int
    out_bytes: int
    reduce_op: str | None

    @property
    def bucket_key(self) -> tuple:
        """Collectives with equal keys may share one launch (same group, kind, dtype, op)."""
        return (self.kind, self.group, self.group_size, str(self.dtype), self.reduce_op)


@dataclasses.dataclass
class IRNode:
    node: fx.Node
    index: int
    kind: Kind
    op: str
    inputs: tuple[int, ...]
    users: tuple[int, ...]
    out_bytes: int           # bytes of the tensors the node returns (0 for non-tensors)
    alias_of: int | None     # IR index whose storage the output shares (views, waits, in-place)
    alloc_bytes: int         # bytes this node newly allocates (0 for aliases and placeholders)
    tile: int | None
    collective: CollectiveInfo | None = None
    wait_of: int | None = None  # for waits: the collective they complete

    @property
    def name(self) -> str:
        return self.node.name


GroupSizeFn = Callable[[str], int]


def _group_size(node: fx.Node, kind: str, group: str, resolve: GroupSizeFn | None) -> int:
    # The graph states the group size for gathers and scatters; trust it over the resolver.
    if kind in ("all_gather", "reduce_scatter"):
        return int(node.args[1] if kind == "all_gather" else node.args[2])
    if kind == "all_to_all" and isinstance(node.args[1], (list, tuple)) and node.args[1]:
        return len(node.args[1])
    if resolve is not None:
        return int(resolve(group))
    raise ValueError(f"helix IR: group size of {node.name} ({kind} on group {group!r}) is not in the "
                     "graph; pass group_size=<callable(group_name) -> int>")


class GraphIR:
    """Classified, indexed view of one FX graph in its current node order."""

    def __init__(self, graph: fx.Graph | fx.GraphModule, group_size: GroupSizeFn | None = None) -> None:
        self.graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
        nodes = list(self.graph.nodes)
        self._index = {n: i for i, n in enumerate(nodes)}
        self.nodes: list[IRNode] = []
        for i, n in enumerate(nodes):
            kind = classify(n)
            ins = tuple(self._index[a] for a in n.all_input_nodes)
            users = tuple(sorted(self._index[u] for u in n.users))
            alias = _alias_arg(n)
            alias_of = self._index[n.all_input_nodes[alias]] if alias is not None else None
            if n.op == "call_function" and n.target is operator.getitem and n.all_input_nodes:
                parent = n.all_input_nodes[0]
                # Items of a multi-output view (split) share the parent's base; items of a
                # multi-output computation own a storage each.
                if classify(parent) == Kind.VIEW:
                    alias_of = self._index[parent]
            tensors = tensors_of(n)
            out_bytes = sum(tensor_bytes(t) for t in tensors)
            alloc = 0 if (alias_of is not None or n.op in ("placeholder", "get_attr")) else out_bytes
            val = value_of(n)
            if alloc and isinstance(val, (tuple, list)):
                # Items taken out by getitem users are owned (and freed) by those getitem nodes.
                taken = {u.args[1] for u in n.users if u.op == "call_function" and u.target is operator.getitem}
                alloc = sum(tensor_bytes(v) for k, v in enumerate(val)
                            if isinstance(v, torch.Tensor) and k not in taken)
            irn = IRNode(node=n, index=i, kind=kind, op=op_name(n), inputs=ins, users=users,
                         out_bytes=out_bytes, alias_of=alias_of, alloc_bytes=alloc, tile=tile_of(n))
            if kind == Kind.COLLECTIVE:
                ckind = collective_kind(n)
                group = group_name_of(n)
                src = tensors_of(n.all_input_nodes[0]) if n.all_input_nodes else []
                in_bytes = sum(tensor_bytes(t) for t in src)
                dtype = tensors[0].dtype if tensors else torch.float32
                irn.collective = CollectiveInfo(kind=ckind, group=group,
                                                group_size=_group_size(n, ckind, group, group_size),
                                                dtype=dtype, in_bytes=in_bytes, out_bytes=out_bytes,
                                                reduce_op=reduce_op_of(n))
            if kind == Kind.WAIT and n.all_input_nodes:
                irn.wait_of = self._index[n.all_input_nodes[0]]
            self.nodes.append(irn)

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[IRNode]:
        return iter(self.nodes)

    def index(self, node: fx.Node) -> int:
        return self._index[node]

    def of_kind(self, kind: Kind) -> list[IRNode]:
        return [n for n in self.nodes if n.kind == kind]

    def collectives(self) -> list[IRNode]:
        return self.of_kind(Kind.COLLECTIVE)

    def wait_for(self, coll: IRNode) -> IRNode | None:
        for u in coll.users:
            if self.nodes[u].kind == Kind.WAIT:
                return self.nodes[u]
        return None

    def storage_root(self, i: int) -> int:
        while self.nodes[i].alias_of is not None:
            i = self.nodes[i].alias_of
        return i

    def lifetimes(self) -> dict[int, tuple[int, int]]:
        """Storage root -> (first, last) node positions during which its bytes are live.

        A storage lives from the node that allocates it to the last use of any of its aliases;
        storages reaching the output live to the end of the graph.
        """
        end = len(self.nodes) - 1
        life: dict[int, list[int]] = {}
        for n in self.nodes:
            root = self.storage_root(n.index)
            span = life.setdefault(root, [root, root])
            for u in n.users:
                last = end if self.nodes[u].node.op == "output" else u
                span[1] = max(span[1], last)
        return {k: (v[0], v[1]) for k, v in life.items()}

    def summary(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.kind.value] = counts.get(n.kind.value, 0) + 1
        return counts


def collective_signature(ir: GraphIR) -> list[tuple]:
    """Ordered, rank-independent description of a graph's collectives (for agreement checks)."""
    out = []
    for n in ir.collectives():
        c = n.collective
        out.append((c.kind, c.group, c.group_size, str(c.dtype), c.in_bytes, c.out_bytes, c.reduce_op, n.tile))
    return out


def check_topological(graph: fx.Graph) -> list[str]:
    """Problems with the order of ``graph`` (empty when every input precedes its user)."""
    seen: set[fx.Node] = set()
    problems = []
    for n in graph.nodes:
        for a in n.all_input_nodes:
            if a not in seen:
                problems.append(f"{n.name} uses {a.name} before it is computed")
        seen.add(n)
    return problems


def iter_subgraph_modules(gm: fx.GraphModule, node: fx.Node) -> Sequence[fx.GraphModule]:
    """Subgraph modules a higher-order-op node refers to through ``get_attr`` arguments."""
    out = []
    for a in node.all_input_nodes:
        if a.op == "get_attr":
            mod = getattr(gm, a.target, None)
            if isinstance(mod, fx.GraphModule):
                out.append(mod)
    return out

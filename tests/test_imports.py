"""The house's one direction of imports: no module of ``megatron_ext`` or ``deepspeed_patches`` is in
an import circle with another, ``config/`` imports nothing from ``runtime/``, and the packages sit in
the layers docs/architecture.md draws (a package imports from its own layer and the ones below only;
the extensions never import one another).

The graph is built from the source with ``ast``: every ``import`` and ``from ... import`` anywhere in
a module counts, those under ``if TYPE_CHECKING:`` and inside functions included (a circle that only
type checkers or late imports close is still a circle a reader has to hold in mind).
"""
from __future__ import annotations

import ast
import os
from collections import defaultdict

from tests.conftest import ROOT

PACKAGES = ("megatron_ext", "deepspeed_patches")


def modules() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (the longest existing prefix of each name)."""
    mods = modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    edges[mod].add(name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_circle_and_only_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    edges = import_graph()
    found = cycles(edges)
    described = []
    for comp in found:
        inside = set(comp)
        described.append("; ".join(f"{m} -> {', '.join(sorted(edges[m] & inside))}" for m in comp))
    assert not found, "import circles:\n" + "\n".join(described)


def test_config_imports_nothing_from_runtime():
    edges = import_graph()
    bad = sorted((m, t) for m, ts in edges.items() if m.startswith("megatron_ext.config") for t in ts
                 if t.startswith(("megatron_ext.runtime", "megatron_ext.ft", "deepspeed_patches")))
    assert not bad, f"config imports the runtime: {bad}"


# Bottom to top; docs/architecture.md draws the same picture.
LAYERS = (
    ("errors",),                                    # the user-error types every layer raises
    ("engines", "models", "data", "compat"),        # pure descriptions, the data pipeline, CPU shims
    ("config",),                                    # flags + YAML -> RunConfig
    ("runtime", "ft", "pipeline"),                  # the training job: parts, fault tolerance, events
    ("helix", "resihp", "hydro", "cluster", "convert", "deepspeed_patches"),  # extensions, engines, tools
    ("bench", "resilience"),                        # the benchmark harness and the resilience simulator: may import anything, nothing imports them
)
EXTENSIONS = LAYERS[-2]


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[0] if parts[0] == "deepspeed_patches" else (parts[1] if len(parts) > 1 else "")


def test_every_package_is_in_a_layer_and_installable():
    layer_of = {p: i for i, ps in enumerate(LAYERS) for p in ps}
    mods = modules()
    missing = sorted({package_of(m) for m in mods} - set(layer_of) - {""})
    assert not missing, f"packages in no layer of tests/test_imports.py LAYERS: {missing}"
    # find_packages (setup.py) installs a package only when it has an __init__.py.
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            if any(f.endswith(".py") for f in files):
                assert "__init__.py" in files, f"{os.path.relpath(dirpath, ROOT)} has no __init__.py"


def test_imports_go_down_the_layers_only():
    layer_of = {p: i for i, ps in enumerate(LAYERS) for p in ps}
    bad = []
    for mod, targets in import_graph().items():
        a = package_of(mod)
        for t in targets:
            b = package_of(t)
            if not a or not b or a == b:
                continue
            if layer_of[b] > layer_of[a] or (a in EXTENSIONS and b in EXTENSIONS):
                bad.append(f"{mod} -> {t}")
    assert not bad, "imports against the layers:\n" + "\n".join(sorted(bad))

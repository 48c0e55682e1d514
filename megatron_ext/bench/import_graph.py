"""The project's import graph, read from the source with ``ast`` (nothing is imported or run).

Two readers need it: tests/test_imports.py holds the house's layers and its freedom from import
circles on ``import_graph``, and ``megatron_ext.bench.figures`` derives from ``loaded_files`` which
source files a benchmark runs, so that a figure is known to be stale when one of them changes.

Every ``import`` and ``from ... import`` anywhere in a module counts, those under ``if
TYPE_CHECKING:`` and inside functions included (a circle that only type checkers or late imports
close is still a circle a reader has to hold in mind, and a late import still runs).
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import os
import re
from collections import defaultdict
from typing import Iterable, Mapping, Sequence

PACKAGES = ("megatron_ext", "deepspeed_patches")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The checkout this module sits in: the tests and tools that read the graph run from a checkout
(``pip install -e``), where the source of every package is beside this file."""

# A string constant that names a project module, alone or as an "module:attribute" target
# (engines.py's EngineSpec parts, ``python -m`` launches, families.py's adapter prefix).
# A package's bare name ("deepspeed_patches") is left out: a message or a comparison, not a load.
_MODULE_NAME = re.compile(r"^((?:%s)(?:\.[A-Za-z_]\w*)+)(?::\w*)?$" % "|".join(PACKAGES))


def modules(root: str = REPO_ROOT) -> dict[str, str]:
    """Module name -> its file, for every ``.py`` file of ``PACKAGES`` under ``root`` (a package is
    named by its ``__init__.py``)."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(root, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                    out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _resolve(name: str, mods: Mapping[str, str]) -> str:
    """The longest prefix of ``name`` that is a project module ('' when none is): ``from a.b import
    c`` imports the module ``a.b.c`` when there is one, else the name ``c`` of module ``a.b``."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name


@dataclasses.dataclass(frozen=True)
class _Facts:
    """What a file says about loading, before names are resolved against the modules."""

    imports: tuple[tuple[int, str, tuple[str, ...]], ...]
    """(level, module, names): ``import a.b`` is (0, "", ("a.b",)), ``from .x import y`` (1, "x", ("y",))."""
    strings: frozenset[str]


@functools.lru_cache(maxsize=None)
def _facts_at(path: str, mtime_ns: int, size: int) -> _Facts:
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    imports, strings = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imports.append((0, "", tuple(a.name for a in node.names)))
        elif isinstance(node, ast.ImportFrom):
            imports.append((node.level, node.module or "", tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.add(node.value)
    return _Facts(tuple(imports), frozenset(strings))


def _facts(path: str) -> _Facts:
    """Parsed once per version of the file: deriving every benchmark's files reads the same modules."""
    st = os.stat(path)
    return _facts_at(path, st.st_mtime_ns, st.st_size)


def file_imports(path: str, mods: Mapping[str, str], package: str = "") -> set[str]:
    """The project modules that the file at ``path`` imports; ``package`` is the package relative
    imports start from (empty for a script outside the packages)."""
    out = set()
    for level, base, names in _facts(path).imports:
        if level == 0 and not base:
            candidates = list(names)
        else:
            if level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - level + 1] + ([base] if base else []))
            candidates = [base] + [f"{base}.{n}" for n in names]
        out.update(filter(None, (_resolve(n, mods) for n in candidates)))
    return out


def _package_of(module: str, path: str) -> str:
    return module if path.endswith("__init__.py") else module.rpartition(".")[0]


def import_graph(root: str = REPO_ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports (the longest existing prefix of each name)."""
    mods = modules(root)
    edges: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        targets = file_imports(path, mods, _package_of(mod, path)) - {mod}
        if targets:
            edges[mod] |= targets
    return edges


def cycles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
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


def entry_points(root: str = REPO_ROOT) -> dict[str, list[str]]:
    """setup.py's ``entry_points``: group -> the modules its entries name, read from the source (the
    installed metadata may be another checkout's). Empty when setup.py has none."""
    path = os.path.join(root, "setup.py")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "entry_points":
            groups = ast.literal_eval(node.value)
            return {group: sorted({e.partition("=")[2].strip().partition(":")[0] for e in entries})
                    for group, entries in groups.items()}
    return {}


def named_modules(path: str, mods: Mapping[str, str], groups: Mapping[str, Sequence[str]]) -> set[str]:
    """The project modules the file at ``path`` loads by name, which no import statement shows: a
    string constant naming a module (``importlib.import_module``, ``python -m``, an ``EngineSpec``
    part "module:attribute"), and every module of an entry-point group whose name it holds
    (config/run.py imports each ``megatron_ext.extensions`` entry point)."""
    out = set()
    for value in _facts(path).strings:
        if value in groups:
            out.update(m for m in groups[value] if m in mods)
            continue
        m = _MODULE_NAME.match(value)
        if m:
            out.add(_resolve(m.group(1), mods))
    out.discard("")
    return out


def _ancestors(module: str) -> list[str]:
    """The packages Python runs the ``__init__`` of before ``module``: ``a`` and ``a.b`` for ``a.b.c``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def loaded_files(scripts: Sequence[str], root: str = REPO_ROOT) -> list[str]:
    """Every source file that running ``scripts`` (paths relative to ``root``) can load, relative to
    ``root`` and sorted: the scripts, the project modules they import, transitively, with the
    ``__init__`` of every package on the way (importing ``a.b.c`` runs ``a`` and ``a.b`` first), and
    the modules loaded by name (``named_modules``). A package imported means its ``__init__`` and
    the modules it imports, not every file beside it."""
    mods = modules(root)
    groups = entry_points(root)
    seen: set[str] = set()
    todo: list[str] = []

    def reach(module: str) -> None:
        for m in [*_ancestors(module), module]:
            if m in mods and m not in seen:
                seen.add(m)
                todo.append(m)

    for script in scripts:
        path = os.path.join(root, script)
        for m in file_imports(path, mods) | named_modules(path, mods, groups):
            reach(m)
    while todo:
        mod = todo.pop()
        path = mods[mod]
        for m in file_imports(path, mods, _package_of(mod, path)) | named_modules(path, mods, groups):
            reach(m)
    files = {os.path.relpath(mods[m], root).replace(os.sep, "/") for m in seen}
    return sorted(files | {s.replace(os.sep, "/") for s in scripts})

"""The house's one direction of imports: no module of ``megatron_ext`` or ``deepspeed_patches`` is in
an import circle with another, ``config/`` imports nothing from ``runtime/``, and the packages sit in
the layers docs/architecture.md draws (a package imports from its own layer and the ones below only;
the extensions never import one another).

The graph is built from the source with ``ast`` (``megatron_ext/bench/import_graph.py``, which the
figures check uses too): every ``import`` and ``from ... import`` anywhere in a module counts, those
under ``if TYPE_CHECKING:`` and inside functions included (a circle that only type checkers or late
imports close is still a circle a reader has to hold in mind).
"""
from __future__ import annotations

import os

from megatron_ext.bench.import_graph import PACKAGES, cycles, import_graph, modules
from tests.conftest import ROOT


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
    ("engines", "models", "layout", "data", "compat"),  # pure descriptions, the data pipeline, CPU shims
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

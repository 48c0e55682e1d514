"""A config section is read by the package that registers it and by no other: ``cfg.ext("x")``
appears only inside the package whose module registers section ``x`` (``@section("x")``). What
another package needs to know of a section it asks through a capability the section declares
(``RunConfig.capability``), so an extension's fields stay its own to rename."""
from __future__ import annotations

import ast
import dataclasses
import os

import pytest

from megatron_ext.config.run import config_from_values
from tests.conftest import ROOT

SOURCES = ("megatron_ext", "deepspeed_patches", "pretrain_gpt.py", "tools")


def python_files():
    for top in SOURCES:
        path = os.path.join(ROOT, top)
        if os.path.isfile(path):
            yield top
            continue
        for dirpath, _, files in os.walk(path):
            for f in files:
                if f.endswith(".py"):
                    yield os.path.relpath(os.path.join(dirpath, f), ROOT).replace(os.sep, "/")


def package_of(rel: str) -> str:
    """``megatron_ext/helix/x.py`` -> ``megatron_ext/helix``; a top-level module or script is its own."""
    parts = rel.split("/")
    if parts[0] == "megatron_ext" and len(parts) > 2:
        return "/".join(parts[:2])
    if parts[0] == "deepspeed_patches":
        return "deepspeed_patches"
    return rel


def string_calls(tree: ast.AST, name: str) -> list[tuple[str, int]]:
    """First string arguments of calls to ``name`` (a function or a method), with their lines."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if called == name:
                out.append((node.args[0].value, node.lineno))
    return out


def test_a_section_is_read_only_inside_the_package_that_registers_it():
    registered: dict[str, str] = {}
    reads: list[tuple[str, str, int]] = []
    for rel in python_files():
        tree = ast.parse(open(os.path.join(ROOT, rel), encoding="utf-8").read(), rel)
        for name, _ in string_calls(tree, "section"):
            registered[name] = package_of(rel)
        reads += [(name, rel, line) for name, line in string_calls(tree, "ext")]
    assert {"helix", "resihp", "ft", "timeline", "squeeze", "faults"} <= set(registered), registered
    assert reads, "the scan found no cfg.ext(...) call: it no longer sees what it checks"
    bad = [f"{rel}:{line} reads section {name!r}, registered in {registered[name]}"
           for name, rel, line in reads if name in registered and package_of(rel) != registered[name]]
    assert not bad, "sections read outside their package (declare a capability instead):\n" + "\n".join(bad)


def test_the_scan_catches_a_read_from_another_package(tmp_path):
    tree = ast.parse('cfg.ext("helix").helix_tiles\nsection("helix")(X)\n')
    assert string_calls(tree, "ext") == [("helix", 1)]
    assert string_calls(tree, "section") == [("helix", 2)]
    assert package_of("megatron_ext/runtime/model.py") == "megatron_ext/runtime"
    assert package_of("pretrain_gpt.py") == "pretrain_gpt.py"


@pytest.mark.parametrize("values, capability, expected", [
    ({}, "local_layer_spec", None),
    ({"helix": True}, "local_layer_spec", "--helix"),
    ({"resihp": True}, "fault_tolerance", "--resihp"),
    ({}, "fault_tolerance", None),
])
def test_capabilities_come_from_the_sections_that_declare_them(values, capability, expected):
    assert config_from_values(dict(values)).capability(capability) == expected


def test_a_capability_names_the_flag_in_the_error_it_causes():
    from megatron_ext.config.base import ConfigError

    cfg = config_from_values({"helix": True, "num_experts": 4, "moe_shared_expert_intermediate_size": 64})
    with pytest.raises(ConfigError, match=r"^--moe-shared-expert-intermediate-size with --helix: Helix's traceable "
                                          r"MoE dispatch \(helix/adapter_moe.py\) does not implement shared experts; "
                                          r"drop one of them$"):
        cfg.validate(1)
    assert dataclasses.replace(cfg, extensions={}).capability("no_shared_experts") is None

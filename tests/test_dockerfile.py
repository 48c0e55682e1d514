"""The Dockerfile installs what setup.py pins (no Docker engine needed to check that)."""
from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_pins() -> tuple[list[str], dict[str, list[str]]]:
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    install = next(ast.literal_eval(n.value) for n in tree.body
                   if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "INSTALL_REQUIRES")
    call = next(n.value for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call))
    extras = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))
    return install, extras


def _arg(dockerfile: str, name: str) -> str:
    m = re.search(rf"^ARG {name}=(\S+)$", dockerfile, re.M)
    assert m, f"Dockerfile has no default for ARG {name}"
    return m.group(1)


def test_default_base_image_carries_the_torch_pin():
    dockerfile = open(os.path.join(ROOT, "Dockerfile")).read()
    install, _ = _setup_pins()
    torch_pin = next(r.split("==")[1] for r in install if r.startswith("torch=="))
    base = _arg(dockerfile, "BASE_IMAGE")
    assert base.split(":")[1].startswith(torch_pin + "-cuda") and base.endswith("-devel"), base


def test_transformer_engine_is_the_gpu_extra_pin():
    dockerfile = open(os.path.join(ROOT, "Dockerfile")).read()
    _, extras = _setup_pins()
    assert [_arg(dockerfile, "TRANSFORMER_ENGINE")] == extras["gpu"]


def test_requirements_are_read_from_setup_py_and_the_check_is_runnable():
    dockerfile = open(os.path.join(ROOT, "Dockerfile")).read()
    assert "INSTALL_REQUIRES" in dockerfile  # the pins come from setup.py, not a copied list
    copied = " ".join(line for line in dockerfile.splitlines() if line.startswith("COPY"))
    for needed in ("Makefile", "tools", "megatron_ext", "setup.py"):
        assert needed in copied, needed

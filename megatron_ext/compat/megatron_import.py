"""One shim that runs while megatron-core is imported: on a machine without CUDA, megatron's
``jit_fuser`` is its own ``noop_decorator``.

``megatron/core/jit.py`` (0.16.1) sets ``jit_fuser = torch.compile``, and the fused kernels of
``megatron/core/fusions/`` are decorated with it as megatron-core is imported. ``torch.compile(fn)``
compiles nothing until a call, but it imports TorchDynamo and Inductor right away: about 1 s of the
2.8 s megatron-core takes to import, paid by every rank process. Without CUDA none of those kernels
runs (``runtime/model.py`` turns the bias-activation, bias-dropout and softmax fusions on only on a
GPU), so on such a machine the decorator is megatron's no-op. With CUDA nothing changes.

The module is replaced the moment megatron executes it, through a meta-path finder that
``install()`` puts in front of the import system (``megatron_ext/__init__.py`` calls it, so it holds
in any process that imports this package before megatron-core; imported the other way round,
megatron keeps ``torch.compile``). Version-guarded: a ``megatron.core.jit`` without ``jit_fuser`` or
``noop_decorator`` is left as it is. ``tests/compat/test_megatron_cpu.py`` checks both sides.
Standard library only: importing this package must stay cheap.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

JIT_MODULE = "megatron.core.jit"


def replace_jit_fuser(module: Any) -> bool:
    """Make ``module.jit_fuser`` megatron's ``noop_decorator`` when no CUDA device is usable.
    Returns whether it did."""
    noop = getattr(module, "noop_decorator", None)
    if noop is None or not hasattr(module, "jit_fuser"):
        return False
    torch = sys.modules.get("torch")
    if torch is None or torch.cuda.is_available():
        return False
    module.jit_fuser = noop
    return True


class _JitFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            replace_jit_fuser(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Put the finder in front of the import system (once; a no-op once megatron-core is imported)."""
    if JIT_MODULE in sys.modules or any(isinstance(f, _JitFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _JitFinder())

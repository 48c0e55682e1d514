"""Keep TorchDynamo out of megatron's CUDA RNG-state setter while Helix compiles a model on a GPU.

Every attention of megatron's local spec enters ``get_cuda_rng_tracker().fork()`` around its
dropout, and the tracker sets the generator state with ``tensor_parallel.random._set_cuda_rng_state``,
which hands a closure to ``torch.cuda._lazy_call``. torch runs that closure while holding
``torch.cuda._initialization_lock``, a plain (non-reentrant) ``threading.Lock``. Under
``torch.compile`` Dynamo intercepts the closure's frame, and compiling it saves and restores the
CUDA RNG state through ``torch.cuda.set_rng_state`` -> ``_lazy_call`` -> the same lock: the thread
waits on itself for ever. The first GPU run of ``make gpu-check`` (docs/runtime.md, "First GPU
run") hung there in its ``helix`` section; pytorch/pytorch#182948 fixes ``_lazy_call`` upstream.
The CPU never gets there (no CUDA state to save; megatron's setter is replaced by the CPU shim).

``apply()`` makes the setter run with Dynamo disabled (``torch._dynamo.disable``, recursive), so
the closure stays eager Python: the compiled graph breaks where the RNG state is set (on a GPU, a
layer's graph is split at its attention's dropout region). Applied only while torch's
``_lazy_call`` still calls back under its lock (``lazy_call_reenters()`` reads its source rather
than trusting a version number); ``remove()`` puts megatron's function back.
"""
from __future__ import annotations

import inspect
import re
from typing import Any, Callable

RANDOM_MODULE = "megatron.core.tensor_parallel.random"
SETTER = "_set_cuda_rng_state"
_original: Callable[..., Any] | None = None


def lazy_call_reenters() -> bool:
    """Whether ``torch.cuda._lazy_call`` still runs its callback inside ``with _initialization_lock:``
    (the deadlock's condition)."""
    import torch.cuda

    try:
        src = inspect.getsource(torch.cuda._lazy_call)
    except (OSError, TypeError, AttributeError):
        return True  # cannot tell: keep Dynamo out, which is safe either way
    m = re.search(r"with _initialization_lock:\n(.*)", src, re.S)
    return bool(m and re.search(r"^\s+callable\(\)", m.group(1), re.M))


def applied() -> bool:
    return _original is not None


def apply() -> bool:
    """Wrap megatron's setter with ``torch._dynamo.disable`` (idempotent). Returns whether it is
    wrapped now."""
    global _original
    import importlib

    import torch._dynamo

    if _original is not None:
        return True
    if not lazy_call_reenters():
        return False
    module = importlib.import_module(RANDOM_MODULE)
    fn = getattr(module, SETTER, None)
    if fn is None:
        raise RuntimeError(f"{RANDOM_MODULE}.{SETTER} is gone: re-check megatron_ext/helix/rng.py "
                           "against this megatron-core")
    _original = fn
    setattr(module, SETTER, torch._dynamo.disable(fn, reason="megatron's CUDA RNG setter re-enters "
                                                             "torch.cuda._lazy_call's lock"))
    return True


def remove() -> None:
    global _original
    import importlib

    if _original is None:
        return
    setattr(importlib.import_module(RANDOM_MODULE), SETTER, _original)
    _original = None

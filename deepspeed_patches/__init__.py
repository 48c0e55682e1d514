"""Version-guarded patches that run DeepSpeed 0.19.8's pipeline engine on CPU with pipeline events.

``apply()`` is explicit and idempotent. It

1. skips ``build_shm_op`` in ``deepspeed.comm.torch`` (a C++ build of a shared-memory all-reduce
   used only for inference: ~200 s on 2 cores at the first ``init_distributed``);
2. replaces the blocking ``deepspeed.runtime.pipe.p2p.send/recv`` by versions that record the open
   p2p event of a Send/Recv instruction (``engine.patch_p2p``; a pass-through otherwise);
3. installs ``engine.EventPipelineEngine`` as the module-level ``deepspeed.PipelineEngine``, which
   ``deepspeed.initialize`` instantiates for a ``PipelineModule``.

``SYMBOLS`` lists every upstream name the patches replace or rely on, with a source fragment where
the reliance is on how the name is used; ``missing_symbols()`` checks them and ``apply()`` refuses to
run when one moved. ``tests/deepspeed_patches/test_patches.py`` has one test per symbol.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_DEEPSPEED = ("0.19.8",)

# (module, attribute path, fragment of its source that the patch relies on, or None)
SYMBOLS: tuple[tuple[str, str, str | None], ...] = (
    ("deepspeed.comm.torch", "build_shm_op", None),
    ("deepspeed.comm.torch", "TorchBackend.__init__", "self.shm_comm_op = build_shm_op()"),
    ("deepspeed", "PipelineEngine", None),
    ("deepspeed", "initialize", "else PipelineEngine"),
    ("deepspeed.runtime.pipe.p2p", "send", None),
    ("deepspeed.runtime.pipe.p2p", "recv", None),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._INSTRUCTION_MAP", None),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_schedule", "self._INSTRUCTION_MAP[type(cmd)]"),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._train_schedule", "schedule.TrainSchedule("),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_send_activations", "p2p.send("),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_recv_activations", "p2p.recv("),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_send_grads", "p2p.send("),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_recv_grads", "p2p.recv("),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._send_tensor_meta", "p2p.send("),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._recv_tensor_meta", "p2p.recv("),
    ("deepspeed.runtime.pipe.schedule", "TrainSchedule._step_to_micro_batch", None),
    ("deepspeed.runtime.pipe.schedule", "TrainSchedule.steps", "prev_micro_batch_id = micro_batch_id"),
    ("deepspeed.runtime.pipe.module", "PipelineModule._partition_layers", "self._set_bounds("),
    ("deepspeed.runtime.pipe.module", "PipelineModule._set_bounds", None),
)
# Instructions the engine subclass times: each must still be a key of the instruction map.
TIMED = ("ForwardPass", "BackwardPass", "LoadMicroBatch", "SendActivation", "RecvActivation", "SendGrad",
         "RecvGrad", "ReduceTiedGrads", "ReduceGrads", "OptimizerStep")


def _resolve(module: str, path: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def missing_symbols() -> list[str]:
    """Upstream names (or the source fragments the patches rely on) that are no longer there."""
    gone = []
    for module, path, fragment in SYMBOLS:
        try:
            obj = _resolve(module, path)
        except (ImportError, AttributeError):
            gone.append(f"{module}.{path}")
            continue
        if fragment is not None:
            try:
                source = inspect.getsource(inspect.unwrap(obj))
            except (OSError, TypeError):
                source = ""
            if fragment not in source:
                gone.append(f"{module}.{path} (no longer contains {fragment!r})")
    try:
        from deepspeed.runtime.pipe import schedule
        from deepspeed.runtime.pipe.engine import PipelineEngine

        gone += [f"PipelineEngine._INSTRUCTION_MAP[{name}]" for name in TIMED
                 if getattr(schedule, name, None) not in PipelineEngine._INSTRUCTION_MAP]
    except ImportError:
        pass
    return gone


def _skip_shm_build() -> None:
    # ``import deepspeed.comm.torch`` binds the name through the package attribute ``torch``, which
    # is the torch module: the DeepSpeed module lives only in sys.modules.
    importlib.import_module("deepspeed.comm.torch")
    mod = sys.modules["deepspeed.comm.torch"]
    if getattr(mod.build_shm_op, "megatron_ext_patch", False):
        return

    def build_shm_op() -> None:
        """Skipped by megatron_ext: the shm all-reduce serves inference only."""
        return None

    build_shm_op.megatron_ext_patch = True
    build_shm_op.__wrapped__ = mod.build_shm_op
    mod.build_shm_op = build_shm_op


def apply() -> None:
    """Apply every patch (idempotent). Call before ``deepspeed.init_distributed``."""
    import deepspeed

    if deepspeed.__version__ not in SUPPORTED_DEEPSPEED:
        raise RuntimeError(f"deepspeed_patches supports deepspeed {SUPPORTED_DEEPSPEED}, found "
                           f"{deepspeed.__version__}: check SYMBOLS in deepspeed_patches/__init__.py")
    gone = missing_symbols()
    if gone:
        raise RuntimeError(f"deepspeed {deepspeed.__version__} no longer has {gone}: update deepspeed_patches/")
    _skip_shm_build()
    from deepspeed_patches import engine

    engine.patch_p2p()
    deepspeed.PipelineEngine = engine.EventPipelineEngine


def applied() -> bool:
    import deepspeed

    from deepspeed_patches import engine

    mod = sys.modules.get("deepspeed.comm.torch")
    return (deepspeed.PipelineEngine is engine.EventPipelineEngine
            and getattr(engine.p2p.send, "megatron_ext_patch", False)
            and mod is not None and getattr(mod.build_shm_op, "megatron_ext_patch", False))

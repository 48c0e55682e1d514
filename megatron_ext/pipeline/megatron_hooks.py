"""Pipeline events from megatron-core's schedules, by wrapping from outside (no copied schedule).

megatron-core 0.16.1 looks up ``schedules.forward_step``, ``schedules.backward_step`` and the
``P2PCommunicator`` methods at call time (docs/pipeline.md, "What the recorders rely on"), so
replacing them on the module and the class sees every forward, backward, send and receive of the
1F1B and interleaved schedules. Time spent inside a p2p call is time the stage waits for its peer.
``install`` is explicit and checks the version and the symbols; ``tests/pipeline`` fails when they
move.
"""
from __future__ import annotations

import functools
import importlib
import logging
from typing import Any, Callable

from megatron_ext.pipeline.events import Call, EventRecorder, Phase

logger = logging.getLogger(__name__)

SUPPORTED_MEGATRON_CORE = ("0.16.1",)
SCHEDULES = "megatron.core.pipeline_parallel.schedules"
P2P = "megatron.core.pipeline_parallel.p2p_communication"
P2P_METHODS: dict[str, Call] = {
    "recv_forward": Call.RECV_FORWARD,
    "recv_backward": Call.RECV_BACKWARD,
    "send_forward": Call.SEND_FORWARD,
    "send_backward": Call.SEND_BACKWARD,
    "send_forward_recv_backward": Call.SEND_FORWARD_RECV_BACKWARD,
    "send_backward_recv_forward": Call.SEND_BACKWARD_RECV_FORWARD,
    "send_forward_recv_forward": Call.SEND_FORWARD_RECV_FORWARD,
    "send_backward_recv_backward": Call.SEND_BACKWARD_RECV_BACKWARD,
    "send_forward_backward_recv_forward_backward": Call.SEND_FORWARD_BACKWARD_RECV_FORWARD_BACKWARD,
}
# Calls whose whole purpose is to send: the stage is not waiting for an input.
_SEND_ONLY = {Call.SEND_FORWARD, Call.SEND_BACKWARD}


def require_megatron_core(what: str, missing: list[str], module_file: str) -> None:
    """The guard of every module that patches or hooks megatron-core from outside: refuse a
    version it was not written against, or one that lost a symbol it needs (``missing``)."""
    import megatron.core

    if megatron.core.__version__ not in SUPPORTED_MEGATRON_CORE:
        raise RuntimeError(f"{what} support megatron-core {SUPPORTED_MEGATRON_CORE}, "
                           f"found {megatron.core.__version__}")
    if missing:
        raise RuntimeError(f"megatron-core no longer has {missing}: update {module_file}")


def missing_symbols() -> list[str]:
    sched = importlib.import_module(SCHEDULES)
    p2p = importlib.import_module(P2P)
    missing = [f"schedules.{n}" for n in ("forward_step", "backward_step") if not hasattr(sched, n)]
    missing += [f"P2PCommunicator.{m}" for m in P2P_METHODS if not hasattr(p2p.P2PCommunicator, m)]
    return missing


class MegatronPipelineHooks:
    """Records this rank's forwards, backwards and p2p waits into ``recorder``.

    ``chunks`` are the rank's model chunks (after DDP wrapping) in virtual-stage order; a forward's
    chunk is found by identity, a backward's from the output tensor its forward produced.
    """

    _active: "MegatronPipelineHooks | None" = None

    def __init__(self, recorder: EventRecorder, chunks: list[Any]) -> None:
        self.recorder = recorder
        self._chunk_of = {id(c): i for i, c in enumerate(chunks)}
        self._produced: dict[int, tuple[int, int]] = {}
        self._pending: dict[int, list[int]] = {}
        self._originals: dict[tuple[Any, str], Any] = {}

    # --- lifecycle -------------------------------------------------------------------------
    def install(self) -> "MegatronPipelineHooks":
        require_megatron_core("pipeline hooks", missing_symbols(), "megatron_ext/pipeline/megatron_hooks.py")
        if MegatronPipelineHooks._active is not None:
            raise RuntimeError("pipeline hooks are already installed; uninstall() the other recorder first")
        sched = importlib.import_module(SCHEDULES)
        p2p = importlib.import_module(P2P)
        self._patch(sched, "forward_step", self._wrap_forward(sched.forward_step))
        self._patch(sched, "backward_step", self._wrap_backward(sched.backward_step))
        for name, call in P2P_METHODS.items():
            self._patch(p2p.P2PCommunicator, name, self._wrap_p2p(getattr(p2p.P2PCommunicator, name), call))
        MegatronPipelineHooks._active = self
        return self

    def uninstall(self) -> None:
        for (owner, name), original in self._originals.items():
            setattr(owner, name, original)
        self._originals.clear()
        if MegatronPipelineHooks._active is self:
            MegatronPipelineHooks._active = None

    def new_iteration(self) -> None:
        self._produced.clear()
        self._pending.clear()

    def _patch(self, owner: Any, name: str, fn: Callable) -> None:
        self._originals[(owner, name)] = getattr(owner, name)
        setattr(owner, name, fn)

    # --- wrappers --------------------------------------------------------------------------
    def _wrap_forward(self, original: Callable) -> Callable:
        rec = self.recorder

        @functools.wraps(original)
        def forward_step(forward_step_func, data_iterator, model, *args, **kwargs):
            chunk = self._chunk_of.get(id(model), 0)
            mb = kwargs.get("current_microbatch")
            if mb is None:  # older call sites: count forwards per chunk
                mb = len(self._pending.setdefault(-1 - chunk, []))
                self._pending[-1 - chunk].append(mb)
            slot = rec.begin(Phase.FORWARD, chunk, mb)
            out = original(forward_step_func, data_iterator, model, *args, **kwargs)
            rec.end(slot)
            output = out[0] if isinstance(out, tuple) else out
            key = output[0] if isinstance(output, list) and output else output
            self._produced[id(key)] = (mb, chunk)
            return out

        return forward_step

    def _wrap_backward(self, original: Callable) -> Callable:
        rec = self.recorder

        @functools.wraps(original)
        def backward_step(input_tensor, output_tensor, *args, **kwargs):
            key = output_tensor[0] if isinstance(output_tensor, list) and output_tensor else output_tensor
            mb, chunk = self._produced.pop(id(key), (-1, 0))
            slot = rec.begin(Phase.BACKWARD, chunk, mb)
            out = original(input_tensor, output_tensor, *args, **kwargs)
            rec.end(slot)
            return out

        return backward_step

    def _wrap_p2p(self, original: Callable, call: Call) -> Callable:
        rec = self.recorder
        phase = Phase.SEND if call in _SEND_ONLY else Phase.RECV

        @functools.wraps(original)
        def p2p(communicator, *args, **kwargs):
            slot = rec.begin(phase, 0, -1, call)
            out = original(communicator, *args, **kwargs)
            rec.end(slot)
            return out

        return p2p


def wrap_phase(recorder: EventRecorder, fn: Callable, phase: Phase) -> Callable:
    """``fn`` recorded as one event of ``phase`` (gradient reduce, optimizer step, ...)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        slot = recorder.begin(phase)
        try:
            return fn(*args, **kwargs)
        finally:
            recorder.end(slot)

    return wrapped

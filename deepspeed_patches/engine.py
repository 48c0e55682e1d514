"""A DeepSpeed ``PipelineEngine`` that records pipeline events (what it relies on in DeepSpeed 0.19.8:
docs/pipeline.md, "What the recorders rely on").

DeepSpeed runs a pipeline iteration as data: ``TrainSchedule`` yields, step by step, instructions
that ``_exec_schedule`` dispatches through ``self._INSTRUCTION_MAP``. ``EventPipelineEngine`` extends
that map (``{**PipelineEngine._INSTRUCTION_MAP, ...}``; no copied engine) with timed versions of the
compute, load, p2p, gradient-reduce and optimizer instructions, and wraps the train schedule so every
instruction knows the micro-batch of its step (DeepSpeed's own ``_step_to_micro_batch``).

The p2p instructions block in ``deepspeed.runtime.pipe.p2p.send/recv`` (module functions the
engine calls as ``p2p.send``); ``patch_p2p`` replaces them so that, while a Send/Recv instruction
runs, its blocking calls (tensor meta + data) become one event spanning the first call's start to
the last call's end: the time the stage waited for its peer. Sends block on gloo too, so they are
waits, not work. Events use the framework-neutral codes of ``megatron_ext.pipeline.events``:
``IterationRecord(schedule="deepspeed")`` reads them like the megatron engine's.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from deepspeed.runtime.pipe import p2p, schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from megatron_ext.pipeline.events import Call, EventRecorder, Phase

logger = logging.getLogger(__name__)

class _P2PSpan:
    """The open p2p event of the running Send/Recv instruction (one object per engine, reused:
    nothing is allocated per event)."""

    __slots__ = ("recorder", "phase", "call", "microbatch", "slot")

    def __init__(self) -> None:
        self.recorder: EventRecorder | None = None
        self.phase = 0
        self.call = 0
        self.microbatch = -1
        self.slot = -1


# Set while a timed Send/Recv instruction runs; the patched p2p functions read it.
_open_span: _P2PSpan | None = None
_ORIGINAL_P2P: dict[str, Callable] = {}


def _timed_p2p(name: str) -> Callable:
    original = getattr(p2p, name)

    def blocking(tensor, stage, async_op=False):
        span = _open_span
        if span is None:
            return original(tensor, stage, async_op)
        if span.slot < 0:
            span.slot = span.recorder.begin(span.phase, 0, span.microbatch, span.call)
        else:
            span.recorder.reopen(span.slot)
        try:
            return original(tensor, stage, async_op)
        finally:
            span.recorder.end(span.slot)  # extends the event to the end of this call

    blocking.__name__ = blocking.__qualname__ = name
    blocking.__wrapped__ = original
    blocking.megatron_ext_patch = True
    return blocking


def patch_p2p() -> None:
    """Replace ``p2p.send``/``p2p.recv`` by span-recording versions (idempotent)."""
    for name in ("send", "recv"):
        if not getattr(getattr(p2p, name), "megatron_ext_patch", False):
            _ORIGINAL_P2P[name] = getattr(p2p, name)
            setattr(p2p, name, _timed_p2p(name))


def unpatch_p2p() -> None:
    for name, fn in _ORIGINAL_P2P.items():
        setattr(p2p, name, fn)
    _ORIGINAL_P2P.clear()


# --- timed instructions ------------------------------------------------------------------------

def _timed(fn: Callable, phase: Phase, *, per_microbatch: bool) -> Callable:
    """``fn`` timed as one event; ``per_microbatch`` False for instructions about the whole batch
    (gradient reduce, optimizer step), which carry no micro-batch."""

    def timed(self: "EventPipelineEngine", **kwargs: Any) -> None:
        rec = self.event_recorder
        if rec is None or not self._recording:
            return fn(self, **kwargs)
        slot = rec.begin(phase, 0, self._step_microbatch) if per_microbatch else rec.begin(phase)
        try:
            fn(self, **kwargs)
        finally:
            rec.end(slot)

    timed.__name__ = f"timed{fn.__name__}"
    return timed


def _compute(fn: Callable, phase: Phase) -> Callable:
    return _timed(fn, phase, per_microbatch=True)


def _whole(fn: Callable, phase: Phase) -> Callable:
    return _timed(fn, phase, per_microbatch=False)


def _p2p(fn: Callable, phase: Phase, call: Call, previous_step: bool) -> Callable:
    """Send/Recv: the event is opened by the first blocking p2p call. Sends carry the output of the
    previous step's micro-batch (``SendActivation(prev_buffer)``), receives feed this step's."""

    def timed(self: "EventPipelineEngine", **kwargs: Any) -> None:
        global _open_span
        rec = self.event_recorder
        if rec is None or not self._recording:
            return fn(self, **kwargs)
        span = self._span
        span.recorder, span.phase, span.call, span.slot = rec, phase, call, -1
        span.microbatch = self._prev_microbatch if previous_step else self._step_microbatch
        _open_span = span
        try:
            fn(self, **kwargs)
        finally:
            _open_span = None

    timed.__name__ = f"timed{fn.__name__}"
    return timed


_BASE = PipelineEngine._INSTRUCTION_MAP
TIMED_INSTRUCTIONS: dict[type, Callable] = {
    schedule.ForwardPass: _compute(_BASE[schedule.ForwardPass], Phase.FORWARD),
    schedule.BackwardPass: _compute(_BASE[schedule.BackwardPass], Phase.BACKWARD),
    schedule.LoadMicroBatch: _compute(_BASE[schedule.LoadMicroBatch], Phase.OTHER),
    schedule.SendActivation: _p2p(_BASE[schedule.SendActivation], Phase.SEND, Call.SEND_FORWARD, True),
    schedule.RecvActivation: _p2p(_BASE[schedule.RecvActivation], Phase.RECV, Call.RECV_FORWARD, False),
    schedule.SendGrad: _p2p(_BASE[schedule.SendGrad], Phase.SEND, Call.SEND_BACKWARD, True),
    schedule.RecvGrad: _p2p(_BASE[schedule.RecvGrad], Phase.RECV, Call.RECV_BACKWARD, False),
    schedule.ReduceTiedGrads: _whole(_BASE[schedule.ReduceTiedGrads], Phase.GRAD_REDUCE),
    schedule.ReduceGrads: _whole(_BASE[schedule.ReduceGrads], Phase.GRAD_REDUCE),
    schedule.OptimizerStep: _whole(_BASE[schedule.OptimizerStep], Phase.OPTIMIZER),
}


class _StepTrackedSchedule:
    """Iterates a ``TrainSchedule`` and tells the engine the micro-batch of each step."""

    def __init__(self, sched: Any, engine: "EventPipelineEngine") -> None:
        self.sched = sched
        self.engine = engine

    def num_pipe_buffers(self) -> int:
        return self.sched.num_pipe_buffers()

    def __iter__(self):
        engine = self.engine
        previous = -1
        engine._recording = True
        try:
            for step_id, cmds in enumerate(self.sched):
                engine._step_microbatch = self.sched._step_to_micro_batch(step_id)[0]
                engine._prev_microbatch = previous
                yield cmds
                previous = engine._step_microbatch
        finally:
            engine._recording = False


class EventPipelineEngine(PipelineEngine):
    """``PipelineEngine`` whose train-schedule instructions are recorded into ``event_recorder``.

    With no recorder attached (the default) every instruction runs as in DeepSpeed after one
    attribute check. Evaluation (``InferenceSchedule``) is never recorded.
    """

    _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, **TIMED_INSTRUCTIONS}

    event_recorder: EventRecorder | None = None
    _recording = False      # True while the train schedule's steps run
    _step_microbatch = -1   # micro-batch of the running step (may be out of range: an idle step)
    _prev_microbatch = -1

    def attach_recorder(self, recorder: EventRecorder | None) -> None:
        self.event_recorder = recorder
        self._span = _P2PSpan()

    def _train_schedule(self) -> Any:
        return _StepTrackedSchedule(super()._train_schedule(), self)

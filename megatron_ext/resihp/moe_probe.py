"""What a rank's experts did in each micro-batch, from megatron-core's own MoE layers: how many
(token, expert) pairs its local experts computed, and how long each forward and backward op spent
inside the token dispatcher's collectives.

Why both. With expert parallelism the work of a rank depends on the routing: the experts of one
rank may get most of a micro-batch's tokens (the MoE analogue of a long document), so the detector
needs the routed count to know how long the op should take. And every MoE layer synchronises the
expert-parallel (EP) group two or three times per pass (the token-count all-gather, the dispatch
and combine all-to-alls, and their backward), so a slow rank's EP peers wait for it *inside their
own forward and backward ops*. Measured on PP2 x DP2 with EP2 (rank 2 throttled 3x): rank 2's ops
took 3x, its EP peer rank 3's 2.9x (all of it in the all-to-alls), and rank 1 on the other stage
1.9x in backward (its EP peer rank 0 waited for the slow replica's gradient). The same-iteration
peer normalisation then sees the slow rank as no slower than its peer (score 1.02-1.14). A
duration that excludes the time inside these collectives is the rank's own compute again, which
is what the trace format asks for (docs/resihp_trace_format.md).

Hook points (megatron-core 0.16.1, checked by ``missing_symbols`` and ``tests/resihp``):

* ``MoELayer.routed_experts_compute`` calls ``self.experts(tokens, tokens_per_expert, probs)``
  for every expert implementation (SequentialMLP, GroupedMLP, TEGroupedMLP): a forward pre-hook
  on ``experts`` reads ``tokens_per_expert`` (after the dispatch: what this rank's experts get,
  padding to capacity included).
* The dispatchers call ``all_to_all``, ``gather_from_sequence_parallel_region`` and
  ``reduce_scatter_to_sequence_parallel_region`` through names of the ``token_dispatcher``
  module, looked up at call time: replacing those names times every dispatcher collective and
  nothing else (attention's tensor-parallel collectives are not touched). The backward of a
  collective is timed by two identity autograd functions around it: the engine runs the
  collective's backward between them (it runs the ready node created last in forward first).

Each probe row names the pipeline event that was open when it happened (the recorder's event
count at that moment: forward and backward steps do not nest other events), so rows join the
timeline without a clock comparison, also under CUDA timing. Host clock spans of collectives are
only the collective's duration on CPU ranks; on a GPU, where a call returns once its kernels are
queued, only the routed counts are used.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging
import time
from typing import Any, Callable

import numpy as np
import torch

from megatron_ext.pipeline.events import EventRecorder, Phase
from megatron_ext.pipeline.megatron_hooks import require_megatron_core

logger = logging.getLogger(__name__)

DISPATCHER_MODULE = "megatron.core.transformer.moe.token_dispatcher"
MOE_LAYER_MODULE = "megatron.core.transformer.moe.moe_layer"
# Collectives the token dispatchers call by module-level name; each moves its ``input_`` argument.
COLLECTIVES = ("all_to_all", "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region")

ROUTED, COLLECTIVE = 0, 1
PROBE_DTYPE = np.dtype([("event", "i4"), ("kind", "i1"), ("t0", "f8"), ("t1", "f8"), ("value", "f8")])


def missing_symbols() -> list[str]:
    """What the probe needs from megatron-core and no longer finds (empty when all is there)."""
    out = []
    try:
        disp = importlib.import_module(DISPATCHER_MODULE)
        layer = importlib.import_module(MOE_LAYER_MODULE)
    except ImportError as exc:
        return [str(exc)]
    for name in COLLECTIVES:
        fn = getattr(disp, name, None)
        if fn is None:
            out.append(f"token_dispatcher.{name}")
        elif "input_" not in inspect.signature(fn).parameters:
            out.append(f"token_dispatcher.{name}(input_=...)")
    moe = getattr(layer, "MoELayer", None)
    if moe is None:
        out.append("moe_layer.MoELayer")
    elif "experts(dispatched_input, tokens_per_expert" not in inspect.getsource(moe.routed_experts_compute):
        out.append("MoELayer.routed_experts_compute calling experts(tokens, tokens_per_expert, probs)")
    return out


def moe_layers(chunks: list[torch.nn.Module]) -> list[list[torch.nn.Module]]:
    """Per model chunk, its megatron ``MoELayer`` modules in order."""
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    return [[m for m in chunk.modules() if isinstance(m, BaseMoELayer)] for chunk in chunks]


class _OnBackward(torch.autograd.Function):
    """Identity whose backward calls ``hook(key)`` as the gradient passes: placed on a collective's
    input its backward runs right after the collective's backward (closes the span), on its output
    right before (opens it)."""

    @staticmethod
    def forward(ctx, x, hook, key):  # type: ignore[override]
        ctx.hook, ctx.key = hook, key
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.hook(ctx.key)
        return grad, None, None


class MoEProbe:
    """Records routed counts and dispatcher collective spans of this rank's MoE layers.

    ``recorder`` is the pipeline event recorder of the run (the timeline's): each row stores the
    index of its open event. ``collective_total_s()`` is the time spent in the collectives since
    the probe was installed (what an injected slow rank's throttle leaves out). ``install(chunks)`` hooks the chunks' MoE layers and the dispatcher
    module (one probe per process); ``reset()`` each iteration; ``rows()`` the iteration's rows.
    """

    _active: "MoEProbe | None" = None

    def __init__(self, recorder: EventRecorder | None, capacity: int = 16384,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.recorder = recorder  # None: only the running total of collective time is kept
        self._collective_s = 0.0
        self._covered_until = -np.inf
        self.clock = clock
        self._buf = np.zeros(capacity, dtype=PROBE_DTYPE)
        self._n = 0
        self.dropped = 0
        self._counts: list[tuple[int, Any]] = []   # (row, tokens_per_expert sum) resolved in rows()
        self._open: dict[int, tuple[int, float]] = {}
        self._next_key = 0
        self._handles: list[Any] = []
        self._originals: dict[str, Any] = {}
        self.layers_per_chunk: list[int] = []

    # --- lifecycle -------------------------------------------------------------------------
    def install(self, chunks: list[torch.nn.Module]) -> "MoEProbe":
        require_megatron_core("the ResiHP MoE probe's hooks", missing_symbols(), "megatron_ext/resihp/moe_probe.py")
        if MoEProbe._active is not None:
            raise RuntimeError("a MoE probe is already installed; uninstall() it first")
        layers = moe_layers(chunks)
        self.layers_per_chunk = [len(ls) for ls in layers]
        for chunk_layers in layers:
            for layer in chunk_layers:
                self._handles.append(layer.experts.register_forward_pre_hook(self._on_experts, with_kwargs=True))
        disp = importlib.import_module(DISPATCHER_MODULE)
        for name in COLLECTIVES:
            original = getattr(disp, name)
            self._originals[name] = original
            setattr(disp, name, self._wrap(original))
        MoEProbe._active = self
        return self

    def uninstall(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._originals:
            disp = importlib.import_module(DISPATCHER_MODULE)
            for name, original in self._originals.items():
                setattr(disp, name, original)
            self._originals.clear()
        if MoEProbe._active is self:
            MoEProbe._active = None

    def reset(self) -> None:
        self._n = 0
        self.dropped = 0
        self._counts.clear()
        self._open.clear()

    # --- recording -------------------------------------------------------------------------
    def collective_total_s(self) -> float:
        return self._collective_s

    def _row(self, kind: int, t0: float, t1: float, value: float) -> int:
        if kind == COLLECTIVE:
            # Rows arrive in the order their spans close: counting only what lies past the end of
            # the spans before counts overlapping backward spans (tokens and probs) once.
            self._collective_s += max(0.0, t1 - max(t0, self._covered_until))
            self._covered_until = max(self._covered_until, t1)
        if self.recorder is None:
            return -1
        i = self._n
        if i >= len(self._buf):
            self.dropped += 1
            return -1
        self._n = i + 1
        # The open pipeline event: the last one begun (forward/backward steps hold no other event).
        self._buf[i] = (len(self.recorder) - 1, kind, t0, t1, value)
        return i

    def _on_experts(self, module, args, kwargs):
        tokens_per_expert = args[1] if len(args) > 1 else kwargs.get("tokens_per_expert")
        if tokens_per_expert is None:
            return None
        now = self.clock()
        i = self._row(ROUTED, now, now, np.nan)
        if i >= 0:
            # A tensor stays as it is (on a GPU .item() here would synchronise): summed in rows().
            total = tokens_per_expert.sum() if isinstance(tokens_per_expert, torch.Tensor) else sum(tokens_per_expert)
            self._counts.append((i, total))
        return None

    def _wrap(self, original: Callable) -> Callable:
        sig = inspect.signature(original)

        @functools.wraps(original)
        def collective(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            x = bound.arguments.get("input_")
            marked = isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled()
            if marked:
                key = self._next_key
                self._next_key += 1
                bound.arguments["input_"] = _OnBackward.apply(x, self._close_backward, key)
            t0 = self.clock()
            out = original(*bound.args, **bound.kwargs)
            t1 = self.clock()
            self._row(COLLECTIVE, t0, t1, t1 - t0)
            if marked and isinstance(out, torch.Tensor) and out.requires_grad:
                out = _OnBackward.apply(out, self._open_backward, key)
            return out

        return collective

    def _open_backward(self, key: int) -> None:
        self._open[key] = self.clock()

    def _close_backward(self, key: int) -> None:
        t0 = self._open.pop(key, None)
        if t0 is not None:
            t1 = self.clock()
            self._row(COLLECTIVE, t0, t1, t1 - t0)

    def rows(self) -> np.ndarray:
        """This iteration's rows (a copy), routed counts resolved."""
        for i, total in self._counts:
            self._buf["value"][i] = float(total)
        self._counts.clear()
        return self._buf[: self._n].copy()


def op_tables(events: np.ndarray, rows: np.ndarray, *, num_chunks: int, num_microbatches: int,
              layers_per_chunk: list[int]) -> dict[str, np.ndarray]:
    """Per (chunk, micro-batch) tables of one rank's iteration from its pipeline ``events`` and
    probe ``rows``: ``routed`` (pairs its experts computed in the forward; NaN where the forward
    did not see one count per MoE layer of the chunk, so a partial count is never taken for a
    small one), ``collective_fwd_s`` / ``collective_bwd_s`` (seconds inside the dispatcher's
    collectives; overlapping backward spans are counted once).
    """
    shape = (num_chunks, num_microbatches)
    routed = np.zeros(shape)
    seen = np.zeros(shape, dtype=int)
    spans: dict[tuple[int, int, int], list[tuple[float, float]]] = {}
    ok = (rows["event"] >= 0) & (rows["event"] < len(events))
    for r in rows[ok]:
        e = events[int(r["event"])]
        phase, chunk, mb = int(e["phase"]), int(e["chunk"]), int(e["microbatch"])
        if phase not in (Phase.FORWARD, Phase.BACKWARD) or not (0 <= chunk < num_chunks and 0 <= mb < num_microbatches):
            continue
        if r["kind"] == ROUTED:
            if phase == Phase.FORWARD:  # a recomputed forward inside the backward is the same routing
                routed[chunk, mb] += r["value"]
                seen[chunk, mb] += 1
        else:
            spans.setdefault((phase, chunk, mb), []).append((float(r["t0"]), float(r["t1"])))
    want = np.asarray(layers_per_chunk, dtype=int)[:num_chunks, None]
    routed = np.where(seen == want, routed, np.nan)
    comm = {Phase.FORWARD: np.zeros(shape), Phase.BACKWARD: np.zeros(shape)}
    for (phase, chunk, mb), ivs in spans.items():
        comm[phase][chunk, mb] = _union_s(ivs)
    return {"routed": routed, "collective_fwd_s": comm[Phase.FORWARD], "collective_bwd_s": comm[Phase.BACKWARD]}


def _union_s(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -np.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total

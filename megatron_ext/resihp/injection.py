"""Fault injection: a slow rank really computes slower, a stopped rank really dies.

``--inject-slow RANK:ITER:FACTOR`` — from iteration ITER on, each forward and backward of rank RANK's
model chunks takes ``FACTOR`` times its real duration: inside the op, the rank is held for
``(FACTOR - 1)`` times what the op took, so every clock that times the op sees a slower device; no
timestamp is edited. For MoE models the time the op spent inside the expert-parallel collectives
(waiting for its peers, ``Throttle.exclude_s``) is left out of what is stretched: a slow device
computes slower, it does not wait longer. ``--inject-slow-mode throttle`` (default) holds the rank idle, like a throttled
device, which leaves the shared CPU cores to the other ranks; ``work`` burns the time on extra real
matrix multiplies instead (on a box with fewer cores than ranks that also slows the neighbours).
``--inject-stop RANK:ITER[:POINT]`` — in iteration ITER rank RANK kills itself with SIGKILL (no
cleanup, as a lost device or node would), at POINT: ``start`` (default, before the forward),
``step`` (gradients reduced, before the optimizer update), ``save`` (inside a checkpoint save that
iteration, after writing its own files) or ``relayout`` (inside a layout change that starts before
iteration ITER, once the new process groups exist: a second fault during a regroup, or a loss
during a fail-slow re-layout). RANK is the rank at launch, also after a fail-stop renumbered the ranks. A replacement started in a lost
rank's place (``--ft-respawn``) meets that rank's faults from after the iteration it joins at, so
the fault that ended the process it replaces is not met a second time after a rollback.
``--inject-error RANK:ITER[:KIND]`` — at the start of iteration ITER rank RANK raises an exception:
``value`` (default; ``ValueError("injected error")``, an ordinary bug in one rank) or ``collective``
(a ``RuntimeError`` as a failed gloo collective raises, while no rank is lost). The message is the
same on every rank, so the same error on a second rank is the same signature.

``--inject-hang RANK:ITER:WHERE`` — in iteration ITER rank RANK's training thread stops for good while
its process lives on (its heartbeat keeps beating), at WHERE: ``collective`` (inside its next
all-reduce, tensor- or data-parallel, before its part reaches the transport: a device that stops
returning), ``p2p`` (inside its next pipeline send/receive; PP > 1), ``compute`` (a forward hook of
its model that never returns) or ``data`` (in the data fetch). What the fault-tolerance core's hang
watch names (``ft/liveness.py``); its peers block waiting for it.

``--inject-slow-link A:B:ITER:MBPS`` — from iteration ITER on, every pipeline message between ranks
A and B (launch ranks, either direction) also crosses a link of MBPS megabytes per second: the
sender is held ``bytes / (MBPS * 1e6)`` seconds inside megatron-core's p2p call before it posts the
send (``LinkThrottle``; megatron engine). Nothing computes slower: the receiver waits for the
message, the sender for its link, which is what ResiHP's link detector (``links.py``) looks for.

``--inject-slow-path A:B:ITER:MBPS`` — from iteration ITER on, the network path between ranks A and B
(launch ranks) carries MBPS megabytes per second both ways: their ring-probe messages to each
other and their pipeline messages (``LinkThrottle``) are held ``bytes / (MBPS * 1e6)`` seconds before
they leave, and while A and B are neighbours on the same data-parallel ring (``dp_ring_neighbours``:
their DP group in group-rank order, cyclic), the smaller of the two is held before the gradient
all-reduce for a ring's share of its gradient bytes at MBPS (``GradRingThrottle``, as for a slow NIC).
A re-layout that parts them on the ring ends that hold. Megatron engine.

``fail_at`` / ``slow_from`` / ``slow_link_from`` build the same specs for tests.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
from typing import Any, Callable

import torch

from megatron_ext.config.base import ConfigError, doc
from megatron_ext.config.run import section

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SlowFault:
    rank: int
    since: int
    factor: float


STOP_POINTS = ("start", "step", "save", "relayout")


@dataclasses.dataclass(frozen=True)
class StopFault:
    rank: int
    at: int
    point: str = "start"


ERROR_KINDS = ("value", "collective")

HANG_PLACES = ("collective", "p2p", "compute", "data")


@dataclasses.dataclass(frozen=True)
class HangFault:
    rank: int
    at: int
    where: str


@dataclasses.dataclass(frozen=True)
class SlowLinkFault:
    a: int
    b: int
    since: int
    mbps: float

    @property
    def pair(self) -> tuple[int, int]:
        return (min(self.a, self.b), max(self.a, self.b))


@dataclasses.dataclass(frozen=True)
class SlowNicFault:
    rank: int
    since: int
    mbps: float


@dataclasses.dataclass(frozen=True)
class SlowPathFault(SlowLinkFault):
    """The network path between launch ranks ``a`` and ``b`` at ``mbps`` from iteration ``since``:
    the link's fields; it also carries their probe messages and their data-parallel ring's share."""


@dataclasses.dataclass(frozen=True)
class ErrorFault:
    rank: int
    at: int
    kind: str = "value"


def _fields(spec: str, where: str, types: tuple, form: str, *, optional: int = 0) -> list:
    """The ``:``-separated fields of ``spec`` converted by ``types`` (the last ``optional`` may be
    left out); a wrong count or a field that does not convert names the form expected."""
    parts = spec.split(":")
    try:
        if not len(types) - optional <= len(parts) <= len(types):
            raise ValueError
        return [t(p) for t, p in zip(types, parts)]
    except ValueError:
        raise ConfigError(f"{where} {spec!r}: expected {form}") from None


def _one_of(where: str, spec: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{where} {spec!r}: {name} must be one of {', '.join(choices)}, got {value!r}")


def parse_slow(spec: str, where: str = "--inject-slow") -> SlowFault:
    fault = SlowFault(*_fields(spec, where, (int, int, float), "RANK:ITER:FACTOR, e.g. 2:30:1.5"))
    if fault.rank < 0 or fault.since < 1 or not fault.factor > 1.0:
        raise ConfigError(f"{where} {spec!r}: need RANK >= 0, ITER >= 1 and FACTOR > 1")
    return fault


def parse_stop(spec: str, where: str = "--inject-stop") -> StopFault:
    fault = StopFault(*_fields(spec, where, (int, int, str), "RANK:ITER[:POINT], e.g. 3:40 or 3:40:step", optional=1))
    if fault.rank < 0 or fault.at < 1:
        raise ConfigError(f"{where} {spec!r}: need RANK >= 0 and ITER >= 1")
    _one_of(where, spec, "POINT", fault.point, STOP_POINTS)
    return fault


def parse_error(spec: str, where: str = "--inject-error") -> ErrorFault:
    fault = ErrorFault(*_fields(spec, where, (int, int, str), "RANK:ITER[:KIND], e.g. 2:5 or 2:5:collective",
                                optional=1))
    if fault.rank < 0 or fault.at < 1:
        raise ConfigError(f"{where} {spec!r}: need RANK >= 0 and ITER >= 1")
    _one_of(where, spec, "KIND", fault.kind, ERROR_KINDS)
    return fault


def parse_hang(spec: str, where: str = "--inject-hang") -> HangFault:
    fault = HangFault(*_fields(spec, where, (int, int, str), "RANK:ITER:WHERE, e.g. 2:14:compute"))
    if fault.rank < 0 or fault.at < 1:
        raise ConfigError(f"{where} {spec!r}: need RANK >= 0 and ITER >= 1")
    _one_of(where, spec, "WHERE", fault.where, HANG_PLACES)
    return fault


def parse_slow_link(spec: str, where: str = "--inject-slow-link") -> SlowLinkFault:
    fault = SlowLinkFault(*_fields(spec, where, (int, int, int, float), "A:B:ITER:MBPS (two ranks, the first "
                                   "iteration, megabytes per second), e.g. 0:2:20:1"))
    if min(fault.a, fault.b) < 0 or fault.a == fault.b or fault.since < 1 or not 0 < fault.mbps < float("inf"):
        raise ConfigError(f"{where} {spec!r}: need two different ranks >= 0, ITER >= 1 and 0 < MBPS < inf")
    return fault


def parse_slow_nic(spec: str, where: str = "--inject-slow-nic") -> SlowNicFault:
    fault = SlowNicFault(*_fields(spec, where, (int, int, float), "RANK:ITER:MBPS (a rank, the first iteration, "
                                  "megabytes per second), e.g. 2:20:4"))
    if fault.rank < 0 or fault.since < 1 or not 0 < fault.mbps < float("inf"):
        raise ConfigError(f"{where} {spec!r}: need RANK >= 0, ITER >= 1 and 0 < MBPS < inf")
    return fault


def parse_slow_path(spec: str, where: str = "--inject-slow-path") -> SlowPathFault:
    fault = SlowPathFault(*_fields(spec, where, (int, int, int, float), "A:B:ITER:MBPS (two ranks, the first "
                                   "iteration, megabytes per second), e.g. 0:1:20:3"))
    if min(fault.a, fault.b) < 0:
        raise ConfigError(f"{where} {spec!r}: need ranks >= 0")
    if fault.a == fault.b:
        raise ConfigError(f"{where} {spec!r}: need two different ranks A != B (a path joins two devices)")
    if fault.since < 1:
        raise ConfigError(f"{where} {spec!r}: need ITER >= 1")
    if not 0 < fault.mbps < float("inf"):
        raise ConfigError(f"{where} {spec!r}: need 0 < MBPS < inf")
    return fault


def dp_ring_neighbours(layout: Any, a: int, b: int) -> bool:
    """Whether devices ``a`` and ``b`` (launch ranks) are neighbours on one data-parallel ring of
    ``layout`` (a ``Layout``): the same DP group, adjacent in its group-rank order, cyclically (a
    ring of two counts; a ring of one is none)."""
    members = list(layout.members)
    if a not in members or b not in members or a == b:
        return False
    for group in layout.dp_groups():
        ring = [members[r] for r in group]
        if a in ring and b in ring:
            n, i, j = len(ring), ring.index(a), ring.index(b)
            return n > 1 and (i - j) % n in (1, n - 1)
    return False


def slow_link_from(a: int, b: int, iteration: int, mbps: float) -> str:
    return f"{a}:{b}:{iteration}:{mbps}"


def slow_from(rank: int, iteration: int, factor: float) -> str:
    return f"{rank}:{iteration}:{factor}"


def fail_at(rank: int, iteration: int, point: str = "start") -> str:
    return f"{rank}:{iteration}" + ("" if point == "start" else f":{point}")


@section("faults")
@dataclasses.dataclass(kw_only=True)
class FaultInjectionConfig:
    """Fault injection for testing detection (real extra work, real process death)."""

    inject_slow: list[str] | None = doc("RANK:ITER:FACTOR — from ITER on, RANK computes FACTOR times slower "
                                        "(repeatable).", None, repeatable=True)
    inject_stop: list[str] | None = doc("RANK:ITER[:POINT] — RANK (its rank at launch) dies (SIGKILL) in ITER at "
                                        "POINT: start (default), step (before the optimizer update), save (inside "
                                        "a checkpoint save), relayout (while survivors regroup) (repeatable).", None, repeatable=True)
    inject_error: list[str] | None = doc("RANK:ITER[:KIND] — RANK (its rank at launch) raises an exception at the "
                                         "start of ITER: value (a ValueError, an ordinary bug) or collective (a "
                                         "RuntimeError as a failed gloo collective raises, no rank lost) "
                                         "(repeatable; for testing the exception policy).", None, repeatable=True)
    inject_hang: list[str] | None = doc("RANK:ITER:WHERE — RANK's (launch rank) training thread stops for good in "
                                        "ITER while its process lives: inside its next all-reduce (collective), "
                                        "pipeline send/receive (p2p), a forward (compute) or the data fetch (data) "
                                        "(repeatable; for testing the hang watch, --ft-hang-timeout-s).", None, repeatable=True)
    inject_slow_link: list[str] | None = doc("A:B:ITER:MBPS — from ITER on, pipeline messages between ranks A and B "
                                             "(launch ranks) also cross a link of MBPS megabytes/s: the sender is "
                                             "held bytes/MBPS before it sends (megatron engine; repeatable).", None, repeatable=True)
    inject_slow_nic: list[str] | None = doc("RANK:ITER:MBPS — from ITER on, RANK's (launch rank) sends cross a NIC of "
                                            "MBPS megabytes/s: held bytes/MBPS before each pipeline message and each "
                                            "ResiHP ring-probe message, and its ring share of the gradient all-reduce "
                                            "(megatron engine; repeatable).", None, repeatable=True)
    inject_slow_path: list[str] | None = doc("A:B:ITER:MBPS — from ITER on, the network path between ranks A and B "
                                             "(launch ranks) carries MBPS megabytes/s both ways: their ring-probe "
                                             "and pipeline messages to each other are held bytes/MBPS, and while "
                                             "they are data-parallel ring neighbours their gradient all-reduce too "
                                             "(megatron engine; repeatable).", None, repeatable=True)
    inject_slow_mode: str = doc("How a slow rank is slowed: 'throttle' (held idle inside each op) or 'work' "
                                "(extra real matrix multiplies inside each op).", "throttle",
                                choices=("throttle", "work"))

    def __post_init__(self) -> None:
        self.slow = [parse_slow(s) for s in self.inject_slow or []]
        self.stop = [parse_stop(s) for s in self.inject_stop or []]
        self.error = [parse_error(s) for s in self.inject_error or []]
        self.hang = [parse_hang(s) for s in self.inject_hang or []]
        self.slow_link = [parse_slow_link(s) for s in self.inject_slow_link or []]
        self.slow_nic = [parse_slow_nic(s) for s in self.inject_slow_nic or []]
        self.slow_path = [parse_slow_path(s) for s in self.inject_slow_path or []]
        ranks = [f.rank for f in self.slow]
        if len(ranks) != len(set(ranks)):
            raise ConfigError(f"--inject-slow names rank(s) more than once: {self.inject_slow}")
        pairs = [f.pair for f in self.slow_link]
        if len(pairs) != len(set(pairs)):
            raise ConfigError(f"--inject-slow-link names a pair of ranks more than once: {self.inject_slow_link}")
        paths = [f.pair for f in self.slow_path]
        if len(paths) != len(set(paths)):
            raise ConfigError(f"--inject-slow-path names a pair of ranks more than once: {self.inject_slow_path}")
        nics = [f.rank for f in self.slow_nic]
        if len(nics) != len(set(nics)):
            raise ConfigError(f"--inject-slow-nic names rank(s) more than once: {self.inject_slow_nic}")

    def check_world(self, world_size: int) -> None:
        """Every fault names a rank of the world at launch (``RunConfig.validate_launch``: before any
        rank starts)."""
        for flag, specs, faults in (("--inject-slow", self.inject_slow, self.slow),
                                    ("--inject-stop", self.inject_stop, self.stop),
                                    ("--inject-error", self.inject_error, self.error),
                                    ("--inject-hang", self.inject_hang, self.hang),
                                    ("--inject-slow-nic", self.inject_slow_nic, self.slow_nic)):
            for spec, f in zip(specs or [], faults):
                if f.rank >= world_size:
                    raise ConfigError(f"{flag} {spec} names rank {f.rank}, but the world has {world_size} ranks "
                                      f"(0..{world_size - 1})")
        for flag, specs, faults in (("--inject-slow-link", self.inject_slow_link, self.slow_link),
                                    ("--inject-slow-path", self.inject_slow_path, self.slow_path)):
            for spec, f in zip(specs or [], faults):
                if max(f.a, f.b) >= world_size:
                    raise ConfigError(f"{flag} {spec} names rank {max(f.a, f.b)}, but the world has "
                                      f"{world_size} ranks (0..{world_size - 1})")

    @property
    def any(self) -> bool:
        return bool(self.slow or self.stop or self.error or self.hang or self.slow_link or self.slow_nic
                    or self.slow_path)


def burn(seconds: float, *, size: int = 96) -> None:
    """Spend ``seconds`` on real floating-point work (small matmuls) on this process's cores."""
    if seconds <= 0:
        return
    a = torch.ones(size, size) / size
    end = time.perf_counter() + seconds
    with torch.no_grad():
        while time.perf_counter() < end:
            a = a @ a


class Throttle:
    """Makes one rank's model chunks slower by ``factor`` once ``active`` is set."""

    def __init__(self, chunks: list[torch.nn.Module], factor: float, mode: str = "throttle") -> None:
        if mode not in ("throttle", "work"):
            raise ValueError(f"Throttle mode must be 'throttle' or 'work', got {mode!r}")
        self.factor = factor
        # Running total of seconds inside the op not to stretch (MoE dispatcher collectives); None: none.
        self.exclude_s: Callable[[], float] | None = None
        self._hold = time.sleep if mode == "throttle" else burn
        self.active = False
        self._handles: list[Any] = []
        for chunk in chunks:
            self._instrument(chunk)

    def _instrument(self, chunk: torch.nn.Module) -> None:
        state: dict[str, float] = {}
        params = [p for p in chunk.parameters() if p.requires_grad]

        def excluded() -> float:
            return self.exclude_s() if self.exclude_s is not None else 0.0

        def pre_forward(module, args):
            state["fwd"] = time.perf_counter()
            state["fwd_ex"] = excluded()

        def post_forward(module, args, output):
            if not self.active:
                return output
            own = time.perf_counter() - state["fwd"] - (excluded() - state["fwd_ex"])
            self._hold((self.factor - 1.0) * max(own, 0.0))
            if torch.is_grad_enabled():
                out = output[0] if isinstance(output, (tuple, list)) else output
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(on_grad_of_output)
            return output

        def on_grad_of_output(grad):
            state["bwd"] = time.perf_counter()
            state["bwd_ex"] = excluded()
            return grad

        def after_backward(grads):
            if self.active and "bwd" in state:
                own = time.perf_counter() - state.pop("bwd") - (excluded() - state["bwd_ex"])
                self._hold((self.factor - 1.0) * max(own, 0.0))

        self._handles.append(chunk.register_forward_pre_hook(pre_forward))
        self._handles.append(chunk.register_forward_hook(post_forward))
        if params:
            self._handles.append(torch.autograd.graph.register_multi_grad_hook(params, after_backward, mode="all"))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class LinkThrottle:
    """Slow pipeline links: megatron-core's p2p functions (``_p2p_ops``, ``_batched_p2p_ops``, looked
    up at call time by ``P2PCommunicator._communicate``) wrapped so that a message to a peer over a
    slow link is held ``bytes / bytes_per_s`` before it is posted. ``links``: for each device of
    this process's slow links (launch rank of the peer), its bandwidth in bytes/s; ``members()``:
    the launch rank of each current rank (a re-layout renumbers ranks, the links stay with the
    devices). Inside the p2p call, so the timeline's send/receive span holds the wait."""

    FUNCTIONS = ("_p2p_ops", "_batched_p2p_ops")

    def __init__(self, links: dict[int, float], members: Callable[[], Any]) -> None:
        import importlib

        from megatron_ext.pipeline.megatron_hooks import P2P, require_megatron_core

        self.links, self.members = dict(links), members
        self.active = False
        self._module = importlib.import_module(P2P)
        require_megatron_core("--inject-slow-link", [n for n in self.FUNCTIONS if not hasattr(self._module, n)],
                              "megatron_ext/resihp/injection.py")
        self._originals = {n: getattr(self._module, n) for n in self.FUNCTIONS}
        for n, fn in self._originals.items():
            setattr(self._module, n, self._wrap(fn))

    def hold(self, nbytes: int, peer: int) -> None:
        """Hold a send of ``nbytes`` to the device ``peer`` (launch rank) as its link would (the
        ResiHP ring probe's sends: ``nic.py``)."""
        if self.active and peer in self.links:
            time.sleep(nbytes / self.links[peer])

    def _wrap(self, original: Callable) -> Callable:
        def p2p(*, tensor_send_prev=None, tensor_recv_prev=None, tensor_send_next=None, tensor_recv_next=None,
                group=None, prev_pipeline_rank=None, next_pipeline_rank=None):
            if self.active:
                members = self.members()
                hold = 0.0
                for tensor, peer in ((tensor_send_prev, prev_pipeline_rank), (tensor_send_next, next_pipeline_rank)):
                    if tensor is not None and peer is not None and members[peer] in self.links:
                        hold += tensor.numel() * tensor.element_size() / self.links[members[peer]]
                if hold > 0:
                    time.sleep(hold)
            return original(tensor_send_prev=tensor_send_prev, tensor_recv_prev=tensor_recv_prev,
                            tensor_send_next=tensor_send_next, tensor_recv_next=tensor_recv_next, group=group,
                            prev_pipeline_rank=prev_pipeline_rank, next_pipeline_rank=next_pipeline_rank)

        return p2p

    def remove(self) -> None:
        for n, fn in self._originals.items():
            setattr(self._module, n, fn)
        self._originals.clear()


class GradRingThrottle:
    """A slow NIC on the data-parallel gradient all-reduce: megatron's gradient finalisation
    (``finalize_model_grads_func`` of the model's config) wrapped so that this rank is held, before
    it enters, for what its share of a ring all-reduce takes at the NIC's bandwidth: ``2 (dp - 1) /
    dp`` of its gradient bytes. The other members wait for it inside the collective, so the ring
    finishes when the slow NIC would let it. ``bytes_per_s()``: the NIC's bandwidth now (None:
    healthy). ``remove`` puts back what it wrapped, unless someone has since replaced the wrapper
    (the timeline's recorder restores its own original when it is uninstalled)."""

    def __init__(self, model_config: Any, grad_bytes: float, dp: int, bytes_per_s: Callable[[], float | None]) -> None:
        self.config, self.grad_bytes, self.dp, self.bytes_per_s = model_config, float(grad_bytes), int(dp), bytes_per_s
        self.held_s = 0.0
        self._original = model_config.finalize_model_grads_func

        def finalize(*args, **kwargs):
            bw = self.bytes_per_s()
            if bw and self.dp > 1:
                hold = 2.0 * (self.dp - 1) / self.dp * self.grad_bytes / bw
                self.held_s += hold
                time.sleep(hold)
            return self._original(*args, **kwargs)

        self._wrapper = finalize
        model_config.finalize_model_grads_func = finalize

    def remove(self) -> None:
        if self.config.finalize_model_grads_func is self._wrapper:
            self.config.finalize_model_grads_func = self._original


def gradient_bytes(chunks: list) -> int:
    """Bytes of the gradients a rank all-reduces: megatron's ``main_grad`` buffers where the DDP
    wrapper made them, else the parameters' own dtype."""
    total = 0
    for chunk in chunks:
        for p in chunk.parameters():
            g = getattr(p, "main_grad", None)
            total += p.numel() * (g.element_size() if g is not None else p.element_size())
    return total


def die_now(rank: int, iteration: int, point: str = "start") -> None:
    """The injected fail-stop: a message, then SIGKILL (nothing is flushed or cleaned up after)."""
    where = "" if point == "start" else f" ({point})"
    print(f"[fault injection] rank {rank}: stopping at iteration {iteration}{where} (SIGKILL)", file=sys.stderr,
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def raise_now(fault: ErrorFault) -> None:
    """The injected exception (a message first, so a reader sees where it came from)."""
    print(f"[fault injection] rank {fault.rank}: raising a {fault.kind} error at iteration {fault.at}", file=sys.stderr,
          flush=True)
    if fault.kind == "collective":
        raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer (injected: a collective failing "
                           "while no rank is lost)")
    raise ValueError("injected error")


def hang_forever(fault: HangFault) -> None:
    """The injected hang: a message, then this thread never returns (the process and its other
    threads live on)."""
    print(f"[fault injection] rank {fault.rank}: hanging at iteration {fault.at} ({fault.where}); the process stays "
          "alive", file=sys.stderr, flush=True)
    while True:
        time.sleep(1.0)


class HangInjector:
    """``--inject-hang``: from the start of the fault's iteration, the next call at its place never
    returns. ``collective``: ``torch.distributed.all_reduce`` wrapped (megatron's tensor- and
    data-parallel reductions call it through the module); ``p2p``: megatron-core's p2p functions
    wrapped (as ``LinkThrottle``); ``compute``: a forward hook on this rank's model chunks
    (``attach`` after a re-layout); ``data``: the loop's ``data`` fault point."""

    def __init__(self, fault: HangFault, chunks: list[torch.nn.Module], *, pp: int) -> None:
        self.fault, self.armed = fault, False
        self._undo: list[Callable[[], None]] = []
        self._hooks: list[Any] = []
        if fault.where == "p2p" and pp < 2:
            raise ConfigError(f"--inject-hang {fault.rank}:{fault.at}:p2p needs pipeline stages "
                              f"(--pipeline-model-parallel-size > 1), got {pp}")
        if fault.where == "collective":
            import torch.distributed as dist

            original = dist.all_reduce

            def all_reduce(*args, **kwargs):
                if self.armed:
                    hang_forever(self.fault)
                return original(*args, **kwargs)

            dist.all_reduce = all_reduce
            self._undo.append(lambda: setattr(dist, "all_reduce", original))
        elif fault.where == "p2p":
            import importlib

            from megatron_ext.pipeline.megatron_hooks import P2P

            module = importlib.import_module(P2P)
            for name in LinkThrottle.FUNCTIONS:
                fn = getattr(module, name)

                def wrapped(*args, _fn=fn, **kwargs):
                    if self.armed:
                        hang_forever(self.fault)
                    return _fn(*args, **kwargs)

                setattr(module, name, wrapped)
                self._undo.append(lambda n=name, f=fn: setattr(module, n, f))
        self.attach(chunks)

    def attach(self, chunks: list[torch.nn.Module]) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.fault.where == "compute":
            def forward_hook(module, args, output):
                if self.armed:
                    hang_forever(self.fault)
                return output

            self._hooks = [c.register_forward_hook(forward_hook) for c in chunks]

    def fault_point(self, point: str, iteration: int) -> None:
        if iteration != self.fault.at:
            return
        if point == "start":
            self.armed = True
        if point == "data" and self.fault.where == "data":
            hang_forever(self.fault)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for undo in reversed(self._undo):
            undo()
        self._undo = []

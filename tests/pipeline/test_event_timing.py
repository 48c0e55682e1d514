"""Event timing follows the device: host clock on CPU, CUDA events on a GPU (checked here with
stand-in events that model a stream running behind the host)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_ext.pipeline.events import EventRecorder, Phase, timing_for


class FakeStream:
    """A device stream: work queued by the host runs later; an event completes when the stream
    reaches it."""

    def __init__(self) -> None:
        self.device_s = 0.0
        self.syncs = 0

    def run(self, seconds: float) -> None:
        self.device_s += seconds

    def synchronize(self) -> None:
        self.syncs += 1


class FakeEvent:
    def __init__(self, stream: FakeStream) -> None:
        self.stream, self.at = stream, None

    def record(self) -> None:
        self.at = self.stream.device_s

    def elapsed_time(self, other: "FakeEvent") -> float:  # milliseconds, as torch.cuda.Event
        assert self.at is not None and other.at is not None, "elapsed_time of an unrecorded event"
        return (other.at - self.at) * 1e3


def test_timing_is_chosen_by_device():
    assert timing_for(torch.device("cpu")) == "host"
    assert timing_for("cpu") == "host"
    assert timing_for(torch.device("cuda", 0)) == "cuda"
    assert timing_for("cuda:1") == "cuda"
    assert EventRecorder(8).timing == "host"


def test_cuda_timing_needs_a_device_and_a_known_mode():
    with pytest.raises(ValueError, match="timing must be one of host, cuda, got 'gpu'"):
        EventRecorder(8, timing="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"EventRecorder\(timing='cuda'\) needs a CUDA device"):
            EventRecorder(8, timing="cuda")


def test_device_events_keep_a_receive_free_of_earlier_kernels():
    # The host queues a 0.5 s forward in 1 ms, then blocks 0.6 s in a receive (it waits for the
    # forward's kernels, then 0.1 s for the peer). Host reads would give the receive 0.6 s; device
    # events give the forward its 0.5 s and the receive its 0.1 s.
    stream = FakeStream()
    host = {"t": 100.0}
    rec = EventRecorder(8, timing="cuda", clock=lambda: host["t"], event_factory=lambda: FakeEvent(stream),
                        synchronize=stream.synchronize)
    f = rec.begin(Phase.FORWARD, 0, 0)
    stream.run(0.5)
    host["t"] += 0.001
    rec.end(f)
    r = rec.begin(Phase.RECV, 0, -1, 1)
    stream.run(0.1)
    host["t"] += 0.6
    rec.end(r)
    ev = rec.events()
    assert np.allclose(ev["t1"] - ev["t0"], [0.5, 0.1])
    assert ev["t0"][0] == pytest.approx(100.0)  # anchored to the host clock at the first event
    assert ev["t0"][1] == pytest.approx(ev["t1"][0])
    assert stream.syncs == 2  # one to anchor, one to read: none per event


def test_open_events_resolve_later_and_reset_reanchors():
    stream = FakeStream()
    host = {"t": 5.0}
    rec = EventRecorder(8, timing="cuda", clock=lambda: host["t"], event_factory=lambda: FakeEvent(stream),
                        synchronize=stream.synchronize)
    a = rec.begin(Phase.FORWARD)
    stream.run(0.2)
    rec.end(a)
    b = rec.begin(Phase.BACKWARD)
    stream.run(0.3)
    first = rec.events()
    assert np.isnan(first["t1"][1]) and first["t1"][0] - first["t0"][0] == pytest.approx(0.2)
    rec.end(b)
    again = rec.events()
    assert again["t1"][1] - again["t0"][1] == pytest.approx(0.3)
    rec.reset()
    host["t"] = 50.0
    c = rec.begin(Phase.OPTIMIZER)
    stream.run(0.05)
    rec.end(c)
    ev = rec.events()
    assert len(ev) == 1 and ev["t0"][0] == pytest.approx(50.0) and ev["t1"][0] == pytest.approx(50.05)


@pytest.mark.parametrize("device, timing", [(torch.device("cpu"), "host"), (torch.device("cuda", 0), "cuda")])
def test_timeline_extension_picks_the_recorder_timing_of_its_device(device, timing, monkeypatch):
    import types

    import megatron_ext.pipeline.events as events_mod
    from megatron_ext.pipeline.extension import TimelineConfig, TimelineExtension

    built = {}

    class Spy(EventRecorder):
        def __init__(self, capacity, **kwargs):
            built.update(kwargs)
            super().__init__(capacity)  # host buffers: no GPU needed to construct

    from megatron_ext.runtime.loop import RecorderHooks

    monkeypatch.setattr(events_mod, "EventRecorder", Spy)
    trainer = types.SimpleNamespace(
        ctx=types.SimpleNamespace(device=device, backend="nccl" if device.type == "cuda" else "gloo", vpp=None),
        schedule_name="1f1b", layout_change=None,
        install_recorder=lambda recorder: RecorderHooks(new_iteration=lambda: None, uninstall=lambda: None),
        cfg=types.SimpleNamespace(training=types.SimpleNamespace(train_iters=1)))
    ext = TimelineExtension(TimelineConfig(timeline=True))
    ext.setup(trainer)
    try:
        assert built["timing"] == timing
    finally:
        ext.teardown(trainer)

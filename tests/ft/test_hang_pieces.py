"""The hang watch's pieces, in one process: the progress marks and their timeout, which stopped
threads count as waiting on a peer, the injection's spec, and the launcher stopping a process that
does not follow the job's decision."""
from __future__ import annotations

import sys
import threading
import time

import pytest

from megatron_ext.config.base import ConfigError
from megatron_ext.ft import liveness
from megatron_ext.ft.liveness import ARM_AFTER, HANG_FACTOR, HANG_FLOOR_S, Progress, stack_summary, waits_on_peer
from megatron_ext.resihp.injection import HangFault, parse_hang
from tests.conftest import ROOT


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Held:
    """A lock held by the test: a thread blocks in C on ``acquire`` (no Python frame of its own)
    until ``set()`` releases it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()

    def wait(self) -> None:  # noqa: D102  (named as a handle's wait is)
        self.lock.acquire()
        self.lock.release()

    def set(self) -> None:
        self.lock.release()


def stuck_thread(target) -> tuple[threading.Thread, Held]:
    """A thread that stays in ``target(stop)`` until ``stop.set()``."""
    stop = Held()
    ready = threading.Event()
    holder = {}

    def run():
        holder["ident"] = threading.get_ident()
        ready.set()
        target(stop)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    ready.wait(5)
    time.sleep(0.1)  # inside ``target`` by now
    t.ident_ = holder["ident"]
    return t, stop


def sleeping(stop):
    stop.lock.acquire()
    stop.lock.release()


def test_the_timeout_is_derived_from_the_iteration_times_with_a_floor_and_armed_after_warm_up():
    clock = Clock()
    p = Progress(clock=clock)
    assert p.timeout() is None                       # nothing measured: a first iteration compiles
    for _ in range(ARM_AFTER):
        p.iteration_done(2.0)
    assert p.timeout() == HANG_FLOOR_S                 # 10 x 2 s is below the floor
    for _ in range(20):
        p.iteration_done(9.0)
    assert p.timeout() == HANG_FACTOR * 9.0            # a slow rank's longer iterations raise it
    p.rearm()                                          # a new layout warms up again
    assert p.timeout() is None
    capped = Progress(clock=clock, cap_s=45.0)
    assert capped.timeout() == 45.0                    # warming up under continue: the cap alone
    for _ in range(3):
        capped.iteration_done(30.0)
    assert capped.timeout() == 45.0                    # under continue: below the collectives' timeout
    explicit = Progress(timeout_s=3.0, long_s=120.0, clock=clock)
    for _ in range(3):
        explicit.iteration_done(30.0)
    assert explicit.timeout() == 3.0
    explicit.mark("a checkpoint save", long=True)      # as long as a collective may take
    assert explicit.timeout() == 120.0
    explicit.mark("the checkpoint saved")
    assert explicit.timeout() == 3.0
    with pytest.raises(ValueError, match="timeout_s must be >= 0, got -1"):
        Progress(timeout_s=-1)


def test_a_thread_stopped_outside_communication_past_the_timeout_is_hung_with_where_it_is():
    clock = Clock()
    p = Progress(timeout_s=5.0, clock=clock)
    for _ in range(ARM_AFTER):
        p.iteration_done(0.1)
    t, stop = stuck_thread(lambda s: (p.mark("the forward of micro-batch 3", 14), sleeping(s)))
    try:
        clock.now += 5.0
        assert p.check() is None                       # not past the timeout yet
        clock.now += 0.5
        hang = p.check()
        assert (hang.point, hang.iteration, hang.stalled_s, hang.timeout_s) == (
            "the forward of micro-batch 3", 14, 5.5, 5.0)
        assert hang.where.startswith("test_hang_pieces.py:") and " sleeping <- " in hang.where, hang.where
        assert hang.describe().startswith("hung: no progress for 5.5 s since the forward of micro-batch 3 (iteration "
                                          "14; hang timeout 5 s); its training thread is in test_hang_pieces.py:")
        p.mark("the optimizer step")                   # progress again: not hung
        assert p.check() is None
    finally:
        stop.set()
        t.join(5)
    clock.now += 100.0
    assert p.check() is None                           # the marking thread ended: nothing to name


def user_wait(stop):
    class Handle:
        wait = None
    handle = Handle()
    handle.wait = stop.lock.acquire
    handle.wait()


def _in_module(name: str, source: str, directory) -> object:
    """A function whose frames belong to module ``name`` (as a collective's wait in torch.distributed
    or megatron would), its source in a file (the line a frame is at is read from it)."""
    path = directory / f"{name}.py"
    path.write_text(source)
    scope = {"__name__": name}
    exec(compile(source, str(path), "exec"), scope)
    return scope["wait"]


def test_a_thread_waiting_on_a_peer_is_not_hung(tmp_path):
    clock = Clock()
    p = Progress(timeout_s=1.0, clock=clock)
    for _ in range(ARM_AFTER):
        p.iteration_done(0.1)
    collective = _in_module("torch.distributed.distributed_c10d", "def wait(stop):\n    stop.lock.acquire()\n"
                            "    stop.lock.release()\n", tmp_path)
    t, stop = stuck_thread(lambda s: (p.mark("the forward of micro-batch 1", 3), collective(s)))
    try:
        clock.now += 60.0
        assert p.check() is None and waits_on_peer(sys._current_frames()[t.ident_])
    finally:
        stop.set()
        t.join(5)
    # megatron waiting on an asynchronous all-reduce's handle (its tensor-parallel backward)
    handle = _in_module("megatron.core.tensor_parallel.layers", "def wait(stop):\n    class H: pass\n"
                        "    handle = H()\n    handle.wait = stop.lock.acquire\n    handle.wait()\n", tmp_path)
    t, stop = stuck_thread(handle)
    try:
        assert waits_on_peer(sys._current_frames()[t.ident_])
    finally:
        stop.set()
        t.join(5)
    # a user's own .wait() outside torch, megatron and DeepSpeed is not a collective's
    t, stop = stuck_thread(user_wait)
    try:
        frame = sys._current_frames()[t.ident_]
        assert not waits_on_peer(frame) and " user_wait <- " in stack_summary(frame)
    finally:
        stop.set()
        t.join(5)
    assert not waits_on_peer(None) and liveness.frames_of(None) is None


def test_a_standard_library_frame_is_judged_by_its_caller(tmp_path):
    # a thread inside the standard library (a queue's condition wait here; an os.environ lookup in
    # the failure seen) counts where its first caller outside it is: the job's store code waits on
    # a peer, a user's module does not
    source = "import queue\ndef wait(stop):\n    stop.q = queue.Queue()\n    stop.q.get()\n"
    for name, peer in (("megatron_ext.ft.fake_store", True), ("user_code", False)):
        t, stop = stuck_thread(_in_module(name, source, tmp_path))
        try:
            frame = sys._current_frames()[t.ident_]
            assert frame.f_code.co_filename.endswith("threading.py")  # innermost: the stdlib
            assert waits_on_peer(frame) is peer, name
        finally:
            stop.q.put(None)
            t.join(5)


@pytest.mark.parametrize("spec,message", [
    ("2:14", "--inject-hang '2:14': expected RANK:ITER:WHERE, e.g. 2:14:compute"),
    ("2:0:compute", "--inject-hang '2:0:compute': need RANK >= 0 and ITER >= 1"),
    ("2:14:gpu", "--inject-hang '2:14:gpu': WHERE must be one of collective, p2p, compute, data, got 'gpu'"),
])
def test_bad_hang_specs_are_named(spec, message):
    with pytest.raises(ConfigError) as err:
        parse_hang(spec)
    assert str(err.value) == message
    assert parse_hang("3:7:p2p") == HangFault(rank=3, at=7, where="p2p")


def test_a_pipeline_hang_needs_pipeline_stages():
    from megatron_ext.resihp.injection import HangInjector

    with pytest.raises(ConfigError, match=r"--inject-hang 1:5:p2p needs pipeline stages "
                                          r"\(--pipeline-model-parallel-size > 1\), got 1"):
        HangInjector(HangFault(1, 5, "p2p"), [], pp=1)


SCRIPT = """
import os, sys, time
sys.path.insert(0, {root!r})
from megatron_ext.ft import membership as ms
from megatron_ext.ft.store import STORE_ENV, connect
base = connect(os.environ[STORE_ENV], timeout_s=30)
rank = int(os.environ["RANK"])
if rank == 0:
    time.sleep(0.5)
    {decide}
    time.sleep(float(sys.argv[1]))  # ends by itself within the grace
else:
    while True:                      # never follows
        time.sleep(1)
"""


@pytest.mark.parametrize("decide,codes,stopped", [
    # The job ended: SIGTERM after the grace (a rank ignoring it would get SIGKILL after as long again).
    ('ms.declare_end(base, code=75, message="rank 9 gone", by=0)', [0, -15], [False, True]),
    # The others named rank 1 lost (hung, or silent) while its process runs: SIGKILL, a lost process.
    ('ms.report_exit(base, 1, 0, code=None, reason="hung: test", by="hang")', [0, -9], [False, False]),
])
def test_the_launcher_stops_a_process_that_does_not_follow_the_decision(tmp_path, decide, codes, stopped):
    from megatron_ext.ft.launch import launch_ranks

    script = tmp_path / "rank.py"
    script.write_text(SCRIPT.format(root=ROOT, decide=decide))
    t0 = time.monotonic()
    results = launch_ranks([str(script), "0.2"], 2, timeout_s=60, grace_s=1.0)
    assert [r.returncode for r in results] == codes and [r.stopped for r in results] == stopped
    assert time.monotonic() - t0 < 20
    assert results[1].lost == (codes[1] == -9)

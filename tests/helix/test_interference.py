"""Compute interference: communication kernels slowing the compute they overlap
(``Interconnect.compute_interference``), in the simulator and in the emulated interconnect, which
share one charging rule (``InterferenceLedger``)."""
import time

import pytest
import torch

from megatron_ext.helix.cost import AnalyticalCostModel, DEFAULT_CPU, Interconnect
from megatron_ext.helix.interconnect import (Flight, emulated_issue, emulated_wait, emulation_stats,
                                             reset_emulation)
from megatron_ext.helix.ir import Kind
from megatron_ext.helix.simulator import InterferenceLedger, SimOp, interference_of, simulate


def comp(name, t):
    return SimOp(name=name, kind=Kind.COMPUTE, compute_s=t)


def coll(name, comm, group="g"):
    return SimOp(name=name, kind=Kind.COLLECTIVE, compute_s=0.0, comm_s=comm, channel=group)


def wait(name, c):
    return SimOp(name=name, kind=Kind.WAIT, wait_of=c, inputs=(c,), alias_of=c)


def test_no_interference_is_the_plain_simulation():
    ops = [comp("a", 2.0), coll("c", 5.0), comp("b", 6.0), wait("w", 1), comp("d", 1.0)]
    plain, zero = simulate(ops), simulate(ops, interference=0.0)
    assert zero.makespan_s == plain.makespan_s == pytest.approx(9.0)
    assert zero.interference_s == 0.0


def test_overlapped_compute_costs_share_over_one_minus_share_extra():
    # link busy over [2, 7]; b computes over [2, 8]: 5 s of it overlap the transfer. At 20 % of
    # throughput lost that work takes 5 / 0.8 = 6.25 s: 1.25 s extra, charged at the wait.
    ops = [comp("a", 2.0), coll("c", 5.0), comp("b", 6.0), wait("w", 1), comp("d", 1.0)]
    r = simulate(ops, interference=0.2)
    assert r.interference_s == pytest.approx(1.25)
    assert r.makespan_s == pytest.approx(9.0 + 1.25)
    assert r.exposed_comm_s == pytest.approx(0.0)


def test_a_transfer_longer_than_the_compute_hides_the_slowdown():
    # b (3 s) overlaps the 5 s transfer entirely: 0.75 s extra, but the wait ends at 7 anyway.
    ops = [comp("a", 2.0), coll("c", 5.0), comp("b", 3.0), wait("w", 1)]
    r = simulate(ops, interference=0.2)
    assert r.makespan_s == pytest.approx(7.0)
    assert r.interference_s == pytest.approx(0.0)
    assert r.exposed_comm_s == pytest.approx(2.0)


def test_compute_overlapped_by_two_collectives_is_slowed_once():
    # Two groups' transfers over [0, 5] in parallel; b overlaps both for 5 s: charged at the first
    # wait (5 * 0.25), nothing more at the second.
    ops = [coll("c1", 5.0, "tp"), coll("c2", 5.0, "ep"), comp("b", 6.0), wait("w1", 0), wait("w2", 1)]
    r = simulate(ops, interference=0.2)
    assert r.interference_s == pytest.approx(1.25)
    assert r.makespan_s == pytest.approx(7.25)


def test_time_blocked_in_a_wait_is_not_slowed_compute():
    # c2's window [0, 10] spans compute [0, 2] and [5, 8] and the wait for c1 [2, 5]; only the
    # 5 s of compute are charged at c2's wait.
    ops = [coll("c1", 5.0, "tp"), coll("c2", 10.0, "ep"), comp("a", 2.0), wait("w1", 0), comp("b", 3.0),
           wait("w2", 1)]
    ledger_only = simulate(ops, interference=0.5)  # factor 1: c1 charges [0, 2] -> 2 s at t=2
    # t: 2 (+2 charged) -> wait c1 until max(5, 4) = 5; b to 8; c2 charges [0, 8] less [0, 2]
    # (charged) less [2, 5] (blocked) = 3 s -> done = max(10, 11) = 11.
    assert ledger_only.makespan_s == pytest.approx(11.0)
    assert ledger_only.interference_s == pytest.approx(1.0)


def test_ledger_rejects_a_share_outside_0_1_and_links_validate_it():
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        InterferenceLedger(1.0)
    with pytest.raises(ValueError, match="compute_interference"):
        Interconnect("x", latency_s=0.0, bandwidth_Bps=1e9, compute_interference=-0.1)
    link = Interconnect("x", latency_s=0.0, bandwidth_Bps=1e9, compute_interference=0.15)
    assert interference_of(AnalyticalCostModel(DEFAULT_CPU, link)) == 0.15
    assert interference_of(AnalyticalCostModel(DEFAULT_CPU, None)) == 0.0


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_emulated_wait_charges_the_overlapped_compute():
    # share 0.5: every overlapped compute second costs one more. Link 40 ms, compute ~60 ms after
    # the issue: ~40 ms of it overlap, the wait returns ~40 ms after it is reached, not at once.
    x = torch.ones(4)
    reset_emulation()
    t_issue = time.perf_counter()
    flight = emulated_issue(x, "g", 0.04, 0.5)
    t_issued = time.perf_counter()
    assert isinstance(flight, Flight) and t_issue <= flight.start <= t_issued
    _spin(0.06)
    t_wait = time.perf_counter()
    emulated_wait(x, flight)
    t_done = time.perf_counter()
    overlap_lo = flight.deadline - t_issued            # compute overlapped at least the window
    assert t_done - t_wait >= overlap_lo - 1e-3
    st = emulation_stats()
    # the time inside the wait is split into exposed communication and the charged slowdown
    assert 0.0 <= st.exposed_s and st.interference_s + st.exposed_s <= t_done - t_wait
    # At least the overlapped window is charged, less what the real collective's wait took (on a
    # loaded host the thread can be descheduled inside it): that time is the exposed time that is
    # not the sleep's overshoot past the charged deadline (link_s).
    assert st.interference_s >= overlap_lo - (st.exposed_s - st.link_s) - 1e-3
    # ...and never more than the whole window at share 0.5 (sleep overshoot counts as exposed)
    assert st.interference_s <= (flight.deadline - flight.start) + 1e-6


def test_emulated_wait_without_interference_is_unchanged():
    x = torch.ones(4)
    reset_emulation()
    flight = emulated_issue(x, "g", 0.02)
    _spin(0.03)
    assert time.perf_counter() > flight.deadline
    emulated_wait(x, flight)
    st = emulation_stats()
    # The link was done before the wait and nothing is charged: the wait does not sleep.
    assert st.interference_s == 0.0 and st.waits == 1 and st.link_s <= st.exposed_s
    with pytest.raises(ValueError, match="interference"):
        emulated_issue(x, "g", 0.01, 1.5)


def test_a_flight_holds_the_collective_input_until_its_wait():
    # The process group keeps a collective's input until the wait; the emulation holds it too, so
    # that its last reference goes on the compute thread (gloo's worker thread frees are invisible
    # to the profiler's allocator events).
    import weakref

    x = torch.ones(4)
    inp = torch.ones(1024)
    ref = weakref.ref(inp)
    reset_emulation()
    flight = emulated_issue(x, "g", 0.0, 0.0, inp)
    del inp
    assert ref() is not None
    emulated_wait(x, flight)
    assert ref() is None


def test_the_hosts_own_share_is_charged_over_the_real_collective_only():
    # On CPU ranks the real collective works on the compute's cores for host_s (here the first 2 s
    # of the 5 s emulated window) and takes 20 % of the compute's throughput meanwhile: b overlaps
    # those 2 s, so 2 * 0.25 = 0.5 s extra. The emulated share (none here) would be charged over
    # the whole window; the two add.
    ops = [comp("a", 2.0), coll("c", 5.0), comp("b", 6.0), wait("w", 1), comp("d", 1.0)]
    ops[1].host_s, ops[1].host_share = 2.0, 0.2
    r = simulate(ops)
    assert r.interference_s == pytest.approx(0.5)
    assert r.makespan_s == pytest.approx(9.5)
    both = simulate(ops, interference=0.2)
    assert both.interference_s == pytest.approx(1.25 + 0.5)
    # A real collective longer than the priced one is cut to it (the priced time is the larger).
    ops[1].host_s = 9.0
    assert simulate(ops).interference_s == pytest.approx(5 * 0.25)


def test_the_cost_model_hands_the_hosts_share_and_the_real_collective_to_the_simulator():
    from megatron_ext.helix.ir import CollectiveInfo
    from megatron_ext.helix.simulator import host_cost

    real = Interconnect("measured", latency_s=2e-4, bandwidth_Bps=1e9)
    info = CollectiveInfo(kind="all_reduce", group="tp", group_size=2, dtype=torch.float32, in_bytes=1 << 20,
                          out_bytes=1 << 20, reduce_op="sum")
    model = AnalyticalCostModel(DEFAULT_CPU, Interconnect("link", 5e-5, 1e10), {("tp", "all_reduce"): real},
                                host_interference=0.12)
    assert host_cost(model, info) == (pytest.approx(real.time_of(info)), 0.12)
    assert host_cost(AnalyticalCostModel(DEFAULT_CPU), info) == (0.0, 0.0)
    with pytest.raises(ValueError, match=r"host_interference is a share of compute throughput in \[0, 1\), got 1.0"):
        AnalyticalCostModel(DEFAULT_CPU, host_interference=1.0)


def test_backends_that_adopt_links_share_the_measured_host_share():
    from megatron_ext.helix.compiler import HelixBackend

    first = HelixBackend()
    first.adopt_links(first)                      # the bench's baseline adopts its own links
    assert first.host_interference is None
    other, explicit = HelixBackend(), HelixBackend(host_interference=0.05)
    other.adopt_links(first)
    explicit.adopt_links(first)
    first._host["share"] = 0.12                   # what _measure_links records once measured
    assert (first.host_interference, other.host_interference, explicit.host_interference) == (0.12, 0.12, 0.05)
    with pytest.raises(ValueError, match=r"host_interference is a share of compute throughput in \[0, 1\)"):
        HelixBackend(host_interference=1.5)

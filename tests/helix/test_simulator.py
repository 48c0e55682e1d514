"""The simulator: makespan on a compute stream + per-group links, peak memory from lifetimes."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ext.helix.ir import Kind
from megatron_ext.helix.simulator import SimOp, peak_memory, simulate


def comp(name, t, inputs=(), alloc=0, alias=None, keep=False):
    return SimOp(name=name, kind=Kind.COMPUTE, compute_s=t, inputs=tuple(inputs), alloc_bytes=alloc,
                 alias_of=alias, keep=keep)


def coll(name, comm, inp, group="g", alloc=0):
    return SimOp(name=name, kind=Kind.COLLECTIVE, compute_s=0.0, comm_s=comm, channel=group, inputs=(inp,),
                 alloc_bytes=alloc)


def wait(name, c):
    return SimOp(name=name, kind=Kind.WAIT, wait_of=c, inputs=(c,), alias_of=c)


def test_exposed_communication_is_hidden_by_independent_compute():
    # a(2) -> issue c(comm 5) -> b(3, independent) -> wait c: blocked 2, makespan 7
    ops = [comp("a", 2.0), coll("c", 5.0, 0), comp("b", 3.0), wait("w", 1)]
    r = simulate(ops)
    assert r.makespan_s == pytest.approx(7.0)
    assert r.exposed_comm_s == pytest.approx(2.0)
    assert r.comm_s == pytest.approx(5.0) and r.hidden_comm_s == pytest.approx(3.0)


def test_waiting_right_after_issue_exposes_everything():
    ops = [comp("a", 2.0), coll("c", 5.0, 0), wait("w", 1), comp("b", 3.0)]
    r = simulate(ops)
    assert r.makespan_s == pytest.approx(10.0)
    assert r.exposed_comm_s == pytest.approx(5.0)


def test_collectives_of_one_group_share_its_link_and_other_groups_do_not():
    same = [comp("a", 1.0), coll("c1", 4.0, 0, "tp"), coll("c2", 4.0, 0, "tp"), wait("w1", 1), wait("w2", 2)]
    other = [comp("a", 1.0), coll("c1", 4.0, 0, "tp"), coll("c2", 4.0, 0, "ep"), wait("w1", 1), wait("w2", 2)]
    assert simulate(same).makespan_s == pytest.approx(9.0)   # 1 + 4 + 4 back to back
    assert simulate(other).makespan_s == pytest.approx(5.0)  # two links in parallel


def test_peak_memory_follows_lifetimes_views_and_kept_outputs():
    ops = [comp("x", 0, alloc=100),                 # 0: freed after its view's last use (3)
           comp("v", 0, inputs=[0], alias=0),       # 1: view of x
           comp("y", 0, inputs=[0], alloc=50),      # 2: freed after 4
           comp("z", 0, inputs=[1], alloc=30),      # 3: last use of x through v
           comp("out", 0, inputs=[2, 3], alloc=10, keep=True)]
    # live: 100, 100, 150, 180 (x freed after op 3 -> 80), +10 = 90
    assert peak_memory(ops) == 180


def test_a_storage_nobody_uses_is_transient():
    ops = [comp("tmp", 0, alloc=1000), comp("a", 0, alloc=10)]
    assert peak_memory(ops) == 1000


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 5.0), st.floats(0.0, 5.0), st.booleans(), st.integers(0, 100)),
                min_size=1, max_size=12))
def test_invariants_of_random_programs(spec):
    """makespan = compute + exposed; exposed <= comm; peak between the largest and the total allocation."""
    ops: list[SimOp] = []
    pending = []
    for compute, comm, issue, alloc in spec:
        ops.append(comp(f"c{len(ops)}", compute, inputs=[len(ops) - 1] if ops else [], alloc=alloc))
        if issue:
            ops.append(coll(f"k{len(ops)}", comm, len(ops) - 1))
            pending.append(len(ops) - 1)
        elif pending:
            ops.append(wait(f"w{len(ops)}", pending.pop(0)))
    for p in pending:
        ops.append(wait(f"w{len(ops)}", p))
    r = simulate(ops)
    assert r.makespan_s == pytest.approx(r.compute_s + r.exposed_comm_s)
    assert r.exposed_comm_s <= r.comm_s + 1e-9
    allocs = [o.alloc_bytes for o in ops]
    assert max(allocs) <= r.peak_bytes <= sum(allocs)


@pytest.mark.parametrize("kind, live_floats", [
    ("all_reduce", 2 * 1024),     # reduces a clone: its input dies at the issue -> clone + t
    ("all_gather", 4 * 1024),     # reads its input while in flight -> y + gathered (2x) + t
])
def test_a_collective_holds_its_input_until_the_wait_unless_it_reduces_a_clone(kind, live_floats):
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from megatron_ext.helix.cost import DEFAULT_CPU, AnalyticalCostModel, resolve_interconnect
    from megatron_ext.helix.ir import GraphIR
    from megatron_ext.helix.simulator import graph_ops
    from tests.helix.helix_helpers import fake_world

    ops = torch.ops._c10d_functional
    with fake_world(0) as g:
        def f(x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            c = ops.all_reduce(y, "sum", g.name) if kind == "all_reduce" else \
                ops.all_gather_into_tensor(y, 2, g.name)
            t = x * 3                                  # computed while the collective is in flight
            return ops.wait_tensor(c).sum() + t.sum()

        gm = make_fx(f)(torch.randn(1024))
    cost = AnalyticalCostModel(DEFAULT_CPU, resolve_interconnect("intra_node", DEFAULT_CPU))
    peak = peak_memory(graph_ops(GraphIR(gm, lambda name: 2), cost))
    assert live_floats * 4 <= peak <= live_floats * 4 + 8, peak   # (+ the scalar sums)

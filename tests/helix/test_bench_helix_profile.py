"""tools/bench_helix_profile.py: how a profiled step's busy time is split by what its thread did."""
import dataclasses

import pytest
import torch

from tools import bench_helix_profile as bp


@dataclasses.dataclass
class Ev:
    name: str
    self_cpu_time_total: float   # us, as the profiler's FunctionEvent
    thread: int = 1


def test_operators_fall_in_their_categories():
    assert [bp.category(n) for n in ("aten::mm", "aten::cat", "aten::view", "_c10d_functional::all_reduce",
                                     "c10d::allreduce_", "aten::add", "_c10d_functional::wait_tensor",
                                     "autograd::engine::evaluate_function: MmBackward0")] == \
        ["matmul", "copies", "views", "issue", "issue", "elementwise", "wait", None]


def test_the_split_adds_up_to_the_busy_time_and_leaves_waits_and_other_threads_out():
    events = [Ev("aten::mm", 3000), Ev("aten::mm", 1000), Ev("aten::cat", 500), Ev("aten::view", 10),
              Ev("_c10d_functional::all_reduce", 200), Ev("aten::gelu", 290),
              Ev("_c10d_functional::wait_tensor", 9000),            # a wait: exposed, not busy
              Ev("autograd::engine::evaluate_function: X", 400),     # a wrapper: between ops
              Ev("aten::mm", 7000, thread=2)]                        # another thread's
    secs, calls = bp.split_step(events, thread=1, busy_s=0.006)
    assert secs == pytest.approx({"matmul": 0.004, "copies": 0.0005, "views": 0.00001, "issue": 0.0002,
                                  "elementwise": 0.00029, "between ops": 0.001})
    assert sum(secs.values()) == pytest.approx(0.006)
    assert calls == {"matmul": 2, "copies": 1, "views": 1, "issue": 1, "elementwise": 1, "between ops": 0}


def test_thread_cpu_times_are_read_for_this_process():
    import threading

    cpu = bp.thread_cpu_ns()
    assert threading.get_native_id() in cpu and all(v >= 0 for v in cpu.values())


SEEN: list = []


def _marker(x):
    return torch.full_like(x, 7.0)


def _record(saved, tangent):
    SEEN.append(float(saved.flatten()[0]))
    return saved + tangent


def test_the_chained_timing_feeds_the_backward_what_the_forward_returned():
    import torch.fx as fx

    fw = fx.Graph()
    x = fw.placeholder("x")
    x.meta["val"] = torch.empty(4, 4)
    fw.output((fw.call_function(_marker, (x,), name="saved"),))
    bw = fx.Graph()
    s_in, t_in = bw.placeholder("saved"), bw.placeholder("tangents_1")
    s_in.meta["val"], t_in.meta["val"] = torch.empty(4, 4), torch.empty(4, 4)
    bw.output((bw.call_function(_record, (s_in, t_in)),))
    SEEN.clear()
    for flush in (False, True):
        assert bp.chained_s({"fw": fx.GraphModule({}, fw), "bw": fx.GraphModule({}, bw)}, flush, reps=3) > 0
    assert SEEN and all(v == 7.0 for v in SEEN), SEEN      # never a made-up input
    assert (torch.tensor([1e-40]) * 1.0).item() != 0.0   # denormals are kept again afterwards

"""Automatic micro-benchmarks that calibrate the cost model on the current device, with a cache.

* :func:`calibrate_device` measures peak FLOP/s (a square matmul), memory bandwidth (a large
  copy) and the per-operator launch overhead (a tiny add), i.e. a :class:`DeviceSpec`.
* :func:`benchmark_graph_ops` times every distinct operator call of a graph on tensors built
  from the graph's recorded shapes, strides and dtypes (median of a few runs).

Results are cached in a JSON file keyed by device (CPU model or GPU name, torch version, thread
count), so a second compile of the same model measures nothing. Pure: no ``torch.distributed``;
the backend agrees the numbers across ranks before using them.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import tempfile
import time
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx

from megatron_ext.helix.cost import DeviceSpec, op_signature
from megatron_ext.helix.ir import Kind, classify, collective_kind, is_emulated_issue, is_wait, value_of

logger = logging.getLogger(__name__)


def default_cache_path() -> str:
    root = os.environ.get("MEGATRON_EXT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megatron_ext")
    return os.path.join(root, "helix_costs.json")


def device_key(device: torch.device | str = "cpu") -> str:
    device = torch.device(device)
    if device.type == "cuda":
        hw = torch.cuda.get_device_name(device)
    else:
        hw = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as fh:
                for line in fh:
                    if line.startswith("model name"):
                        hw = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
    return f"{device.type}|{hw}|torch={torch.__version__}|threads={torch.get_num_threads()}"


class CostCache:
    """JSON file: ``{device_key: {"device": {...}, "ops": {signature: seconds}}}``."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or default_cache_path()
        self.data: dict[str, Any] = {}
        if os.path.isfile(self.path):
            try:
                with open(self.path, encoding="utf-8") as fh:
                    self.data = json.load(fh)
            except (OSError, ValueError):
                logger.warning("helix: cost cache %s is unreadable; starting a new one", self.path)
                self.data = {}

    def entry(self, key: str) -> dict[str, Any]:
        return self.data.setdefault(key, {"device": None, "ops": {}})

    def save(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        # Atomic replace: ranks sharing a file may write at the same time.
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path) or ".", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(self.data, fh, indent=0, sort_keys=True)
        os.replace(tmp, self.path)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device, reps: int = 5, min_total_s: float = 2e-3,
              stat: Callable[[list[float]], float] = statistics.median) -> float:
    """``stat`` (median) of the seconds of ``fn()`` after one warm-up; repeats until
    ``min_total_s`` has elapsed."""
    fn()
    _sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps or (time.perf_counter() - start < min_total_s and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return stat(times)


def calibrate_device(device: torch.device | str = "cpu", cache: CostCache | None = None) -> DeviceSpec:
    """Measure (or read from the cache) this device's peak FLOP/s, bandwidth and op overhead."""
    device = torch.device(device)
    key = device_key(device)
    if cache is not None and cache.entry(key)["device"]:
        return DeviceSpec(**cache.entry(key)["device"])
    n = 1024 if device.type == "cuda" else 384
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    t_mm = time_call(lambda: torch.mm(a, b), device, stat=min)  # capabilities: the undisturbed runs
    src = torch.randn(4 << 20, device=device)
    dst = torch.empty_like(src)
    t_copy = time_call(lambda: dst.copy_(src), device, stat=min)
    tiny = torch.randn(8, device=device)
    t_op = time_call(lambda: torch.ops.aten.add.Tensor(tiny, tiny), device, reps=200, stat=min)
    spec = DeviceSpec(name=key, peak_flops_per_s=2 * n ** 3 / t_mm,
                      mem_bandwidth_Bps=2 * src.numel() * src.element_size() / t_copy,
                      op_overhead_s=t_op, graph_overhead_s=_graph_overhead_s(device))
    logger.info("helix: calibrated %s: %.1f GFLOP/s, %.2f GB/s, %.1f us/op, %.1f us/graph", key,
                spec.peak_flops_per_s / 1e9, spec.mem_bandwidth_Bps / 1e9, spec.op_overhead_s * 1e6,
                spec.graph_overhead_s * 1e6)
    if cache is not None:
        cache.entry(key)["device"] = {k: getattr(spec, k) for k in
                                      ("name", "peak_flops_per_s", "mem_bandwidth_Bps", "op_overhead_s",
                                       "graph_overhead_s")}
    return spec


def _graph_overhead_s(device: torch.device) -> float:
    """Fixed cost of running one forward+backward pair of graphs through the autograd runtime,
    measured with a trivial autograd.Function (no compile needed)."""

    class _Id(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            return g

    x = torch.randn(8, device=device, requires_grad=True)
    g = torch.ones(8, device=device)
    return time_call(lambda: _Id.apply(x).backward(g), device, reps=50) / 2


def _materialize(v: Any, device: torch.device) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    # Integer/bool tensors become zeros: valid indices for gathers and embeddings.
    storage = sum((s - 1) * st for s, st in zip(v.shape, v.stride())) + 1 if v.numel() else 0
    base = torch.zeros(storage, dtype=v.dtype, device=device) if not v.is_floating_point() \
        else torch.randn(storage, device=device).to(v.dtype)
    return base.as_strided(tuple(v.shape), tuple(v.stride()))


def rewritten_copy(gm: fx.GraphModule, rewrite: Callable[[fx.Graph, fx.Node], None]) -> fx.GraphModule:
    """A copy of an AOT graph with ``rewrite(graph, node)`` applied to each node in order, the
    emulated link's issue helpers left without users dropped, in the plain calling convention."""
    import copy

    g = copy.deepcopy(gm)
    g.graph.set_codegen(fx.graph.CodeGen())  # plain calling convention even if gm is boxed
    for n in list(g.graph.nodes):
        rewrite(g.graph, n)
    for n in reversed(list(g.graph.nodes)):
        if is_emulated_issue(n) and not n.users:
            g.graph.erase_node(n)
    g.graph.lint()
    g.recompile()
    return g


def _compute_only(graph: fx.Graph, n: fx.Node) -> None:
    kind = collective_kind(n)
    if kind == "all_gather":      # (input, group size, group): the output is group-size inputs
        n.target = torch.ops.aten.cat.default
        n.args, n.kwargs = ([n.args[0]] * int(n.args[1]),), {}
    elif kind == "reduce_scatter":  # (input, op, group size, group): one chunk of dim 0
        n.target = torch.ops.aten.narrow_copy.default
        size = int(n.args[2])
        n.args, n.kwargs = (n.args[0], 0, 0, int(value_of(n.args[0]).shape[0]) // size), {}
    elif kind is not None:
        n.target = torch.ops.aten.clone.default
        n.args, n.kwargs = (n.args[0],), {}
    elif is_wait(n):
        n.replace_all_uses_with(n.args[0])
        graph.erase_node(n)


def compute_only_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of an AOT graph whose collectives are local copies and whose waits are no-ops:
    its run time is the graph's computation alone."""
    return rewritten_copy(gm, _compute_only)


def time_graphs(graphs: Iterable[fx.GraphModule], device: torch.device | str = "cpu", reps: int = 5) -> float:
    """Median seconds to run the computation of ``graphs`` once each, on inputs built from their
    placeholders' recorded shapes (a whole-graph micro-benchmark: it sees cache effects and the
    machine's current load, which per-operator timings miss)."""
    device = torch.device(device)
    runs = []
    for gm in graphs:
        g = compute_only_copy(gm)
        args = [_materialize(value_of(n), device) for n in g.graph.nodes if n.op == "placeholder"]
        runs.append((g, args))

    def once() -> None:
        with torch.no_grad():
            for g, args in runs:
                g(*args)

    once()  # first runs pay for page faults and allocator growth
    return time_call(once, device, reps=reps, min_total_s=0.0)


class _CollectiveClock:
    """Seconds spent in the collectives' starts and waits of a :func:`live_copy` graph since ``reset``."""

    waits = starts = 0.0

    @classmethod
    def reset(cls) -> None:
        cls.waits = cls.starts = 0.0


def _wait_op(x: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor.default(x)


def _timed_wait(x: torch.Tensor) -> torch.Tensor:
    t0 = time.perf_counter()
    out = _wait_op(x)
    _CollectiveClock.waits += time.perf_counter() - t0
    return out


def _timed_start(target: Callable[..., Any]) -> Callable[..., Any]:
    def start(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = target(*args, **kwargs)
        _CollectiveClock.starts += time.perf_counter() - t0
        return out

    start.__name__ = f"timed_{getattr(target, '__name__', 'collective')}"
    return start


def _timed_collectives(graph: fx.Graph, n: fx.Node) -> None:
    if collective_kind(n) is not None:
        n.target = _timed_start(n.target)
    elif is_wait(n):
        n.target, n.args, n.kwargs = _timed_wait, (n.args[0],), {}


def live_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a compiled graph that runs its real collectives (an emulated link's helpers taken
    out), each start and each wait timed into ``_CollectiveClock``."""
    return rewritten_copy(gm, _timed_collectives)


def time_graphs_live(graphs: Iterable[fx.GraphModule], device: torch.device | str = "cpu", reps: int = 5,
                     sync: Callable[[], Any] | None = None) -> float:
    """Median seconds of the computation of ``graphs`` (each run once, in order, on inputs made up
    from their placeholders) run *with* their real collectives: the elapsed time less the time in
    the collectives' starts and waits. Unlike :func:`time_graphs` it sees what running beside the
    collectives does to the computation (the communication library's threads on the cores, its
    caches). Every rank of the graphs' groups must call it at the same point, as the collectives
    need (it calls nothing of ``torch.distributed`` itself); ``sync`` (e.g. a barrier) runs before
    each repetition, untimed."""
    device = torch.device(device)
    runs = []
    for gm in graphs:
        g = live_copy(gm)
        runs.append((g, [_materialize(value_of(n), device) for n in g.graph.nodes if n.op == "placeholder"]))
    out = []
    for r in range(reps + 1):
        if sync is not None:
            sync()
        _sync(device)
        _CollectiveClock.reset()
        t0 = time.perf_counter()
        with torch.no_grad():
            for g, args in runs:
                g(*args)
        _sync(device)
        if r:   # the first run pays for page faults and allocator growth
            out.append(time.perf_counter() - t0 - _CollectiveClock.waits - _CollectiveClock.starts)
    return statistics.median(out)


def benchmarkable(node: fx.Node) -> bool:
    """Whether a node is an operator call that micro-benchmarks can time on made-up inputs."""
    if node.op not in ("call_function",) or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if collective_kind(node) is not None or is_wait(node) or classify(node) == Kind.OTHER:
        return False
    # Ops that mutate their inputs would corrupt the shared input tensors of later runs.
    return not node.target._schema.is_mutable


def benchmark_graph_ops(graphs: Iterable[fx.GraphModule | fx.Graph], device: torch.device | str = "cpu",
                        cache: CostCache | None = None, rounds: int = 5) -> dict[str, float]:
    """Seconds per distinct operator call of ``graphs`` (ATen graphs with ``meta["val"]``).

    The calls are timed in ``rounds`` interleaved rounds (every call once per round) and each
    keeps its fastest time: on a shared host a load spike then hits all calls alike instead of
    the few measured during it, so the table stays consistent -- what decisions compare. A cache
    hit needs *every* call cached (values from different sessions are not mixed); otherwise all
    are measured again and the cache is updated.
    """
    device = torch.device(device)
    known = cache.entry(device_key(device))["ops"] if cache is not None else {}
    calls: dict[str, fx.Node] = {}
    for g in graphs:
        graph = g.graph if isinstance(g, fx.GraphModule) else g
        for node in graph.nodes:
            if benchmarkable(node):
                calls.setdefault(op_signature(node), node)
    if calls and all(sig in known for sig in calls):
        return {sig: known[sig] for sig in calls}
    runnable: dict[str, Callable[[], Any]] = {}
    for sig, node in calls.items():
        try:
            args, kwargs = torch.utils._pytree.tree_map(
                lambda a: _materialize(value_of(a), device) if isinstance(a, fx.Node) else a,
                (node.args, node.kwargs))
            fn = (lambda t=node.target, a=args, k=kwargs: t(*a, **k))
            with torch.no_grad():
                fn()  # warm-up; also weeds out calls that cannot run on made-up data
            runnable[sig] = fn
        except Exception as exc:  # data-dependent ops: the analytical model covers them
            logger.debug("helix: cannot benchmark %s: %s", sig, exc)
    best = {sig: float("inf") for sig in runnable}
    with torch.no_grad():
        for _ in range(rounds):
            for sig, fn in runnable.items():
                t0 = time.perf_counter()
                fn()
                _sync(device)
                best[sig] = min(best[sig], time.perf_counter() - t0)
    if cache is not None:
        known.update(best)
    if best:
        logger.info("helix: micro-benchmarked %d operator calls on %s (%d rounds)", len(best), device, rounds)
    return best


_SYNC = 8  # floats all-reduced to line the ranks up before each timed collective


def trimmed_mean(values: Iterable[float]) -> float:
    """The mean without the largest and the smallest value (from 5 values on)."""
    v = sorted(values)
    if len(v) >= 5:
        v = v[1:-1]
    return sum(v) / len(v)


def measure_collectives(group: str, group_size: int, kinds: Iterable[str], device: torch.device | str = "cpu",
                        sizes: Iterable[int] = (1 << 16, 1 << 20), reps: int = 31,
                        issue: dict[str, list[tuple[int, float]]] | None = None) -> dict[str, list[tuple[int, float]]]:
    """Time the real collectives of ``group`` (every rank of it must call this, in step):
    for each kind and payload size (``sizes``, bytes: the larger of input and output, as the cost
    model counts them), the mean of ``reps`` runs less the slowest and the fastest, each started
    right after a small all-reduce that lines the ranks up. Returns (payload bytes, seconds) samples
    per kind, for :class:`megatron_ext.helix.cost.MeasuredLink` and
    :func:`megatron_ext.helix.cost.fit_link`. Uses the functional collectives only.

    Why a mean, not a median: on CPU ranks a gloo collective over loopback either completes on its
    fast path or stalls some 3 ms more, and the share of stalls grows with the payload (2 ranks,
    one core each: a fifth to a quarter of the runs at 64 KiB, 40-55 % at 512 KiB, more above;
    ``tools/bench_gloo_sizes.py``). A step runs several collectives, so what it pays is their
    expected time; a median of a few runs lands on either mode.

    ``issue``, when given, also gets per kind the (payload bytes, seconds) the *calling* thread
    spends starting each collective, before its wait: on CPU ranks that is not free (the functional
    all-reduce clones its input, gloo queues the work), and it is paid on the compute thread
    whether or not the transfer is hidden."""
    device = torch.device(device)
    ops = torch.ops._c10d_functional
    sync = torch.zeros(_SYNC, device=device)
    out: dict[str, list[tuple[int, float]]] = {}
    for kind in sorted(set(kinds)):
        samples, started = [], []
        for size in sizes:
            # Elements whose payload is ``size``: the gathered side of an all-gather is the group's
            # inputs together; the others' inputs divide evenly among the ranks.
            n = max(size // 4 // group_size, 1) * (1 if kind == "all_gather" else group_size)
            x = torch.ones(n, device=device)

            def start() -> torch.Tensor:
                if kind == "all_reduce":
                    return ops.all_reduce(x, "sum", group)
                if kind == "all_gather":
                    return ops.all_gather_into_tensor(x, group_size, group)
                if kind == "reduce_scatter":
                    return ops.reduce_scatter_tensor(x, "sum", group_size, group)
                if kind == "all_to_all":
                    split = [n // group_size] * group_size
                    return ops.all_to_all_single(x, split, split, group)
                raise ValueError(f"cannot measure collective kind {kind!r}")

            ops.wait_tensor(start())  # warm-up (connections, buffers)
            times, issued = [], []
            for _ in range(reps):
                ops.wait_tensor(ops.all_reduce(sync, "sum", group))
                _sync(device)
                t0 = time.perf_counter()
                pending = start()
                t1 = time.perf_counter()
                ops.wait_tensor(pending)
                _sync(device)
                times.append(time.perf_counter() - t0)
                issued.append(t1 - t0)
            payload = n * 4 * (group_size if kind == "all_gather" else 1)
            samples.append((payload, trimmed_mean(times)))
            started.append((payload, statistics.median(issued)))
        out[kind] = samples
        if issue is not None:
            issue[kind] = started
    return out


def measure_host_interference(group: str, device: torch.device | str = "cpu", rounds: int = 7,
                              payload_bytes: int = 4 << 20) -> float:
    """The share of compute throughput a real collective of ``group`` takes from the compute it
    overlaps on this rank (every rank of the group must call this, in step). On CPU ranks gloo
    reduces and copies on the cores the compute needs; on a GPU the answer is 0 here (NCCL's SMs
    are the emulated ``compute_interference``). A block of small matmuls about half as long as an
    all-reduce of ``payload_bytes`` is timed alone and inside that all-reduce's flight, ``rounds``
    times each, interleaved, each after a small all-reduce that lines the ranks up; the share is
    ``1 - alone / inside`` of the medians, clipped to [0, 0.9]."""
    device = torch.device(device)
    if device.type != "cpu":
        return 0.0
    ops = torch.ops._c10d_functional
    sync = torch.zeros(_SYNC, device=device)
    x = torch.ones(max(payload_bytes // 4, 1), device=device)
    a, b = torch.randn(128, 256, device=device), torch.randn(256, 256, device=device)

    def line_up() -> None:
        ops.wait_tensor(ops.all_reduce(sync, "sum", group))

    def collective_s() -> float:
        line_up()
        t0 = time.perf_counter()
        ops.wait_tensor(ops.all_reduce(x, "sum", group))
        return time.perf_counter() - t0

    def block(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            torch.mm(a, b)
        return time.perf_counter() - t0

    collective_s()                                        # warm-up
    t_coll = statistics.median(collective_s() for _ in range(3))
    one = statistics.median(block(1) for _ in range(5))
    n = max(1, int(0.5 * t_coll / max(one, 1e-7)))
    alone, inside = [], []
    for _ in range(rounds):
        line_up()
        alone.append(block(n))
        line_up()
        work = ops.all_reduce(x, "sum", group)
        inside.append(block(n))
        ops.wait_tensor(work)
    a_med, i_med = statistics.median(alone), statistics.median(inside)
    share = 1.0 - a_med / i_med if i_med > 0 else 0.0
    return min(max(share, 0.0), 0.9)

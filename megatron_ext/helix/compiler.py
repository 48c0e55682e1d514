"""The Helix torch.compile backend: tile, reorder and bucket the captured graph, guided by the simulator.

``backend(tiles=2, memory_budget_bytes=None, interconnect=None)`` returns a callable for
``torch.compile(model, backend=...)``. For each graph Dynamo hands it:

1. the untiled graph goes through aot_autograd (the baseline forward/backward graphs), which is
   simulated;
2. the Dynamo graph is tiled into K streams (before autograd, so the backward is tiled too); the
   tiled forward and backward graphs are reordered (segmented round-robin) and bucketed (DP over
   simulated merges, under the memory budget), then simulated;
3. the tiled schedule is kept only when the simulator predicts at least ``min_gain`` less
   makespan for the whole training step and a peak within the budget; otherwise the baseline runs.

Each graph logs one summary line (collectives, exposed communication before/after, predicted
makespan and peak memory, decisions taken and refused); ``HelixBackend.summaries`` keeps them.

Compiled graphs run as Python (aot_eager-style), which works on CPU and GPU. With an
``interconnect`` on CPU, collectives run over the emulated link (``interconnect.py``). On GPUs
the same passes can run inside Inductor instead: see ``megatron_ext.helix.inductor``.

Scheduling decisions are functions of the graph and of costs that are agreed across the ranks of
every process group in the graph (all-reduce max), so all ranks compile the same order.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from megatron_ext.helix.calibrate import (CostCache, benchmark_graph_ops, benchmarkable, calibrate_device,
                                         measure_collectives, measure_host_interference, time_graphs,
                                         time_graphs_live)
from megatron_ext.helix.cost import (DEFAULT_CPU, AnalyticalCostModel, CostModel, DeviceSpec, Interconnect,
                                     InterconnectPreset, MeasuredCostModel, MeasuredLink, fit_link, op_signature,
                                     resolve_interconnect)
from megatron_ext.helix.ir import GraphIR, Kind, collective_kind, iter_subgraph_modules
from megatron_ext.helix.passes.bucketing import BucketingReport, bucket_graphs
from megatron_ext.helix.passes.reorder import ReorderReport, reorder_graph
from megatron_ext.helix.passes.tiling import TilingReport, tile_graph
from megatron_ext.helix.simulator import SimResult, interference_of, simulate, step_ops

logger = logging.getLogger(__name__)

MODES = ("auto", "helix", "baseline", "inductor_overlap")
MAX_PREFILL_TILES = 16
"""The finest sequence tiling a forward-only graph over its memory budget is tried at."""


def _mib(b: int) -> str:
    return f"{b / (1 << 20):.2f} MiB"


@dataclasses.dataclass
class GraphSummary:
    """What Helix did with one compiled graph (also logged as one line)."""

    index: int
    collectives: int          # in Dynamo's graph, autograd.Function bodies included
    tiled: bool
    step_collectives: dict[str, int] = dataclasses.field(default_factory=dict)  # untiled fw/bw graphs
    baseline: SimResult | None = None
    helix: SimResult | None = None       # the tiled candidate, whether taken or not
    # The taken tiled graphs simulated with their own whole-graph compute scale (the decision
    # prices both variants with the untiled graphs' scale); None when the untiled graphs run.
    predicted: SimResult | None = None
    tiling: TilingReport | None = None
    reorder: dict[str, ReorderReport] = dataclasses.field(default_factory=dict)
    bucketing: BucketingReport | None = None
    decisions: list[str] = dataclasses.field(default_factory=list)
    refused: list[str] = dataclasses.field(default_factory=list)
    order: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # collective order per graph
    graphs: dict[str, fx.GraphModule] = dataclasses.field(default_factory=dict, repr=False)  # as compiled

    @property
    def chosen(self) -> SimResult | None:
        return self.helix if self.tiled else self.baseline

    @property
    def prediction(self) -> SimResult | None:
        """The compile-time prediction of the graphs that run: each variant's step with the compute
        scale fitted to its own graphs."""
        return self.predicted if self.predicted is not None else self.chosen

    def line(self) -> str:
        b, c = self.baseline, self.chosen
        counts = "+".join(str(self.step_collectives[k]) for k in ("fw", "bw") if k in self.step_collectives)
        parts = [f"helix graph {self.index}: {counts or self.collectives} collectives"
                 + (" (fw+bw)" if "bw" in self.step_collectives else "")]
        if b is not None and c is not None:
            parts.append(f"exposed comm {b.exposed_comm_s * 1e3:.2f} -> {c.exposed_comm_s * 1e3:.2f} ms (simulated)")
            parts.append(f"makespan {b.makespan_s * 1e3:.2f} -> {c.makespan_s * 1e3:.2f} ms")
            if self.predicted is not None:
                parts.append(f"predicted step {self.predicted.makespan_s * 1e3:.2f} ms (the tiled graphs timed whole)")
            parts.append(f"peak {_mib(b.peak_bytes)} -> {_mib(c.peak_bytes)}")
        parts.append("taken: " + ("; ".join(self.decisions) or "none"))
        parts.append("refused: " + ("; ".join(self.refused) or "none"))
        return " | ".join(parts)


@dataclasses.dataclass
class _Variant:
    tiled: bool
    compiled: Callable | None = None
    fw: fx.GraphModule | None = None
    bw: fx.GraphModule | None = None
    sim: SimResult | None = None
    emulate: bool = False
    scale: float | None = None  # whole-graph calibration factor shared by the variants
    own_scale: float | None = None  # a tiled variant's: fitted to its own graphs
    predicted: SimResult | None = None  # simulated with ``own_scale``
    reorder: dict[str, ReorderReport] = dataclasses.field(default_factory=dict)
    bucketing: BucketingReport | None = None
    error: str = ""


def _count_collectives(gm: fx.GraphModule) -> int:
    n = 0
    for node in gm.graph.nodes:
        if collective_kind(node) is not None:
            n += 1
        for sub in iter_subgraph_modules(gm, node):
            n += _count_collectives(sub)
    return n


@contextlib.contextmanager
def _real_tensors():
    """Leave the tracer's fake/functional modes and its Python dispatcher: calibration must run
    (and time) the real kernels and collectives."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C._DisablePythonDispatcher():
        yield


def _has_symbolic_shapes(gm: fx.GraphModule) -> bool:
    from torch.utils._pytree import tree_leaves

    for n in gm.graph.nodes:
        for v in tree_leaves(n.meta.get("example_value", n.meta.get("val"))):
            if isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and
                                               any(isinstance(d, torch.SymInt) for d in v.shape)):
                return True
    return False


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def group_size_of(name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name).size()


def agree_max(values: Sequence[float], groups: Sequence[str]) -> list[float]:
    """Element-wise max of ``values`` over the ranks of every group (repeated so that ranks linked
    through several groups converge), so that decisions derived from them are rank-identical."""
    if not values or not groups or not _dist_ready():
        return list(values)
    from torch.distributed.distributed_c10d import _resolve_process_group

    from megatron_ext.runtime.distributed import collective_device

    t = torch.tensor(list(values), dtype=torch.float64)
    pgs = [_resolve_process_group(g) for g in sorted(set(groups))]
    for _ in range(len(pgs)):
        for pg in pgs:
            if pg.size() > 1:  # on the group's device: an NCCL group cannot reduce a CPU tensor
                t = t.to(collective_device(pg))
                torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=pg)
    return t.cpu().tolist()


class HelixBackend:
    """A torch.compile backend; see the module docstring. Extra knobs are keyword-only."""

    def __init__(self, tiles: int = 2, memory_budget_bytes: int | None = None,
                 interconnect: str | Interconnect | InterconnectPreset | None = None, *,
                 seq_tiling: bool = False, bucketing: bool = True, min_gain: float = 0.02,
                 cost_model: str | CostModel = "analytical", cost_cache: str | None = None,
                 device: DeviceSpec | None = None, input_dims: Mapping[str, int] | None = None,
                 batch_size: int | None = None, emulate: bool | None = None, mode: str = "auto",
                 host_interference: float | None = None) -> None:
        if tiles < 1:
            raise ValueError(f"helix backend: tiles must be >= 1, got {tiles}")
        if memory_budget_bytes is not None and memory_budget_bytes <= 0:
            raise ValueError(f"helix backend: memory_budget_bytes must be > 0, got {memory_budget_bytes}")
        if mode not in MODES:
            raise ValueError(f"helix backend: mode must be one of {MODES}, got {mode!r}")
        if host_interference is not None and not 0.0 <= host_interference < 1.0:
            raise ValueError(f"helix backend: host_interference is a share of compute throughput in [0, 1), "
                             f"got {host_interference}")
        if isinstance(cost_model, str) and cost_model not in ("analytical", "calibrated"):
            raise ValueError(f"helix backend: cost_model must be 'analytical', 'calibrated' or a CostModel, "
                             f"got {cost_model!r}")
        self.tiles = tiles
        self.memory_budget_bytes = memory_budget_bytes
        self.interconnect_spec = interconnect
        self.seq_tiling = seq_tiling
        self.bucketing = bucketing
        self.min_gain = min_gain
        self.cost_model_spec = cost_model
        self.cost_cache = cost_cache
        self.device_spec = device
        self.input_dims = input_dims
        self.batch_size = batch_size
        self.emulate_spec = emulate
        self.mode = mode
        self.summaries: list[GraphSummary] = []
        self._cost: AnalyticalCostModel | MeasuredCostModel | CostModel | None = None
        self._scale: float | None = None
        self._base: _Variant | None = None
        self._decision_cost: CostModel | None = None
        self._links: dict[tuple[str, str], MeasuredLink] = {}  # measured real collectives
        self._issue: dict[tuple[str, str], Interconnect] = {}  # what starting each costs the compute thread
        # What they were measured from: per (group, kind), payload bytes -> seconds (agreed).
        self._real_samples: dict[tuple[str, str], dict[int, float]] = {}
        self._issue_samples: dict[tuple[str, str], dict[int, float]] = {}
        # The share of compute throughput a real collective takes from the compute it overlaps on
        # this host (CPU ranks: gloo works on the same cores); None: measured with the links.
        # (a dict, shared with the links by ``adopt_links``)
        self._host: dict[str, float | None] = {"share": host_interference}
        self.link: Interconnect | None = None

    # -- setup -------------------------------------------------------------------------------------

    def prepare(self) -> "HelixBackend":
        """Calibrate the device and resolve the interconnect now rather than at the first compile.

        With the calibrated cost model this agrees the device's figures over the world group, a
        collective: every rank must call it at the same point. At the first compile that is only
        true without pipeline stages -- a later stage compiles after it received its first
        activations, while the first stage would wait in the agreement for it (the deadlock
        ``pretrain_gpt.py --helix`` with PP > 1 had). The extension prepares at trainer setup."""
        self._setup()
        return self

    def _setup(self) -> None:
        if self._cost is not None:
            return
        with _real_tensors():
            self._setup_cost()

    def _setup_cost(self) -> None:
        if not isinstance(self.cost_model_spec, str):
            self._cost = self.cost_model_spec
            self.link = getattr(self._cost, "interconnect", None)
            self.device_spec = self._cost.device
            return
        if self.device_spec is None:
            if self.cost_model_spec == "calibrated":
                cache = CostCache(self.cost_cache)
                spec = calibrate_device("cpu" if not torch.cuda.is_available() else "cuda", cache)
                cache.save()
                groups = [torch.distributed.group.WORLD.group_name] if _dist_ready() else []
                inv = agree_max([1 / spec.peak_flops_per_s, 1 / spec.mem_bandwidth_Bps, spec.op_overhead_s,
                                 spec.graph_overhead_s], groups)
                spec = DeviceSpec(name=spec.name, peak_flops_per_s=1 / inv[0], mem_bandwidth_Bps=1 / inv[1],
                                  op_overhead_s=inv[2], graph_overhead_s=inv[3])
            else:
                spec = DEFAULT_CPU
            self.device_spec = spec
        self.link = resolve_interconnect(self.interconnect_spec, self.device_spec)
        self._cost = AnalyticalCostModel(self.device_spec, self.link)

    @property
    def emulating(self) -> bool:
        if self.link is None:
            return False
        if self.emulate_spec is not None:
            return self.emulate_spec
        return not torch.cuda.is_available()

    def _group_size(self) -> Callable[[str], int] | None:
        return group_size_of if _dist_ready() else None

    def _cost_for(self, graphs: list[fx.GraphModule], scale: float | None = None,
                  scale_graphs: list[fx.GraphModule] | None = None) -> tuple[CostModel, float]:
        """The cost model for ``graphs``: analytical, or per-operator micro-benchmarks (all of
        ``graphs`` measured in one interleaved session) times a whole-graph ``scale``: the
        computation of ``scale_graphs`` (default ``graphs``) timed as a whole over the sum of its
        operators. Agreed across ranks."""
        if self.cost_model_spec != "calibrated":
            return self._cost, 1.0
        with _real_tensors():
            cache = CostCache(self.cost_cache)
            device = "cuda" if torch.cuda.is_available() else "cpu"
            table = benchmark_graph_ops(graphs, device, cache)
            cache.save()
            gs = self._group_size()
            irs = [GraphIR(g, gs) for g in graphs]
            groups = sorted({n.collective.group for ir in irs for n in ir.collectives()})
            self._measure_links(irs, device)
            # Agree over every benchmarkable call, measured here or not (-1): a call that failed to
            # run on one rank must not make the ranks' vectors differ in length.
            keys = sorted({op_signature(n) for g in graphs for n in g.graph.nodes if benchmarkable(n)} | set(table))
            unscaled = MeasuredCostModel(table, self._fallback())
            if scale is None:
                scale_graphs = scale_graphs or graphs
                predicted = sum(unscaled.compute_s(n) for g in scale_graphs for n in GraphIR(g, gs).nodes
                                if n.kind not in (Kind.COLLECTIVE, Kind.WAIT))
                measured = self._time_computation(scale_graphs, device)
                scale = max(measured / predicted, 1.0) if predicted > 0 else 1.0
            agreed = agree_max([table.get(k, -1.0) for k in keys] + [scale], groups)
            agreed_table = {k: v for k, v in zip(keys, agreed[:-1]) if v > 0}
            return MeasuredCostModel(agreed_table, self._fallback(), scale=agreed[-1]), agreed[-1]

    def _time_computation(self, graphs: list[fx.GraphModule], device: str) -> float:
        """Seconds of the computation of ``graphs``, the whole-graph figure the compute scale is
        fitted to. On CPU ranks whose graphs carry collectives, timed running beside the real
        collectives (calibrate.time_graphs_live: gloo's threads share the cores, which slows the
        computation by 1.2-1.4 ms a step untiled in bench_helix_profile run e); every rank of the graphs' groups
        is here at once, as the agreement that follows needs. Otherwise (GPU: the collectives run
        on their own streams; no collectives; one process) the computation alone."""
        live = (device == "cpu" and _dist_ready()
                and any(collective_kind(n) is not None for g in graphs for n in g.graph.nodes))
        return time_graphs_live(graphs, device) if live else time_graphs(graphs, device)

    def _fallback(self) -> AnalyticalCostModel:
        return AnalyticalCostModel(self.device_spec, self.link, self._links, self._host_share() or 0.0,
                                   issue=self._issue)

    def _host_share(self) -> float | None:
        return self._host["share"]

    @property
    def host_interference(self) -> float | None:
        """The host's collective interference share in use (None until measured)."""
        return self._host_share()

    def _measure_links(self, irs: list[GraphIR], device: str) -> None:
        """Measure the real collectives of every (group, kind) in the graphs at the payloads they
        carry, and once per (group, kind) at 64 KiB and 1 MiB for the fit beyond them; each payload
        once per backend (and those it shares them with); agreed (slowest) over every group of the
        graphs.

        Why over every group, and in graph order: ranks in different groups of one kind (TP
        {0, 1} and {2, 3} under TP2 x DP2) compile the same graph on differently named groups. If
        each priced its own group's measurement, ranks {0, 1} could keep the tiled schedule while
        {2, 3} declined it -- and a group spanning both (EP, TP x EP) would see different
        collectives from its members and hang. Entries are matched across ranks by first
        appearance in the graphs (the same on every rank), not by name."""
        if not _dist_ready():
            return
        todo: dict[tuple[str, str], tuple[int, list[int]]] = {}   # (group, kind) -> (group size, payloads)
        for ir in irs:
            for n in ir.collectives():
                c = n.collective
                if c.kind == "broadcast":
                    continue
                key = (c.group, c.kind)
                done = self._real_samples.get(key)
                payloads = todo.setdefault(key, (c.group_size, [] if done is not None else [1 << 16, 1 << 20]))[1]
                payload = max(c.in_bytes, c.out_bytes)
                if payload > 0 and payload not in payloads and payload not in (done or {}):
                    payloads.append(payload)
        todo = {k: v for k, v in todo.items() if v[1]}
        if not todo:
            return
        figures = []
        for (group, kind), (size, payloads) in todo.items():
            started: dict[str, list[tuple[int, float]]] = {}
            samples = measure_collectives(group, size, [kind], device, sizes=payloads, issue=started)[kind]
            # Kept under the payloads asked for: one that the group cannot split evenly (a scalar
            # on two ranks) is measured at the nearest that it can, and is not measured again.
            figures += [t for _, t in samples] + [t for _, t in started[kind]]
        groups = sorted({n.collective.group for ir in irs for n in ir.collectives()})
        measure_host = self._host_share() is None
        if measure_host:
            # Once per backend, on the first group measured (the same on every rank), agreed below.
            figures.append(measure_host_interference(next(iter(todo))[0], device))
        agreed = agree_max(figures, groups)
        if measure_host:
            self._host["share"] = agreed[-1]
            logger.info("helix: a real collective takes %.1f %% of the compute it overlaps on this host",
                        100 * agreed[-1])
        i = 0
        for (group, kind), (size, payloads) in todo.items():
            times, starts = agreed[i:i + len(payloads)], agreed[i + len(payloads):i + 2 * len(payloads)]
            i += 2 * len(payloads)
            real = self._real_samples.setdefault((group, kind), {})
            real.update(zip(payloads, times))
            issued = self._issue_samples.setdefault((group, kind), {})
            issued.update(zip(payloads, starts))
            fit = fit_link(f"measured:{group}:{kind}", kind, size, sorted(real.items()))
            self._links[(group, kind)] = MeasuredLink(f"measured:{group}:{kind}", tuple(sorted(real.items())), fit)
            self._issue[(group, kind)] = fit_link(f"issue:{group}:{kind}", kind, size, sorted(issued.items()))
            logger.info("helix: measured %s on group %s: %s; starting one costs the compute thread %.1f us + %.1f MB/s",
                        kind, group, ", ".join(f"{b / 1024:.0f} KiB {t * 1e3:.3f} ms" for b, t in sorted(real.items())),
                        self._issue[(group, kind)].latency_s * 1e6, 1e-6 * self._issue[(group, kind)].bandwidth_Bps)

    def adopt_links(self, other: "HelixBackend") -> None:
        """Price real collectives with the fits ``other`` measured (shared dict: later measurements of
        either are seen by both). For comparing variants under one measurement of a noisy host."""
        self._links = other._links
        self._issue = other._issue
        self._real_samples = other._real_samples
        self._issue_samples = other._issue_samples
        if self._host["share"] is None:     # an explicit share of its own stays
            self._host = other._host

    def simulate_compiled(self, index: int = 0, measured_compute_s: float | None = None) -> SimResult:
        """Simulate graph ``index`` exactly as compiled. With ``measured_compute_s`` (the compute
        time of one forward + backward measured now: the computation alone timed, or the compute
        thread's busy time in measured steps), the compute scale is re-calibrated to it --
        isolating the simulator's schedule model from drift of the host's load since compile."""
        s = self.summaries[index]
        graphs = [s.graphs[k] for k in ("fw", "bw") if k in s.graphs]
        gs = self._group_size()
        cost, _ = self._cost_for(graphs, 1.0)
        table = cost.table if isinstance(cost, MeasuredCostModel) else {}
        fallback = self._fallback() if self.cost_model_spec == "calibrated" else self._cost
        unscaled = MeasuredCostModel(table, fallback)
        irs = [GraphIR(g, gs) for g in graphs]
        scale = 1.0
        if measured_compute_s is not None:
            predicted = sum(unscaled.compute_s(n) for ir in irs for n in ir.nodes
                            if n.kind not in (Kind.COLLECTIVE, Kind.WAIT))
            scale = measured_compute_s / predicted if predicted > 0 else 1.0
        elif isinstance(cost, MeasuredCostModel):
            scale = self._scale or 1.0
        model = MeasuredCostModel(table, fallback, scale=scale)
        return simulate(step_ops(irs[0], irs[1] if len(irs) > 1 else None, model), record=True,
                        interference=interference_of(model))

    # -- compile -----------------------------------------------------------------------------------

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        self._setup()
        self._scale = None  # measured again for every Dynamo graph
        summary = GraphSummary(index=len(self.summaries), collectives=_count_collectives(gm), tiled=False)
        self.summaries.append(summary)
        if _has_symbolic_shapes(gm):
            # The IR, the costs and the tiling rules need concrete shapes: run the graph as captured.
            from torch._dynamo.backends.common import aot_autograd
            from functorch.compile import make_boxed_func

            summary.refused.append("all passes: dynamic shapes (compile with dynamic=False)")
            logger.info("%s", summary.line())
            return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward),
                                bw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)
        # A forward-only graph with sequence tiling (prefill, evaluation): tiles along the sequence
        # bound its activation memory, so they are worth taking without collectives to overlap.
        prefill = self.seq_tiling and not torch.is_grad_enabled()
        self._base, self._decision_cost = None, None
        base = self._trace(gm, example_inputs, tiled=False)
        self._base = base
        self._scale = base.scale
        summary.baseline = base.sim
        for tag, g in (("fw", base.fw), ("bw", base.bw)):
            if g is not None:
                summary.step_collectives[tag] = sum(1 for n in g.graph.nodes if collective_kind(n) is not None)
        chosen = base
        if self.mode == "baseline":
            summary.decisions.append("baseline requested (no passes)")
        elif self.mode == "inductor_overlap":
            summary.decisions.append("Inductor overlap scheduling on the untiled graphs" +
                                     (f" (failed: {base.error})" if base.error else ""))
        elif self.tiles < 2:
            summary.refused.append("tiling: tiles=1")
        elif summary.collectives == 0 and not prefill:
            summary.refused.append("tiling: no collectives to overlap")
        else:
            chosen = self._tile_and_decide(gm, example_inputs, summary, base, prefill)
        if chosen.compiled is None:
            raise RuntimeError(f"helix: compiling graph {summary.index} failed: {chosen.error}")
        chosen.emulate = self.emulating
        for tag, g in (("fw", chosen.fw), ("bw", chosen.bw)):
            if g is not None:
                summary.graphs[tag] = g
                summary.order[tag] = [f"{collective_kind(n)}:{n.args[-1]}" for n in g.graph.nodes
                                      if collective_kind(n) is not None]
        logger.info("%s", summary.line())
        return chosen.compiled

    def _tile_and_decide(self, gm: fx.GraphModule, example_inputs: Sequence[Any], summary: GraphSummary,
                         base: _Variant, prefill: bool) -> _Variant:
        """Tile ``gm``, schedule and simulate it, and return the variant to run: the tiled one when
        :meth:`_accept` takes it, else ``base``. A forward-only graph over the memory budget is
        tiled finer (twice the tiles each time) until its predicted peak fits."""
        tiles, budget = self.tiles, self.memory_budget_bytes
        tgm, trep = tile_graph(gm, tiles, self.input_dims, self.seq_tiling, self.batch_size)
        helix = self._trace(tgm, example_inputs, tiled=True) if trep.applied else None
        while (prefill and budget is not None and helix is not None and helix.sim.peak_bytes > budget
               and tiles * 2 <= MAX_PREFILL_TILES):
            finer_gm, finer_rep = tile_graph(gm, tiles * 2, self.input_dims, self.seq_tiling, self.batch_size)
            if not finer_rep.applied:
                summary.refused.append(f"{tiles * 2} tiles: {finer_rep.reason}")
                break
            finer = self._trace(finer_gm, example_inputs, tiled=True)
            if finer.sim.peak_bytes >= helix.sim.peak_bytes:
                summary.refused.append(f"{tiles * 2} tiles: predicted peak {_mib(finer.sim.peak_bytes)}, no lower")
                break
            summary.refused.append(f"{tiles} tiles: predicted peak {_mib(helix.sim.peak_bytes)} over the budget "
                                   f"{_mib(budget)}")
            tiles, trep, helix = tiles * 2, finer_rep, finer
        summary.tiling = trep
        missing = trep.missing_rules()
        if missing:
            summary.refused.append("no tiling rule for " + ", ".join(
                f"{op} ({n} call{'s' if n > 1 else ''})" for op, n in sorted(missing.items())))
        summary.refused += [f"tile join before {node} ({op}): {why}" for node, op, why in trep.joins]
        if not trep.applied:
            summary.refused.append(f"tiling: {trep.reason}")
            return base
        if self._decision_cost is not None:  # re-price the baseline with the same table
            gs = self._group_size()
            base.sim = simulate(step_ops(GraphIR(base.fw, gs), GraphIR(base.bw, gs) if base.bw is not None
                                         else None, self._decision_cost), record=True,
                                interference=interference_of(self._decision_cost))
            summary.baseline = base.sim
            self._scale = helix.scale
        summary.helix, summary.reorder, summary.bucketing = helix.sim, helix.reorder, helix.bucketing
        ok, why = self._accept(base.sim, helix.sim, prefill)
        if not ok:
            summary.refused.insert(0, f"tiled schedule: {why}")
            return base
        summary.tiled, summary.predicted = True, helix.predicted
        self._scale = helix.own_scale or self._scale
        along = "the sequence" if any(d == 1 for d in trep.tiled_inputs.values()) and prefill else None
        summary.decisions.append(f"tiling into {tiles} streams{' along ' + along if along else ''} + round-robin "
                                 f"({why})")
        if helix.bucketing is not None:
            summary.decisions += [f"bucket {c}" for c in helix.bucketing.taken]
            summary.refused += [f"bucket {c}: {r}" for c, r in helix.bucketing.refused]
        return helix

    def _accept(self, base: SimResult, helix: SimResult, prefill: bool = False) -> tuple[bool, str]:
        gain = (base.makespan_s - helix.makespan_s) / base.makespan_s if base.makespan_s > 0 else 0.0
        budget = self.memory_budget_bytes
        if budget is not None and helix.peak_bytes > budget and helix.peak_bytes > base.peak_bytes:
            return False, f"predicted peak {_mib(helix.peak_bytes)} over the budget {_mib(budget)}"
        if self.mode == "helix":
            return True, f"forced; predicted gain {gain:+.1%}"
        if prefill and budget is not None and base.peak_bytes > budget and helix.peak_bytes < base.peak_bytes:
            return True, (f"untiled predicted peak {_mib(base.peak_bytes)} over the budget {_mib(budget)}, tiled "
                          f"{_mib(helix.peak_bytes)}; predicted gain {gain:+.1%}")
        if gain < self.min_gain:
            return False, f"predicted gain {gain:+.1%} below {self.min_gain:.0%}"
        return True, f"predicted gain {gain:+.1%}"

    def _trace(self, gm: fx.GraphModule, example_inputs: Sequence[Any], tiled: bool) -> _Variant:
        from functorch.compile import default_partition
        from torch._dynamo.backends.common import aot_autograd

        v = _Variant(tiled=tiled, scale=self._scale)

        def partition(joint, joint_inputs, **kwargs):
            fw, bw = default_partition(joint, joint_inputs, **kwargs)
            v.fw, v.bw = fw, bw
            self._optimize(v)
            return v.fw, v.bw

        def fw_compiler(g: fx.GraphModule, _inputs):
            if v.fw is None:  # inference: no partition, no backward
                v.fw = g
                self._optimize(v)
                g = v.fw
            return self._runner(v, g)

        def bw_compiler(g: fx.GraphModule, _inputs):
            return self._runner(v, g)

        v.compiled = aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                                  partition_fn=partition)(gm, example_inputs)
        return v

    def _runner(self, v: _Variant, g: fx.GraphModule) -> Callable:
        # Boxed code: the graph drops its arguments as it goes, so saved activations die at
        # their last use in the backward (what the simulator assumes).
        g.graph.set_codegen(torch.fx.graph._BoxedCodeGen())
        g.recompile()
        state = {"emulated": False}

        def run(args: list) -> Any:
            if v.emulate and not state["emulated"]:
                from megatron_ext.helix.interconnect import install_emulation

                install_emulation(g, self.link, self._group_size())
                state["emulated"] = True
            return g(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def _optimize(self, v: _Variant) -> None:
        gs = self._group_size()
        graphs = [g for g in (v.fw, v.bw) if g is not None]
        own: CostModel | None = None   # a tiled variant's costs at its own scale (calibrated only)
        if v.tiled:
            for tag, g in (("fw", v.fw), ("bw", v.bw)):
                if g is not None:
                    _, v.reorder[tag] = reorder_graph(g)
        elif self.mode == "inductor_overlap":
            for g in graphs:
                try:
                    _inductor_overlap(g, self._cost, gs)
                except Exception as exc:  # the competitor may not run on this device
                    v.error = f"{type(exc).__name__}: {exc}"
                    logger.warning("helix: Inductor overlap scheduling failed: %s", v.error)
        if v.tiled and self._base is not None:
            # Measure the untiled and tiled operators in one session, so the comparison that
            # decides between them is not skewed by the host's load changing in between. The
            # decision prices both with the untiled graphs' compute scale (one scale: whole-graph
            # timings of MoE graphs on made-up routing scatter); the prediction of the tiled step
            # uses a scale fitted to the tiled graphs timed whole right after (their extra views,
            # copies and collectives cost more than their operators timed one by one say).
            base = [g for g in (self._base.fw, self._base.bw) if g is not None]
            cost, v.scale = self._cost_for(base + graphs, None, scale_graphs=base)
            self._decision_cost = cost
            if self.cost_model_spec == "calibrated":
                own, v.own_scale = self._cost_for(base + graphs, None, scale_graphs=graphs)
        else:
            cost, v.scale = self._cost_for(graphs, v.scale)
        fw_ir = GraphIR(v.fw, gs)
        bw_ir = GraphIR(v.bw, gs) if v.bw is not None else None
        ops = step_ops(fw_ir, bw_ir, cost)
        if v.tiled and self.bucketing:
            offsets = {"fw": 1, "bw": len(fw_ir) + 2}
            tagged = {"fw": v.fw} | ({"bw": v.bw} if v.bw is not None else {})
            v.bucketing = bucket_graphs(tagged, ops, offsets, cost, self.memory_budget_bytes, gs)
            if v.bucketing.taken:  # the merged collectives' copies are new operators to price
                cost, _ = self._cost_for(graphs, v.scale)
                if own is not None:
                    own, _ = self._cost_for(graphs, v.own_scale)
                fw_ir = GraphIR(v.fw, gs)
                bw_ir = GraphIR(v.bw, gs) if v.bw is not None else None
                ops = step_ops(fw_ir, bw_ir, cost)
        v.sim = simulate(ops, record=True, interference=interference_of(cost))
        if own is not None:
            v.predicted = simulate(step_ops(fw_ir, bw_ir, own), record=True, interference=interference_of(own))


def _inductor_overlap(g: fx.GraphModule, cost: CostModel, group_size: Callable[[str], int] | None) -> None:
    """Inductor's own overlap scheduler (fx_passes/overlap_scheduling.py) on an untiled AOT graph,
    fed with Helix's cost model so that it sees the same link -- the comparison point.

    Its roofline estimator needs triton (GPU builds only); on CPU it is replaced, for the duration
    of the call, by the same cost model.
    """
    from unittest import mock

    from torch._inductor.fx_passes import overlap_scheduling

    ir = GraphIR(g, group_size)
    by_node = {n.node: n for n in ir.nodes}

    def estimate(node: fx.Node, override_size: int | None = None) -> float | None:
        n = by_node.get(node)
        if n is None:
            return None
        if n.collective is not None:
            return cost.collective_s(n.collective) * 1e3
        return cost.compute_s(n) * 1e3

    with mock.patch.object(overlap_scheduling, "estimate_roofline_runtime_ms", lambda n: estimate(n) or 0.0):
        overlap_scheduling.schedule_overlap_bucketing(
            g, custom_runtime_estimation=estimate, collective_bucketing=True, compute_estimator="analytical")
    g.graph.lint()
    g.recompile()


def backend(tiles: int = 2, memory_budget_bytes: int | None = None,
            interconnect: str | Interconnect | InterconnectPreset | None = None) -> HelixBackend:
    """A torch.compile backend that runs Helix with K=``tiles`` tile streams.

    ``memory_budget_bytes``: refuse schedules whose predicted step peak exceeds it.
    ``interconnect``: ``"intra_node"``/``"cross_node"`` presets or an :class:`Interconnect`; the
    simulator prices collectives with it and, on CPU, collectives run over it (emulated). Costs are
    calibrated by micro-benchmarks on this device (cached); :class:`HelixBackend` has more knobs.
    """
    return HelixBackend(tiles=tiles, memory_budget_bytes=memory_budget_bytes, interconnect=interconnect,
                        cost_model="calibrated")


def backend_from_config(cfg: Any, batch_size: int | None = None, *, mode: str | None = None,
                        tiles: int | None = None, bucketing: bool | None = None,
                        device: DeviceSpec | None = None) -> HelixBackend:
    """Build the backend from a :class:`megatron_ext.helix.config.HelixConfig`; ``batch_size``
    (the micro-batch size) lets graphs after a graph break find their batch dim. ``mode``, ``tiles``
    and ``bucketing`` override the config's (a measured-selection candidate; ``mode`` "inductor":
    Inductor's own overlap scheduler); ``device``: a device already calibrated and agreed (another
    backend's ``device_spec``), not calibrated again."""
    link = None if cfg.helix_interconnect == "none" else cfg.helix_interconnect
    mode = {"auto": "auto", "tiled": "helix", "baseline": "baseline", "inductor": "inductor_overlap"}[
        mode or getattr(cfg, "helix_mode", "auto")]
    tiles = cfg.helix_tiles if tiles is None else tiles
    bucketing = cfg.helix_bucketing if bucketing is None else bucketing
    return HelixBackend(tiles=tiles, memory_budget_bytes=cfg.memory_budget_bytes, interconnect=link,
                        seq_tiling=cfg.helix_seq_tiling, bucketing=bucketing, min_gain=cfg.helix_min_gain,
                        cost_model=cfg.helix_cost_model, cost_cache=cfg.helix_cost_cache, batch_size=batch_size,
                        mode=mode, host_interference=getattr(cfg, "helix_host_interference", None), device=device)

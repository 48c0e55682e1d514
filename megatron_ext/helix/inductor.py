"""Run the Helix passes inside Inductor (the GPU path).

``register_inductor_passes(tiles=2, ...)`` installs two Inductor custom passes:

* a *pre-grad* pass (``config.pre_grad_custom_pass``) that tiles Dynamo's graph into K streams
  -- before autograd, so Inductor's joint graph and its backward are tiled too;
* a *post-grad* pass (``config.post_grad_custom_post_pass``) that runs segmented round-robin
  reordering and simulator-chosen bucketing on each post-grad forward/backward graph, just
  before Inductor lowers and schedules it.

Inductor then compiles the reordered graphs with its own kernels (Triton on GPUs). Unlike the
Helix backend, this path cannot compare the tiled and untiled *training step* before choosing
(Inductor compiles forward and backward separately), so tiling is applied wherever it applies;
bucketing is chosen per graph. Use ``torch.compile(model, backend="inductor")`` after registering,
and ``handle.restore()`` to put Inductor's previous passes back.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.fx as fx

from megatron_ext.helix.cost import DEFAULT_CPU, AnalyticalCostModel, DeviceSpec, Interconnect, resolve_interconnect
from megatron_ext.helix.ir import GraphIR
from megatron_ext.helix.passes.bucketing import bucket_graphs
from megatron_ext.helix.passes.reorder import reorder_graph
from megatron_ext.helix.passes.tiling import tile_graph
from megatron_ext.helix.simulator import graph_ops

logger = logging.getLogger(__name__)

try:
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover - very old torch
    CustomGraphPass = object  # type: ignore[misc, assignment]


@dataclasses.dataclass
class PassCounters:
    pre_grad_calls: int = 0
    graphs_tiled: int = 0
    post_grad_calls: int = 0
    graphs_reordered: int = 0
    buckets: int = 0


def _group_size():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from megatron_ext.helix.compiler import group_size_of

        return group_size_of
    return None


def replace_graph_in_place(graph: fx.Graph, new: fx.Graph) -> None:
    """Make ``graph`` compute what ``new`` computes, in place (Inductor passes must edit the graph
    object they get). Placeholders are kept: Dynamo attached its input sources to them."""
    old_phs = [n for n in graph.nodes if n.op == "placeholder"]
    new_phs = [n for n in new.nodes if n.op == "placeholder"]
    if [n.name for n in old_phs] != [n.name for n in new_phs]:
        raise ValueError("helix: tiled graph has different inputs than the original")
    for n in reversed(list(graph.nodes)):
        if n.op != "placeholder":
            graph.erase_node(n)
    val_map: dict[fx.Node, fx.Node] = dict(zip(new_phs, old_phs))
    with graph.inserting_after(old_phs[-1] if old_phs else None):
        pass
    for n in new.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            graph.output(fx.node.map_arg(n.args[0], val_map.__getitem__))
            continue
        val_map[n] = graph.node_copy(n, val_map.__getitem__)


class HelixPreGradPass(CustomGraphPass):
    """Tile Dynamo's graph (Inductor pre-grad)."""

    def __init__(self, tiles: int, counters: PassCounters, batch_size: int | None = None) -> None:
        self.tiles, self.counters, self.batch_size = tiles, counters, batch_size

    def __call__(self, graph: fx.Graph) -> None:
        self.counters.pre_grad_calls += 1
        gm = graph.owning_module
        if gm is None:
            logger.warning("helix pre-grad pass: graph has no owning module; not tiled")
            return
        if not any("grapharg" in n.meta for n in graph.nodes if n.op == "placeholder"):
            return  # a subgraph (e.g. an autograd.Function body): tiled as part of its caller
        tiled, report = tile_graph(gm, self.tiles, batch_size=self.batch_size)
        if not report.applied:
            logger.info("helix pre-grad pass: not tiled (%s)", report.reason or "no tileable calls")
            return
        replace_graph_in_place(graph, tiled.graph)
        self.counters.graphs_tiled += 1
        logger.info("helix pre-grad pass: %d calls tiled into %d streams, %d joins", report.tiled_calls,
                    self.tiles, len(report.joins))

    def uuid(self) -> Any:
        return f"helix-pre-grad-tiles{self.tiles}-b{self.batch_size}"


class HelixPostGradPass(CustomGraphPass):
    """Segmented round-robin reordering + bucketing of one post-grad graph."""

    def __init__(self, counters: PassCounters, link: Interconnect | None, device: DeviceSpec,
                 memory_budget_bytes: int | None, bucketing: bool = True) -> None:
        self.counters, self.link, self.device = counters, link, device
        self.memory_budget_bytes, self.bucketing = memory_budget_bytes, bucketing

    def __call__(self, graph: fx.Graph) -> None:
        self.counters.post_grad_calls += 1
        gm = graph.owning_module
        if gm is None:
            return
        _, report = reorder_graph(gm)
        if report.streams >= 2:
            self.counters.graphs_reordered += 1
        if self.bucketing and report.streams >= 2:
            gs = _group_size()
            cost = AnalyticalCostModel(self.device, self.link)
            ops = graph_ops(GraphIR(gm, gs), cost)
            rep = bucket_graphs({"g": gm}, ops, {"g": 1}, cost, self.memory_budget_bytes, gs)
            self.counters.buckets += len(rep.taken)

    def uuid(self) -> Any:
        link = None if self.link is None else (self.link.latency_s, self.link.bandwidth_Bps)
        return f"helix-post-grad-{link}-{self.memory_budget_bytes}-{self.bucketing}"


@dataclasses.dataclass
class InductorRegistration:
    counters: PassCounters
    previous: dict[str, Any]

    def restore(self) -> None:
        from torch._inductor import config

        for key, value in self.previous.items():
            setattr(config, key, value)


def register_inductor_passes(tiles: int = 2, memory_budget_bytes: int | None = None,
                             interconnect: str | Interconnect | None = None, *, device: DeviceSpec | None = None,
                             batch_size: int | None = None, bucketing: bool = True) -> InductorRegistration:
    """Install the Helix passes into Inductor's config (see the module docstring)."""
    from torch._inductor import config

    device = device or DEFAULT_CPU
    link = resolve_interconnect(interconnect, device)
    counters = PassCounters()
    previous = {"pre_grad_custom_pass": config.pre_grad_custom_pass,
                "post_grad_custom_post_pass": config.post_grad_custom_post_pass}
    config.pre_grad_custom_pass = HelixPreGradPass(tiles, counters, batch_size)
    config.post_grad_custom_post_pass = HelixPostGradPass(counters, link, device, memory_budget_bytes, bucketing)
    return InductorRegistration(counters=counters, previous=previous)

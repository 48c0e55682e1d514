"""ResiHP re-layout planner: from per-device speeds to a new TP/PP/DP layout, scored by simulation.

A slow device in hybrid-parallel training costs far more than its own share: a TP group runs at
its slowest member, a pipeline at its slowest stage, a data-parallel step at its slowest replica.
Given what the detector believes (a speed per device: 1 healthy, 1/factor slow, 0 dead), the
planner searches the knobs jointly, because each alone leaves capacity unused:

* **TP membership**: a permutation that packs the slow devices into as few TP groups as possible
  (one slow device slows its whole group), those groups either in one replica (then DP migration
  absorbs them) or at one stage index across replicas (then PP repartition does);
* **PP repartition**: uneven layers per stage in proportion to each stage's effective speed (the
  slowest member of its TP group), the output layer counted on the last stage; the partition is
  shared by all replicas (DP replicas all-reduce per stage), so it is fitted to an aggregate of
  the replicas' stage speeds;
* **DP work migration**: uneven micro-batches per replica, global count unchanged (the executor
  weights per sample so the gradient is the same);
* **shape change**: other (tp, pp, dp) over the usable devices (TP size only downwards and only
  where the heads divide), and for dead devices or very slow ones, fewer replicas.

Every candidate is scored by a closed form first (a 1F1B pipeline of ``m`` micro-batches with
per-micro-batch stage times ``c_s`` takes about ``sum c_s + (m - 1) max c_s``); the best few are
then scored by the pipeline simulator (``pipesim``) with FLOPs from ``flops``, plus the time to
move state (bytes each device must receive / link bandwidth, the largest per device, plus a fixed
pause) amortized over a horizon. A plan is proposed only when it gains more than a threshold and
fits in every device's memory. Pure: numpy only, no torch. The data it works on (``PlanLayout``,
``Cluster``, ``Workload``, ``PlannerConfig``, ``Plan``) lives in ``planner_types`` and is
re-exported here; ``planner_policy.PlanPolicy`` decides when to ask.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import logging
import math
from typing import Iterable, Mapping, Sequence

import numpy as np

from megatron_ext.layout import split_even
from megatron_ext.models.flops import ModelSpec, stage_cost
from megatron_ext.pipeline.pipesim import compile_plan, simulate
from megatron_ext.pipeline.schedule_orders import schedule_order
from megatron_ext.resihp.planner_types import (HEALTHY_EPS, Cluster, MemoryModel, Plan, PlanLayout, PlannerConfig,
                                               PlanningError, Workload, _short)

__all__ = ["Cluster", "MemoryModel", "Plan", "PlanLayout", "Planner", "PlannerConfig", "PlanningError", "Workload",
           "believed_healthy", "capacity_optimum_s", "default_memory_model", "layer_params", "link_seconds",
           "node_local_groups", "predict_iteration_s", "ring_factors", "ring_order",
           "spans_nodes", "stage_params", "stage_speeds", "state_move_bytes"]

logger = logging.getLogger(__name__)

MAX_PATH_SWAPS = 8
"""Single swaps around slow ring hops scored per search (``Planner._avoid_paths``)."""


# --------------------------------------------------------------------------------------------
# Cost model


def layer_params(spec: ModelSpec) -> float:
    """Parameters of one transformer layer (projections; norms and biases are noise here). MoE:
    every expert's MLP (at the experts' width), the router and the shared expert, if any."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.groups * d
    matrices = 3 if spec.gated_linear_unit else 2
    mlp = h * spec.ffn * matrices
    if spec.num_experts is not None:
        mlp = (spec.num_experts * h * spec.expert_ffn * matrices + h * spec.num_experts
               + h * spec.shared_expert_ffn_hidden_size * matrices)
    return float(h * (q + 2 * kv) + q * h + mlp)


def stage_params(spec: ModelSpec, layers: Sequence[int]) -> np.ndarray:
    """Parameters of each stage (layers, plus the embedding on the first and the output layer on the
    last; megatron keeps a copy of the shared embedding on the last stage)."""
    out = np.asarray(layers, dtype=float) * layer_params(spec)
    emb = float(spec.vocab_size * spec.hidden_size)
    out[0] += emb
    out[-1] += emb
    return out


def default_memory_model(spec: ModelSpec, workload: Workload, tp: int, pp: int, layers: Sequence[int],
                         dp: int = 1) -> np.ndarray:
    """Bytes per device of each stage: state (``state_bytes_per_param``, whole on every replica: no
    distributed optimizer, so ``dp`` does not matter) plus the activations 1F1B keeps in flight
    (stage ``s`` holds up to ``pp - s`` micro-batches), per layer ``s b h (34 + 5 a s / h)`` bytes
    without recomputation and ``2 s b h`` with full recomputation (Korthikanti et al. 2022),
    divided by ``tp`` (sequence parallel)."""
    s, b, h, a = workload.seq_length, workload.micro_batch_size, spec.hidden_size, spec.num_attention_heads
    per_layer = 2.0 * s * b * h if spec.recompute else s * b * h * (34.0 + 5.0 * a * s / h)
    inflight = pp - np.arange(pp, dtype=float)
    state = stage_params(spec, layers) * workload.state_bytes_per_param
    act = np.asarray(layers, dtype=float) * per_layer * inflight
    return (state + act) / tp


@dataclasses.dataclass(frozen=True)
class _Costs:
    """Per-micro-batch seconds of one layer and of the output layer on a healthy device (tp=1)."""

    layer_fwd: float
    layer_bwd: float
    head_fwd: float
    head_bwd: float
    tp_allreduce_s: float   # a micro-batch's activation bytes / TP link bandwidth (before the ring factor)
    nic_allreduce_s: float  # the same bytes over the NIC: a TP group that spans nodes
    message_bytes: float = 0.0     # those bytes: a pipeline message at TP 1

    def nic_extra_s(self, nics: "Nics | None", tp: int) -> dict[int, float]:
        """Seconds a slow NIC adds to each pipeline message its device sends at TP ``tp`` (a
        sequence-parallel shard of the activations), over what the healthy link takes."""
        if not nics:
            return {}
        msg = self.message_bytes / tp
        return {int(d): max(0.0, msg / bw - self.nic_allreduce_s / tp) for d, bw in nics.items()}

    def path_extra_s(self, paths: "Paths | None", tp: int) -> dict[tuple[int, int], float]:
        """Seconds a slow path adds to each pipeline message between its two devices at TP ``tp``."""
        if not paths:
            return {}
        msg = self.message_bytes / tp
        return {_pair(*k): max(0.0, msg / bw - self.nic_allreduce_s / tp) for k, bw in paths.items()}

    def layer(self, tp: int, across_nodes: bool = False) -> tuple[float, float]:
        """Seconds per layer and micro-batch on one device of a TP group of ``tp``: the FLOPs
        divided by ``tp``, plus megatron's two activation all-reduces per layer forward and two
        backward (ring: ``2 (tp - 1) / tp`` of the bytes), over the NIC when the group spans nodes."""
        comm = 2.0 * 2.0 * (tp - 1) / tp * (self.nic_allreduce_s if across_nodes else self.tp_allreduce_s)
        return self.layer_fwd / tp + comm, self.layer_bwd / tp + comm


def _costs(spec: ModelSpec, workload: Workload, cluster: Cluster) -> _Costs:
    one = stage_cost(spec, 1)
    head = stage_cost(spec, 0, last_stage=True)
    t, sq, f = workload.tokens, workload.sum_sq, cluster.device_flops
    act_bytes = workload.activation_bytes_per_value * workload.tokens * spec.hidden_size   # the micro-batch's
    return _Costs(one.forward(t, sq).total / f, one.backward(t, sq).total / f,
                  head.forward(t, sq).total / f, head.backward(t, sq).total / f,
                  act_bytes / cluster.tp_bytes_per_s, act_bytes / cluster.link_bytes_per_s, act_bytes)


def spans_nodes(layout: PlanLayout, devices_per_node: int | None) -> np.ndarray:
    """(pp, dp) bool: which TP groups of ``layout`` have devices on more than one node (all False
    without nodes, or at TP 1)."""
    grid = layout.grid()
    if devices_per_node is None or layout.tp == 1:
        return np.zeros(grid.shape[:2], dtype=bool)
    node = grid // devices_per_node
    return (node != node[:, :, :1]).any(axis=2)


Links = Mapping[tuple[int, int], float]
"""Slow pipeline links: (device, device) with the smaller first -> extra seconds per message."""


Nics = Mapping[int, float]
"""Slow NICs: device -> the bandwidth of its network interface in bytes/s. The data-parallel
gradient all-reduce of every ring the device is in crosses it."""


Paths = Mapping[tuple[int, int], float]
"""Slow network paths: (device, device) with the smaller first -> the path's bandwidth in bytes/s.
It carries the data-parallel ring's traffic where the two devices are neighbours on a ring (the
ring's order is the replicas' order), and the pipeline messages between them."""


def ring_factors(layout: PlanLayout, nics: Nics | None, link_bytes_per_s: float,
                 paths: Paths | None = None) -> np.ndarray:
    """(pp,) how many times longer each stage's gradient all-reduce takes than with healthy links:
    a stage has one ring per TP rank (over the replicas, in replica order, closed), every ring
    carries the same bytes, and a ring finishes at its slowest hop: the slower NIC of its two ends,
    or a slow path between them. 1 everywhere without replicas or slow NICs and paths."""
    out = np.ones(layout.pp)
    if (not nics and not paths) or layout.dp == 1:
        return out
    grid = layout.grid()
    for d, bw in (nics or {}).items():
        if not bw > 0:
            raise PlanningError(f"NIC of device {d}: bandwidth must be > 0 bytes/s, got {bw!r}")
        for s in np.unique(np.argwhere(grid == int(d))[:, 0]):
            out[s] = max(out[s], link_bytes_per_s / min(float(bw), link_bytes_per_s))
    if paths:
        hop = _ring_hop_factors(grid, {_pair(*k): bw for k, bw in paths.items()}, link_bytes_per_s)      # (pp, dp): hop d -> d + 1
        out = np.maximum(out, hop.max(axis=1))
    return out


def _hop_factor(grid: np.ndarray, s: int, i: int, j: int, paths: Paths, link_bytes_per_s: float) -> float:
    """How many times slower stage ``s``'s rings run a hop between replicas ``i`` and ``j``: the
    slowest TP rank's path between the two (1 where no path of theirs is slow)."""
    f = 1.0
    for t in range(grid.shape[2]):
        key = _pair(grid[s, i, t], grid[s, j, t])
        bw = paths.get(key)
        if bw is not None:
            if not bw > 0:
                raise PlanningError(f"path {key}: bandwidth must be > 0 bytes/s, got {bw!r}")
            f = max(f, link_bytes_per_s / min(float(bw), link_bytes_per_s))
    return f


def _ring_hop_factors(grid: np.ndarray, paths: Paths, link_bytes_per_s: float) -> np.ndarray:
    """(pp, dp) the slowdown of each ring hop from replica d to d + 1 (closed), the worst TP rank's."""
    pp, dp, _ = grid.shape
    out = np.ones((pp, dp))
    if dp == 1:
        return out
    for s in range(pp):
        for d in range(dp):
            out[s, d] = _hop_factor(grid, s, d, (d + 1) % dp, paths, link_bytes_per_s)
    return out


def ring_order(layout: PlanLayout, paths: Paths, link_bytes_per_s: float) -> PlanLayout:
    """``layout`` with its replicas reordered so that the data-parallel rings' slowest hop is as
    fast as the slow ``paths`` allow (then the fewest slow hops; the old order among equals).
    Replicas hold the same state, so a new order moves nothing: every ring is rebuilt over the same
    devices. Exhaustive up to 8 replicas; beyond, a greedy walk that keeps the old successor where
    its hop is healthy, then segment reversals (2-opt) while they lower the cost."""
    dp = layout.dp
    if dp < 3 or not paths:
        return layout                                  # a ring of 2 has one hop, whatever the order
    paths = {_pair(*k): bw for k, bw in paths.items()}
    grid = layout.grid()
    pp = grid.shape[0]
    bad = np.ones((dp, dp))
    for i in range(dp):
        for j in range(i + 1, dp):
            bad[i, j] = bad[j, i] = max(_hop_factor(grid, s, i, j, paths, link_bytes_per_s) for s in range(pp))

    def cost(order: Sequence[int]) -> tuple[float, int]:
        hops = [bad[order[k], order[(k + 1) % dp]] for k in range(dp)]
        return (max(hops), sum(h > 1.0 for h in hops))

    best = list(range(dp))
    best_c = cost(best)
    if best_c[1] == 0:
        return layout
    if dp <= 8:
        import itertools
        for rest in itertools.permutations(range(1, dp)):
            order = [0, *rest]
            c = cost(order)
            if c < best_c:
                best, best_c = order, c
    else:
        left, order = list(range(1, dp)), [0]
        while left:
            nxt = next((j for j in left if bad[order[-1], j] <= 1.0), left[0])
            order.append(nxt)
            left.remove(nxt)
        c = cost(order)
        improved = True
        while improved:
            improved = False
            for i in range(1, dp - 1):
                for j in range(i + 1, dp):
                    cand = order[:i] + order[i:j + 1][::-1] + order[j + 1:]
                    cc = cost(cand)
                    if cc < c:
                        order, c, improved = cand, cc, True
        if c < best_c:
            best, best_c = order, c
    if best == list(range(dp)):
        return layout
    new = grid[:, best, :]
    return dataclasses.replace(layout, devices=tuple(int(x) for x in new.reshape(-1)),
                               microbatches=tuple(layout.microbatches[d] for d in best))


def _pair(a: int, b: int) -> tuple[int, int]:
    return (int(a), int(b)) if a < b else (int(b), int(a))


def _hops(layout: PlanLayout) -> list[tuple[int, int, int]]:
    """(upstream stage, downstream stage, messages per micro-batch each way) of every pipeline hop:
    each chunk boundary a micro-batch crosses forward (and its gradient backward)."""
    pp, vp = layout.pp, layout.vp
    out = [(s, s + 1, vp) for s in range(pp - 1)]
    if pp > 1 and vp > 1:
        out.append((pp - 1, 0, vp - 1))
    return out


def link_seconds(layout: PlanLayout, links: Links | None, nic_extra: Mapping[int, float] | None = None,
                 path_extra: Mapping[tuple[int, int], float] | None = None) -> np.ndarray:
    """(pp, dp) seconds per micro-batch that slow links add to each TP group: a sender is held for
    its link (the activation downstream, the gradient upstream), and a hop is as slow as its
    slowest TP rank's link. ``nic_extra``: what a slow NIC adds to each message of its device
    (``_Costs.nic_extra_s``); a hop takes the larger of that and its link's own figure (a link
    verdict measured across a slow NIC is the NIC). ``path_extra``: what a slow path adds to each
    message between its two devices (``_Costs.path_extra_s``), taken the same way."""
    grid = layout.grid()
    out = np.zeros(grid.shape[:2])
    if not links and not nic_extra and not path_extra:
        return out
    links = {_pair(*k): float(v) for k, v in (links or {}).items()}
    ne = nic_extra or {}
    pe = path_extra or {}
    for s, t, n in _hops(layout):
        for d in range(layout.dp):
            worst = max(max(links.get(_pair(a, b), 0.0), pe.get(_pair(a, b), 0.0), ne.get(int(a), 0.0),
                            ne.get(int(b), 0.0))
                        for a, b in zip(grid[s, d], grid[t, d]))
            out[s, d] += worst * n
            out[t, d] += worst * n
    return out


def stage_speeds(layout: PlanLayout, speeds: np.ndarray, costs: _Costs, devices_per_node: int | None,
                 links: Links | None = None, nics: "Nics | None" = None, paths: "Paths | None" = None) -> np.ndarray:
    """(pp, dp) effective speed of each TP group: its slowest member, divided by how much longer a
    layer takes when the group's all-reduces cross the NIC (a whole-group slowdown, as a slow
    member is), and by what slow links, NICs and paths add to its micro-batches (``link_seconds``,
    against the group's healthy seconds per micro-batch)."""
    out = speeds[layout.grid()].min(axis=2)
    across = spans_nodes(layout, devices_per_node)
    if across.any():
        inside, over = sum(costs.layer(layout.tp)), sum(costs.layer(layout.tp, across_nodes=True))
        out = np.where(across, out * inside / over, out)
    extra = link_seconds(layout, links, costs.nic_extra_s(nics, layout.tp), costs.path_extra_s(paths, layout.tp))
    if extra.any():
        fwd, bwd = _chunk_seconds(costs, layout.layers, layout.tp)
        c = (fwd + bwd).sum(axis=1)[:, None]                       # (pp, 1) healthy seconds per micro-batch
        with np.errstate(divide="ignore"):
            out = np.where(out > 0, c / (c / np.maximum(out, 1e-300) + extra), out)
    return out


def node_local_groups(layout: PlanLayout, devices_per_node: int, speed: np.ndarray) -> PlanLayout:
    """``layout`` with its TP groups inside nodes where the devices allow: the groups that span
    nodes are rebuilt from their own devices and the usable idle ones (spares, devices a plan left
    out), whole node-local groups first (fastest first; among equals, those of the spanning groups'
    own devices, which move nothing), and handed to those groups' slots in order. Groups already
    inside a node keep their devices, so a placement of slow devices survives."""
    g, tp = devices_per_node, layout.tp
    devs = np.asarray(layout.devices).reshape(-1, tp)
    spanning = [i for i, grp in enumerate(devs) if len({int(d) // g for d in grp}) > 1]
    if not spanning:
        return layout
    own = [int(d) for i in spanning for d in devs[i]]
    idle = sorted(set(np.flatnonzero(speed > 0).tolist()) - {int(d) for d in layout.devices})
    by_node: dict[int, list[int]] = {}
    for d in sorted(set(own) | set(idle), key=lambda d: (-speed[d], d not in own, d)):
        by_node.setdefault(d // g, []).append(d)
    whole = [ds[i:i + tp] for ds in by_node.values() for i in range(0, len(ds) - len(ds) % tp, tp)]
    whole.sort(key=lambda grp: (-min(speed[d] for d in grp), -sum(d in own for d in grp), grp[0]))
    groups = whole[:len(spanning)]
    if len(groups) < len(spanning):
        taken = {d for grp in groups for d in grp}
        rest = [d for d in own if d not in taken]
        groups += [rest[i:i + tp] for i in range(0, tp * (len(spanning) - len(groups)), tp)]
    for i, grp in zip(spanning, groups):
        devs[i] = sorted(grp)
    return dataclasses.replace(layout, devices=tuple(int(d) for d in devs.reshape(-1)))


def _chunk_seconds(costs: _Costs, layers: Sequence[Sequence[int]], tp: int) -> tuple[np.ndarray, np.ndarray]:
    """Healthy (pp, vp) forward and backward seconds per micro-batch and chunk."""
    lay = np.asarray(layers, dtype=float)
    lf, lb = costs.layer(tp)
    fwd = lay * lf
    bwd = lay * lb
    fwd[-1, -1] += costs.head_fwd / tp
    bwd[-1, -1] += costs.head_bwd / tp
    return fwd, bwd


def _tail_seconds(spec: ModelSpec, workload: Workload, cluster: Cluster, tp: int, dp: int,
                  stage_layers: Sequence[int], ring: np.ndarray | None = None) -> np.ndarray:
    """Per-stage gradient all-reduce after the last op (ring: 2 (dp - 1) / dp of the bytes), not
    overlapped with the backward: the conservative case. It grows with a stage's layers, so an
    uneven partition pays for its heaviest stage here too. ``ring``: each stage's slowdown from
    slow NICs (``ring_factors``)."""
    if dp == 1:
        return np.zeros(len(stage_layers))
    grad = stage_params(spec, stage_layers) / tp * workload.grad_bytes_per_param
    out = grad * 2.0 * (dp - 1) / dp / cluster.link_bytes_per_s
    return out if ring is None else out * ring


@functools.lru_cache(maxsize=256)
def _sim_plan(schedule: str, pp: int, m: int, vp: int):
    return compile_plan(schedule_order(schedule, pp, m, vp))


def _closed_form(fwd: np.ndarray, bwd: np.ndarray, speed: np.ndarray, vp: int, lat: float) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) per replica with ``T(m) = A + (m - 1) B``: ``speed`` (pp, dp) stage speeds;
    B is the bottleneck stage's time per micro-batch, A one pass through all stages (the fill and
    drain; interleaving divides it by ``vp``)."""
    c = (fwd + bwd).sum(axis=1)[:, None] / np.maximum(speed, 1e-300)  # (pp, dp)
    b = c.max(axis=0)
    a = c.sum(axis=0) / vp + b * (vp - 1) / vp + 2.0 * (c.shape[0] - 1) * lat
    return a, b


def _simulate_layout(layout: PlanLayout, stage_speed: np.ndarray, fwd: np.ndarray, bwd: np.ndarray,
                     tail: np.ndarray, lat: float) -> float:
    """Iteration seconds: every replica's pipeline simulated (replicas with equal stage speeds and
    micro-batch counts once), the slowest one decides."""
    groups: dict[int, dict[tuple, int]] = {}
    for d in range(layout.dp):
        key = tuple(np.round(stage_speed[:, d], 12))
        groups.setdefault(layout.microbatches[d], {}).setdefault(key, d)
    worst = 0.0
    for m, reps in groups.items():
        plan = _sim_plan(layout.schedule, layout.pp, m, layout.vp)
        sp = np.array([stage_speed[:, d] for d in reps.values()])        # (B, pp)
        f = np.broadcast_to((fwd[None] / sp[:, :, None])[..., None], sp.shape + (layout.vp, m))
        b = np.broadcast_to((bwd[None] / sp[:, :, None])[..., None], sp.shape + (layout.vp, m))
        res = simulate(plan, f, b, p2p_latency_s=lat, tail_s=np.broadcast_to(tail, sp.shape))
        worst = max(worst, float(res.makespan_s.max()))
    return worst


def predict_iteration_s(layout: PlanLayout, spec: ModelSpec, speeds: Sequence[float], cluster: Cluster,
                        workload: Workload, links: Links | None = None, nics: Nics | None = None,
                        paths: Paths | None = None) -> float:
    """Predicted iteration seconds of ``layout`` at ``speeds`` (pipeline simulator + FLOPs model),
    with slow pipeline ``links``, slow ``nics`` and slow ``paths``; infinite when a device of the
    layout is dead."""
    sp = _check_speeds(speeds, layout)
    if layout.num_layers != spec.num_layers:
        raise PlanningError(f"layout.layers hold {layout.num_layers} layers, the model has {spec.num_layers}")
    costs = _costs(spec, workload, cluster)
    stage_speed = stage_speeds(layout, sp, costs, cluster.devices_per_node, links, nics, paths)
    if (stage_speed <= 0).any():
        return math.inf
    fwd, bwd = _chunk_seconds(costs, layout.layers, layout.tp)
    tail = _tail_seconds(spec, workload, cluster, layout.tp, layout.dp, layout.stage_layers,
                         ring_factors(layout, nics, cluster.link_bytes_per_s, paths))
    return _simulate_layout(layout, stage_speed, fwd, bwd, tail, cluster.p2p_latency_s)


def capacity_optimum_s(healthy_iteration_s: float, speeds: Sequence[float], num_devices: int) -> float:
    """The capacity-proportional optimum: the healthy iteration time scaled by how much of the
    job's device capacity is left, ``num_devices / sum(speeds)`` (every device's compute used at
    its own speed, nothing lost to grouping)."""
    total = float(np.sum(np.asarray(speeds, dtype=float)[:num_devices]))
    return math.inf if total <= 0 else healthy_iteration_s * num_devices / total


def state_move_bytes(old: PlanLayout, new: PlanLayout, spec: ModelSpec, workload: Workload,
                     num_devices: int, old_holdings: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Bytes each device must receive to go from ``old`` to ``new``: its new share of layers (and
    embedding / output layer) minus what it already holds; a device that changes only its DP
    replica keeps its state (replicas are identical). Indexed by rank."""
    need = np.zeros(num_devices)
    lp = layer_params(spec) * workload.state_bytes_per_param
    emb = spec.vocab_size * spec.hidden_size * workload.state_bytes_per_param
    old_hold, old_tp = old_holdings or _holdings(old, num_devices)
    new_hold, new_tp = _holdings(new, num_devices)
    # TP shard overlap: old shard [t/T, (t+1)/T) against the new one.
    lo = np.maximum(old_tp[:, 0], new_tp[:, 0])
    hi = np.minimum(old_tp[:, 1], new_tp[:, 1])
    share = np.maximum(hi - lo, 0.0)
    new_share = new_tp[:, 1] - new_tp[:, 0]
    n_layers = spec.num_layers
    lay_new, lay_old = new_hold[:, :n_layers], old_hold[:, :n_layers]
    ext_new, ext_old = new_hold[:, n_layers:], old_hold[:, n_layers:]
    need += lay_new.sum(axis=1) * lp * new_share - (lay_new & lay_old).sum(axis=1) * lp * share
    need += ext_new.sum(axis=1) * emb * new_share - (ext_new & ext_old).sum(axis=1) * emb * share
    return np.maximum(need, 0.0)


def _holdings(layout: PlanLayout, num_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """(devices, layers + 2) bool: which layers (and embedding, output layer) each device holds;
    (devices, 2): its TP shard as a fraction interval."""
    n, pp, vp, tp = layout.num_layers, layout.pp, layout.vp, layout.tp
    # Virtual stage v * pp + s holds a contiguous range; walk them in model order.
    stage_mask = np.zeros((pp, n + 2), dtype=bool)
    start = 0
    for v in range(vp):
        for s in range(pp):
            k = layout.layers[s][v]
            stage_mask[s, start:start + k] = True
            start += k
    stage_mask[0, n] = True
    stage_mask[pp - 1, n + 1] = True
    devs = np.asarray(layout.devices, dtype=np.int64)
    hold = np.zeros((num_devices, n + 2), dtype=bool)
    hold[devs] = stage_mask[np.repeat(np.arange(pp), layout.dp * tp)]
    t = np.tile(np.arange(tp), pp * layout.dp)
    tpi = np.zeros((num_devices, 2))
    tpi[devs, 0] = t / tp
    tpi[devs, 1] = (t + 1) / tp
    return hold, tpi


# --------------------------------------------------------------------------------------------
# Search


def _check_speeds(speeds: Sequence[float], layout: PlanLayout) -> np.ndarray:
    sp = np.asarray(speeds, dtype=float)
    if sp.ndim != 1:
        raise PlanningError(f"speeds must be a flat list, one per device, got shape {sp.shape}")
    top = max(layout.devices)
    if sp.shape[0] <= top:
        raise PlanningError(f"speeds: expected one speed per device (at least {top + 1}: the layout names "
                            f"rank {top}), got {sp.shape[0]}")
    bad = np.flatnonzero(~np.isfinite(sp) | (sp < 0))
    if bad.size:
        raise PlanningError(f"speeds[{bad[0]}] = {sp[bad[0]]}: a speed must be finite and >= 0 "
                            "(1 healthy, 1/factor slow, 0 dead)")
    return sp


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _greedy_layers(unit: np.ndarray, fixed: np.ndarray, num_layers: int, cap: np.ndarray) -> list[int] | None:
    """Layers per stage minimising the slowest stage's time ``n_s * unit_s + fixed_s`` (each >= 1,
    at most ``cap_s``). Adding one layer at a time to the stage that stays fastest is optimal for
    this min-max over increasing costs."""
    pp = unit.shape[0]
    if num_layers < pp or (cap < 1).any() or cap.sum() < num_layers:
        return None
    n = np.ones(pp, dtype=np.int64)
    heap = [((n[s] + 1) * unit[s] + fixed[s], s) for s in range(pp) if cap[s] > 1]
    heapq.heapify(heap)
    for _ in range(num_layers - pp):
        if not heap:
            return None
        _, s = heapq.heappop(heap)
        n[s] += 1
        if n[s] < cap[s]:
            heapq.heappush(heap, ((n[s] + 1) * unit[s] + fixed[s], s))
    return n.tolist()


def _allocate_microbatches(a: np.ndarray, b: np.ndarray, total: int, unit: int) -> list[int] | None:
    """Micro-batches per replica (multiples of ``unit``, each >= ``unit``, summing to ``total``)
    minimising ``max_d A_d + (m_d - 1) B_d``: bisect on the finish time, then hand back the
    surplus from the replicas that would finish last."""
    dp = a.shape[0]
    if total % unit or total < dp * unit:
        return None
    k_total = total // unit

    def counts(t: float) -> np.ndarray:
        return np.maximum(np.floor((t - a) / (b * unit) + 1.0 / unit + 1e-9), 1).astype(np.int64)

    lo, hi = 0.0, float((a + (total - 1) * b).max())
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if counts(mid).sum() >= k_total:
            hi = mid
        else:
            lo = mid
    k = counts(hi)
    while k.sum() > k_total:
        fin = np.where(k > 1, a + (k * unit - 1) * b, -np.inf)
        k[int(np.argmax(fin))] -= 1
    return (k * unit).tolist()


@dataclasses.dataclass(frozen=True)
class _SlowPaths:
    """The slow pipeline links ((device, device) -> extra seconds per message), slow NICs
    (device -> bytes/s) and slow paths ((device, device) -> bytes/s) one search plans around:
    handed to each of its steps, never kept on the planner (a planner is reused across searches
    with other faults)."""

    links: dict[tuple[int, int], float]
    nics: dict[int, float]
    paths: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)


def believed_healthy(devices: set[int], speeds: np.ndarray, links: Iterable[tuple[int, int]] = (),
                     nics: Iterable[int] = (), paths: Iterable[tuple[int, int]] = ()) -> bool:
    """No believed slowness among ``devices``: each at full speed, no slow link, NIC or path
    touching one (``links`` and ``paths`` as device pairs, ``nics`` as devices)."""
    if any(abs(speeds[d] - 1.0) > HEALTHY_EPS for d in devices):
        return False
    return not (any(d in devices for d in nics) or any(a in devices or b in devices for a, b in [*links, *paths]))


@dataclasses.dataclass
class _Candidate:
    layout: PlanLayout
    actions: tuple[str, ...]
    closed_s: float
    move_s: float = 0.0
    bytes_total: float = 0.0
    bytes_max: float = 0.0
    sim_s: float | None = None


class Planner:
    """Searches re-layouts for one model on one cluster. ``plan()`` is the entry point; the
    other methods are exposed for baselines and benchmarks."""

    def __init__(self, spec: ModelSpec, cluster: Cluster, workload: Workload,
                 config: PlannerConfig | None = None, memory_model: MemoryModel | None = None) -> None:
        self.spec, self.cluster, self.workload = spec, cluster, workload
        self.config = config or PlannerConfig()
        self.memory_model = memory_model or default_memory_model
        self.costs = _costs(spec, workload, cluster)
        self.shape_factors: dict[tuple[int, int], float] = {}
        """Measured over predicted seconds per iteration of the (tp, pp) shapes the job ran
        (``PlanPolicy.record_time``): the search scales its predictions by them."""

    def shape_factor(self, layout: PlanLayout) -> float:
        """The measured-over-predicted factor of ``layout``'s (tp, pp) shape; for a shape never
        run, the median of the known ones (the model's error in general); 1 when none is known."""
        f = self.shape_factors.get((layout.tp, layout.pp))
        if f is not None:
            return f
        return float(np.median(list(self.shape_factors.values()))) if self.shape_factors else 1.0

    # ---- scoring ----

    def iteration_s(self, layout: PlanLayout, speeds: Sequence[float], links: Links | None = None,
                    nics: Nics | None = None, paths: Paths | None = None) -> float:
        """Predicted seconds per iteration with these device speeds, slow pipeline links, slow
        NICs and slow paths (none by default)."""
        return predict_iteration_s(layout, self.spec, speeds, self.cluster, self.workload, links or {}, nics or {},
                                   paths or {})

    def fits(self, layout: PlanLayout, memory: np.ndarray) -> bool:
        need = self.memory_model(self.spec, self.workload, layout.tp, layout.pp, layout.stage_layers, layout.dp)
        return bool((need[:, None, None] <= memory[layout.grid()] * (1 + 1e-9)).all())

    def _closed_s(self, layout: PlanLayout, stage_speed: np.ndarray, slow: _SlowPaths) -> float:
        fwd, bwd = _chunk_seconds(self.costs, layout.layers, layout.tp)
        a, b = _closed_form(fwd, bwd, stage_speed, layout.vp, self.cluster.p2p_latency_s)
        tail = _tail_seconds(self.spec, self.workload, self.cluster, layout.tp, layout.dp, layout.stage_layers,
                             ring_factors(layout, slow.nics, self.cluster.link_bytes_per_s, slow.paths))
        m = np.asarray(layout.microbatches, dtype=float)
        return float((a + (m - 1) * b).max() + tail.max())

    # ---- the search ----

    def plan(self, layout: PlanLayout, speeds: Sequence[float], links: Links | None = None,
             nics: Nics | None = None, paths: Paths | None = None) -> Plan | None:
        """The best re-layout of ``layout`` for devices at ``speeds`` (indexed by rank; ranks not
        in the layout are spares), slow pipeline ``links`` ((device, device) -> extra seconds
        per message), slow ``nics`` (device -> bytes/s) and slow ``paths`` ((device, device) ->
        bytes/s), or None when none gains more than
        ``min_gain`` (``min_gain_healthy`` where every device of both layouts is believed healthy).
        Raises ``PlanningError`` when the layout has a dead device and no layout runs on the rest."""
        best, current_s, speeds_arr, slow = self._search(layout, speeds, links=links, nics=nics, paths=paths)
        if best is None:
            return None
        horizon = self.config.horizon_iterations
        after = best.sim_s + best.move_s / horizon
        threshold = self.config.min_gain
        if believed_healthy({*layout.devices, *best.layout.devices}, speeds_arr, slow.links, slow.nics, slow.paths):
            threshold = min(threshold, self.config.min_gain_healthy)
        if not math.isinf(current_s) and after >= current_s * (1 - threshold):
            logger.debug("resihp planner: best %s gains %.1f %%, under the threshold of %.0f %%", best.actions,
                         100 * (1 - after / current_s), 100 * threshold)
            return None
        return self._to_plan(layout, best, current_s, speeds_arr, slow)

    def best_layout(self, layout: PlanLayout, speeds: Sequence[float], links: Links | None = None,
                    nics: Nics | None = None, paths: Paths | None = None) -> tuple[PlanLayout, float]:
        """The best layout the allowed knobs reach (no threshold, no amortization) and its
        predicted iteration seconds; ``layout`` itself when nothing is better."""
        best, current_s, _, _ = self._search(layout, speeds, amortize=False, links=links, nics=nics, paths=paths)
        if best is None or best.sim_s >= current_s:
            return layout, current_s
        return best.layout, best.sim_s

    def _to_plan(self, layout: PlanLayout, best: _Candidate, current_s: float, sp: np.ndarray,
                 slow: _SlowPaths) -> Plan:
        n_dev = sp.shape[0]
        healthy_s = self._healthy_s(layout, slow) * self.shape_factor(layout)
        members = set(layout.devices)
        return Plan(old=layout, new=best.layout, actions=best.actions, iteration_s_before=current_s,
                    iteration_s_after=float(best.sim_s), bytes_to_move=best.bytes_total,
                    max_bytes_per_device=best.bytes_max, move_s=best.move_s,
                    horizon_iterations=self.config.horizon_iterations,
                    optimum_s=capacity_optimum_s(healthy_s, sp[list(layout.devices)], layout.world_size),
                    speeds={int(r): float(sp[r]) for r in range(n_dev) if abs(sp[r] - 1.0) > HEALTHY_EPS
                            and (r in members or sp[r] < 1.0)}, links=dict(slow.links), nics=dict(slow.nics),
                    paths=dict(slow.paths))

    def _healthy_s(self, layout: PlanLayout, slow: _SlowPaths) -> float:
        ones = np.ones(max(layout.devices) + 1)
        even = PlanLayout.even(num_layers=self.spec.num_layers, tp=layout.tp, pp=layout.pp, dp=layout.dp,
                               num_microbatches=layout.num_microbatches, vp=layout.vp, schedule=layout.schedule,
                               devices=layout.devices)
        return min(self.iteration_s(layout, ones, slow.links, slow.nics, slow.paths),
                   self.iteration_s(even, ones, slow.links, slow.nics, slow.paths))

    def _search(self, layout: PlanLayout, speeds: Sequence[float], amortize: bool = True, links: Links | None = None,
                nics: Nics | None = None, paths: Paths | None = None
                ) -> tuple[_Candidate | None, float, np.ndarray, _SlowPaths]:
        """The best candidate (None: none runs), the current layout's seconds, the speeds checked,
        and the slow paths this search planned around (threaded through its steps, not kept)."""
        sp = _check_speeds(speeds, layout)
        slow_links = {_pair(*k): float(v) for k, v in (links or {}).items() if v > 0}
        for d, bw in (nics or {}).items():
            if not (math.isfinite(float(bw)) and float(bw) > 0) or not 0 <= int(d) < sp.shape[0]:
                raise PlanningError(f"slow NIC of device {d} at {bw!r} bytes/s: need a device of the "
                                    f"{sp.shape[0]} known and a finite bandwidth > 0")
        for k, bw in (paths or {}).items():
            if not (math.isfinite(float(bw)) and float(bw) > 0) or len(set(k)) != 2 or \
                    not all(0 <= int(d) < sp.shape[0] for d in k):
                raise PlanningError(f"slow path {k} at {bw!r} bytes/s: need two devices of the {sp.shape[0]} known "
                                    "and a finite bandwidth > 0")
        slow = _SlowPaths(slow_links, {int(d): float(bw) for d, bw in (nics or {}).items()
                                       if float(bw) < self.cluster.link_bytes_per_s},
                          {_pair(*k): float(bw) for k, bw in (paths or {}).items()
                           if float(bw) < self.cluster.link_bytes_per_s})
        if layout.num_layers != self.spec.num_layers:
            raise PlanningError(f"layout.layers hold {layout.num_layers} layers, the model has {self.spec.num_layers}")
        n_dev = sp.shape[0]
        memory = self.cluster.memory_of(n_dev)
        current_s = self.iteration_s(layout, sp, slow.links, slow.nics, slow.paths) * self.shape_factor(layout)
        cands = self._candidates(layout, sp, memory, slow)
        for c in cands:
            c.closed_s *= self.shape_factor(c.layout)
        if not cands:
            if math.isinf(current_s):
                dead = [r for r in layout.devices if sp[r] <= 0]
                raise PlanningError(f"no layout runs without rank(s) {_short(dead)}: the {int((sp > 0).sum())} "
                                    f"usable devices cannot hold {self.spec.num_layers} layers in memory under the "
                                    "allowed knobs; restart from a checkpoint on more devices")
            return None, current_s, sp, slow
        horizon = self.config.horizon_iterations if amortize else math.inf
        old_holdings = _holdings(layout, n_dev)
        for c in cands:
            moved = state_move_bytes(layout, c.layout, self.spec, self.workload, n_dev, old_holdings)
            c.bytes_total, c.bytes_max = float(moved.sum()), float(moved.max())
            # A new micro-batch split only changes what the data loader hands out; anything else
            # rebuilds groups or model chunks and pays the fixed pause.
            rebuilt = dataclasses.replace(c.layout, microbatches=layout.microbatches) != layout \
                if c.layout.dp == layout.dp else True
            c.move_s = c.bytes_max / self.cluster.link_bytes_per_s + (self.cluster.relayout_pause_s if rebuilt else 0.0)
        cands.sort(key=lambda c: c.closed_s + c.move_s / horizon)
        first = cands[0].closed_s + cands[0].move_s / horizon
        for c in cands[:self.config.simulate_top]:
            # The closed form ranks well; only near-ties are worth a simulation each.
            if c is cands[0] or c.closed_s + c.move_s / horizon <= first * (1 + self.config.simulate_margin):
                c.sim_s = self.iteration_s(c.layout, sp, slow.links, slow.nics, slow.paths) * self.shape_factor(c.layout)
        scored = [c for c in cands if c.sim_s is not None]
        best = min(scored, key=lambda c: c.sim_s + c.move_s / horizon)
        return best, current_s, sp, slow

    def _candidates(self, layout: PlanLayout, sp: np.ndarray, memory: np.ndarray, slow: _SlowPaths
                    ) -> list[_Candidate]:
        cfg = self.config
        out: list[_Candidate] = []
        seen: set[PlanLayout] = set()

        g = self.cluster.devices_per_node

        def add(lay: PlanLayout | None, actions: tuple[str, ...]) -> None:
            if lay is not None and g is not None:
                lay = node_local_groups(lay, g, sp)
            if lay is not None and slow.paths:
                # Whatever the shape, its rings go around the known slow paths (nothing moves).
                ordered = ring_order(lay, slow.paths, self.cluster.link_bytes_per_s)
                if ordered is not lay:
                    lay, actions = ordered, _dedupe(actions + ("ring_order",))
            if lay is None or lay in seen:
                return
            if not cfg.uneven_microbatches and len(set(lay.microbatches)) > 1:
                return
            stage_speed = stage_speeds(lay, sp, self.costs, g, slow.links, slow.nics, slow.paths)
            if (stage_speed <= 0).any() or not self.fits(lay, memory):
                return
            seen.add(lay)
            out.append(_Candidate(lay, actions, self._closed_s(lay, stage_speed, slow)))

        # Same (tp, pp): every replica count from all of them down to the ones with only healthy
        # devices; each with or without the TP permutation, then layers and micro-batches.
        dead_reps = {d for d in range(layout.dp) if (sp[layout.grid()[:, d, :]] <= 0).any()}
        dps = [layout.dp] if not dead_reps or cfg.drop_replicas else []
        if cfg.drop_replicas:
            # A dropped replica's devices can stand in for dead or slow ones of the kept replicas,
            # so a few replicas fewer than the ones hit can already be enough.
            dps += [layout.dp - k for k in range(1, min(layout.dp, len(dead_reps) + 3))]
        for dp in dps:
            base = self._keep_replicas(layout, sp, dp, slow)
            if base is None:
                continue
            tag = ("dp_shrink",) if dp < layout.dp else ("replace",) if base != layout else ()
            placements = [(base, tag)]
            if cfg.tp_regroup:
                placements += [(p, tag + ("tp_regroup",)) for p in self._packings(base, sp)]
            if cfg.link_avoid and slow.links:
                placements += [(p, tag + ("link_avoid",)) for p in self._avoid_links(base, slow)]
            if cfg.link_avoid and slow.paths:
                placements += [(p, tag + acts) for p, acts in self._avoid_paths(base, slow)]
            for lay, acts in placements:
                for lay2, acts2 in self._fill(lay, layout, sp, memory, acts, slow, same_shape=True):
                    add(lay2, acts2)

        if cfg.grow_replicas:
            # Replicas added on healthy idle devices (after a shrink, once devices recovered or came
            # back): the same (tp, pp) with more replicas, which no reshape offers.
            base = self._keep_replicas(layout, sp, layout.dp, slow) or layout
            for lay in self._grow_replicas(base, sp, slow):
                for lay2, acts2 in self._fill(lay, layout, sp, memory, ("dp_grow",), slow, same_shape=True):
                    add(lay2, acts2)

        if cfg.reshape:
            for lay in self._reshapes(layout, sp, memory, slow):
                placements = [lay] + (self._packings(lay, sp) if cfg.tp_regroup else [])
                for pl in placements:
                    for lay2, acts2 in self._fill(pl, layout, sp, memory, ("reshape",), slow, same_shape=False):
                        add(lay2, acts2)
        return out

    def _nic_share(self, n_dev: int, slow: _SlowPaths) -> np.ndarray:
        """(n_dev,) each device's NIC bandwidth as a share of healthy (1 for a healthy NIC)."""
        out = np.ones(n_dev)
        for d, bw in slow.nics.items():
            if d < n_dev:
                out[d] = bw / self.cluster.link_bytes_per_s
        return out

    def _keep_replicas(self, layout: PlanLayout, sp: np.ndarray, dp: int, slow: _SlowPaths) -> PlanLayout | None:
        """Keep the ``dp`` best replicas in place (fewest dead, then fastest), replacing dead or slow
        devices in them by faster spares (devices of the dropped replicas, or idle ones); a device
        behind a slow NIC counts as worse than an equally fast one behind a healthy NIC. The
        micro-batches of a shrunk job spread evenly over the survivors."""
        grid = layout.grid()
        nic = self._nic_share(sp.shape[0], slow)
        idle = np.setdiff1d(np.flatnonzero(sp > 0), np.asarray(layout.devices))
        worst_kept = min((sp[r], nic[r]) for r in layout.devices)
        if dp == layout.dp and (idle.size == 0 or worst_kept >= max((sp[r], nic[r]) for r in idle)):
            return layout
        rep_speed = sp[grid].min(axis=2).min(axis=0)          # (dp,) slowest stage of each replica
        rep_sum = sp[grid].sum(axis=(0, 2))
        order = sorted(range(layout.dp), key=lambda d: (-rep_speed[d], -rep_sum[d], d))
        keep, drop = sorted(order[:dp]), order[dp:]
        new = grid[:, keep, :].copy()
        pool = np.concatenate([grid[:, drop, :].reshape(-1), idle])
        spares = sorted((int(x) for x in pool if sp[x] > 0), key=lambda r: (-sp[r], -nic[r], r))
        # Replace the worst kept devices by faster spares (or as fast, behind a better NIC), one
        # swap at a time.
        flat = new.reshape(-1)
        for i in np.lexsort((nic[flat], sp[flat])):
            if not spares or (sp[spares[0]], nic[spares[0]]) <= (sp[flat[i]], nic[flat[i]]):
                break
            flat[i] = spares.pop(0)
        if (sp[flat] <= 0).any() or layout.num_microbatches < dp:
            return None
        mbs = layout.microbatches if dp == layout.dp else tuple(split_even(layout.num_microbatches, dp))
        return dataclasses.replace(layout, dp=dp, devices=tuple(new.reshape(-1).tolist()), microbatches=mbs)

    def _grow_replicas(self, layout: PlanLayout, sp: np.ndarray, slow: _SlowPaths) -> list[PlanLayout]:
        """The layout with 1, 2, ... more replicas of its (tp, pp), on the healthy idle devices
        behind healthy NICs (in rank order), as many as they and the micro-batches allow; the
        micro-batches spread evenly over all replicas."""
        nic = self._nic_share(sp.shape[0], slow)
        used = set(layout.devices)
        idle = [r for r in range(sp.shape[0]) if r not in used and sp[r] >= 1 - HEALTHY_EPS and nic[r] >= 1]
        per = layout.tp * layout.pp
        grid = layout.grid()
        out = []
        for k in range(1, len(idle) // per + 1):
            dp = layout.dp + k
            if dp > layout.num_microbatches:
                break
            extra = np.asarray(idle[:k * per]).reshape(layout.pp, k, layout.tp)
            new = np.concatenate([grid, extra], axis=1)
            out.append(dataclasses.replace(layout, dp=dp, devices=tuple(int(x) for x in new.reshape(-1)),
                                           microbatches=tuple(split_even(layout.num_microbatches, dp))))
        return out

    def _avoid_links(self, layout: PlanLayout, slow: _SlowPaths) -> list[PlanLayout]:
        """For each slow link the layout uses as a pipeline hop: the layouts with one end's TP group
        swapped with the same stage's group of another replica (the downstream end, or the
        upstream one), so that the link carries no message; and all links moved that way at once."""
        out: list[PlanLayout] = []
        grid = layout.grid()
        cur = grid.copy()
        for s, t, _ in _hops(layout):
            for d in range(layout.dp):
                if not any(_pair(a, b) in slow.links for a, b in zip(grid[s, d], grid[t, d])):
                    continue
                for end in (t, s):
                    for other in range(layout.dp):
                        if other == d:
                            continue
                        g = grid.copy()
                        g[end, [d, other]] = g[end, [other, d]]
                        out.append(dataclasses.replace(layout, devices=tuple(int(x) for x in g.reshape(-1))))
                # Cumulative: the first swap (downstream end, next replica) for every link in turn.
                other = (d + 1) % layout.dp
                if other != d:
                    cur[t, [d, other]] = cur[t, [other, d]]
        combined = dataclasses.replace(layout, devices=tuple(int(x) for x in cur.reshape(-1)))
        if combined != layout and combined not in out:
            out.append(combined)
        return out

    def _avoid_paths(self, layout: PlanLayout, slow: _SlowPaths) -> list[tuple[PlanLayout, tuple[str, ...]]]:
        """Around slow paths on the data-parallel rings: the replicas reordered so that the rings'
        slowest hop is as fast as it can be (``ring_order``: nothing moves); and,
        where the order cannot help (a ring of 2 or 3 replicas has every pair as neighbours), one
        end of each slow ring hop swapped with the device of its own replica at the same TP rank of
        another stage, or at another TP rank of the same stage (``path_avoid``: state moves), so the
        two ends are on different rings."""
        out: list[tuple[PlanLayout, tuple[str, ...]]] = []
        ordered = ring_order(layout, slow.paths, self.cluster.link_bytes_per_s)
        if ordered != layout:
            out.append((ordered, ("ring_order",)))
        grid = ordered.grid()
        pp, dp, tp = grid.shape
        if dp == 1:
            return out
        hop = _ring_hop_factors(grid, slow.paths, self.cluster.link_bytes_per_s)
        if pp * tp == 1 or not (hop > 1.0).any():
            return out
        acts = (("ring_order",) if ordered != layout else ()) + ("path_avoid",)
        combined = grid.copy()
        singles: list[PlanLayout] = []
        for s, d in zip(*np.nonzero(hop > 1.0)):
            e = (int(d) + 1) % dp
            for t in range(tp):
                if _pair(grid[s, d, t], grid[s, e, t]) not in slow.paths:
                    continue
                others = [(s2, t) for s2 in range(pp) if s2 != s] + [(s, t2) for t2 in range(tp) if t2 != t]
                for end in (e, int(d)):
                    for s2, t2 in others:
                        g = grid.copy()
                        g[s, end, t], g[s2, end, t2] = g[s2, end, t2], g[s, end, t]
                        singles.append(dataclasses.replace(ordered, devices=tuple(int(x) for x in g.reshape(-1))))
                s2, t2 = others[0]
                if combined[s, e, t] == grid[s, e, t] and combined[s2, e, t2] == grid[s2, e, t2]:
                    combined[s, e, t], combined[s2, e, t2] = grid[s2, e, t2], grid[s, e, t]
        # Each swap is scored in full (partitions, splits): a handful, and every one at once.
        for lay in singles[:MAX_PATH_SWAPS] + [dataclasses.replace(ordered, devices=tuple(
                int(x) for x in combined.reshape(-1)))]:
            if lay != ordered and all(lay != o for o, _ in out):
                out.append((lay, acts))
        return out

    def _packings(self, layout: PlanLayout, sp: np.ndarray) -> list[PlanLayout]:
        """Slow devices packed by replica or by stage, into the stage of the slowest device or, when
        that is the last stage (it carries the output layer), into the first."""
        out = []
        for mode in ("replica", "stage"):
            for first_stage in (False, True):
                lay = self._pack(layout, sp, mode, first_stage)
                if lay not in out:
                    out.append(lay)
        return out

    def _pack(self, layout: PlanLayout, sp: np.ndarray, mode: str, first_stage: bool = False) -> PlanLayout:
        """Move the slow devices into as few TP groups as possible, slowest together, filling the
        groups of one replica first (``replica``) or one stage index across replicas (``stage``);
        every move is a swap with a healthy device of the target group."""
        grid = layout.grid()
        pp, dp, tp = grid.shape
        flat = grid.reshape(-1).copy()
        slow_slots = np.flatnonzero(sp[flat] < 1 - HEALTHY_EPS)
        if slow_slots.size == 0:
            return layout
        slow = sorted(flat[slow_slots].tolist(), key=lambda r: (sp[r], r))
        slot_of = {int(flat[i]): int(i) for i in slow_slots}
        count = np.zeros((pp, dp))
        for i in slow_slots:
            count[i // (tp * dp), (i // tp) % dp] += 1
        s0, d0 = slot_of[slow[0]] // (tp * dp), (slot_of[slow[0]] // tp) % dp
        if first_stage:
            s0 = 0
        reps = sorted(range(dp), key=lambda d: (d != d0, -count[:, d].sum(), d))
        stages = sorted(range(pp), key=lambda s: (s != s0, -count[s].sum(), s))
        if mode == "replica":
            groups = [(s, d) for d in reps for s in stages]
        else:
            groups = [(s, d) for s in stages for d in reps]
        for j in range(0, len(slow), tp):
            chunk = slow[j:j + tp]
            s, d = groups[j // tp]
            target = [t + tp * (d + dp * s) for t in range(tp)]
            members = set(chunk)
            for r in chunk:
                i = slot_of[r]
                if i in target:
                    continue
                # Swap with the fastest occupant of the target group that is not in this chunk.
                _, k = max((sp[flat[k]], k) for k in target if int(flat[k]) not in members)
                other = int(flat[k])
                flat[k], flat[i] = r, other
                slot_of[r], slot_of[other] = k, i
        return dataclasses.replace(layout, devices=tuple(flat.tolist()))

    def _fill(self, placed: PlanLayout, original: PlanLayout, sp: np.ndarray, memory: np.ndarray,
              actions: tuple[str, ...], slow: _SlowPaths, *, same_shape: bool):
        """Layer partitions x micro-batch splits for a placement."""
        cfg = self.config
        if self.cluster.devices_per_node is not None:
            placed = node_local_groups(placed, self.cluster.devices_per_node, sp)
        stage_speed = stage_speeds(placed, sp, self.costs, self.cluster.devices_per_node, slow.links,
                                   slow.nics, slow.paths)   # (pp, dp)
        if (stage_speed <= 0).any():
            return
        layer_opts: list[tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]] = []
        if same_shape and placed.pp == original.pp and placed.vp == original.vp:
            layer_opts.append((placed.layers, ()))
        even = PlanLayout.even(num_layers=self.spec.num_layers, tp=placed.tp, pp=placed.pp, dp=1,
                               num_microbatches=1, vp=placed.vp).layers
        if not layer_opts or layer_opts[0][0] != even:
            layer_opts.append((even, ("pp_repartition",) if same_shape else ()))
        if cfg.pp_repartition or not same_shape:
            cap = self._layer_cap(placed, memory)
            ring = ring_factors(placed, slow.nics, self.cluster.link_bytes_per_s, slow.paths)
            for agg in (stage_speed.min(axis=1), stage_speed.mean(axis=1)):
                for r in ((None, ring) if (ring > 1).any() else (None,)):
                    per = self._partition(agg, placed, cap, r)
                    if per is not None and per not in [lo[0] for lo in layer_opts]:
                        layer_opts.append((per, ("pp_repartition",)))
        for layers, lacts in layer_opts:
            lay = dataclasses.replace(placed, layers=layers)
            mb_opts = [(lay.microbatches, ())]
            if cfg.dp_migration and lay.dp > 1:
                fwd, bwd = _chunk_seconds(self.costs, layers, lay.tp)
                a, b = _closed_form(fwd, bwd, stage_speed, lay.vp, self.cluster.p2p_latency_s)
                unit = lay.pp if lay.vp > 1 else 1
                mbs = _allocate_microbatches(a, b, lay.num_microbatches, unit)
                if mbs is not None and tuple(mbs) != lay.microbatches:
                    mb_opts.append((tuple(mbs), ("dp_migration",)))
            for mbs, macts in mb_opts:
                yield dataclasses.replace(lay, microbatches=mbs), _dedupe(actions + lacts + macts)

    def _layer_cap(self, layout: PlanLayout, memory: np.ndarray) -> np.ndarray:
        """Most layers each stage can hold in memory (the smallest device of the stage decides)."""
        pp = layout.pp
        cap_mem = memory[layout.grid()].min(axis=(1, 2))
        zero = self.memory_model(self.spec, self.workload, layout.tp, pp, [0] * pp, layout.dp)
        one = self.memory_model(self.spec, self.workload, layout.tp, pp, [1] * pp, layout.dp) - zero
        with np.errstate(divide="ignore", invalid="ignore"):
            cap = np.floor((cap_mem - zero) / one)
        return np.clip(np.nan_to_num(cap, nan=0, posinf=self.spec.num_layers), 0, self.spec.num_layers).astype(np.int64)

    def _partition(self, speed: np.ndarray, layout: PlanLayout, cap: np.ndarray, ring: np.ndarray | None = None
                   ) -> tuple[tuple[int, ...], ...] | None:
        """Layers per stage for stage speeds ``speed`` (pp,), split over the stage's chunks. With
        ``ring`` (each stage's gradient all-reduce slowdown from slow NICs, ``ring_factors``), a
        stage also pays its share of the all-reduce, spread over the micro-batches a replica runs
        (``m + pp - 1`` pipeline steps): layers leave a stage whose ring is slow."""
        pp, vp, tp = layout.pp, layout.vp, layout.tp
        c = self.costs
        unit = sum(c.layer(tp)) / speed
        fixed = np.zeros(pp)
        fixed[-1] = (c.head_fwd + c.head_bwd) / tp / speed[-1]
        if ring is not None:
            steps = max(layout.microbatches) + pp - 1
            zero = _tail_seconds(self.spec, self.workload, self.cluster, tp, layout.dp, [0] * pp, ring)
            one = _tail_seconds(self.spec, self.workload, self.cluster, tp, layout.dp, [1] * pp, ring) - zero
            unit = unit + one / steps
            fixed = fixed + zero / steps
        per = _greedy_layers(unit, fixed, self.spec.num_layers, np.minimum(cap, self.spec.num_layers))
        if per is None or any(n < vp for n in per):
            return None
        return tuple(tuple(split_even(n, vp)) for n in per)

    def _reshapes(self, layout: PlanLayout, sp: np.ndarray, memory: np.ndarray, slow: _SlowPaths) -> list[PlanLayout]:
        """Other (tp, pp) shapes over the fastest usable devices, best closed-form bound first.
        Hundreds of shapes at 4,096 devices: the bound and the memory check use prefix sums over
        the devices in speed order (a slow NIC among them charged to the gradient all-reduce), and only
        the best ``max_reshapes`` become layouts."""
        spec, m_total = self.spec, layout.num_microbatches
        nic = self._nic_share(sp.shape[0], slow)
        alive = sorted((r for r in range(sp.shape[0]) if sp[r] > 0), key=lambda r: (-sp[r], -nic[r], r))
        keep = self.config.reshape_keeps_devices
        if keep:
            if any(sp[r] <= 0 for r in layout.devices):
                return []
            alive = [r for r in alive if r in set(layout.devices)]
        n_healthy = sum(1 for r in alive if sp[r] >= 1 - HEALTHY_EPS)
        n_clean = sum(1 for r in alive if sp[r] >= 1 - HEALTHY_EPS and nic[r] >= 1)   # and a healthy NIC
        speed_sum = np.concatenate([[0.0], np.cumsum(sp[alive])])
        mem_min = np.minimum.accumulate(memory[alive]) if alive else np.zeros(0)
        nic_min = np.minimum.accumulate(nic[alive]) if alive else np.zeros(0)
        c = self.costs
        tps = [t for t in _divisors(spec.num_attention_heads) if spec.groups % t == 0 and t <= layout.tp]
        scored = []
        for tp in tps:
            for pp in range(1, min(spec.num_layers, len(alive) // tp) + 1):
                vp = layout.vp if pp > 1 and spec.num_layers >= pp * layout.vp else 1
                even = split_even(spec.num_layers, pp)
                per_mb = np.asarray(even, dtype=float) * sum(c.layer(tp))
                per_mb[-1] += (c.head_fwd + c.head_bwd) / tp
                a = per_mb.sum() / vp + per_mb.max() * (vp - 1) / vp + 2.0 * (pp - 1) * self.cluster.p2p_latency_s
                for n_pool in sorted({len(alive)} if keep else {len(alive), n_healthy, n_clean}):
                    dp = min(n_pool // (tp * pp), m_total // (pp if vp > 1 else 1))
                    if dp < 1 or (tp, pp) == (layout.tp, layout.pp) or (keep and tp * pp * dp != n_pool):
                        continue
                    n = tp * pp * dp
                    need = float(self.memory_model(spec, self.workload, tp, pp, even, dp).max())
                    if need > mem_min[n - 1] * (1 + 1e-9):
                        continue
                    m = -(-m_total // dp)
                    tail = _tail_seconds(spec, self.workload, self.cluster, tp, dp, even).max()
                    # The slowest NIC among the devices used holds a ring (the worst case: its
                    # stage's). Without it, the pool over every device always ranked above the one
                    # without the slow NICs (more devices, same speeds), and the shapes that leave a
                    # slow NIC out were cut by the top-k before being scored.
                    if dp > 1 and nic_min[n - 1] < 1:
                        tail = tail / nic_min[n - 1]
                    t = (a + (m - 1) * per_mb.max() + tail) * n / speed_sum[n]
                    scored.append((t, tp, pp, dp, vp))
        scored.sort()
        old_slot = {r: i for i, r in enumerate(layout.devices)}
        out: list[PlanLayout] = []
        for _, tp, pp, dp, vp in scored[:self.config.max_reshapes]:
            # Keep the old rank order among the chosen devices: neighbours stay neighbours.
            use = sorted(alive[:tp * pp * dp], key=lambda r: (old_slot.get(r, 1 << 30), r))
            out.append(PlanLayout.even(num_layers=spec.num_layers, tp=tp, pp=pp, dp=dp, num_microbatches=m_total,
                                       vp=vp, schedule=layout.schedule if vp == layout.vp else None, devices=use))
        return out


def _dedupe(actions: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(actions))

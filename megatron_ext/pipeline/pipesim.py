"""Pipeline-schedule simulator: from per-op durations and a schedule order to the iteration's
makespan, critical path and each stage's idle time and bubble windows.

Model (dataflow): a stage runs its ops one at a time in the schedule's order; an op starts when
the previous op on its stage has finished and its input from another stage has arrived (the
producer's output time plus ``p2p_latency_s``). An output leaves when its op finishes, or, for
DeepSpeed's deferred sends (``Op.deferred_send``), when the stage starts its next op. Sends never
block the sender. That is the idealised schedule; it ignores the rendezvous of blocking sends,
which on a real run shows up as a small extra wait the detector's calibration absorbs.

The dependency graph depends only on the schedule, so it is compiled once (``compile_plan``) into
topological levels; ``simulate`` then evaluates many iterations at once with numpy, one level at
a time (a level's ops are independent of each other).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Sequence

import numpy as np

from megatron_ext.pipeline.schedule_orders import FORWARD, Op, ScheduleOrder

logger = logging.getLogger(__name__)


class ScheduleDeadlock(RuntimeError):
    """The order cannot run: some stage waits for an op that waits for it."""


@dataclasses.dataclass(frozen=True, eq=False)
class SimPlan:
    """A schedule compiled for simulation. Ops are numbered stage by stage in order; index ``n``
    (one past the last op) is a sentinel whose times are 0."""

    order: ScheduleOrder
    stage: np.ndarray        # (n,) stage of each op
    chunk: np.ndarray        # (n,)
    microbatch: np.ndarray   # (n,)
    is_forward: np.ndarray   # (n,) bool
    prev: np.ndarray         # (n,) previous op on the same stage, or n
    prod: np.ndarray         # (n,) producer op on another stage (or own forward), or n
    out_idx: np.ndarray      # (n,) where the producer's output time is read, or n
    out_from_start: np.ndarray  # (n,) bool: read start[out_idx] (deferred send) instead of finish
    cross: np.ndarray        # (n,) bool: input crosses stages (p2p latency applies)
    last: np.ndarray         # (p,) last op of each stage
    levels: tuple[np.ndarray, ...]

    @functools.cached_property
    def level_data(self) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], ...]:
        """Per level: op indices, row of the previous op's finish, row of the input's output time
        and the cross-stage mask, as rows of ``simulate``'s (start; finish) table."""
        n = self.num_ops
        fin = n + 1
        out = []
        for idx in self.levels:
            prev_pos = fin + self.prev[idx]  # prev == n -> the finish sentinel (2n + 1)
            o = self.out_idx[idx]
            out_pos = np.where(self.out_from_start[idx], o, fin + o)  # o == n -> a sentinel
            cross = (self.cross[idx] & (self.prod[idx] != n)).astype(float)
            out.append((idx, prev_pos, out_pos, cross))
        return tuple(out)

    @property
    def num_ops(self) -> int:
        return int(self.stage.shape[0])

    def op(self, j: int) -> Op:
        s = int(self.stage[j])
        return self.order.stages[s][j - int(self.first[s])]

    @functools.cached_property
    def first(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([len(ops) for ops in self.order.stages])[:-1]])


def compile_plan(order: ScheduleOrder) -> SimPlan:
    """Resolve each op's dependencies and sort the ops into topological levels."""
    index: dict[tuple[int, tuple[str, int, int]], int] = {}
    flat: list[tuple[int, int, Op]] = []
    for s, k, op in order.ops():
        if (s, op.key) in index:
            raise ValueError(f"schedule '{order.name}': stage {s} runs {op} twice")
        index[(s, op.key)] = len(flat)
        flat.append((s, k, op))
    n = len(flat)
    prev = np.full(n, n, dtype=np.int64)
    prod = np.full(n, n, dtype=np.int64)
    out_idx = np.full(n, n, dtype=np.int64)
    out_from_start = np.zeros(n, dtype=bool)
    cross = np.zeros(n, dtype=bool)
    last = np.zeros(order.num_stages, dtype=np.int64)
    for j, (s, k, op) in enumerate(flat):
        if k > 0:
            prev[j] = j - 1
        last[s] = j
        src = order.producer(s, op)
        if src is None:
            continue
        ps, pop = src
        if (ps, pop.key) not in index:
            raise ValueError(f"schedule '{order.name}': {op} on stage {s} needs {pop} from stage {ps}, "
                             "which the order never runs")
        pj = index[(ps, pop.key)]
        prod[j] = pj
        cross[j] = ps != s
        p_op = flat[pj][2]
        p_last = flat[pj][1] == len(order.stages[ps]) - 1
        if p_op.deferred_send and not p_last:
            out_idx[j], out_from_start[j] = pj + 1, True
        else:
            out_idx[j] = pj

    # Longest-path levels by Kahn's algorithm over edges prev -> j and out_idx -> j.
    deps = [[] for _ in range(n)]
    indeg = np.zeros(n, dtype=np.int64)
    for j in range(n):
        for d in {int(prev[j]), int(out_idx[j])}:
            if d != n:
                deps[d].append(j)
                indeg[j] += 1
    level = np.zeros(n, dtype=np.int64)
    ready = [j for j in range(n) if indeg[j] == 0]
    done = 0
    while ready:
        nxt = []
        for d in ready:
            done += 1
            for j in deps[d]:
                level[j] = max(level[j], level[d] + 1)
                indeg[j] -= 1
                if indeg[j] == 0:
                    nxt.append(j)
        ready = nxt
    if done < n:
        stuck = []
        for s in range(order.num_stages):
            js = [j for j in range(n) if flat[j][0] == s and indeg[j] > 0]
            if js:
                j = min(js)
                stuck.append(f"stage {s} at {flat[j][2]}")
        raise ScheduleDeadlock(f"schedule '{order.name}' deadlocks: " + "; ".join(stuck))
    levels = tuple(np.flatnonzero(level == lv) for lv in range(int(level.max()) + 1)) if n else ()
    arr = np.array([(s, op.chunk, op.microbatch, op.phase == FORWARD) for s, _, op in flat], dtype=np.int64)
    return SimPlan(order=order, stage=arr[:, 0], chunk=arr[:, 1], microbatch=arr[:, 2],
                   is_forward=arr[:, 3].astype(bool), prev=prev, prod=prod, out_idx=out_idx,
                   out_from_start=out_from_start, cross=cross, last=last, levels=levels)


@dataclasses.dataclass(frozen=True)
class PathStep:
    """One op on the critical path; ``via`` says what it waited for before starting: ``stage``
    (the previous op on its stage), ``p2p`` (its input from another stage) or ``start``."""

    stage: int
    op: Op
    start_s: float
    finish_s: float
    via: str


@dataclasses.dataclass(eq=False)
class SimResult:
    """Times of a batch of simulated iterations; arrays have a leading batch axis."""

    plan: SimPlan
    start: np.ndarray    # (B, n)
    finish: np.ndarray   # (B, n)
    tail_s: np.ndarray   # (B, p) time after each stage's last op (gradient sync, optimizer)
    p2p_latency_s: float

    @property
    def stage_end_s(self) -> np.ndarray:
        """(B, p) when each stage's last op finishes."""
        return self.finish[:, self.plan.last]

    @property
    def makespan_s(self) -> np.ndarray:
        """(B,) iteration time: the latest stage end plus that stage's tail."""
        return (self.stage_end_s + self.tail_s).max(axis=1)

    @property
    def busy_s(self) -> np.ndarray:
        """(B, p) compute time of each stage."""
        dur = self.finish - self.start
        out = np.zeros((dur.shape[0], self.plan.order.num_stages))
        for s in range(self.plan.order.num_stages):
            out[:, s] = dur[:, self.plan.stage == s].sum(axis=1)
        return out

    @property
    def idle_s(self) -> np.ndarray:
        """(B, p) time each stage is not computing between t=0 and the end of the last op of
        the whole pipeline (the bubbles; tails not included)."""
        return self.finish.max(axis=1, keepdims=True) - self.busy_s

    def bubbles(self, stage: int, b: int = 0) -> list[tuple[float, float]]:
        """Idle windows ``(t0, t1)`` of one stage in iteration ``b``, from t=0 to the end of the
        pipeline's last op; windows shorter than 1 ns are dropped."""
        js = np.flatnonzero(self.plan.stage == stage)
        end = float(self.finish[b].max())
        t, out = 0.0, []
        for j in js:
            if self.start[b, j] - t > 1e-9:
                out.append((t, float(self.start[b, j])))
            t = float(self.finish[b, j])
        if end - t > 1e-9:
            out.append((t, end))
        return out

    def critical_path(self, b: int = 0) -> list[PathStep]:
        """The chain of ops that fixes the end of the pipeline in iteration ``b``, first op first.

        Walks back from the last op to finish; at each op follows whichever constraint set its
        start (on a tie the cross-stage input, since that is the wait worth explaining).
        """
        plan, start, finish = self.plan, self.start[b], self.finish[b]
        n = plan.num_ops
        if n == 0:
            return []

        def explain(j: int) -> tuple[str, tuple[str, int] | None]:
            t = start[j]
            tol = 1e-12 * max(1.0, abs(t))
            if plan.prod[j] != n:
                o = int(plan.out_idx[j])
                out = start[o] if plan.out_from_start[j] else finish[o]
                if out + (self.p2p_latency_s if plan.cross[j] else 0.0) >= t - tol:
                    return "p2p", ("start" if plan.out_from_start[j] else "finish", o)
            if plan.prev[j] != n and finish[plan.prev[j]] >= t - tol:
                return "stage", ("finish", int(plan.prev[j]))
            return "start", None

        stage_end = finish[plan.last] + self.tail_s[b]
        event: tuple[str, int] | None = ("finish", int(plan.last[int(np.argmax(stage_end))]))
        steps: list[PathStep] = []
        while event is not None:
            kind, j = event
            why, event = explain(j)
            # A ("start", k) event is a deferred send released when op k started: k's start is
            # on the path, its duration is not.
            if kind == "finish":
                steps.append(PathStep(int(plan.stage[j]), plan.op(j), float(start[j]), float(finish[j]), why))
        return steps[::-1]


def op_durations(plan: SimPlan, fwd_s: np.ndarray, bwd_s: np.ndarray) -> np.ndarray:
    """Gather per-op durations (B, n) from arrays shaped (..., p, chunks, microbatches)."""
    fwd = np.asarray(fwd_s, dtype=float)
    bwd = np.asarray(bwd_s, dtype=float)
    order = plan.order
    want = (order.num_stages, order.num_chunks, order.num_microbatches)
    for name, a in (("fwd_s", fwd), ("bwd_s", bwd)):
        if a.shape[-3:] != want:
            raise ValueError(f"{name} must end in shape (stages, chunks, microbatches) = {want}, got {a.shape}")
    fwd = fwd.reshape((-1,) + want)
    bwd = bwd.reshape((-1,) + want)
    f = fwd[:, plan.stage, plan.chunk, plan.microbatch]
    g = bwd[:, plan.stage, plan.chunk, plan.microbatch]
    return np.where(plan.is_forward[None, :], f, g)


def simulate(plan: SimPlan, fwd_s: np.ndarray, bwd_s: np.ndarray, *, p2p_latency_s: float = 0.0,
             tail_s: float | Sequence[float] | np.ndarray = 0.0) -> SimResult:
    """Simulate one or many iterations.

    ``fwd_s``/``bwd_s``: durations shaped ``(stages, chunks, microbatches)`` or with a leading
    batch axis ``(B, stages, chunks, microbatches)``. ``tail_s``: scalar, per stage ``(p,)`` or
    ``(B, p)``, time each stage needs after its last op before the iteration ends.
    """
    if p2p_latency_s < 0:
        raise ValueError(f"p2p_latency_s must be >= 0, got {p2p_latency_s}")
    dur = op_durations(plan, fwd_s, bwd_s)
    if (dur < 0).any() or not np.isfinite(dur).all():
        raise ValueError("durations must be finite and >= 0")
    batch, n = dur.shape
    # One (2n + 2, B) table: rows 0..n are start times, rows n+1..2n+1 finish times, row n and
    # row 2n+1 the zero sentinels. Each level is then two gathers and two scatters.
    times = np.zeros((2 * n + 2, batch))
    dur_t = np.ascontiguousarray(dur.T)
    for idx, prev_pos, out_pos, cross in plan.level_data:
        s = np.maximum(times[prev_pos], times[out_pos] + (p2p_latency_s * cross)[:, None])
        times[idx] = s
        times[idx + n + 1] = s + dur_t[idx]
    start, finish = times[:n].T, times[n + 1:2 * n + 1].T
    tail = np.broadcast_to(np.asarray(tail_s, dtype=float), (batch, plan.order.num_stages)).copy()
    return SimResult(plan=plan, start=np.ascontiguousarray(start), finish=np.ascontiguousarray(finish), tail_s=tail,
                     p2p_latency_s=float(p2p_latency_s))


def timeline_error(result: SimResult, observed: dict[tuple[int, str, int, int], tuple[float, float]],
                   b: int = 0) -> dict[str, float]:
    """How far a recorded timeline is from the simulation of its own durations.

    ``observed`` maps ``(stage, phase, microbatch, chunk)`` to the op's ``(start_s, end_s)``,
    relative to the iteration's start (the pipeline events of a real run). Feed ``simulate`` the
    observed durations (end - start) and compare: what is left is what the dataflow model does not
    capture (blocking sends, launch gaps). Returns the relative makespan error, the mean absolute
    start error, and the largest per-stage idle-time error, in seconds.
    """
    plan = result.plan
    missing = [(int(plan.stage[j]),) + plan.op(j).key for j in range(plan.num_ops)
               if (int(plan.stage[j]),) + plan.op(j).key not in observed]
    if missing:
        raise KeyError(f"observed timeline lacks {len(missing)} op(s), e.g. stage {missing[0][0]} "
                       f"{missing[0][1]}{missing[0][2]} chunk {missing[0][3]}")
    obs = np.array([observed[(int(plan.stage[j]),) + plan.op(j).key] for j in range(plan.num_ops)])
    obs_end = float(obs[:, 1].max())
    sim_end = float(result.finish[b].max())
    busy = np.zeros(plan.order.num_stages)
    np.add.at(busy, plan.stage, obs[:, 1] - obs[:, 0])
    obs_idle = obs_end - busy
    return {
        "makespan_rel_error": (sim_end - obs_end) / obs_end if obs_end > 0 else float("nan"),
        "start_mae_s": float(np.abs(result.start[b] - obs[:, 0]).mean()),
        "idle_max_abs_error_s": float(np.abs(result.idle_s[b] - obs_idle).max()),
    }

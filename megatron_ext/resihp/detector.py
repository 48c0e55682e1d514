"""Fail-slow detection: the ResiHP detector (FLOPs-normalised, pipeline-simulated) and the raw
busy-time baseline, behind one interface: ``observe(record) -> IterationReport``.

ResiHP's point is that a slow iteration is not evidence of a slow device: with packed
variable-length documents a micro-batch's attention work varies with the sum of squared document
lengths, and the pipeline schedule decides which stage's work is on the critical path. So:

1. every (rank, chunk, micro-batch, phase) gets its expected FLOPs from the model description and
   the micro-batch's documents (``flops.py``), split into linear and attention FLOPs;
2. each stage's throughput per FLOP class (plus a fixed per-op cost) is calibrated online from
   healthy iterations by a robust (Huber) regression pooled over the stage's TP and DP ranks, so
   one bad rank cannot teach the stage its slowness; a rank may keep a small steady bias
   (``resihp_rank_bias_max``);
3. a rank's raw score is its observed compute time over its expected time in the iteration;
4. its score is the raw score relative to the other ranks of the same iteration, job-wide and
   within its stage (``relative_scores``): what all ranks share (host load, a data mix the model
   misses) is not a device fault; its healthy noise is the MAD of its recent scores;
5. a verdict needs persistence (``stats.Persistence``);
6. the expected iteration time is the pipeline simulation (``pipesim``) of the expected per-op
   durations plus a calibrated fixed tail, times the iteration's shared factor, reported next to
   the observed time.

The baseline sees only the same per-rank busy time, normalised by its own median (no FLOPs, no
simulation), with the same persistence rule, so the two differ only in the normalisation.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Protocol

import numpy as np

from megatron_ext.models.flops import stage_costs
from megatron_ext.pipeline.schedule_orders import schedule_order
from megatron_ext.resihp.config import ResiHPConfig
from megatron_ext.pipeline.pipesim import compile_plan, simulate
from megatron_ext.resihp.stats import Persistence, huber_fit, loo_median, nanmedian, robust_scale
from megatron_ext.resihp.trace import TraceRecord
from megatron_ext.resihp.verdicts import Verdict, detector_prefix

logger = logging.getLogger(__name__)

# Points per (stage, phase) regression: enough to pin three coefficients, few enough to refit
# 64 stages in milliseconds.
_MAX_FIT_POINTS = 2048


@dataclasses.dataclass(eq=False)
class IterationReport:
    """What a detector made of one iteration."""

    iteration: int
    detector: str
    calibrated: bool
    observed_s: float
    expected_s: float | None        # expected iteration time (None before calibration)
    rank_scores: np.ndarray         # (world,) observed / expected compute, relative to the other
                                    # ranks when common-mode normalisation is on; NaN if not scored
    stage_scores: np.ndarray        # (pp, dp) same for each stage of each replica (slowest TP rank)
    verdicts: list[Verdict]
    # The iteration's shared slowdown: median over ranks of observed / expected before the
    # common-mode normalisation (None when it is off or before calibration).
    common_factor: float | None = None
    # (world,) observed / expected compute against the rank's own calibration, before the
    # common-mode normalisation (None before calibration).
    raw_scores: np.ndarray | None = None

    def scalars(self) -> dict[str, float]:
        """Values for TensorBoard / progress lines."""
        out = {"observed_s": self.observed_s}
        if self.expected_s is not None:
            out["expected_s"] = self.expected_s
            out["observed_over_expected"] = self.observed_s / self.expected_s if self.expected_s > 0 else float("nan")
        if np.isfinite(self.rank_scores).any():
            out["max_rank_score"] = float(np.nanmax(self.rank_scores))
        if self.common_factor is not None:
            out["common_factor"] = self.common_factor
        return out


class Detector(Protocol):
    name: str

    def observe(self, record: TraceRecord) -> IterationReport: ...


def _layout_key(rec: TraceRecord) -> Any:
    """What a calibration is valid for: the layout, the model, the layers per stage and each
    replica's micro-batch count (DP work migration can change the counts and keep the width)."""
    layers = None if rec.layers is None else tuple(map(tuple, rec.layers))
    counts = tuple(sum(1 for docs in replica if docs) for replica in rec.documents)
    return rec.layout, rec.model, layers, counts


def _devices(rec: TraceRecord) -> tuple[int, ...]:
    return rec.devices if rec.devices is not None else tuple(range(rec.layout.world_size))


def _sources(old: tuple[int, ...], new: tuple[int, ...]) -> np.ndarray:
    """For each rank of ``new`` (devices by rank), the rank its device had in ``old``; -1 for a
    device that was not there."""
    where = {d: r for r, d in enumerate(old)}
    return np.array([where.get(d, -1) for d in new], dtype=np.int64)


# Common-mode normalisation needs a majority that can outvote one slow rank: with two ranks,
# "rank 0 is 2x slow" and "rank 1 is 2x fast" are the same observation.
_MIN_PEERS = 3


def common_mode(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-rank divisor ``(..., world)`` and the iteration's shared factor ``(...)`` of raw scores
    (NaN: not scored): each rank against the median of the *other* ranks of the same iteration.

    Why: what every rank of an iteration shares is not a device fault. On a shared host, other
    jobs, CPU frequency, the allocator warming up or a busy file system slow all ranks at once,
    by 2-5x for an iteration or 0.6x for minutes; on a cluster a data-mix shift the FLOPs model
    under-predicts does the same. The median of the others cancels it and is not moved by the
    rank under test, nor by a minority of slow ranks. Iterations with fewer than three scored
    ranks are not normalised (divisor and factor 1).
    """
    raw = np.asarray(raw, dtype=float)
    enough = np.isfinite(raw).sum(axis=-1) >= _MIN_PEERS
    loo = loo_median(raw)
    div = np.where(enough[..., None] & np.isfinite(loo) & (loo > 0), loo, 1.0)
    shared = nanmedian(raw, axis=-1)
    shared = np.where(enough & np.isfinite(shared) & (shared > 0), shared, 1.0)
    return div, shared


def relative_scores(raw: np.ndarray, by_stage: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scores ``(..., world)`` made relative, and the shared factor ``(...)``.

    A rank's relative score is the smaller of its score over the other ranks' median
    (``common_mode``) and its score over its stage peers' median (the other TP and DP ranks of its
    pipeline stage; ``by_stage`` lists each stage's ranks). A slow device is slow against both;
    each reference alone is fooled by something the other is not: the stage peers run the same
    layers on the same kind of data, so a shift between *stages* (one stage's ops losing CPU
    share, a data mix that hits the last stage's vocabulary projection harder) cancels; the
    whole job cancels what a stage's few peers share.
    """
    raw = np.asarray(raw, dtype=float)
    div, shared = common_mode(raw)
    rel = raw / div
    if by_stage.shape[1] > 1:
        peers = np.full(raw.shape, np.nan)
        peers[..., by_stage] = loo_median(raw[..., by_stage])
        with np.errstate(all="ignore"):
            rel = np.fmin(rel, raw / peers)  # no peer scored: the job-wide reference alone
    return rel, shared


class _Base:
    """Layout bookkeeping, warm-up, calibration buffer and the persistence rule.

    State is kept per rank but belongs to a device (``TraceRecord.devices``: launch ranks). When
    a re-layout renumbers the ranks or changes the work, what is known about each device goes
    with it: its verdict history and whether it is convicted (``Persistence.adopt``), the
    slowdown it was convicted at (``known``) and its healthy noise. What depends on the work is
    calibrated again (``_relayout``)."""

    name = "base"
    # Whether scores are divided by the other ranks' median of the same iteration (see
    # ``common_mode``); the baseline keeps plain per-rank time so it stays the naive reference.
    common_mode = False

    def __init__(self, config: ResiHPConfig | None = None):
        self.cfg = config if config is not None else ResiHPConfig()
        self._key: Any = None

    # subclasses fill these in
    def _setup(self, rec: TraceRecord) -> None:
        raise NotImplementedError

    def _sample(self, rec: TraceRecord) -> dict[str, Any]:
        raise NotImplementedError

    def _fit(self) -> None:
        raise NotImplementedError

    def _score(self, rec: TraceRecord, sample: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, float]:
        raise NotImplementedError

    def _reset(self, rec: TraceRecord) -> None:
        self._key = _layout_key(rec)
        self.devices = _devices(rec)
        lay = rec.layout
        coords = lay.coord_array
        self.stage_of, self.dp_of, self.tp_of = coords[:, 0], coords[:, 1], coords[:, 2]
        self.world, self.pp, self.dp = lay.world_size, lay.pp, lay.dp
        # Every stage has tp * dp ranks: (pp, tp * dp) rank indices.
        self.by_stage = np.stack([np.flatnonzero(self.stage_of == s) for s in range(self.pp)])
        # A rank's role: its stage and its replica's micro-batch count (what its work depends on).
        counts = np.array(self._key[-1], dtype=np.int64)
        self.role = self.stage_of * (lay.num_microbatches + 1) + counts[self.dp_of]
        self.buffer: collections.deque = collections.deque(maxlen=self.cfg.resihp_calibration_window)
        self.seen = 0
        self.calibrated = False
        self.sigma = np.full(self.world, self.cfg.resihp_noise_floor)
        self.persist = self._persistence()
        # The slowdown each convicted rank's device was named with (1: not convicted).
        self.known = np.ones(self.world)
        # ``seen`` when the rank's device took its place; 0: it has held it since calibration began.
        self.since = np.zeros(self.world, dtype=np.int64)
        self._setup(rec)

    def _persistence(self) -> Persistence:
        return Persistence(self.world, threshold=self.cfg.resihp_threshold, zscore=self.cfg.resihp_zscore,
                           window=self.cfg.resihp_window, severe=self.cfg.resihp_severe_factor or None,
                           severe_window=self.cfg.resihp_severe_window)

    def _relayout(self, rec: TraceRecord) -> None:
        """The record's layout, work or rank order differs from the last one's.

        Devices whose ranks were only permuted, with every rank's work the same (same layout,
        layers and micro-batches), keep the calibration: the per-stage throughput was learnt from
        the same work, and a device that stayed in its role keeps its bias. A device that changed
        role (another stage, or a replica with another micro-batch count) restarts its bias at 1,
        and its bias and noise are learnt again from its own data in the new place
        (``_settled``): the rows its place holds from the device before it still teach the stage.

        Any other change (layers per stage, micro-batches, TP/PP/DP, world size) calibrates again
        from a warm-up, and a device convicted before it stays convicted: its calibration data are
        divided by its known slowdown (``scale`` in the samples), so the warm-up learns the
        healthy speed of its new role instead of taking the slow device as normal, it is neither
        accused again nor forgotten, and a ``recovered`` verdict follows when it heals."""
        old_devices, old_persist = self.devices, self.persist
        old_known, old_sigma = self.known, self.sigma
        new_devices = _devices(rec)
        src = _sources(old_devices, new_devices)
        ok = src >= 0
        take = np.where(ok, src, 0)
        if _layout_key(rec) == self._key:
            moved = ok & (self.role[take] != self.role)
            self.devices = new_devices
            self.since = np.where(src == np.arange(self.world), self.since, self.seen)
            self._permuted(src, moved)
            what = "ranks renumbered; calibration kept"
        else:
            self._reset(rec)
            what = "calibrating again"
        self.persist = self._persistence()
        self.persist.adopt(old_persist, src)
        self.known = np.where(ok, old_known[take], 1.0)
        self.sigma = np.where(ok, old_sigma[take], self.sigma)
        slow = ", ".join(f"launch rank {d} x{f:.2f}" for d, f in self.known_slow().items())
        logger.info("%s: re-layout at iteration %d (%s)%s", detector_prefix(self.name), rec.iteration, what,
                    f"; known slow: {slow}" if slow else "")

    def _permuted(self, src: np.ndarray, moved: np.ndarray) -> None:
        """Per-rank calibration after a permutation that kept every rank's work (see ``_relayout``)."""

    def known_slow(self) -> dict[int, float]:
        """Convicted devices (launch ranks) and the slowdown each was named with."""
        return {int(self.devices[r]): float(self.known[r]) for r in np.flatnonzero(self.persist.suspect)}

    def _settled(self, healthy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``healthy`` (n, world) of the buffer restricted to the rows each rank's own device
        produced, and per rank whether those are enough to learn its bias and noise from: always
        for a rank whose device has held it since the calibration began, else at least a
        warm-up's worth."""
        seen = np.array([b["seen"] for b in self.buffer])
        own = healthy & (seen[:, None] > self.since[None, :])
        return own, (self.since == 0) | (own.sum(axis=0) >= self.cfg.resihp_warmup)

    def observe(self, record: TraceRecord) -> IterationReport:
        if self._key is None:
            self._reset(record)
        elif _layout_key(record) != self._key or _devices(record) != self.devices:
            self._relayout(record)
        self.seen += 1
        sample = self._sample(record)
        present = record.present
        verdicts: list[Verdict] = []
        shared = 1.0
        raw_scores = None
        if self.calibrated:
            scores, stage_scores, expected_s = self._score(record, sample)
            scores = np.where(present, scores, np.nan)
            raw_scores = scores
            if self.common_mode:
                scores, shared_a = relative_scores(raw_scores, self.by_stage)
                shared = float(shared_a)
                stage_scores = stage_scores / shared
                expected_s = expected_s * shared
            for d in self.persist.update(scores, self.sigma):
                self.known[d.rank] = d.factor if d.kind == "fail_slow" else 1.0
                verdicts.append(Verdict(
                    kind=d.kind, rank=d.rank, stage=int(self.stage_of[d.rank]), iteration=record.iteration,
                    factor=round(d.factor, 4) if d.kind == "fail_slow" else None,
                    confidence=round(min(1.0, max(0.0, d.confidence)), 4), detector=self.name,
                    time_s=record.time_s,
                    detail={"launch_rank": int(self.devices[d.rank]),
                            "dp": int(self.dp_of[d.rank]), "tp": int(self.tp_of[d.rank]),
                            "median_z": round(d.median_z, 2), "threshold": self.cfg.resihp_threshold,
                            "window": self.cfg.resihp_window,
                            **({"rule": d.rule} if d.kind == "fail_slow" else {}),
                            "observed_s": record.iteration_s,
                            "expected_s": None if expected_s is None else round(expected_s, 6),
                            **({"common_factor": round(shared, 4)} if self.common_mode else {})}))
            # Only clearly healthy ranks teach the calibration: a rank on its way to a verdict
            # (or already convicted) must not pull the expectation towards its slowness.
            guard = 1.0 + 0.5 * (self.cfg.resihp_threshold - 1.0)
            healthy = present & (scores < guard) & ~self.persist.suspect
        else:
            scores = np.full(self.world, np.nan)
            stage_scores = np.full((self.pp, self.dp), np.nan)
            expected_s = None
            healthy = present
        sample["healthy"] = healthy
        sample["iteration_s"] = record.iteration_s
        sample["seen"] = self.seen
        # A convicted device teaches the calibration only divided by its known slowdown (only the
        # warm-up after a re-layout takes it in at all: afterwards suspects are not healthy).
        sample["scale"] = np.where(self.persist.suspect, self.known, 1.0)
        self.buffer.append(sample)
        warm = self.cfg.resihp_warmup
        if (self.seen == warm or (self.seen > warm and (self.seen - warm) % self.cfg.resihp_refit_every == 0)
                or (self.calibrated and self._outside_calibration(sample))):
            self._fit()
            self.calibrated = True
        for v in verdicts:
            # DEBUG only: the caller presents verdicts (the live loop prints each once, replay lists them).
            logger.debug(v.describe())
        return IterationReport(record.iteration, self.name, expected_s is not None,
                               record.iteration_s, expected_s, scores, stage_scores, verdicts,
                               shared if self.calibrated and self.common_mode else None, raw_scores)

    def _outside_calibration(self, sample: dict[str, Any]) -> bool:
        """Whether this iteration's work lies where the last fit had no data (refit now)."""
        return False

    def _scaled(self, key: str) -> np.ndarray:
        """The buffer's ``key`` (n, world, ...) divided by each row's known slowdown."""
        a = np.stack([b[key] for b in self.buffer])
        scale = np.stack([b["scale"] for b in self.buffer])
        return a / scale.reshape(scale.shape + (1,) * (a.ndim - 2))

    def _set_sigma(self, scores: np.ndarray, healthy: np.ndarray) -> None:
        """Per-rank healthy noise from calibration scores (n_it, world); a rank without healthy
        iterations in the buffer keeps its previous value."""
        s = np.where(healthy, scores, np.nan)
        sig = robust_scale(s, axis=0)
        self.sigma = np.where(np.isfinite(sig), np.maximum(sig, self.cfg.resihp_noise_floor), self.sigma)


class ResiHPDetector(_Base):
    """FLOPs-normalised, pipeline-simulated fail-slow detector."""

    name = "resihp"

    def _setup(self, rec: TraceRecord) -> None:
        self.common_mode = self.cfg.resihp_common_mode
        lay = rec.layout
        order = schedule_order(lay.schedule, lay.pp, lay.num_microbatches, lay.vp, lay.microbatch_group_size)
        self.plan = compile_plan(order)
        costs = stage_costs(rec.model, lay.pp, lay.vp, lay.tp, rec.layers)
        # (p, vp, phase) coefficients: FLOPs per token and per squared document length.
        self.per_token = np.array([[[c.fwd_per_token, c.bwd_per_token] for c in row] for row in costs])
        self.per_sq = np.array([[[c.fwd_per_sq, c.bwd_per_sq] for c in row] for row in costs])
        # MoE: a third FLOP class, the experts' work per routed (token, expert) pair. Expert GEMMs
        # run on however many tokens the routing gave each expert, at their own efficiency; a
        # dense model keeps the two classes (and its fits exactly as they were).
        self.moe = rec.model.num_experts is not None
        self.per_pair = np.array([[[c.fwd_per_pair, c.bwd_per_pair] for c in row] for row in costs])
        self.pairs_per_token = np.array([[c.pairs_per_token for c in row] for row in costs])  # (p, vp)
        self.classes = ("linear", "attention", "expert") if self.moe else ("linear", "attention")
        # (stage, phase, [s per FLOP of each class..., s per op])
        self.coef = np.zeros((lay.pp, 2, len(self.classes) + 1))
        self.bias = np.ones(self.world)
        self.overhead_s = 0.0
        self._starved: set[int] = set()
        self._pair_range: np.ndarray | None = None
        self._last_fit = 0

    def _sample(self, rec: TraceRecord) -> dict[str, Any]:
        tokens, sq = rec.doc_stats
        # (world, phase, vp, m) FLOPs of each op of each rank, per class.
        pt = self.per_token[self.stage_of].transpose(0, 2, 1)[..., None]
        ps = self.per_sq[self.stage_of].transpose(0, 2, 1)[..., None]
        feats = [pt * tokens[self.dp_of][:, None, None, :], ps * sq[self.dp_of][:, None, None, :]]
        out: dict[str, Any] = {}
        if self.moe:
            pairs = self.routed_pairs(rec)
            feats.append(self.per_pair[self.stage_of].transpose(0, 2, 1)[..., None] * pairs[:, None])
            out["pairs"] = pairs
        obs = np.stack([rec.fwd_s, rec.bwd_s], axis=1)
        # Ops a present rank did not run (its replica has fewer micro-batches) expect nothing; a
        # stopped rank keeps its expectation (what the job is missing).
        ran = np.isfinite(obs) | ~rec.present[:, None, None, None]
        return {"obs": obs, "feats": np.stack(feats, axis=-1), "ran": ran.astype(float), **out}

    def routed_pairs(self, rec: TraceRecord) -> np.ndarray:
        """(world, vp, m) (token, expert) pairs each rank's experts computed: the trace's counts
        where it has them, else what uniform routing gives (top-k per token and MoE layer)."""
        tokens = rec.doc_stats[0][self.dp_of]                                        # (world, m)
        uniform = self.pairs_per_token[self.stage_of][:, :, None] * tokens[:, None, :]  # (world, vp, m)
        if rec.routed_tokens is None:
            return uniform
        return np.where(np.isfinite(rec.routed_tokens), rec.routed_tokens, uniform)

    def _predict(self, feats: np.ndarray) -> np.ndarray:
        """Expected op durations (..., world, phase, vp, m) from FLOPs (..., world, phase, vp, m,
        class), without the rank bias."""
        c = self.coef[self.stage_of][:, :, None, None, :]  # (world, phase, 1, 1, classes + 1)
        return (c[..., :-1] * feats).sum(axis=-1) + c[..., -1]

    def _permuted(self, src: np.ndarray, moved: np.ndarray) -> None:
        # The bias of a device that kept its role goes with it; one in a new role is learnt again.
        self.bias = np.where((src >= 0) & ~moved, self.bias[np.maximum(src, 0)], 1.0)

    def _fit(self) -> None:
        obs = self._scaled("obs")                             # (n, world, 2, vp, m)
        feats = np.stack([b["feats"] for b in self.buffer])  # (n, world, 2, vp, m, classes)
        healthy = np.stack([b["healthy"] for b in self.buffer])  # (n, world)
        ran = np.stack([b["ran"] for b in self.buffer])
        n = obs.shape[0]
        # Every stage has tp * dp ranks, so all (stage, phase) fits have the same shape and run
        # as one batched regression over the newest iterations that fit the point budget.
        by_stage = self.by_stage
        per_it = by_stage.shape[1] * obs.shape[3] * obs.shape[4]
        keep = max(1, min(n, _MAX_FIT_POINTS // per_it))

        def groups(a: np.ndarray) -> np.ndarray:  # (n, world, 2, vp, m) -> (p, 2, points)
            g = a[n - keep:][:, by_stage]                   # (keep, p, r, 2, vp, m)
            return g.transpose(1, 3, 0, 2, 4, 5).reshape(self.pp, 2, -1)

        ok = np.broadcast_to(healthy[:, :, None, None, None], obs.shape)
        cols = [groups(feats[..., k]) for k in range(feats.shape[-1])]
        x = np.stack(cols + [np.ones_like(cols[0])], axis=-1)
        y, valid = groups(obs), groups(ok)
        enough = (valid & np.isfinite(y)).sum(axis=-1) >= 3
        coef = huber_fit(x, y, valid)
        if self.moe:
            coef = self._gate_expert_rate(x, y, valid, coef)
            self._pair_range = self._calibrated_pairs(healthy[n - keep:], n - keep)
        self._last_fit = self.seen
        starved = set(np.flatnonzero(~enough.all(axis=1)).tolist())
        for s in sorted(starved - self._starved):
            logger.info("resihp: stage %d has no healthy data to calibrate from; keeping its old fit", s)
        self._starved = starved
        self.coef = np.where(enough[..., None], coef, self.coef)
        pred = self._predict(feats) * ran
        with np.errstate(all="ignore"):
            ratio = np.nansum(obs, axis=(2, 3, 4)) / pred.sum(axis=(2, 3, 4))  # (n, world)
            present = ~np.isnan(obs).all(axis=(2, 3, 4))
            ratio = np.where(present & np.isfinite(ratio), ratio, np.nan)
            # The bias is a rank's steady speed against its peers: taken, like the scores, after
            # the shared factor of each iteration is divided out.
            rel = relative_scores(ratio, self.by_stage)[0] if self.common_mode else ratio
            own, settled = self._settled(healthy)
            bias = nanmedian(np.where(own, rel, np.nan), axis=0)
        bmax = self.cfg.resihp_rank_bias_max
        # A rank with no healthy iteration of its own in the buffer (convicted, or its device new
        # in its place) keeps what it had.
        self.bias = np.where(np.isfinite(bias) & settled, np.clip(bias, 1.0 / bmax, bmax), self.bias)
        # The scores the detector would have given these iterations, for the noise estimate.
        scores = ratio / self.bias
        shared = np.ones(n)
        if self.common_mode:
            scores, shared = relative_scores(scores, self.by_stage)
        self._set_sigma(scores, own & settled)
        # The part of the iteration the pipeline simulation does not model (optimizer step, data
        # loading, gradient all-reduce) as one robust constant, in the same units as the
        # expectation: scaled back by each iteration's shared factor (and a known-slow device's
        # slowdown put back, which the observed iteration time contains).
        scale = np.stack([b["scale"] for b in self.buffer])
        exp = pred * (self.bias[None, :] * scale)[:, :, None, None, None]
        sim = self._simulate(exp)
        iters = np.array([b["iteration_s"] for b in self.buffer]) / shared
        all_healthy = healthy.all(axis=1)
        rest = (iters - sim)[all_healthy] if all_healthy.any() else iters - sim
        self.overhead_s = float(np.median(rest))

    # The expert class keeps its own rate only where the calibration data determine it this well
    # (t statistic of the coefficient): with balanced routing the routed counts of a stage vary by
    # a few per cent, and a rate fitted on that extrapolates wildly once the routing shifts
    # (measured: 5x the rate later fitted on skewed routing, which put a healthy rank with no
    # routed tokens at 1.5-1.9x). Without it the expert work counts as uniform (in the constant).
    _EXPERT_T_MIN = 2.0

    def _gate_expert_rate(self, x: np.ndarray, y: np.ndarray, valid: np.ndarray, coef: np.ndarray) -> np.ndarray:
        """``coef`` with the expert rate set to 0 (and the other classes refitted) for every
        (stage, phase) fit whose expert rate is negative or not significant.

        The standard error treats ops as independent points. Errors clustered by (rank,
        iteration) were tried and are worse: under a routing skew that stays on one rank through
        the calibration, the rank and its expert work cannot be told apart by the clusters, the
        rate was dropped, and the heavy rank was named (two false alarms in the live traces)."""
        k = self.classes.index("expert")
        ok = valid & np.isfinite(y) & np.isfinite(x).all(axis=-1)
        xs = np.where(ok[..., None], x, 0.0)
        scale = np.abs(xs).max(axis=-2)
        scale[scale == 0] = 1.0
        xs = xs / scale[..., None, :]
        w = ok.astype(float)
        resid = np.where(ok, y - (x * coef[..., None, :]).sum(axis=-1), np.nan)
        s = robust_scale(resid, axis=-1)
        # Frisch-Waugh: the expert column's part not explained by the other columns fixes its
        # standard error, whatever the collinearity among the others (packed tokens: constant).
        others = [j for j in range(x.shape[-1]) if j != k]
        xo, xe = xs[..., others], xs[..., k]
        a = np.swapaxes(xo * w[..., None], -1, -2) @ xo
        ridge = 1e-10 * np.trace(a, axis1=-2, axis2=-1)[..., None, None] / len(others) + 1e-300
        beta = np.linalg.solve(a + ridge * np.eye(len(others)), (np.swapaxes(xo * w[..., None], -1, -2) @ xe[..., None]))
        part = (xe - (xo @ beta)[..., 0]) * w
        with np.errstate(all="ignore"):
            t = coef[..., k] * scale[..., k] * np.sqrt((part * part).sum(axis=-1)) / s
        keep = (coef[..., k] > 0) & np.isfinite(t) & (t >= self._EXPERT_T_MIN)
        if keep.all():
            return coef
        x0 = x.copy()
        x0[..., k] = 0.0
        return np.where(keep[..., None], coef, huber_fit(x0, y, valid))

    def _calibrated_pairs(self, healthy: np.ndarray, first: int) -> np.ndarray:
        """(pp, 2) smallest and largest routed pairs per op among the points of the last fit."""
        pairs = np.stack([b["pairs"] for b in list(self.buffer)[first:]])        # (keep, world, vp, m)
        used = np.where(healthy[..., None, None], pairs, np.nan)
        out = np.full((self.pp, 2), np.nan)
        for st in range(self.pp):
            v = used[:, self.by_stage[st]]
            if np.isfinite(v).any():
                out[st] = np.nanmin(v), np.nanmax(v)
        return out

    def _outside_calibration(self, sample: dict[str, Any]) -> bool:
        """MoE: the routing moved past what the last fit saw (a rank's experts got clearly more, or
        fewer, pairs per op than any calibration point of its stage): refit at once, as for a new
        layout, instead of scoring the new routing with a rate fitted where it did not vary."""
        if not self.moe or getattr(self, "_pair_range", None) is None:
            return False
        # At most a few extra refits per refit period: a rank that stays outside (one convicted, or
        # suspect, feeds no calibration) must not make every iteration refit.
        if self.seen - self._last_fit < max(1, self.cfg.resihp_refit_every // 5):
            return False
        lo, hi = self._pair_range[self.stage_of, 0], self._pair_range[self.stage_of, 1]  # (world,)
        p = sample["pairs"].reshape(self.world, -1)
        # Margin: a tenth of the stage's mean count per op (balanced routing wanders by about that).
        with np.errstate(invalid="ignore"):
            mean = np.array([np.nanmean(p[self.by_stage[st]]) for st in range(self.pp)])[self.stage_of]
            out = (p < (lo - 0.1 * mean)[:, None]) | (p > (hi + 0.1 * mean)[:, None])
        return bool(out.any())

    def _simulate(self, exp: np.ndarray) -> np.ndarray:
        """Makespan (n,) of expected durations (n, world, phase, vp, m): per replica, each stage's
        op takes as long as its slowest TP rank; the iteration waits for the slowest replica."""
        n = exp.shape[0]
        lay_shape = (n, self.dp, self.pp) + exp.shape[3:]
        fwd, bwd = np.zeros(lay_shape), np.zeros(lay_shape)
        np.maximum.at(fwd, (slice(None), self.dp_of, self.stage_of), exp[:, :, 0])
        np.maximum.at(bwd, (slice(None), self.dp_of, self.stage_of), exp[:, :, 1])
        res = simulate(self.plan, fwd.reshape((-1,) + lay_shape[2:]), bwd.reshape((-1,) + lay_shape[2:]),
                       p2p_latency_s=self.cfg.resihp_p2p_latency_s)
        return res.makespan_s.reshape(n, self.dp).max(axis=1)

    def _score(self, rec: TraceRecord, sample: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, float]:
        obs = sample["obs"]
        exp = self._predict(sample["feats"]) * self.bias[:, None, None, None] * sample["ran"]
        with np.errstate(all="ignore"):
            scores = np.nansum(obs, axis=(1, 2, 3)) / exp.sum(axis=(1, 2, 3))
        stage_scores = np.full((self.pp, self.dp), np.nan)
        for s in range(self.pp):
            for d in range(self.dp):
                ranks = np.flatnonzero((self.stage_of == s) & (self.dp_of == d))
                o = obs[ranks]
                if np.isnan(o).all():
                    continue
                stage_scores[s, d] = np.nanmax(o, axis=0).sum() / exp[ranks].max(axis=0).sum()
        expected_s = float(self._simulate(exp[None])[0]) + self.overhead_s
        return scores, stage_scores, expected_s


class RawTimeDetector(_Base):
    """Baseline: a rank's busy time against its own healthy median; the same persistence rule."""

    name = "raw"

    def _setup(self, rec: TraceRecord) -> None:
        self.center = np.ones(self.world)
        self.iter_center = 0.0

    def _sample(self, rec: TraceRecord) -> dict[str, Any]:
        busy = np.nansum(rec.fwd_s, axis=(1, 2)) + np.nansum(rec.bwd_s, axis=(1, 2))
        return {"busy": np.where(rec.present, busy, np.nan)}

    def _fit(self) -> None:
        # The centre is the place's (its work's) healthy busy time, whichever device produced it;
        # the noise is the device's own.
        busy = self._scaled("busy")
        healthy = np.stack([b["healthy"] for b in self.buffer])
        center = nanmedian(np.where(healthy, busy, np.nan), axis=0)
        self.center = np.where(np.isfinite(center) & (center > 0), center, self.center)
        own, settled = self._settled(healthy)
        self._set_sigma(busy / self.center, own & settled)
        self.iter_center = float(np.median([b["iteration_s"] for b in self.buffer]))

    def _score(self, rec: TraceRecord, sample: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, float]:
        scores = sample["busy"] / self.center
        stage_scores = np.full((self.pp, self.dp), np.nan)
        for s in range(self.pp):
            for d in range(self.dp):
                ranks = np.flatnonzero((self.stage_of == s) & (self.dp_of == d))
                b = sample["busy"][ranks]
                if np.isfinite(b).any():
                    stage_scores[s, d] = np.nanmax(b) / self.center[ranks].max()
        return scores, stage_scores, self.iter_center


def make_detector(config: ResiHPConfig, name: str | None = None) -> ResiHPDetector | RawTimeDetector:
    """The detector named by ``name`` or ``config.resihp_detector``."""
    which = name or config.resihp_detector
    if which == "resihp":
        return ResiHPDetector(config)
    if which == "raw":
        return RawTimeDetector(config)
    raise ValueError(f"unknown detector {which!r}; expected 'resihp' or 'raw'")

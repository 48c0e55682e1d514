"""ResiHP in the training loop: ``--resihp`` and the fault-injection flags.

Each iteration the pipeline events of all ranks are joined on the logging rank (last stage, tp 0,
dp 0), turned into a trace record (per rank / chunk / micro-batch compute durations and the
micro-batches' document lengths) and fed to the detector; verdicts go to the log, the verdict JSONL
file and TensorBoard, and the record to ``--resihp-trace-out``. Fail-stop is the job's liveness
(``ft/liveness.py``, run by the fault-tolerance core): this extension hands the core its layout
chooser (``choose.choose_layout``) and turns each loss the core names into a ``fail_stop`` verdict
for its log and the run-end outcome lines. Fault injection (``injection``) works with or without
``--resihp``, so the raw-time baseline can be measured on the same faults.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from megatron_ext.pipeline.events import Phase
from megatron_ext.resihp import config as _config  # noqa: F401  (registers the "resihp" section)
from megatron_ext.resihp.choose import model_spec
from megatron_ext.resihp.injection import (FaultInjectionConfig, HangInjector, LinkThrottle, Throttle, die_now,
                                         raise_now)
from megatron_ext.resihp.trace import FaultLabel, TraceLayout, TraceRecord
from megatron_ext.runtime.extension import Extension, IterationMetrics, register_extension

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.pipeline.timeline import IterationRecord
    from megatron_ext.resihp.config import ResiHPConfig
    from megatron_ext.resihp.verdicts import Verdict
    from megatron_ext.runtime.loop import Trainer

logger = logging.getLogger(__name__)

def model_chunks(trainer: "Trainer") -> list:
    """This rank's model chunks: megatron's per-virtual-stage chunks, or DeepSpeed's stage module."""
    chunks = getattr(trainer.model, "chunks", None)
    return list(chunks) if chunks is not None else [trainer.model]


def to_trace_record(rec: "IterationRecord", *, model, iteration_s: float, faults: tuple[FaultLabel, ...] = (),
                    time_s: float | None = None, stage_layers: list[int] | None = None,
                    moe: dict[int, dict[str, np.ndarray]] | None = None,
                    devices: tuple[int, ...] | None = None) -> TraceRecord:
    """The detector's view of a joined pipeline iteration. ``moe``: per rank, its MoE probe tables
    (``moe_probe.op_tables``); the time inside the token dispatcher's collectives is taken out of
    the op durations (the rank's own compute is what the trace format asks for) and recorded
    beside them, with the routed counts. ``devices``: the launch rank of each rank
    (``DistContext.members``), kept in the record once a re-layout has renumbered the ranks."""
    world = len(rec.ranks)
    # Replicas may run different micro-batch counts (DP work migration): the table is as wide as
    # the largest, and the ops a replica does not run stay NaN.
    vp = rec.num_chunks
    m = max([rec.num_microbatches, *(len(v) for v in rec.replica_doc_lengths.values())])
    fwd = np.full((world, vp, m), np.nan)
    bwd = np.full((world, vp, m), np.nan)
    for r, events in rec.ranks.items():
        comp = events.compute()
        f = comp[comp["phase"] == Phase.FORWARD]
        b = comp[comp["phase"] == Phase.BACKWARD]
        fwd[r, f["chunk"], f["microbatch"]] = f["t1"] - f["t0"]
        bwd[r, b["chunk"], b["microbatch"]] = b["t1"] - b["t0"]
    dps = sorted({e.dp for e in rec.ranks.values()})
    tps = sorted({e.tp for e in rec.ranks.values()})
    layout = TraceLayout(tp=len(tps), pp=rec.num_stages, dp=len(dps), vp=vp, schedule=rec.schedule, num_microbatches=m,
                    ranks=tuple((rec.ranks[r].stage, rec.ranks[r].dp, rec.ranks[r].tp) for r in range(world)))
    documents = []
    for d in dps:
        per_mb = rec.replica_doc_lengths.get(d, rec.doc_lengths)
        documents.append([[int(n) for seq in per_mb[i] for n in seq] if i < len(per_mb) else [] for i in range(m)])
    # Uneven stages (--pipeline-stage-layers, or a re-layout): the detector's FLOPs per stage follow them.
    layers = [[int(n)] for n in stage_layers] if stage_layers else None
    extra = {}
    if moe:
        tables = {k: np.full((world, vp, m), np.nan) for k in ("routed", "collective_fwd_s", "collective_bwd_s")}
        for r, t in moe.items():
            for k, a in t.items():
                if k in tables:
                    tables[k][r, :a.shape[0], :a.shape[1]] = a[:vp, :m]
        comm_f, comm_b = tables["collective_fwd_s"], tables["collective_bwd_s"]
        # Within an op, so never longer than it; clipped against clock rounding only.
        fwd = np.where(np.isfinite(comm_f) & np.isfinite(fwd), np.maximum(fwd - comm_f, 0.0), fwd)
        bwd = np.where(np.isfinite(comm_b) & np.isfinite(bwd), np.maximum(bwd - comm_b, 0.0), bwd)
        extra = {"routed_tokens": tables["routed"] if np.isfinite(tables["routed"]).any() else None,
                 "moe_comm_fwd_s": comm_f if np.isfinite(comm_f).any() else None,
                 "moe_comm_bwd_s": comm_b if np.isfinite(comm_b).any() else None}
    if devices is not None and tuple(devices) == tuple(range(world)):
        devices = None
    return TraceRecord(iteration=rec.iteration, iteration_s=iteration_s, layout=layout, model=model,
                       documents=documents, fwd_s=fwd, bwd_s=bwd, time_s=time_s, faults=faults, layers=layers,
                       devices=devices, **extra)


def injection_outcome(faults: FaultInjectionConfig, verdicts: list["Verdict"], last_iteration: int) -> list[str]:
    """One line per injected fault: whether a verdict named it, so that a run whose fault went
    unseen says so at the end instead of ending silently. Faults and verdicts meet on the device
    (launch rank), which a re-layout's renumbering does not change."""
    lines = []

    def outcome(what: str, since: int, hit: "Verdict | None", found: str) -> str:
        if since > last_iteration:
            return what + f"never reached (the run ended at iteration {last_iteration})"
        if hit is None:
            return what + f"no verdict in {last_iteration - since + 1} iterations"
        return what + f"named at iteration {hit.iteration} ({found}, {hit.iteration - since} iterations later)"

    for f in faults.slow:
        hit = next((v for v in verdicts if v.kind == "fail_slow" and v.launch_rank == f.rank and v.iteration >= f.since), None)
        lines.append(outcome(f"injected: rank {f.rank} x{f.factor:g} slow from iteration {f.since}; ", f.since, hit,
                             f"x{hit.factor:.2f}" if hit else ""))
    for f in faults.slow_link:
        hit = next((v for v in verdicts if v.kind == "slow_link" and v.link == f.pair and v.iteration >= f.since), None)
        lines.append(outcome(f"injected: link {f.a}-{f.b} at {f.mbps:g} MB/s from iteration {f.since}; ", f.since, hit,
                             f"+{1e3 * hit.detail['extra_s_per_message']:.1f} ms per message" if hit else ""))
    for f in faults.slow_nic:
        hit = next((v for v in verdicts if v.kind == "slow_nic" and v.launch_rank == f.rank and v.iteration >= f.since),
                   None)
        lines.append(outcome(f"injected: rank {f.rank}'s NIC at {f.mbps:g} MB/s from iteration {f.since}; ", f.since,
                             hit, f"about {hit.detail.get('mbps')} MB/s" if hit else ""))
    for f in faults.slow_path:
        hit = next((v for v in verdicts if v.kind == "slow_path" and v.link == f.pair and v.iteration >= f.since), None)
        lines.append(outcome(f"injected: path {f.a}-{f.b} at {f.mbps:g} MB/s from iteration {f.since}; ", f.since, hit,
                             f"+{1e3 * hit.detail['extra_s_per_message']:.1f} ms per message" if hit else ""))
    for f in faults.hang:
        hit = next((v for v in verdicts if v.launch_rank == f.rank and v.kind in ("hang", "fail_stop")), None)
        lines.append(f"injected: rank {f.rank} hung at iteration {f.at} ({f.where}); "
                     + ("no verdict" if hit is None else f"named hung: {hit.detail.get('why')}" if hit.kind == "hang"
                        else f"named {hit.kind} (by {hit.detector}), not hung"))
    named_by = {"launcher": "the launcher (its exit)", "self": "itself (its exception)", "heartbeat": "heartbeat"}
    for what, rank in ([(f"injected: rank {f.rank} stopped at iteration {f.at}; ", f.rank) for f in faults.stop]
                       + [(f"injected: rank {f.rank} raised {f.kind} error at iteration {f.at}; ", f.rank)
                          for f in faults.error]):
        hit = next((v for v in verdicts if v.kind == "fail_stop" and v.launch_rank == rank), None)
        lines.append(what + (f"named by {named_by.get(hit.detector, hit.detector)}" if hit is not None
                             else "no verdict"))
    return lines


class ResiHPExtension(Extension):
    name = "resihp"
    requires = ("timeline",)   # the pipeline events it scores

    def __init__(self, cfg: "ResiHPConfig | None", faults: FaultInjectionConfig | None) -> None:
        self.cfg = cfg
        self.faults = faults
        self.detect = bool(cfg is not None and cfg.resihp)
        self.throttle: Throttle | None = None
        self.link_throttle: LinkThrottle | None = None
        self.detector = None
        self.trace_writer = None
        self.verdict_log = None
        self.timeline = None
        self.verdicts: list[Verdict] = []
        self.actor = None
        self.trainer: Trainer | None = None
        self.iteration_times: list[float] = []   # recent ones of the layout in force (the chooser scales by them)
        self._unlogged: list[Verdict] = []       # losses named while the verdict file was elsewhere
        self.moe_probe = None
        self.detector_member: int | None = None   # launch rank of the process holding the detector
        self.ring_throttle = None                 # an injected slow NIC on the gradient all-reduce
        self.hang_injector = None                 # --inject-hang of this rank
        self.control = None                       # --resihp-control-file (resihp/control.py)
        self.joined_after = 0                     # a replacement joined after this iteration: earlier faults are not its
        self._ring_bytes_per_s: float | None = None   # this rank's injected share of the gradient ring (NIC, path)

    # --- setup -----------------------------------------------------------------------------
    def setup(self, trainer: "Trainer") -> None:
        """At the start of the run, or in a process that joins a running job (a replacement: it is
        set up inside the layout change that takes it in, ``trainer.layout_change``)."""
        self.trainer = trainer
        joining = getattr(trainer, "layout_change", None) is not None
        if self.faults is not None:
            if not joining:  # fault ranks are launch ranks: checked against the world at launch
                self.faults.check_world(trainer.ctx.world_size)
            trainer.fault_points.append(self._fault_point)
            # A replacement (--ft-respawn) meets the faults of its rank from after the iteration it
            # joins at: one that ran an earlier iteration again (a rollback) does not meet the fault
            # that ended the process it replaces a second time.
            self.joined_after = trainer.iteration if joining else 0
            hang = [f for f in self.faults.hang if f.rank == trainer.ctx.member and f.at > self.joined_after]
            if hang:
                self.hang_injector = HangInjector(hang[0], model_chunks(trainer), pp=trainer.ctx.layout.pp)
            mine = [f for f in self.faults.slow if f.rank == trainer.ctx.member]
            if mine:
                self.throttle = Throttle(model_chunks(trainer), mine[0].factor, self.faults.inject_slow_mode)
            if (any(trainer.ctx.member in (f.a, f.b) for f in self.faults.slow_link + self.faults.slow_path)
                    or any(trainer.ctx.member == f.rank for f in self.faults.slow_nic)):
                self.link_throttle = LinkThrottle({}, lambda: trainer.ctx.members)
            self._install_ring_throttle(trainer)
        if self.detect:
            self.timeline = self.deps["timeline"]
            self.spec = model_spec(trainer)
        self._install_moe_probe(trainer)
        if not self.detect:
            return
        self._place_detector(trainer, trace_mode="a" if joining else "w")
        ft = getattr(trainer, "ft", None)
        if ft is not None:
            from megatron_ext.resihp.choose import choose_layout

            ft.chooser = choose_layout
            ft.listeners.append(self._on_loss)

    def _place_detector(self, trainer: "Trainer", *, trace_mode: str) -> None:
        """The detector runs on the logging rank (last stage, tp 0, dp 0). After a rank
        permutation or a fail-stop regroup that may be another process: the detector goes there
        (``_hand_over``), with its calibration and what it knows of each device, and the new
        holder appends to the same files. Only when the process that held it is gone does the
        new one start from nothing."""
        from megatron_ext.resihp.jsonl import JsonLinesWriter

        rank = trainer.ctx.rank
        self.detector_rank = next(r for r, c in trainer.ctx.layout.rank_coords()
                                  if c.pp == trainer.ctx.layout.pp - 1 and c.tp == 0 and c.dp == 0)
        received = self._hand_over(trainer)
        self.detector_member = trainer.ctx.members[self.detector_rank]
        if rank != self.detector_rank:
            for f in (self.trace_writer, self.verdict_log):
                if f is not None:
                    f.close()
            self.detector = self.trace_writer = self.verdict_log = None
        else:
            from megatron_ext.resihp.detector import make_detector
            from megatron_ext.resihp.verdicts import VerdictLog

            # The process that held the file is gone (no hand-over): the losses it could not write
            # are written here.
            orphaned = self.detector is None and received is None and trace_mode == "a"
            if self.detector is None:
                self.detector = received if received is not None else make_detector(self.cfg)
            if self.cfg.resihp_links and getattr(self.detector, "link_detector", None) is None:
                from megatron_ext.resihp.links import LinkDetector

                # An attribute of the detector, so it is handed over with it (``_hand_over``).
                self.detector.link_detector = LinkDetector(warmup=self.cfg.resihp_warmup, window=self.cfg.resihp_window,
                                                           floor_s=self.cfg.resihp_link_floor_ms / 1e3,
                                                           **self._link_severe())
            if self.cfg.resihp_nic_probe_interval and getattr(self.detector, "nic_detector", None) is None:
                from megatron_ext.resihp.nic import NicDetector

                self.detector.nic_detector = NicDetector(
                    nbytes=1024 * self.cfg.resihp_nic_probe_kb, warmup=self.cfg.nic_probe_warmup,
                    window=self.cfg.resihp_window, floor_s=self.cfg.resihp_link_floor_ms / 1e3, **self._link_severe())
            if self.cfg.resihp_nic_probe_interval and getattr(self.detector, "path_detector", None) is None:
                from megatron_ext.resihp.nic import PathDetector

                # Slow paths between probe-ring neighbours, from the same probe rows; handed over
                # with the detector as the NIC detector is.
                self.detector.path_detector = PathDetector(
                    nbytes=1024 * self.cfg.resihp_nic_probe_kb, warmup=self.cfg.nic_probe_warmup,
                    window=self.cfg.resihp_window, floor_s=self.cfg.resihp_link_floor_ms / 1e3, **self._link_severe())
            if self.trace_writer is None and self.cfg.resihp_trace_out:
                self.trace_writer = JsonLinesWriter(self.cfg.resihp_trace_out, trace_mode)
            if self.verdict_log is None and self.cfg.resihp_verdicts_out:
                self.verdict_log = VerdictLog(self.cfg.resihp_verdicts_out)
            if self.verdict_log is not None and orphaned:
                for v in self._unlogged:
                    self.verdict_log.write(v)
        self._unlogged = []
        if self.cfg.resihp_act != "off":
            from megatron_ext.resihp.act import Actor

            if self.actor is None or self.actor.decider != self.detector_rank or self.actor.decides != (rank == self.detector_rank):
                old, self.actor = self.actor, Actor(self.cfg, rank=rank, decider=self.detector_rank)
                if old is not None:
                    # Another shape put the decision on another rank: it plans on from the beliefs
                    # the last applied plan carried (a slow NIC or link is not forgotten).
                    self.actor.carried = old.carried

    def _hand_over(self, trainer: "Trainer"):
        """Collective between two ranks: when the logging rank is now another process than the
        one holding the detector (and that one is still in the job), the holder sends it the
        detector; returns it on the receiving rank, None elsewhere. Why send it rather than start
        afresh: a new calibration learns a device that is known to be slow as normal, loses its
        verdict (no ``recovered`` would ever follow) and keeps nothing of the others' noise."""
        ctx = trainer.ctx
        change = getattr(trainer, "layout_change", None)
        # Every member of the new layout names the same old holder: the old logging rank.
        old = change.old_logger if change is not None else self.detector_member
        new = ctx.members[self.detector_rank]
        if old is None or old == new or old not in ctx.members:
            return None
        import torch.distributed as dist

        src = list(ctx.members).index(old)
        if ctx.rank == src:
            dist.send_object_list([self.detector], dst=self.detector_rank)
            return None
        if ctx.rank != self.detector_rank:
            return None
        box = [None]
        dist.recv_object_list(box, src=src)
        detector = box[0]
        slow = [f"launch rank {d} x{f:.2f}" for d, f in detector.known_slow().items()]
        links = getattr(detector, "link_detector", None)
        if links is not None:
            slow += [f"link {a}-{b} +{1e3 * s:.1f} ms/message" for (a, b), s in links.known_slow().items()]
        nics = getattr(detector, "nic_detector", None)
        if nics is not None:
            slow += [f"NIC of launch rank {d} +{1e3 * s:.1f} ms/probe" for d, s in nics.known_slow().items()]
        paths = getattr(detector, "path_detector", None)
        if paths is not None:
            slow += [f"path {a}-{b} +{1e3 * s:.1f} ms/probe" for (a, b), s in paths.known_slow().items()]
        slow = ", ".join(slow) or "none"
        print(f" resihp: detector handed over with the logging rank from launch rank {old} to launch rank {new} "
              f"(known slow: {slow})", flush=True)
        return detector

    def _install_ring_throttle(self, trainer: "Trainer") -> None:
        """This rank's injected slow NIC, or a slow path of which it is the smaller end, also holds
        its share of the gradient all-reduce (the model's config is rebuilt by a re-layout:
        installed again in ``attach``; whether the path's ends are ring neighbours is decided each
        iteration, ``_ring_bandwidth``)."""
        me = trainer.ctx.member
        if not (any(me == f.rank for f in self.faults.slow_nic) or any(me == f.pair[0] for f in self.faults.slow_path)):
            return
        from megatron_ext.resihp.injection import GradRingThrottle, gradient_bytes

        self.ring_throttle = GradRingThrottle(trainer.model.config, gradient_bytes(model_chunks(trainer)),
                                              trainer.ctx.layout.dp, lambda: self._ring_bytes_per_s)

    def _ring_bandwidth(self, trainer: "Trainer", iteration: int) -> float | None:
        """Bytes/s of this rank's share of the gradient ring this iteration: its injected slow NIC,
        and each injected slow path of which it is the smaller end while the two ends are
        neighbours on a data-parallel ring of the layout in force (the slowest; None: healthy)."""
        from megatron_ext.resihp.injection import dp_ring_neighbours

        me, layout = trainer.ctx.member, trainer.ctx.layout
        found = [f.mbps * 1e6 for f in self.faults.slow_nic if f.rank == me and iteration >= f.since]
        found += [f.mbps * 1e6 for f in self.faults.slow_path if f.pair[0] == me and iteration >= f.since
                  and dp_ring_neighbours(layout, *f.pair)]
        return min(found) if found else None

    def _link_severe(self) -> dict:
        """The severe rule of the link, NIC and path watches (``links.ExcessWatch``)."""
        return {"severe_factor": self.cfg.resihp_link_severe_factor, "severe_window": self.cfg.resihp_severe_window}

    def _install_moe_probe(self, trainer: "Trainer") -> None:
        """MoE models on the megatron engine: routed counts and dispatcher collective time per op
        (``moe_probe``) for the detector, and for an injected slow rank the collective time its
        throttle must not stretch (a slow device computes slower; waiting for its EP peers is not
        its compute). Without the hooks (another megatron-core) the detector assumes uniform
        routing and the durations keep the collectives, and the log says so once."""
        if trainer.cfg.model.num_experts is None or not (self.detect or self.throttle is not None):
            return
        recorder = getattr(self.timeline, "recorder", None)
        if self.detect and recorder is None:
            return
        from megatron_ext.resihp.moe_probe import MoEProbe

        try:
            self.moe_probe = MoEProbe(recorder).install(model_chunks(trainer))
        except RuntimeError as exc:
            self.moe_probe = None
            logger.warning("resihp: no MoE probe (%s); the detector assumes uniform routing and op durations "
                           "include the expert-parallel collectives", exc)
            return
        if self.throttle is not None:
            self.throttle.exclude_s = self.moe_probe.collective_total_s

    def _moe_tables(self, trainer: "Trainer") -> dict[int, dict[str, np.ndarray]] | None:
        """Collective over the job when a probe is installed: every rank's probe tables on the
        detector's rank (None elsewhere, and where no probe runs)."""
        if self.moe_probe is None or self.moe_probe.recorder is None:
            return None
        import torch.distributed as dist

        from megatron_ext.resihp.moe_probe import op_tables

        recorder = self.timeline.recorder
        events = recorder.events()
        comp = events[events["phase"] <= 1]
        m = int(comp["microbatch"].max()) + 1 if len(comp) else 0
        vp = trainer.ctx.vpp or 1
        tables = op_tables(events, self.moe_probe.rows(), num_chunks=vp, num_microbatches=m,
                           layers_per_chunk=self.moe_probe.layers_per_chunk)
        if recorder.dropped or self.moe_probe.dropped:  # event indices past a full buffer mean nothing
            tables = {k: np.full_like(a, np.nan) for k, a in tables.items()}
        if recorder.timing != "host":
            # A host clock around a GPU collective times its launch, not its wait: keep the counts only.
            tables["collective_fwd_s"][:] = np.nan
            tables["collective_bwd_s"][:] = np.nan
        mine = (trainer.ctx.rank, tables)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return dict([mine])
        parts = [None] * dist.get_world_size() if trainer.ctx.rank == self.detector_rank else None
        dist.gather_object(mine, parts, dst=self.detector_rank)
        return dict(parts) if parts is not None else None

    def detach(self, trainer: "Trainer") -> None:
        if self.throttle is not None:
            self.throttle.remove()
        if self.ring_throttle is not None:
            self.ring_throttle.remove()
            self.ring_throttle = None
        if self.moe_probe is not None:
            self.moe_probe.uninstall()
            self.moe_probe = None

    def attach(self, trainer: "Trainer") -> None:
        """After a re-layout: slow the new chunks of an injected slow rank, describe the new model
        split. The detector and its files stay where they are, or, when the logging rank is now
        another process, go with it (``_hand_over``). The detector sees the new layout and rank
        order in the next record and carries its per-device state over
        (``detector._Base._relayout``)."""
        self.iteration_times = []  # another layout: its own times from here
        if self.hang_injector is not None:
            self.hang_injector.attach(model_chunks(trainer))
        if self.throttle is not None:
            active = self.throttle.active
            self.throttle = Throttle(model_chunks(trainer), self.throttle.factor, self.faults.inject_slow_mode)
            self.throttle.active = active
        if self.faults is not None:
            self._install_ring_throttle(trainer)
        if self.moe_probe is not None:
            self.moe_probe.uninstall()
            self.moe_probe = None
        if self.detect:
            self.spec = model_spec(trainer)
        self._install_moe_probe(trainer)
        if self.detect:
            self._place_detector(trainer, trace_mode="a")

    def _fault_point(self, point: str, iteration: int) -> None:
        if iteration <= self.joined_after:
            return
        if self.hang_injector is not None:
            self.hang_injector.fault_point(point, iteration)
        for f in self.faults.stop:
            if f.rank == self.trainer.ctx.member and f.at == iteration and f.point == point:
                die_now(f.rank, iteration, point)
        for f in self.faults.error:
            if f.rank == self.trainer.ctx.member and f.at == iteration and point == "start":
                raise_now(f)

    def _on_loss(self, loss, silence) -> None:
        """The core named a lost process (on any thread): a ``fail_stop`` verdict for the verdict
        file and the run-end outcome (the detector's rank writes them)."""
        from megatron_ext.resihp.verdicts import Verdict

        detail = {"launch_rank": loss.member, "how": loss.how, "why": loss.why}
        if silence is not None:
            layout = self.trainer.ctx.layout
            stage = layout.coord(silence.rank).pp if silence.rank < self.trainer.ctx.world_size else None
            v = Verdict.fail_stop(silence, stage=stage, launch_rank=loss.member)
            v = Verdict(**{**v.to_dict(), "detail": {**v.detail, **detail}})
        else:
            # named by another path than its heartbeat (an exit report, the launcher): its stage still
            # comes from the layout it was lost in
            ctx = self.trainer.ctx
            members = list(getattr(ctx, "members", None) or range(ctx.world_size))
            stage = ctx.layout.coord(members.index(loss.member)).pp if loss.member in members else None
            v = Verdict(kind="hang" if loss.how == "hang" else "fail_stop", rank=loss.member, stage=stage,
                        iteration=loss.iteration, factor=None,
                        confidence=1.0, detector=loss.how, time_s=time.time(), detail=detail)
        self.verdicts.append(v)
        if self.verdict_log is not None:
            self.verdict_log.write(v)
        else:  # the detector's file may come here with the change that follows (``_place_detector``)
            self._unlogged.append(v)

    # --- per iteration ---------------------------------------------------------------------
    def _active_faults(self, iteration: int) -> tuple[FaultLabel, ...]:
        if self.faults is None:
            return ()
        out = [FaultLabel(kind="slow", rank=f.rank, since=f.since, factor=f.factor)
               for f in self.faults.slow if iteration >= f.since]
        out += [FaultLabel(kind="stop", rank=f.rank, since=f.at) for f in self.faults.stop if iteration >= f.at]
        return tuple(out)

    def before_iteration(self, trainer: "Trainer", iteration: int) -> None:
        if self.faults is not None:
            self._fault_point("start", iteration)
            if self.throttle is not None:
                since = next(f.since for f in self.faults.slow if f.rank == trainer.ctx.member)
                self.throttle.active = iteration >= since
            if self.link_throttle is not None:
                me = trainer.ctx.member
                links = {}
                for f in self.faults.slow_link + self.faults.slow_path:   # a path: its probe messages too
                    if me in (f.a, f.b) and iteration >= f.since:
                        peer = f.b if f.a == me else f.a
                        links[peer] = min(links.get(peer, float("inf")), f.mbps * 1e6)
                for f in self.faults.slow_nic:       # a slow NIC: every send of the device crosses it
                    if f.rank == me and iteration >= f.since:
                        for m in trainer.ctx.members:
                            if m != me:
                                links[m] = min(links.get(m, float("inf")), f.mbps * 1e6)
                self.link_throttle.links = links
                self.link_throttle.active = bool(links)
            if self.ring_throttle is not None:
                self._ring_bytes_per_s = self._ring_bandwidth(trainer, iteration)
        if self.moe_probe is not None:
            self.moe_probe.reset()

    def after_iteration(self, trainer: "Trainer", metrics: IterationMetrics) -> None:
        self.iteration_times = (self.iteration_times + [metrics.iter_time_s])[-20:]
        if not self.detect:
            return
        record = self.timeline.record(trainer, metrics.iteration, dst=self.detector_rank)
        probe = self._nic_probe(trainer, metrics.iteration)
        moe = self._moe_tables(trainer)
        if self.detector is not None and self.cfg.resihp_control_file:
            from megatron_ext.resihp.control import ControlFile

            self.control = self.control or ControlFile(self.cfg.resihp_control_file)
            for line in self.control.poll(metrics.iteration, self.detector, self.verdicts):
                print(f"resihp: {line}", flush=True)
        on = self.control is None or self.control.detection
        new_verdicts = (self._detect(trainer, metrics, record, moe, probe)
                        if record is not None and self.detector is not None and on else [])
        if self.actor is not None:
            plan = self.actor.observe(trainer, metrics.iteration, new_verdicts, metrics.iter_time_s)
            if plan is not None and self.verdict_log is not None:
                self.verdict_log.write_line({"kind": "plan", "iteration": metrics.iteration, **plan.to_dict()})

    def _nic_probe(self, trainer: "Trainer", iteration: int) -> list[tuple[float, float]] | None:
        """Every --resihp-nic-probe-interval iterations, on every rank: the ring probe (``nic.py``);
        the arrival times of all ranks on each (None between probes)."""
        every = self.cfg.resihp_nic_probe_interval
        if not every or iteration % every or trainer.ctx.world_size < 2:
            return None
        import torch
        import torch.distributed as dist

        from megatron_ext.resihp.nic import ring_probe
        from megatron_ext.runtime.distributed import collective_device

        throttle = self.link_throttle
        hold = None
        if throttle is not None:
            hold = lambda nbytes, peer: throttle.hold(nbytes, trainer.ctx.members[peer])  # noqa: E731
        # The world group's collective device: NCCL sends no CPU tensor, gloo sends no CUDA one.
        device = collective_device(trainer.ctx)
        mine = torch.tensor(ring_probe(1024 * self.cfg.resihp_nic_probe_kb, hold=hold, device=device),
                            dtype=torch.float64, device=device)
        every_rank = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(trainer.ctx.world_size)]
        dist.all_gather(every_rank, mine)
        return [tuple(float(x) for x in t.tolist()) for t in every_rank]

    def _detect(self, trainer: "Trainer", metrics: IterationMetrics, record: "IterationRecord",
                moe: dict[int, dict[str, np.ndarray]] | None = None,
                probe: list[tuple[float, float]] | None = None) -> list["Verdict"]:
        trace = to_trace_record(record, model=self.spec, iteration_s=metrics.iter_time_s,
                                faults=self._active_faults(metrics.iteration), time_s=time.time(),
                                stage_layers=trainer.ctx.layout.stage_layers, moe=moe,
                                devices=tuple(trainer.ctx.members))
        if self.trace_writer is not None:
            self.trace_writer.write(trace)
        report = self.detector.observe(trace)
        found = list(report.verdicts)
        nics = getattr(self.detector, "nic_detector", None)
        if nics is not None and probe is not None:
            found += nics.observe(probe, trainer.ctx.members, metrics.iteration)
            if nics.last:
                metrics.extra["resihp_nic_egress_ms"] = round(1e3 * max(nics.last.values()), 2)
        paths = getattr(self.detector, "path_detector", None)
        if paths is not None and probe is not None:
            found += paths.observe(probe, trainer.ctx.members, metrics.iteration)
            if paths.last:
                metrics.extra["resihp_path_ms"] = round(1e3 * max(paths.last.values()), 2)
        links = getattr(self.detector, "link_detector", None)
        if links is not None and record.num_stages > 1:
            # after the NIC probe: a link verdict a suspected NIC may explain waits for it
            found += [v.on_devices(trainer.ctx.members)
                      for v in links.observe(record, trainer.ctx.members, metrics.iteration, nics=nics)]
            if links.last:
                metrics.extra["resihp_link_rt_ms"] = round(1e3 * max(links.last.values()), 2)
        scalars = report.scalars()
        if "expected_s" in scalars:
            metrics.extra["resihp_expected_ms"] = round(scalars["expected_s"] * 1e3, 1)
        if "max_rank_score" in scalars:
            metrics.extra["resihp_max_score"] = round(scalars["max_rank_score"], 3)
            metrics.extra["resihp_max_score_rank"] = int(np.nanargmax(report.rank_scores))
        tb = trainer.tensorboard
        if tb is not None:
            for k, v in scalars.items():
                if np.isfinite(v):
                    tb.add_scalar(f"resihp/{k}", v, metrics.iteration)
        for v in found:
            self.verdicts.append(v)
            print(f" {v.describe()}", flush=True)
            if self.verdict_log is not None:
                self.verdict_log.write(v)
            if tb is not None and v.kind == "fail_slow":
                tb.add_scalar(f"resihp/fail_slow_rank{v.launch_rank}", v.factor, metrics.iteration)
        return found

    def teardown(self, trainer: "Trainer") -> None:
        if self.detector is not None and self.faults is not None and self.faults.any:
            for line in injection_outcome(self.faults, self.verdicts, trainer.iteration):
                print(f"resihp: {line}", flush=True)
        if self.throttle is not None:
            self.throttle.remove()
        if self.hang_injector is not None:
            self.hang_injector.remove()
            self.hang_injector = None
        if self.link_throttle is not None:
            self.link_throttle.remove()
            self.link_throttle = None
        if self.ring_throttle is not None:
            self.ring_throttle.remove()
            self.ring_throttle = None
        if self.moe_probe is not None:
            self.moe_probe.uninstall()
            self.moe_probe = None
        for f in (self.trace_writer, self.verdict_log):
            if f is not None:
                f.close()


@register_extension("resihp")
def _factory(cfg) -> ResiHPExtension | None:
    resihp = cfg.ext("resihp")
    faults = cfg.ext("faults")
    if faults is not None and (faults.slow_link or faults.slow_nic or faults.slow_path):
        from megatron_ext.engines import engine

        if faults.slow_link:
            engine(cfg.parallel.engine).refuse("slow_link_injection")
        if faults.slow_nic:
            engine(cfg.parallel.engine).refuse("slow_nic_injection")
        if faults.slow_path:
            engine(cfg.parallel.engine).refuse("slow_path_injection")
    if (resihp is not None and resihp.resihp) or (faults is not None and faults.any):
        return ResiHPExtension(resihp, faults)
    return None



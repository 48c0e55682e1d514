"""ResiHP's part in a layout change: which layout for these devices.

The fault-tolerance core (``ft/core.py``) owns what happens when a rank dies, slows or comes back;
ResiHP supplies only the decision, on both paths, through one rule from plan to target:

* ``target_from_plan`` -- a planner ``Plan`` as the core's ``LayoutTarget`` (even stages and an
  even split written as None, devices as members). The fail-slow actor (``act.py``) and the chooser
  below both use it.
* ``choose_layout`` -- the core's ``Chooser``: the layout for ``devices`` after a loss (the
  planner with every knob: DP shrink, PP re-partition over the survivors, another TP x PP shape,
  uneven micro-batches where the engine runs them; a rank permutation costs nothing, since the
  ranks are renumbered anyway) or when replacements arrive (``grow``: the planner's best layout,
  the layout the job was launched with, and the current shape widened over the devices, scored by
  the same model; the launch layout wins ties).
"""
from __future__ import annotations

import logging
import statistics
from typing import TYPE_CHECKING

import numpy as np

from megatron_ext.ft.target import LayoutTarget
from megatron_ext.models.flops import spec_of_model
from megatron_ext.resihp.planner_types import Cluster, PlanLayout, PlannerConfig, Workload

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.ft.protocol import TrainerLike
    from megatron_ext.resihp.planner import Planner

logger = logging.getLogger(__name__)


def model_spec(trainer: "TrainerLike"):
    """The run's model as the FLOPs model sees it, from the model family's registry entry (GQA,
    SwiGLU and MoE included)."""
    from megatron_ext.runtime.model import model_vocab_size

    vocab = model_vocab_size(trainer.cfg, trainer.splits.tokenizer.vocab_size)
    return spec_of_model(trainer.cfg.model, vocab)


def extension_of(trainer: "TrainerLike"):
    """The ResiHP extension of ``trainer`` (None when it runs without one)."""
    return next((e for e in trainer.extensions if getattr(e, "name", None) == "resihp"), None)


# In-memory state moves between CPU ranks on one host: about a memory copy plus pickling.
CPU_LINK_BYTES_PER_S = 1e9
CPU_RELAYOUT_PAUSE_S = 2.0   # groups, model chunks and optimizer rebuilt (measured 1-3 s on 2 cores)


def plan_layout(trainer: "TrainerLike") -> PlanLayout:
    """The layout in force, in the planner's terms. Devices are the launch ranks of the ranks in
    megatron's order (``ctx.members``: ``0..world-1`` until a permutation or a fail-stop renumbers
    them)."""
    ctx, cfg = trainer.ctx, trainer.cfg
    lay, vp = ctx.layout, ctx.vpp or 1
    stages = lay.stage_layers
    if stages is None:
        per_chunk = cfg.model.num_layers // (lay.pp * vp)
        layers = tuple(tuple([per_chunk] * vp) for _ in range(lay.pp))
    else:
        layers = tuple((int(n),) for n in stages)
    split = lay.replica_microbatches
    m = trainer.train_stream.num_microbatches
    return PlanLayout(tp=lay.tp, pp=lay.pp, dp=lay.dp, vp=vp, schedule="interleaved" if vp > 1 else "1f1b",
                      layers=layers, microbatches=tuple(split) if split else (m,) * lay.dp,
                      devices=tuple(ctx.members))


def make_planner(trainer: "TrainerLike", *, executable_only: bool, min_gain: float = 0.05,
                 min_gain_healthy: float = 0.02, horizon: int = 500,
                 healthy_times: list[float] | None = None, live_reshape: bool = False,
                 device_flops: float | None = None) -> "Planner":
    """A planner for the running job. ``executable_only``: search only what ``Trainer.relayout``
    applies in a live job with every rank kept (the engine's ``relayout_knobs``: layers per stage,
    micro-batches per replica, a rank permutation; other TP x PP x DP sizes over the same ranks only
    with ``live_reshape``, ``--resihp-act-reshape``). The device speed is scaled so that the model predicts the healthy
    iterations measured so far: plans compare layouts relative to each other, but the pause is
    amortized in seconds. ``device_flops``: that scale as another decider took it (``Actor``'s
    carried beliefs), since the layout in force may no longer be the one the times were measured in."""
    from megatron_ext.resihp.planner import Planner

    spec = model_spec(trainer)
    t = trainer.cfg.training
    workload = Workload(seq_length=trainer.cfg.model.seq_length, micro_batch_size=t.micro_batch_size,
                        state_bytes_per_param=12.0 if not t.bf16 else 16.0,
                        grad_bytes_per_param=2.0 if t.bf16 else 4.0, activation_bytes_per_value=2.0 if t.bf16 else 4.0)
    config = PlannerConfig(min_gain=min_gain, min_gain_healthy=min_gain_healthy, horizon_iterations=horizon,
                           tp_regroup=not executable_only or "permute" in trainer.relayout_knobs,
                           dp_migration="microbatches" in trainer.relayout_knobs,
                           uneven_microbatches="microbatches" in trainer.relayout_knobs,
                           drop_replicas=not executable_only, grow_replicas=not executable_only,
                           reshape=not executable_only or (live_reshape and "shape" in trainer.relayout_knobs),
                           reshape_keeps_devices=executable_only)
    if device_flops is None:
        probe = Cluster(device_flops=1e12, memory_bytes=float("inf"), link_bytes_per_s=CPU_LINK_BYTES_PER_S)
        predicted = Planner(spec, probe, workload, config).iteration_s(plan_layout(trainer),
                                                                       np.ones(max(trainer.ctx.members) + 1))
        measured = statistics.median(healthy_times) if healthy_times else predicted
        device_flops = 1e12 * predicted / max(measured, 1e-9)
    cluster = Cluster(device_flops=device_flops, memory_bytes=float("inf"),
                      link_bytes_per_s=CPU_LINK_BYTES_PER_S, relayout_pause_s=CPU_RELAYOUT_PAUSE_S)
    return Planner(spec, cluster, workload, config)


def target_from_plan(new: PlanLayout) -> LayoutTarget:
    """The one rule from the planner's layout to a target."""
    return new.as_layout()


def not_applicable(trainer: "TrainerLike", target: LayoutTarget) -> str | None:
    """Why the live job cannot apply ``target`` with every rank kept (the core's rules and the
    engine's refusals), or None when it can."""
    from megatron_ext.errors import UserError
    from megatron_ext.ft.target import check

    try:
        trainer.check_target(target)
        check(target, cfg=trainer.cfg, members=trainer.ctx.members, knobs=trainer.relayout_knobs,
              membership_may_change=False, what="the plan")
    except UserError as exc:
        return str(exc)
    return None


def _speeds(trainer: "TrainerLike", devices: list[int], lost: list[int]) -> np.ndarray:
    """1 for every available device (or the slowdown the fail-slow policy believes, where it
    runs), 0 for the lost and the absent."""
    size = max([*devices, *trainer.ctx.members, *lost]) + 1
    speeds = np.zeros(size)
    speeds[devices] = 1.0
    actor = getattr(extension_of(trainer), "actor", None)
    if actor is not None and actor.policy is not None:
        known = [d for d in devices if d < actor.policy.speeds.shape[0]]
        speeds[known] = np.minimum(speeds[known], actor.policy.speeds[known])
    speeds[list(lost)] = 0.0
    return speeds


def _slow_links(trainer: "TrainerLike", devices: list[int]) -> tuple[dict, dict]:
    """The slow pipeline links and NICs the fail-slow policy believes in (where it runs), among
    ``devices``: the planner weighs them after a loss as it does before."""
    actor = getattr(extension_of(trainer), "actor", None)
    if actor is None or actor.policy is None:
        return {}, {}
    keep = set(devices)
    return ({k: x for k, x in actor.policy.links.items() if k[0] in keep and k[1] in keep},
            {d: x for d, x in actor.policy.nics.items() if d in keep})


def _healthy_times(trainer: "TrainerLike") -> list[float]:
    """Iteration times of the layout in force while healthy: the fail-slow actor's, where it runs
    (taken before its first verdict), else the extension's recent ones."""
    ext = extension_of(trainer)
    actor = getattr(ext, "actor", None)
    if actor is not None and actor.healthy_times:
        return list(actor.healthy_times)
    return list(getattr(ext, "iteration_times", []) or [])


def choose_layout(trainer: "TrainerLike", devices: list[int], lost: list[int], cause: str
                  ) -> tuple[LayoutTarget, str] | str:
    """The core's ``Chooser``, on the round's leader: a target over ``devices`` (launch ranks) and
    its plan line, or why the job cannot continue."""
    from megatron_ext.resihp.planner_types import PlanningError

    try:
        layout = plan_layout(trainer)  # devices are launch ranks, as ``devices``, ``lost`` and the policy's
        speeds = _speeds(trainer, devices, lost)
        links, nics = _slow_links(trainer, devices)
        # The model's device speed is scaled to the iteration times measured in the layout in force
        # (before the fault): how compute weighs against the links on this machine decides between
        # more replicas and more stages, and 1 TFLOP/s per CPU rank would misjudge it by 100x.
        times = _healthy_times(trainer)
        planner = make_planner(trainer, executable_only=False, min_gain=0.0, healthy_times=times)
        if cause == "grow":
            return _grow(trainer, planner, layout, speeds, devices, links, nics)
        plan = planner.plan(layout, speeds, links=links, nics=nics)
    except PlanningError as exc:
        return str(exc)
    if plan is None:
        return "the planner found no layout for the survivors"
    line = plan.describe()
    if not times:  # e.g. a loss right after another change: no iteration of this layout measured
        line += " [seconds of the planner's model at 1 TFLOP/s per rank: no iteration of the layout in force measured]"
    return _checked(trainer, plan.new, line)


def _checked(trainer: "TrainerLike", new: PlanLayout, describe: str) -> tuple[LayoutTarget, str] | str:
    target = target_from_plan(new)
    if new.vp > 1 and target.stage_layers is not None:
        return f"the next layout needs uneven interleaved chunks ({describe})"
    if target.replica_microbatches is not None and "microbatches" not in trainer.relayout_knobs:
        return (f"the next layout needs uneven micro-batches per replica ({describe}), which this engine "
                "cannot run")
    return target, describe


def _grow(trainer: "TrainerLike", planner: "Planner", layout: PlanLayout, speeds: np.ndarray, devices: list[int],
          links: dict | None = None, nics: dict | None = None) -> tuple[LayoutTarget, str] | str:
    """Replacements arrived: the best of (the launch layout over every device, the current shape
    widened to every device, the planner's own best), by the planner's model; ties go to the
    launch layout, then the current shape."""
    from megatron_ext.resihp.planner_types import PlanningError

    num_layers, m = trainer.cfg.model.num_layers, layout.num_microbatches
    candidates: list[tuple[str, PlanLayout]] = []
    launch = trainer.ft.launch_target() if getattr(trainer, "ft", None) is not None else None
    shapes = ([("the launch layout", launch.tp, launch.pp, launch.vp)] if launch is not None else []) + [
        ("the current shape", layout.tp, layout.pp, layout.vp)]
    for name, tp, pp, vp in shapes:
        if len(devices) % (tp * pp) or m < len(devices) // (tp * pp):
            continue
        # The devices in their order at launch: neighbours at launch are neighbours again.
        try:
            candidates.append((name, PlanLayout.even(num_layers=num_layers, tp=tp, pp=pp, dp=len(devices) // (tp * pp),
                                                     num_microbatches=m, vp=vp, devices=sorted(devices))))
        except PlanningError:
            continue
    best_layout, _ = planner.best_layout(layout, speeds, links=links, nics=nics)
    candidates.append(("the planner's best", best_layout))
    scored = [(planner.iteration_s(lay, speeds, links, nics), i, name, lay) for i, (name, lay) in enumerate(candidates)]
    seconds, _, name, chosen = min(scored, key=lambda s: (round(s[0], 9), s[1]))
    text = (f"grow to {len(set(chosen.devices))} device(s): {name} "
            f"({', '.join(f'{n} {s * 1e3:.3g} ms' for s, _, n, _ in scored)} by the planner's model)")
    return _checked(trainer, chosen, text)

"""The core's own layout chooser, for a job that runs the fault-tolerance core without ResiHP.

After a loss, the survivors keep the shape they have -- the same TP and PP sizes, the same layers
per stage -- and form as many data-parallel replicas as they fill and the global batch splits
evenly over, whole surviving replicas first; the survivors left over wait as spares. When replacements arrive (``grow``), the
launch layout comes back if the devices fill it, else the current shape widens. No cost model:
ResiHP's planner (``--resihp``) replaces this chooser with one that weighs shapes and speeds.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_ext.errors import UserError
from megatron_ext.ft.target import LayoutTarget, check
from megatron_ext.layout import Layout

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.ft.protocol import TrainerLike


def keep_shape(trainer: "TrainerLike", devices: list[int], lost: list[int], cause: str
               ) -> tuple[LayoutTarget, str] | str:
    """The core's ``Chooser``: a target over ``devices`` (launch ranks: survivors, then invited
    spares) and its one-line reason, or why the job cannot continue."""
    current = trainer.ctx.layout
    launch = trainer.ft.launch_target() if cause == "grow" and getattr(trainer, "ft", None) is not None else None
    shapes = ([("the launch layout", launch)] if launch is not None else []) + [("the current shape", current)]
    refusals = []
    for name, shape in shapes:
        replicas = _replicas_over(current, shape, devices)
        for dp in range(len(replicas), 0, -1):
            target = LayoutTarget(tp=shape.tp, pp=shape.pp, vp=shape.vp, members=_members(shape, replicas[:dp]),
                                  stage_layers=shape.stage_layers).normalised()
            try:
                trainer.check_target(target)
                check(target, cfg=trainer.cfg, members=current.members, knobs=trainer.relayout_knobs,
                      membership_may_change=True, what="the next layout")
            except UserError as exc:
                refusals.append(str(exc))
                continue
            spare = len(devices) - len(target.members)
            return target, (f"{name} over {len(target.members)} of {len(devices)} device(s)"
                            + (f" ({spare} left as spare{'s' if spare > 1 else ''})" if spare else "")
                            + " (the core's chooser: no --resihp planner)")
    why = refusals[-1] if refusals else f"{len(devices)} device(s) cannot hold one replica of TP x PP"
    return f"no layout of the same shape fits the {len(devices)} remaining device(s): {why}"


def _replicas_over(current: LayoutTarget, shape: LayoutTarget, devices: list[int]) -> list[list[int]]:
    """Model replicas of ``shape`` over ``devices``, each a list of devices in (stage, TP rank)
    order. Where the shape is the current one, a replica every device of which survived stays
    whole and comes first: its state is already in place, and a stage whose other copies are gone
    survives in it (a replica made of leftovers would move state it may no longer have). The
    remaining devices (survivors, then replacements) fill further replicas in order."""
    per = shape.tp * shape.pp
    available = set(devices)
    whole: list[list[int]] = []
    if (shape.tp, shape.pp) == (current.tp, current.pp):
        for replica in _replica_members(current):
            if available.issuperset(replica):
                whole.append(replica)
    used = {d for r in whole for d in r}
    rest = [m for m in current.members if m in available and m not in used] + sorted(available - set(current.members))
    if (shape.tp, shape.pp) != (current.tp, current.pp):
        rest = sorted(available)  # a new shape: the devices in their order at launch
    return whole + [rest[i:i + per] for i in range(0, len(rest) - per + 1, per)]


def _replica_members(target: LayoutTarget) -> list[list[int]]:
    """``target``'s replicas, each its devices in (stage, TP rank) order."""
    lay = Layout(tp=target.tp, pp=target.pp, dp=target.dp)
    replicas: list[list[int]] = [[0] * (target.tp * target.pp) for _ in range(target.dp)]
    for rank, c in lay.rank_coords():
        replicas[c.dp][c.pp * target.tp + c.tp] = target.members[rank]
    return replicas


def _members(shape: LayoutTarget, replicas: list[list[int]]) -> tuple[int, ...]:
    """The members of ``shape`` with ``replicas`` as its data-parallel replicas, in rank order."""
    lay = Layout(tp=shape.tp, pp=shape.pp, dp=len(replicas))
    return tuple(replicas[c.dp][c.pp * shape.tp + c.tp] for _, c in lay.rank_coords())

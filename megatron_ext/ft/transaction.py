"""The one layout transaction: every change of a live job's layout goes through ``apply``.

Whatever the cause -- a fail-slow re-layout the planner chose, the survivors of a lost rank, a
replaced rank rejoining, a permutation asked for by hand -- the change is a ``LayoutTarget``
(``ft/target.py``) applied in one order, on every member of the new layout:

1. extensions let go of the old objects (``detach``), outputs close;
2. liveness of the old generation stops;
3. process groups: rebuilt on the same default group, or a new default group over the new members
   under the next generation's store keys (the engine's ``layout_context``);
4. model, optimizer and scheduler are rebuilt (``build_model``);
5. state moves point to point from its holders (``runtime/transport.move_state``): weights, fp32
   masters, Adam moments and steps, from the rank's own copy, a replica, or -- where no copy is
   left -- the last checkpoint (by default every stage rolls back to it, so the model is one
   iteration's model; ``keep_newer`` fills only the lost slices);
6. the data streams, the LR schedule and the iteration continue from the agreed position;
7. extensions attach to the new objects (a process that joins sets them up for the first time);
8. the logging rank's rows go to the process that logs next; outputs reopen (rewound on a rollback);
9. liveness of the new generation starts;
10. one log line and one ``layout_change`` metrics row, the same for every cause.

``HeldState.capture`` takes what a rank brings (its shards at the agreed iteration, replicas
included) before step 1; the caller keeps it until the change is done everywhere, so a second
fault in the middle starts the next attempt from the same state (``ft/core.py``).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from megatron_ext.ft.target import LayoutTarget
from megatron_ext.runtime import reshard
from megatron_ext.runtime import transport
from megatron_ext.layout import Coord

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.ft.protocol import TrainerLike

logger = logging.getLogger(__name__)

CAUSES = ("relayout", "fail_stop", "grow")


@dataclasses.dataclass
class HeldState:
    """What one rank brings to a layout change: its shards (every replica it holds) at
    ``iteration``, or None (a process that joins, or whose update of that iteration failed), and
    the position every rank agreed on."""

    payload: list[dict[str, Any]] | None
    iteration: int
    consumed_samples: int
    scheduler: dict[str, Any] | None

    @classmethod
    def capture(cls, trainer: "TrainerLike", *, valid: bool = True) -> "HeldState":
        """This rank's state now. Every replica is taken (no collective), except under the
        distributed optimizer, whose state exists only sharded: there only the main replicas, with
        the optimizer's own gather over the data-parallel group."""
        payload = None
        if valid and trainer.model is not None:
            try:
                payload = reshard.collect_payload(trainer.model, trainer.optimizer, every_replica=True)
            except reshard.CheckpointError:
                payload = reshard.collect_payload(trainer.model, trainer.optimizer)
        return cls(payload=payload, iteration=trainer.iteration,
                   consumed_samples=trainer.train_stream.consumed_samples if trainer.train_stream else 0,
                   scheduler=trainer.scheduler.state_dict() if trainer.scheduler is not None else None)


@dataclasses.dataclass
class Change:
    """One layout change, as every member of the new layout applies it."""

    target: LayoutTarget
    cause: str
    """``relayout`` (planned: fail-slow or by hand), ``fail_stop`` (survivors of a lost rank) or
    ``grow`` (a replaced rank rejoins)."""
    reason: str = ""
    """The plan line, or what the planner said."""
    generation: int | None = None
    """Form a new default group under this generation's keys; None: keep the default group (same
    members in the same order)."""
    store_addr: str | None = None
    old_members: tuple[int, ...] = ()
    """Launch ranks of the layout before, in its rank order."""
    old_name: str = ""
    iteration: int = 0
    consumed_samples: int = 0
    scheduler: dict[str, Any] | None = None
    lost: tuple[int, ...] = ()
    lost_why: dict[int, str] = dataclasses.field(default_factory=dict)
    joined: tuple[int, ...] = ()
    rolled_back: int | None = None
    """An iteration that was abandoned before its update (redone in the new layout)."""
    checkpoint: str | None = None
    """Where a slice that has no copy left comes from (``--save``, else ``--load``)."""
    keep_newer: bool = False
    old_tp: int = 1
    old_pp: int = 1
    started_s: float = dataclasses.field(default_factory=time.perf_counter)

    @property
    def old_logger(self) -> int | None:
        """Launch rank of the process that was the logging rank before (None: no layout before)."""
        return None if not self.old_members else _logging_member(self.old_members, self.old_tp, self.old_pp)


class Liveness(Protocol):
    def stop_liveness(self) -> None: ...

    def arm(self, trainer: "TrainerLike") -> None: ...


def _logging_member(members: tuple[int, ...], tp: int, pp: int) -> int:
    """Launch rank of the logging rank (last stage, TP 0, DP 0) of a layout over ``members``."""
    from megatron_ext.layout import Layout

    lay = Layout.from_world(len(members), tp, pp)
    return members[lay.rank(Coord(tp=0, pp=lay.pp - 1, dp=0))]


def apply(trainer: "TrainerLike", change: Change, held: HeldState | None, *,
          liveness: Liveness | None = None) -> dict[str, Any]:
    """Collective over ``change.target.members``: apply ``change`` (the module docstring gives the
    order). ``held``: what this rank brings (None: nothing, it joins). Returns the
    ``layout_change`` row. The target was checked by the caller (``ft.target.check``) on every rank."""
    target = change.target.normalised()
    first_time = not getattr(trainer, "extensions_set_up", False)  # a process that joins for the first time
    # 1. extensions let go; outputs close (the logging rank may change: the new one appends)
    if trainer.model is not None:
        for ext in trainer.extensions:
            ext.detach(trainer)
    trainer.close_outputs()
    # 2. liveness of the old generation
    if liveness is not None:
        liveness.stop_liveness()
    # 3. process groups
    trainer.ctx = trainer.layout_context(target, generation=change.generation, store_addr=change.store_addr)
    trainer.fault_point("relayout", change.iteration + 1)
    # 4. model, optimizer, scheduler
    trainer.build_model()
    # 5. state
    moved = transport.move_state(held.payload if held is not None else None, model=trainer.model,
                                 optimizer=trainer.optimizer, checkpoint=change.checkpoint,
                                 keep_newer=change.keep_newer)
    # 6. data streams (this rank's new data-parallel share), LR schedule, iteration
    # (megatron's scheduler adds the loaded step count to its own: load once into the fresh one.)
    trainer.build_streams(change.consumed_samples)
    if moved["rollback"]:
        trainer.load_checkpoint(change.checkpoint)  # the checkpoint's iteration, data position and LR schedule
        moved["checkpoint_iteration"] = trainer.iteration
    else:
        if change.scheduler is not None:
            trainer.scheduler.load_state_dict(change.scheduler)
        trainer.scheduler.step(0)
        trainer.iteration = change.iteration
    # Kept newer stages (keep_newer): the lost stages' iterations since the checkpoint are lost.
    lost_iterations = change.iteration - moved["checkpoint_iteration"] if moved["checkpoint_iteration"] is not None else 0
    trainer.prepare_schedule()
    # 7. extensions attach (set up for the first time in a process that joins)
    trainer.layout_change = change
    for ext in trainer.extensions:
        (ext.setup if first_time else ext.attach)(trainer)
    trainer.extensions_set_up = True
    # 8. the logging rank's rows, outputs
    hand_over_history(trainer, change.old_logger)
    if moved["rollback"] and trainer.ctx.is_logging_rank:
        trainer.rewind_outputs(trainer.iteration)
    trainer.open_outputs(purge_step=trainer.iteration + 1 if moved["rollback"] else None)
    # 9. liveness of the new generation
    if liveness is not None:
        liveness.arm(trainer)
    # 10. one line, one row
    info = {"cause": change.cause, "from": change.old_name or None, "to": trainer.layout_name(),
            "iteration": trainer.iteration, "members": list(trainer.ctx.members),
            "lost_ranks": list(change.lost), "lost_why": {str(k): v for k, v in change.lost_why.items()},
            "joined_ranks": list(change.joined), "rolled_back": change.rolled_back,
            "lost_iterations": lost_iterations, "rolled_back_to": trainer.iteration if moved["rollback"] else None,
            "restored_from_checkpoint": moved["from_checkpoint"],
            "checkpoint_iteration": moved["checkpoint_iteration"], "generation": trainer.ctx.generation,
            "stage_layers": list(target.stage_layers) if target.stage_layers else None,
            "replica_microbatches": list(target.replica_microbatches) if target.replica_microbatches else None,
            "rank_order": ([list(change.old_members).index(m) for m in target.members]
                           if change.cause == "relayout" and change.generation is not None else None),
            "payload_bytes": moved["held_bytes"], "sent_bytes": moved["sent_bytes"],
            "received_bytes": moved["received_bytes"], "messages": moved["messages"],
            "plan": change.reason, "pause_s": time.perf_counter() - change.started_s}
    if trainer.ctx.rank == 0:
        print(" " + describe(info), flush=True)
    trainer.record("layout_change", info)
    return info


def describe(info: dict[str, Any]) -> str:
    """The one log line of a layout change."""
    why = {"relayout": "re-layout", "fail_stop": "lost rank(s) " + ", ".join(
        f"{m}" + (f" ({info['lost_why'][str(m)]})" if info["lost_why"].get(str(m)) else "") for m in info["lost_ranks"]),
        "grow": "rank(s) " + ", ".join(map(str, info["joined_ranks"])) + " joined"}[info["cause"]]
    if info["cause"] == "fail_stop" and info["joined_ranks"]:
        why += "; spare rank(s) " + ", ".join(map(str, info["joined_ranks"])) + " taken in"
    if info["from"] == info["to"]:  # same shape: what changed is the ranks' order or the split
        text = f"layout change ({why}): {info['to']} kept"
        order = info.get("rank_order")
        if order and list(order) != sorted(order):
            text += f", ranks regrouped (the new ranks {','.join(map(str, range(len(order))))} were {','.join(map(str, order))})"
    else:
        text = f"layout change ({why}): {info['from'] or 'a new process'} -> {info['to']}"
    if info["stage_layers"]:
        text += f" (layers per stage {' '.join(map(str, info['stage_layers']))})"
    if info["replica_microbatches"]:
        text += f" (micro-batches per replica {' '.join(map(str, info['replica_microbatches']))})"
    text += f" on rank(s) {','.join(map(str, info['members']))} at iteration {info['iteration']}"
    if info["rolled_back"]:
        text += f"; iteration {info['rolled_back']} rolled back"
    if info["cause"] == "fail_stop" or info["lost_iterations"]:
        text += f"; {info['lost_iterations']} iteration(s) lost"
    if info["rolled_back_to"] is not None:
        text += (f" (no copy of {len(info['restored_from_checkpoint'])} tensor(s) left in memory: every stage back "
                 f"to the checkpoint of iteration {info['checkpoint_iteration']})")
    elif info["checkpoint_iteration"] is not None:
        text += (f" (the lost ranks' shards of {len(info['restored_from_checkpoint'])} tensor(s) from the checkpoint "
                 f"of iteration {info['checkpoint_iteration']}; the other stages kept theirs)")
    return text + f"; pause {info['pause_s']:.2f} s"


def hand_over_history(trainer: "TrainerLike", old_logger: int | None) -> None:
    """Collective: when the logging rank moved to another process, that process gets the rows
    (``trainer.history``) the old one kept, so ``run()`` returns the whole run there. The metrics
    file and TensorBoard need nothing: the new logging rank appends to them. When the old logging
    rank is gone, its rows in memory are gone with it (the metrics file keeps them)."""
    ctx = trainer.ctx
    members = list(ctx.members)
    if old_logger is None or old_logger not in members or not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    new_logger = _logging_member(tuple(members), ctx.layout.tp, ctx.layout.pp)
    if new_logger == old_logger:
        return
    src = members.index(old_logger)
    box = [trainer.history if ctx.rank == src else None]
    dist.broadcast_object_list(box, src=src)
    if ctx.is_logging_rank:
        trainer.history = box[0]
    elif ctx.rank == src:
        trainer.history = []

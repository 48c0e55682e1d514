"""Live re-layout of a running job in the same processes (``Trainer.relayout``).

At an iteration boundary, every rank: collects its main-replica shards with the checkpoint's own
``collect_payload`` and keeps them; lets the engine destroy the old layout's process groups and
build the new ones (``Trainer._relayout_context``), or, for a rank permutation, form a new default
group with the processes renumbered (``Trainer._regroup_context``, the mechanism of a fail-stop
regroup, with nobody left out); rebuilds model, DDP, optimizer and scheduler and fills them with
``transport.reshard_between_ranks`` (each holder sends each new owner only the boxes it needs,
point to point; cut and applied by the checkpoint's resharding planner, the one for files and
peers); and
hands the logging rank's rows to the process that logs next. ``Trainer._rebuild`` carries the LR
schedule, the data position and the extensions (detach, attach) over.

A permutation needs a store the ranks can meet in that does not live in a process group it
destroys: the job's own (the project's launcher, ``MEGATRON_EXT_STORE``) or torchrun's agent store
(``distributed.rendezvous_address``).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from megatron_ext.errors import UserError
from megatron_ext.runtime import checkpoint as ckpt
from megatron_ext.runtime import distributed, transport
from megatron_ext.runtime.layout import Coord

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.runtime.distributed import DistContext
    from megatron_ext.runtime.loop import Trainer

logger = logging.getLogger(__name__)

NO_STORE = ("a live rank permutation (relayout rank_order) renumbers the ranks through a new process group, "
            "which needs a store outside the old one: start the job with `python pretrain_gpt.py "
            "--nproc-per-node N` or torchrun, or export the MEGATRON_EXT_STORE=host:port line of "
            "`python -m megatron_ext.runtime.store` to every rank")


def relayout(trainer: "Trainer", *, tp: int, pp: int, vpp: int | None = None, stage_layers: list[int] | None = None,
             replica_microbatches: list[int] | None = None, rank_order: list[int] | None = None) -> dict[str, Any]:
    """Collective: continue ``trainer``'s run under another TP x PP (x DP) layout.

    Model and optimizer state (weights, fp32 masters, Adam moments, step counts) move to their
    new owners in memory, cut with the same geometry and code as checkpoint resharding; every
    process group of the old layout is destroyed and the new ones built; model chunks, DDP,
    optimizer and LR scheduler are rebuilt and the LR schedule's state carried over; the data
    stream continues at the same sample. ``stage_layers``: layers per pipeline stage (uneven
    stages). ``rank_order`` permutes the ranks: rank ``i`` of the new layout (TP fastest, then
    DP, then PP) is the process that is rank ``rank_order[i]`` now, e.g. ``[0, 3, 1, 2]`` on
    TP2 x PP2 puts ranks 1 and 2 into one TP group; the processes are renumbered on a new default
    group (the next generation's store keys). Bad input raises ``UserError`` before anything
    changes. Returns what it did (layouts, rank order, this rank's shard bytes, seconds)."""
    trainer._check_relayout(tp=tp, pp=pp, vpp=vpp, replica_microbatches=replica_microbatches)
    order = check_rank_order(trainer, rank_order)
    start = time.perf_counter()
    old_name, old_logger = trainer.layout_name(), logging_member(trainer.ctx)
    new_parallel = dataclasses.replace(trainer.cfg.parallel, tensor_model_parallel_size=tp,
                                       pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                                       pipeline_stage_layers=list(stage_layers) if stage_layers else None,
                                       data_parallel_microbatches=(list(replica_microbatches)
                                                                   if replica_microbatches else None))
    new_cfg = dataclasses.replace(trainer.cfg, parallel=new_parallel)
    new_cfg.validate(trainer.ctx.world_size)  # a bad target raises here, before anything changes
    store_addr = None
    if order is not None:
        store_addr = distributed.rendezvous_address(trainer.ctx)
        if store_addr is None:
            raise UserError(NO_STORE)
    payload = ckpt.collect_payload(trainer.model, trainer.optimizer)
    if dist.is_initialized():
        dist.barrier()
    if order is not None and trainer.failover is not None:
        # The heartbeat of this generation stops here, on every rank right after the barrier, and
        # the next generation's starts when the extensions attach: a rank whose rebuild is quicker
        # must not look silent to one still on the old keys. The rendezvous is bounded by the
        # collective timeout meanwhile.
        trainer.failover.stop()
    ep = new_parallel.expert_model_parallel_size

    def new_ctx() -> "DistContext":
        if order is None:
            return trainer._relayout_context(tp=tp, pp=pp, vpp=vpp, ep=ep)
        members = [trainer.ctx.members[r] for r in order]
        return trainer._regroup_context(trainer.ctx, members=members, tp=tp, pp=pp, vpp=vpp, ep=ep,
                                        store_addr=store_addr)

    moved = trainer._rebuild(new_cfg, new_ctx, lambda: transport.reshard_between_ranks(
        payload, model=trainer.model, optimizer=trainer.optimizer))
    if order is not None and trainer.failover is not None:
        trainer.failover.arm(trainer.ctx)  # the commit ledger of the new generation
    hand_over_history(trainer, old_logger)
    info = {"from": old_name, "to": trainer.layout_name(), "iteration": trainer.iteration,
            "stage_layers": new_parallel.pipeline_stage_layers,
            "replica_microbatches": new_parallel.data_parallel_microbatches,
            "rank_order": order, "members": list(trainer.ctx.members),
            "payload_bytes": moved["held_bytes"], "sent_bytes": moved["sent_bytes"],
            "received_bytes": moved["received_bytes"], "messages": moved["messages"],
            "pause_s": time.perf_counter() - start}
    if trainer.ctx.rank == 0:
        logger.info("re-laid out %s -> %s at iteration %d in %.2f s", old_name, info["to"], trainer.iteration,
                    info["pause_s"])
    return info


def check_rank_order(trainer: "Trainer", rank_order: list[int] | None) -> list[int] | None:
    """``rank_order`` as a list when it really permutes the ranks, None for none or the identity;
    ``UserError`` for anything that is not a permutation of this world's ranks, or an engine
    that cannot permute."""
    if rank_order is None:
        return None
    order = [int(r) for r in rank_order]
    world = trainer.ctx.world_size
    if sorted(order) != list(range(world)):
        raise UserError(f"relayout rank_order {order}: expected each rank 0..{world - 1} once (every rank of the "
                        "job keeps a place; only a fail-stop leaves ranks out)")
    if order == list(range(world)):
        return None
    if "permute" not in trainer.relayout_knobs:
        raise UserError(f"relayout rank_order {order}: {type(trainer).__name__} cannot permute ranks live")
    return order


def logging_member(ctx: "DistContext") -> int:
    """Launch rank of the process that is the logging rank (last stage, TP 0, DP 0) in ``ctx``."""
    lay = ctx.layout
    return ctx.members[lay.rank(Coord(tp=0, pp=lay.pp - 1, dp=0))]


def hand_over_history(trainer: "Trainer", old_logger: int) -> None:
    """Collective: when the logging rank moved to another process, that process gets the rows
    (``trainer.history``) the old one kept, so ``run()`` returns the whole run there. The metrics
    file and TensorBoard need nothing: the new logging rank appends to them."""
    ctx = trainer.ctx
    if logging_member(ctx) == old_logger or not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    src = list(ctx.members).index(old_logger)
    box = [trainer.history if ctx.rank == src else None]
    dist.broadcast_object_list(box, src=src)
    if ctx.is_logging_rank:
        trainer.history = box[0]
    elif ctx.rank == src:
        trainer.history = []

"""Live re-layout scenarios, run under ``torchrun --nproc_per_node 4`` by test_relayout.py.

Each scenario trains 10 iterations in one layout, re-lays the job out in the same processes
(``Trainer.relayout``: state moved rank to rank, groups rebuilt) and trains 10 more; its loss curve
is compared with a straight 20-iteration run. Results go to one JSON file.
"""
from __future__ import annotations

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch.distributed as dist  # noqa: E402

from megatron_ext.config.run import config_from_values  # noqa: E402
from megatron_ext.errors import UserError  # noqa: E402
from megatron_ext.runtime import distributed  # noqa: E402
from megatron_ext.runtime.extension import build_extensions  # noqa: E402
from megatron_ext.runtime.loop import Trainer  # noqa: E402
from tests.scenario_helpers import TINY, from_logging_rank  # noqa: E402

# Warm-up then cosine decay: the LR schedule's position must carry over too.
BASE = {**TINY, "train_iters": 20, "lr": 2e-3, "min_lr": 2e-4, "lr_warmup_iters": 3, "lr_decay_style": "cosine"}
LAYOUTS = {"tp2pp2": (2, 2), "pp4": (1, 4), "pp2dp2": (1, 2), "tp2dp2": (2, 1), "pp2dp2_3+1": (1, 2, [3, 1]),
           "tp2pp2_1+3": (2, 2, [1, 3]), "pp2dp2_mb3+1": (1, 2, None, [3, 1])}


def losses(trainer: Trainer, iterations: int, extra_keys: list | None = None) -> list[float]:
    mine = []
    for _ in range(iterations):
        m = trainer.train_step()
        mine.append(m.loss)
        if extra_keys is not None:
            extra_keys.append(sorted(m.extra))
    return from_logging_rank(trainer.ctx, mine)


def trainer_for(ctx, layout: str, values: dict | None = None) -> tuple[Trainer, distributed.DistContext]:
    tp, pp, stages, split = (list(LAYOUTS[layout]) + [None, None])[:4]
    cfg = config_from_values({**BASE, **(values or {}), "tensor_model_parallel_size": tp,
                              "pipeline_model_parallel_size": pp, "pipeline_stage_layers": stages,
                              "data_parallel_microbatches": split})
    ctx = distributed.relayout(ctx, tp=tp, pp=pp, vpp=None, seed=cfg.training.seed)
    return Trainer(cfg, ctx, build_extensions(cfg)).setup(), ctx


def live_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def main() -> None:
    out_path = sys.argv[1]
    ctx = distributed.setup(config_from_values(dict(BASE)).parallel, seed=1234)
    result: dict = {}
    for start in ("tp2pp2", "pp2dp2", "pp2dp2_3+1", "pp2dp2_mb3+1"):
        trainer, ctx = trainer_for(ctx, start)
        result[f"straight_{start}"] = losses(trainer, 20)
    for start, target in (("tp2pp2", "pp4"), ("pp2dp2", "tp2pp2"), ("tp2pp2", "tp2dp2"),
                          ("pp2dp2", "pp2dp2_3+1"), ("pp2dp2_3+1", "tp2pp2_1+3"), ("pp2dp2", "pp2dp2_mb3+1")):
        trainer, ctx = trainer_for(ctx, start)
        first = losses(trainer, 10)
        groups_before = live_groups()
        tp, pp, stages, split = (list(LAYOUTS[target]) + [None, None])[:4]
        info = trainer.relayout(tp=tp, pp=pp, stage_layers=stages, replica_microbatches=split)
        ctx = trainer.ctx
        moved = [None] * dist.get_world_size()  # every rank's bytes: sent, received, held
        dist.all_gather_object(moved, [info["sent_bytes"], info["received_bytes"], info["payload_bytes"]])
        info["moved"] = moved
        second = losses(trainer, 10)
        result[f"{start}->{target}"] = {"losses": first + second, "info": info,
                                        "groups": [groups_before, live_groups()]}
    # Rank permutations (the processes renumbered through a new default group on the agent's store):
    # ranks 1 and 2 into one TP group; then with a TP/PP change and uneven stages as well.
    for start, target, order in (("tp2pp2", "tp2pp2", [0, 3, 1, 2]), ("tp2pp2", "pp2dp2_3+1", [2, 0, 3, 1])):
        trainer, ctx = trainer_for(ctx, start)
        first = losses(trainer, 10)
        refused = None
        try:
            trainer.relayout(tp=2, pp=2, rank_order=[0, 0, 1, 2])
        except UserError as exc:
            refused = str(exc)
        groups_before, members_before = live_groups(), list(ctx.members)
        tp, pp, stages, split = (list(LAYOUTS[target]) + [None, None])[:4]
        info = trainer.relayout(tp=tp, pp=pp, stage_layers=stages, replica_microbatches=split, rank_order=order)
        ctx = trainer.ctx
        from megatron.core import parallel_state as ps

        mine = {"member": ctx.member, "rank": ctx.rank, "generation": ctx.generation,
                "tp_group": sorted(ctx.members[r] for r in dist.get_process_group_ranks(
                    ps.get_tensor_model_parallel_group())),
                "stage": ctx.coord.pp}
        who = [None] * dist.get_world_size()
        dist.all_gather_object(who, mine)
        second = losses(trainer, 10)
        result[f"{start}->{target} {order}"] = {"losses": first + second, "info": info, "who": who,
                                                "members_before": members_before, "refused": refused,
                                                "groups": [groups_before, live_groups()]}
    # With the pipeline-event extension on: it detaches from the old objects and records the new ones.
    trainer, ctx = trainer_for(ctx, "pp2dp2", {"timeline": True})
    keys_before: list = []
    keys_after: list = []
    first = losses(trainer, 10, keys_before)
    trainer.relayout(tp=1, pp=4)
    ctx = trainer.ctx
    second = losses(trainer, 10, keys_after)
    record = trainer.extensions[0].record(trainer, trainer.iteration)
    result["timeline"] = {"losses": first + second, "keys_before": keys_before[-1], "keys_after": keys_after[-1],
                          "stages_recorded": record.num_stages if record is not None else None}
    for ext in trainer.extensions:
        ext.teardown(trainer)
    if dist.get_rank() == 0:
        with open(out_path, "w", encoding="utf-8") as fh:
            json.dump(result, fh)
    distributed.teardown()


if __name__ == "__main__":
    main()

"""Optimizer-state scenarios on 2 gloo ranks, run by test_optimizer_state_multirank.py.

One launch, several layouts in the same processes (megatron's import dominates a launch):
megatron's DistributedOptimizer against the plain one, resume under it, and checkpoints moved
between the distributed optimizer (state sharded over DP) and tensor parallelism (no DP), each
re-saved right after loading so the test can compare the tensors that went in and came out.
"""
from __future__ import annotations

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron_ext.config.run import config_from_values  # noqa: E402
from megatron_ext.runtime import distributed, optimizer  # noqa: E402
from megatron_ext.runtime.loop import Trainer  # noqa: E402
from tests.scenario_helpers import CURVE, curve  # noqa: E402

BASE = {**CURVE, "num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "seq_length": 32}
DP2_DO = {"tensor_model_parallel_size": 1, "use_distributed_optimizer": True}
TP2 = {"tensor_model_parallel_size": 2}


def build(ctx, values: dict) -> tuple[Trainer, distributed.DistContext]:
    cfg = config_from_values({**BASE, **values})
    cfg.validate(ctx.world_size)
    ctx = distributed.relayout(ctx, tp=cfg.parallel.tensor_model_parallel_size,
                               pp=cfg.parallel.pipeline_model_parallel_size,
                               vpp=cfg.parallel.virtual_pipeline_model_parallel_size, seed=cfg.training.seed)
    return Trainer(cfg, ctx).setup(), ctx


def run(ctx, values: dict) -> tuple[list[float], distributed.DistContext]:
    trainer, ctx = build(ctx, values)
    trainer.run()
    return curve(trainer), ctx


def main() -> None:
    out_path, root = sys.argv[1], sys.argv[2]
    # Many small all-reduces instead of one: the round trips below then also check the chunking.
    optimizer.GATHER_CHUNK_ELEMENTS = 3000
    ctx = distributed.setup(config_from_values(dict(BASE)).parallel, seed=1234)
    res: dict[str, object] = {}
    # fp32: megatron's DistributedOptimizer (ZeRO-1 over DP2) against the plain AdamW runtime.
    res["fp32_plain"], ctx = run(ctx, {"tensor_model_parallel_size": 1})
    res["fp32_do"], ctx = run(ctx, DP2_DO)
    # bf16 under the distributed optimizer: 20 straight == 10 + resume + 10.
    res["bf16_do_straight20"], ctx = run(ctx, {**DP2_DO, "bf16": True, "train_iters": 20})
    do_ckpt = os.path.join(root, "bf16_do")
    res["bf16_do_first10"], ctx = run(ctx, {**DP2_DO, "bf16": True, "save": do_ckpt})
    res["bf16_do_resumed10"], ctx = run(ctx, {**DP2_DO, "bf16": True, "train_iters": 20, "load": do_ckpt})
    # Reshard: the DP2 distributed-optimizer checkpoint loaded under TP2 and saved again unchanged,
    # and that TP2 checkpoint loaded back under DP2 with the distributed optimizer.
    tp2_ckpt = os.path.join(root, "bf16_tp2_from_do")
    t, ctx = build(ctx, {**TP2, "bf16": True, "load": do_ckpt, "save": tp2_ckpt})
    t.save_checkpoint()
    back_ckpt = os.path.join(root, "bf16_do_from_tp2")
    t, ctx = build(ctx, {**DP2_DO, "bf16": True, "load": tp2_ckpt, "save": back_ckpt})
    t.save_checkpoint()
    # And the TP2 run goes on from the DP2 checkpoint.
    res["bf16_tp2_resumed10"], ctx = run(ctx, {**TP2, "bf16": True, "train_iters": 20, "load": do_ckpt})
    if ctx.rank == 0:
        with open(out_path, "w", encoding="utf-8") as fh:
            json.dump(res, fh)
    distributed.teardown()


if __name__ == "__main__":
    main()

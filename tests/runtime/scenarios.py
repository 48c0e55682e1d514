"""Multi-rank training scenarios, run under ``torchrun --nproc_per_node 4`` by test_training.py.

One launch runs every scenario in the same 4 processes (megatron's import costs 15-20 s per rank
on 2 cores), relayouting between them, and writes each scenario's loss curve to a JSON file.
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
from megatron_ext.runtime import distributed  # noqa: E402
from megatron_ext.runtime.loop import Trainer  # noqa: E402
from tests.scenario_helpers import CURVE, curve  # noqa: E402


def run(ctx, values: dict, *, load: str | None = None) -> tuple[Trainer, list[float], distributed.DistContext]:
    cfg = config_from_values({**CURVE, **values})
    cfg.validate(ctx.world_size)
    ctx = distributed.relayout(ctx, tp=cfg.parallel.tensor_model_parallel_size,
                               pp=cfg.parallel.pipeline_model_parallel_size,
                               vpp=cfg.parallel.virtual_pipeline_model_parallel_size, seed=cfg.training.seed)
    if load:
        cfg.checkpoint.load = load
    trainer = Trainer(cfg, ctx).setup()
    trainer.run()
    return trainer, curve(trainer), ctx


def main() -> None:
    out_path, ckpt_root = sys.argv[1], sys.argv[2]
    cfg = config_from_values(dict(CURVE))
    ctx = distributed.setup(cfg.parallel, seed=cfg.training.seed)
    results: dict[str, list[float]] = {}
    tp2pp2 = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    pp2dp2 = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2}
    pp4 = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 4}

    _, results["tp2pp2"], ctx = run(ctx, tp2pp2)
    _, results["pp2dp2"], ctx = run(ctx, pp2dp2)
    # Interleaved 1F1B: 2 model chunks per stage.
    _, results["pp2dp2_vpp2"], ctx = run(ctx, {**pp2dp2, "virtual_pipeline_model_parallel_size": 2})

    # Resume: 20 straight against 10 + resume + 10 (same layout).
    _, results["straight20"], ctx = run(ctx, {**tp2pp2, "train_iters": 20})
    first = os.path.join(ckpt_root, "tp2pp2")
    _, results["first10"], ctx = run(ctx, {**tp2pp2, "train_iters": 10, "save": first})
    _, results["resumed10"], ctx = run(ctx, {**tp2pp2, "train_iters": 20}, load=first)
    # Reshard on load: the TP2xPP2 checkpoint continued under PP4 and under TP1xPP2xDP2.
    _, results["reshard_pp4"], ctx = run(ctx, {**pp4, "train_iters": 20}, load=first)
    _, results["reshard_pp2dp2"], ctx = run(ctx, {**pp2dp2, "train_iters": 20}, load=first)

    if ctx.rank == 0:
        with open(out_path, "w", encoding="utf-8") as fh:
            json.dump(results, fh)
    distributed.teardown()


if __name__ == "__main__":
    main()

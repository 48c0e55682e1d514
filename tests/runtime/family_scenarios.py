"""LLaMA-style and MoE training scenarios for test_families_multirank.py.

Under ``torchrun --nproc_per_node 4`` one launch runs every parallel layout of both families (and the
LLaMA-style model on DeepSpeed's engine) in the same 4 processes (relayouting between them) and writes each loss curve (and the MoE load-balancing
loss curve) to a JSON file. Run as a lone process it writes the single-rank reference curves.
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
from megatron_ext.runtime.extension import build_extensions  # noqa: E402
from megatron_ext.runtime.loop import Trainer  # noqa: E402
from tests.scenario_helpers import CURVE, LLAMA_STYLE, curve  # noqa: E402

LLAMA = {**LLAMA_STYLE, "rotary_base": 500000, "qk_layernorm": True}
MOE = {**LLAMA, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 64, "moe_aux_loss_coeff": 0.01,
       "moe_token_dispatcher_type": "alltoall"}
AUX = "moe_load_balancing_loss"


def run(ctx, values: dict, results: dict, name: str, *, load: str | None = None):
    cfg = config_from_values({**CURVE, **values})
    cfg.validate(ctx.world_size)
    p = cfg.parallel
    ctx = distributed.relayout(ctx, tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                               vpp=p.virtual_pipeline_model_parallel_size, seed=cfg.training.seed,
                               ep=p.expert_model_parallel_size)
    if load:
        cfg.checkpoint.load = load
    trainer = Trainer(cfg, ctx, build_extensions(cfg)).setup()
    trainer.run()
    results[name] = curve(trainer)
    if cfg.model.num_experts is not None:
        results[name + "/aux"] = curve(trainer, AUX)
    return ctx


def run_deepspeed(values: dict, world: int) -> list[float] | None:
    """The LLaMA-style model on DeepSpeed's PipelineEngine (deepspeed_patches/gpt.py)."""
    from deepspeed_patches import trainer as ds

    cfg = config_from_values({**CURVE, **values, "engine": "deepspeed"})
    cfg.validate(world)
    ds.check_config(cfg)
    ctx = ds.setup_distributed(cfg.parallel, seed=cfg.training.seed)
    trainer = ds.DeepSpeedTrainer(cfg, ctx, build_extensions(cfg)).setup()
    trainer.run()
    return curve(trainer)


def main() -> None:
    out_path, ckpt_root = sys.argv[1], sys.argv[2]
    ctx = distributed.setup(config_from_values(dict(CURVE)).parallel, seed=1234)
    results: dict[str, list[float] | None] = {}
    if ctx.world_size == 1:
        ctx = run(ctx, LLAMA, results, "llama")
        ctx = run(ctx, MOE, results, "moe")
    else:
        tp2 = {"tensor_model_parallel_size": 2}
        pp2 = {"pipeline_model_parallel_size": 2}
        ctx = run(ctx, {**LLAMA, **tp2}, results, "llama/tp2")
        ctx = run(ctx, {**LLAMA, **pp2}, results, "llama/pp2")
        # Saved under TP2 x PP2 after 5 iterations, continued to 10 under TP1 x PP2 x DP2.
        first = os.path.join(ckpt_root, "llama")
        ctx = run(ctx, {**LLAMA, **tp2, **pp2, "train_iters": 5, "save": first}, results, "llama/tp2pp2_first5")
        ctx = run(ctx, {**LLAMA, **pp2}, results, "llama/reshard_pp2", load=first)

        # megatron's distributed optimizer (Adam state sharded over DP): the SwiGLU halves' state is
        # gathered at save (DP4) and sliced back at load under another layout (TP2 x DP2).
        first = os.path.join(ckpt_root, "llama_distopt")
        distopt = {**LLAMA, "use_distributed_optimizer": True}
        ctx = run(ctx, {**distopt, "train_iters": 5, "save": first}, results, "llama/distopt_dp4_first5")
        ctx = run(ctx, {**distopt, **tp2}, results, "llama/distopt_reshard_tp2", load=first)

        ctx = run(ctx, {**MOE, **tp2, "sequence_parallel": True}, results, "moe/tp2sp")
        # TP2 x EP2 (expert TP 2): the all-gather dispatcher; gloo cannot all-to-all here (refused).
        ctx = run(ctx, {**MOE, **tp2, "sequence_parallel": True, "expert_model_parallel_size": 2,
                        "moe_token_dispatcher_type": "allgather"}, results, "moe/tp2ep2sp")
        ctx = run(ctx, {**MOE, **pp2, "expert_model_parallel_size": 2}, results, "moe/pp2ep2")
        # Saved under DP4 x EP2 after 5 iterations, continued under EP4 and under PP2 x EP1.
        first = os.path.join(ckpt_root, "moe")
        ctx = run(ctx, {**MOE, "expert_model_parallel_size": 2, "train_iters": 5, "save": first}, results,
                  "moe/ep2_first5")
        ctx = run(ctx, {**MOE, "expert_model_parallel_size": 4}, results, "moe/reshard_ep4", load=first)
        ctx = run(ctx, {**MOE, **pp2}, results, "moe/reshard_pp2ep1", load=first)
        # DeepSpeed's engine: 5 iterations of the LLaMA-style model under PP2 x DP2, saved, and
        # continued by the megatron engine (the checkpoint moves between engines).
        first = os.path.join(ckpt_root, "llama_ds")
        results["llama/deepspeed_pp2_first5"] = run_deepspeed({**LLAMA, **pp2, "train_iters": 5, "save": first},
                                                              ctx.world_size)
        ctx = run(ctx, {**LLAMA, **pp2}, results, "llama/megatron_from_deepspeed", load=first)
    if ctx.rank == 0:
        with open(out_path, "w", encoding="utf-8") as fh:
            json.dump(results, fh)
    distributed.teardown()


if __name__ == "__main__":
    main()

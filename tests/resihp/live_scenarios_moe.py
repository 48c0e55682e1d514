"""Live ResiHP scenarios on the MoE model for test_live_moe.py, under torchrun --nproc_per_node 4:
PP2 x DP2 with EP2 inside each stage (ranks {0, 1} and {2, 3} each share their experts through the
all-to-all dispatcher), packed documents.

Scenario "slow": rank 2 (stage 1, dp 0) computes 3x slower from iteration 20 (3x, not 2x: docs/
resihp.md, "The README example"); its EP peer rank 3 waits for it in every MoE layer. Scenario
"skewed": healthy, with strongly imbalanced routing: a fixed bias on the router logits (what
megatron's expert bias does; the runtime has no flag for it) sends most tokens to the experts of
EP rank 0 (experts 0, 1) until iteration 20, then to those of EP rank 1: one rank of each stage
does most of the expert work, first one side, then the other. Verdicts and traces go to files
under OUT; ``skewed.routing.r<rank>.json`` has, per iteration and stage, the (token, expert) pairs
this rank's router sent to experts 0-1 and in all, counted from the router's own routing map (a
check of the probe's counts, which are taken after the dispatch, on the receiving rank).
"""
from __future__ import annotations

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megatron_ext.config.run import config_from_values  # noqa: E402
from megatron_ext.resihp.moe_probe import moe_layers  # noqa: E402
from megatron_ext.runtime import distributed  # noqa: E402
from megatron_ext.runtime.extension import build_extensions  # noqa: E402
from megatron_ext.runtime.loop import Trainer  # noqa: E402
from tests.scenario_helpers import LLAMA_STYLE, TINY  # noqa: E402

BASE = {**TINY, **LLAMA_STYLE, "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2, "num_experts": 4,
        "moe_router_topk": 2, "moe_ffn_hidden_size": 512, "moe_token_dispatcher_type": "alltoall",
        "moe_aux_loss_coeff": 0.001, "seq_length": 128, "micro_batch_size": 1, "doc_length_dist": "lognormal:3.5,1",
        "resihp": True, "resihp_warmup": 12, "lr_decay_style": "constant"}
SCENARIOS = {
    "slow": {"train_iters": 40, "inject_slow": ["2:20:3.0"]},
    # No load-balancing loss: it would train the router against the bias.
    "skewed": {"train_iters": 32, "moe_aux_loss_coeff": 0.0},
}
SKEW_LOGIT = 1.0   # added to the favoured experts' router logits (router logits here are ~0.2)
SKEW_FLIP = 20     # from this iteration on the other EP rank's experts are favoured


def skew_routing(trainer: Trainer) -> dict[str, list[int]]:
    """Bias every router of this rank towards the experts of one EP rank (which one depends on the
    iteration); returns per iteration [pairs sent to experts 0..n/2-1, all pairs] of this rank."""
    sent: dict[str, list[int]] = {}
    for layers in moe_layers(trainer.model.chunks):
        for layer in layers:
            router, n = layer.router, layer.config.num_moe_experts
            gating = router.gating

            def biased(x, gating=gating, n=n):
                it = trainer.iteration + 1
                favoured = slice(0, n // 2) if it < SKEW_FLIP else slice(n // 2, n)
                bias = torch.zeros(n, dtype=x.dtype)
                bias[favoured] = SKEW_LOGIT
                return gating(x) + bias

            router.gating = biased

            def count(module, args, output, n=n):
                routing_map = output[1]
                row = sent.setdefault(str(trainer.iteration + 1), [0, 0])
                row[0] += int(routing_map[:, : n // 2].sum())
                row[1] += int(routing_map.sum())

            router.register_forward_hook(count)
    return sent


def main() -> None:
    out = sys.argv[1]
    ctx = distributed.setup(config_from_values(dict(BASE)).parallel, seed=1234)
    for name, values in SCENARIOS.items():
        cfg = config_from_values({**BASE, **values, "resihp_verdicts_out": os.path.join(out, f"{name}.verdicts.jsonl"),
                                  "resihp_trace_out": os.path.join(out, f"{name}.trace.jsonl")})
        ctx = distributed.relayout(ctx, tp=1, pp=2, vpp=None, seed=cfg.training.seed, ep=2)
        trainer = Trainer(cfg, ctx, build_extensions(cfg)).setup()
        share = skew_routing(trainer) if name == "skewed" else None
        trainer.run()
        ctx = trainer.ctx
        if share is not None:
            with open(os.path.join(out, f"{name}.routing.r{ctx.rank}.json"), "w", encoding="utf-8") as fh:
                json.dump(share, fh)
    distributed.teardown()


if __name__ == "__main__":
    main()

"""Multi-rank checkpoints for test_hf_export.py: under ``torchrun --nproc_per_node 2`` a few iterations
of the Qwen3-style model (GQA, q/k norms, SwiGLU) under TP2 and of the MoE model under DP2 x EP2 (two
experts per rank), each saved to ``<root>/<name>``, in the same two processes (relayouting between them).
"""
from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron_ext.config.run import config_from_values  # noqa: E402
from megatron_ext.runtime import distributed  # noqa: E402
from megatron_ext.runtime.loop import Trainer  # noqa: E402
from tests.scenario_helpers import LLAMA_STYLE, TINY  # noqa: E402

# Tiny models, a few iterations at a high learning rate: norm gains and biases move away from their
# initial ones and zeros, so a mapping that dropped or misplaced one would show in the logits. The
# initialisation is 10x wider than megatron's default so that activations reach the range where
# exact and tanh GELU, or two norm epsilons, differ by more than the test's tolerance.
BASE = {**TINY, "train_iters": 3, "global_batch_size": 4, "seq_length": 32, "lr": 1e-2, "lr_decay_style": "constant",
        "num_layers": 2, "init_method_std": 0.2}
LLAMA = {**LLAMA_STYLE, "rotary_base": 500000, "untie_embeddings_and_output_weights": True}
MODELS = {
    "gpt": {},
    "llama": LLAMA,
    # biases on every linear layer and tied embeddings: the other half of the LLaMA mapping
    "llama_bias": {**LLAMA, "disable_bias_linear": False, "untie_embeddings_and_output_weights": False},
    "qwen3": {**LLAMA, "qk_layernorm": True},
    "moe": {**LLAMA, "qk_layernorm": True, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
            "moe_aux_loss_coeff": 0.01, "moe_token_dispatcher_type": "alltoall"},
}
# Sinkhorn routing evaluates as softmax then top-k without renormalising (norm_topk_prob false).
MODELS["moe_sinkhorn"] = {**MODELS["moe"], "moe_router_load_balancing_type": "sinkhorn", "moe_aux_loss_coeff": 0.0}
# --moe-router-pre-softmax: softmax over every expert, then the top k (norm_topk_prob false, both ways).
MODELS["moe_presoftmax"] = {**MODELS["moe"], "moe_router_pre_softmax": True}
LAYOUTS = {"qwen3_tp2": ("qwen3", {"tensor_model_parallel_size": 2}),
           "moe_ep2": ("moe", {"expert_model_parallel_size": 2})}


def main() -> None:
    root = sys.argv[1]
    ctx = distributed.setup(config_from_values(dict(BASE)).parallel, seed=1234)
    for name, (model, layout) in LAYOUTS.items():
        cfg = config_from_values({**BASE, **MODELS[model], **layout, "save": os.path.join(root, name)})
        cfg.validate(ctx.world_size)
        p = cfg.parallel
        ctx = distributed.relayout(ctx, tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                                   vpp=None, seed=cfg.training.seed, ep=p.expert_model_parallel_size)
        Trainer(cfg, ctx).setup().run()
    distributed.teardown()


if __name__ == "__main__":
    main()

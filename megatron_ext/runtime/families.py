"""Model families: one place per family for what the rest of the project needs to know about it.

Three families share megatron-core's ``GPTModel`` and differ in the flags of ``ModelConfig``:

* ``gpt``   - GPT-2/3 block: LayerNorm, GELU MLP, learned positions, biases, multi-head attention;
* ``llama`` - LLaMA-3-style block: RMSNorm, SwiGLU, rotary positions, grouped-query attention, no
  biases (any of these flags makes a model ``llama``);
* ``moe``   - Qwen3-MoE-style block: the ``llama`` block whose MLP is megatron's ``MoELayer``
  (router top-k, experts sharded over ``--expert-model-parallel-size``).

For each family this module holds: its TransformerConfig fields (``transformer_config_kwargs``), its
layer spec (``layer_spec``: megatron's own ``get_gpt_layer_local_spec`` / Transformer Engine spec,
never re-written), the checks that need the world size (``validate``), whether the DeepSpeed engine
builds it (``ModelFamily.deepspeed``), and the FLOPs shape ResiHP counts (``flops_spec``).
Initialisation by global name (``runtime/model.py``) needs no per-family rule: every new parameter
follows megatron's rules by its name (norm gains one, biases zero, ``linear_fc2`` / ``linear_proj``
scaled by 1/sqrt(2L), everything else normal(0, std)), and expert weights are keyed by their global
expert index, so every TP/PP/EP layout draws the same weights.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch

from megatron_ext.config.base import ConfigError
from megatron_ext.runtime.extension import Extension, IterationMetrics, register_extension

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.config.run import ModelConfig, RunConfig
    from megatron_ext.runtime.loop import Trainer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    name: str
    summary: str
    # None: the DeepSpeed engine (deepspeed_patches/gpt.py) builds this family; else why it does not.
    deepspeed_refusal: str | None


GPT = ModelFamily("gpt", "GPT-2/3 block: LayerNorm, GELU MLP, learned positions, biases", None)
LLAMA = ModelFamily("llama", "LLaMA-3-style block: RMSNorm, SwiGLU, rotary positions, GQA, no biases", None)
MOE = ModelFamily("moe", "Qwen3-MoE-style block: the llama block with megatron's MoELayer as MLP",
                  "--engine deepspeed does not train mixture-of-experts models (--num-experts): DeepSpeed's "
                  "PipelineModule here is a dense GPT; use --engine megatron")
FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (GPT, LLAMA, MOE)}

# Flags (ModelConfig fields) that leave the GPT block, with the value that keeps it.
_GPT_VALUES: dict[str, Any] = {"normalization": "LayerNorm", "swiglu": False, "group_query_attention": False,
                               "position_embedding_type": "learned_absolute", "disable_bias_linear": False,
                               "qk_layernorm": False}


def family_of(m: "ModelConfig") -> ModelFamily:
    if m.num_experts is not None:
        return MOE
    if any(getattr(m, k) != v for k, v in _GPT_VALUES.items()):
        return LLAMA
    return GPT


def non_gpt_flags(m: "ModelConfig") -> list[str]:
    """The flags (``--name``) by which ``m`` differs from the GPT block."""
    out = ["--" + k.replace("_", "-") for k, v in _GPT_VALUES.items() if getattr(m, k) != v]
    if m.num_experts is not None:
        out.append("--num-experts")
    return out


# --- megatron-core objects --------------------------------------------------------------------

def transformer_config_kwargs(m: "ModelConfig") -> dict[str, Any]:
    """TransformerConfig fields of the model shape (parallel sizes and dtypes come from the caller).

    Only fields that differ from TransformerConfig's defaults are passed for the GPT block, so its
    config is the one it always was."""
    kw: dict[str, Any] = dict(num_layers=m.num_layers, hidden_size=m.hidden_size,
                              num_attention_heads=m.num_attention_heads, ffn_hidden_size=m.ffn_hidden_size,
                              hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
                              init_method_std=m.init_method_std)
    if m.normalization != "LayerNorm":
        kw["normalization"] = m.normalization
    if m.swiglu:
        # Megatron-LM's --swiglu: a gated linear unit with SiLU.
        kw.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    if m.group_query_attention:
        kw["num_query_groups"] = m.num_query_groups
    if m.disable_bias_linear:
        kw["add_bias_linear"] = False
    if m.qk_layernorm:
        kw["qk_layernorm"] = True
    if m.num_experts is not None:
        kw.update(num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
                  moe_ffn_hidden_size=m.moe_ffn_hidden_size, moe_token_dispatcher_type=m.moe_token_dispatcher_type,
                  moe_router_load_balancing_type=m.moe_router_load_balancing_type,
                  moe_aux_loss_coeff=m.moe_aux_loss_coeff, moe_grouped_gemm=m.moe_grouped_gemm)
    return kw


def layer_spec(m: "ModelConfig", on_gpu: bool, *, per_document_attention: bool = False, local: bool = False) -> Any:
    """megatron's layer spec for the family: Transformer Engine's on GPUs where TE imports, the
    plain-torch local spec otherwise.

    ``per_document_attention``: packed sequences attend within each document only
    (``runtime.attention.DocumentAttention``, on the local spec). ``local``: the local spec even on a
    GPU (``--helix`` rewrites megatron's own tensor-parallel layers, not TE's)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    kw: dict[str, Any] = {}
    if m.num_experts is not None:
        kw.update(num_experts=m.num_experts, moe_grouped_gemm=m.moe_grouped_gemm)
    if m.qk_layernorm:
        kw["qk_layernorm"] = True
    if on_gpu and not per_document_attention and not local:
        try:
            import transformer_engine  # noqa: F401

            return specs.get_gpt_layer_with_transformer_engine_spec(**kw)
        except ImportError:
            logger.warning("transformer_engine not importable: using the local (plain torch) layer spec")
    if m.normalization != "LayerNorm":
        kw["normalization"] = m.normalization
    spec = specs.get_gpt_layer_local_spec(**kw)
    if per_document_attention:
        from megatron_ext.runtime.attention import DocumentAttention

        spec.submodules.self_attention.submodules.core_attention = DocumentAttention
    return spec


def gpt_model_kwargs(m: "ModelConfig") -> dict[str, Any]:
    """Family-dependent ``GPTModel`` arguments."""
    kw: dict[str, Any] = {"position_embedding_type": m.position_embedding_type}
    if m.position_embedding_type == "rope":
        kw["rotary_base"] = m.rotary_base
    return kw


# --- checks that need the world size and device -------------------------------------------------

def validate(cfg: "RunConfig", world_size: int) -> None:
    """Refuse bad combinations of model and layout flags before any model is built."""
    m, p = cfg.model, cfg.parallel
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    fam = family_of(m)
    if p.engine == "deepspeed" and fam.deepspeed_refusal:
        raise ConfigError(f"{fam.deepspeed_refusal} (model flags: {' '.join(non_gpt_flags(m))})")
    if m.group_query_attention and m.num_query_groups % tp:
        raise ConfigError(f"--num-query-groups ({m.num_query_groups}) is not divisible by "
                          f"--tensor-model-parallel-size ({tp})")
    if ep > 1 and m.num_experts is None:
        raise ConfigError(f"--expert-model-parallel-size ({ep}) needs --num-experts")
    if m.num_experts is None:
        return
    if m.num_experts % ep:
        raise ConfigError(f"--num-experts ({m.num_experts}) is not divisible by --expert-model-parallel-size ({ep})")
    if world_size % (ep * tp * pp):
        raise ConfigError(f"world size {world_size} is not divisible by --expert-model-parallel-size ({ep}) x "
                          f"--tensor-model-parallel-size ({tp}) x --pipeline-model-parallel-size ({pp}) "
                          f"= {ep * tp * pp}")
    if m.moe_ffn_hidden_size % tp:
        raise ConfigError(f"--moe-ffn-hidden-size ({m.moe_ffn_hidden_size}) is not divisible by "
                          f"--tensor-model-parallel-size ({tp})")
    if tp > 1 and not p.sequence_parallel:
        # megatron-core's MoELayer refuses to train this: with TP, the router and experts take the
        # sequence-parallel shard of the tokens (otherwise every TP rank routes every token).
        raise ConfigError(f"--num-experts with --tensor-model-parallel-size > 1 ({tp}) needs --sequence-parallel")
    want = p.device
    on_gpu = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    gloo = p.distributed_backend == "gloo" or (p.distributed_backend == "auto" and not on_gpu)
    if gloo and tp > 1 and ep > 1 and m.moe_token_dispatcher_type == "alltoall":
        # With expert TP > 1 the all-to-all dispatcher gathers a different token count from each TP
        # rank (all_gather with uneven sizes), which NCCL does and gloo refuses.
        raise ConfigError("--moe-token-dispatcher-type alltoall with --tensor-model-parallel-size > 1 and "
                          "--expert-model-parallel-size > 1 needs NCCL (uneven all-gathers); on gloo use "
                          "--moe-token-dispatcher-type allgather")
    if m.moe_grouped_gemm:
        if not on_gpu:
            raise ConfigError("--moe-grouped-gemm runs experts as one grouped GEMM kernel on a GPU "
                              "(Transformer Engine); this run is on CPU: leave it off")
        import importlib.util

        helix = cfg.ext("helix")
        local = [f for f, on in (("--helix", bool(helix is not None and helix.helix)),
                                 ("--doc-length-dist", bool(cfg.data.doc_length_dist))) if on]
        if local or importlib.util.find_spec("transformer_engine") is None:
            why = (f"{' and '.join(local)} build{'s' if len(local) == 1 else ''} on megatron's local layer spec"
                   if local else "transformer_engine is not installed")
            raise ConfigError(f"--moe-grouped-gemm needs Transformer Engine's layer spec, but {why}: leave it off")


# --- MoE auxiliary loss in the progress line ----------------------------------------------------

def moe_aux_losses(num_microbatches: int) -> dict[str, float]:
    """megatron's MoE auxiliary losses of the last iteration, per layer and micro-batch, reduced
    over ranks (collective over every rank); the tracker is cleared for the next iteration.

    The router records each loss divided by its coefficient (``load_balancing_loss`` is 1.0 for a
    perfectly balanced router), summed over micro-batches, one value per layer."""
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    if not tracker:
        return {}
    names = sorted(tracker)
    moe_utils.reduce_aux_losses_tracker_across_ranks(names)
    out = {}
    for name in names:
        values = tracker[name]["values"]
        out[f"moe_{name}"] = float(values.float().sum()) / (values.numel() * max(num_microbatches, 1))
    moe_utils.clear_aux_losses_tracker()
    return out


class MoEAuxLossLogging(Extension):
    """Puts the MoE auxiliary losses into ``metrics.extra`` (progress line, metrics file, TensorBoard)."""

    name = "moe-aux-loss"

    def after_iteration(self, trainer: "Trainer", metrics: IterationMetrics) -> None:
        metrics.extra.update(moe_aux_losses(len(getattr(trainer, "last_batches", ()) or ())))


@register_extension("moe-aux-loss")
def _moe_aux_loss_factory(cfg: "RunConfig") -> Extension | None:
    return MoEAuxLossLogging() if cfg.model.num_experts is not None and cfg.parallel.engine == "megatron" else None


# --- ResiHP's FLOPs shape -----------------------------------------------------------------------

def flops_spec(m: "ModelConfig", vocab_size: int) -> Any:
    """The model as ResiHP's FLOPs model sees it (``resihp.flops.ModelSpec``)."""
    from megatron_ext.resihp.flops import ModelSpec

    return ModelSpec(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
                     vocab_size=vocab_size, ffn_hidden_size=m.ffn_hidden_size,
                     num_query_groups=m.num_query_groups if m.group_query_attention else None,
                     gated_linear_unit=m.swiglu, num_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
                     moe_ffn_hidden_size=m.moe_ffn_hidden_size)

"""Model families on megatron-core: the TransformerConfig fields, layer spec and GPTModel arguments
of each family (``models/families.py`` describes the families; this module builds them).

Initialisation by global name (``runtime/model.py``) needs no per-family rule: every new parameter
follows megatron's rules by its name (norm gains one, biases zero, ``linear_fc2`` / ``linear_proj``
scaled by 1/sqrt(2L), everything else normal(0, std)), and expert weights are keyed by their global
expert index, so every TP/PP/EP layout draws the same weights.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch


if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.config.run import ModelConfig

logger = logging.getLogger(__name__)


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
    if m.squared_relu:
        from megatron.core.activations import squared_relu

        kw["activation_func"] = squared_relu
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
                  moe_aux_loss_coeff=m.moe_aux_loss_coeff, moe_grouped_gemm=m.moe_grouped_gemm,
                  moe_router_pre_softmax=m.moe_router_pre_softmax,
                  moe_router_score_function=m.moe_router_score_function,
                  moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
                  moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size)
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
        kw.update(rotary_base=m.rotary_base, rotary_percent=m.rotary_percent, rope_scaling=m.use_rope_scaling,
                  rope_scaling_factor=m.rope_scaling_factor,
                  seq_len_interpolation_factor=m.rotary_seq_len_interpolation_factor)
    return kw

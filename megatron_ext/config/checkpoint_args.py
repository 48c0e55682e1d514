"""Megatron-LM's ``--use-checkpoint-args``: the model's flags taken from the checkpoint ``--load`` holds.

As Megatron-LM ``core_v0.16.1`` (``load_args_from_checkpoint``): the shape flags (``UNLESS_GIVEN``) are
taken where the launch line or YAML did not give them, the rest (``ALWAYS``) always; the tokenizer's
type and model too unless ``--no-use-tokenizer-model-from-checkpoint-args``, and the TP/PP/VP/EP sizes
with ``--use-mp-args-from-checkpoint-args``. The checkpoint's args are read from either format by the
reader the caller hands in (``runtime/checkpoint.saved_config``: a Megatron-LM checkpoint's ``args``, or
the flags our run saved); the configuration layer does not import the runtime.
What was taken is said once at start-up (``RunConfig.notes``).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

UNLESS_GIVEN = ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads", "kv_channels",
                "max_position_embeddings", "moe_ffn_hidden_size", "moe_token_dispatcher_type")
ALWAYS = ("num_query_groups", "group_query_attention", "position_embedding_type", "rotary_base", "rotary_percent",
          "rotary_interleaved", "disable_bias_linear", "add_qkv_bias", "squared_relu", "swiglu",
          "untie_embeddings_and_output_weights", "layernorm_zero_centered_gamma", "normalization",
          "attention_dropout", "hidden_dropout", "num_experts", "moe_layer_freq", "moe_router_topk",
          "moe_router_pre_softmax", "moe_grouped_gemm", "moe_shared_expert_intermediate_size",
          "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
          "tiktoken_pattern")
TOKENIZER = ("tokenizer_type", "tokenizer_model")
LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
          "expert_model_parallel_size")
MEGATRON_NAMES = {"layernorm_zero_centered_gamma": "apply_layernorm_1p"}
"""Our key -> the name Megatron-LM's args use where they differ."""


def saved_value(saved: dict[str, Any], key: str) -> Any:
    """``key`` from a checkpoint's args, under our name or Megatron-LM's (``add_bias_linear`` for
    ``disable_bias_linear``)."""
    if key in saved:
        return saved[key]
    if key == "disable_bias_linear" and "add_bias_linear" in saved:
        return not saved["add_bias_linear"]
    return saved.get(MEGATRON_NAMES.get(key, key))


def apply(values: dict[str, Any], given: Iterable[str], known: Iterable[str], effective: dict[str, Any],
          saved_config: Callable[[str], dict[str, Any] | None]) -> tuple[dict[str, Any], list[str]]:
    """``values`` with the checkpoint's model flags, and the notes to say. ``given``: the keys the
    launch line or YAML set; ``known``: every key of the run configuration; ``effective``: what each
    key comes to without the checkpoint (defaults included), so only a change is said;
    ``saved_config``: the reader of a --load directory's saved flags (None: no checkpoint there)."""
    load = values.get("load")
    saved = saved_config(load) if load else None
    if saved is None:
        return values, [f"--use-checkpoint-args: --load {load} holds no checkpoint yet; the flags stand"]
    keys = [(k, False) for k in UNLESS_GIVEN] + [(k, True) for k in ALWAYS]
    if values.get("use_tokenizer_model_from_checkpoint_args", True):
        keys += [(k, True) for k in TOKENIZER]
    if values.get("use_mp_args_from_checkpoint_args", False):
        keys += [(k, True) for k in LAYOUT]
    known, given = set(known), set(given)
    out, taken = dict(values), []
    for key, always in keys:
        if key not in known or (not always and key in given):
            continue
        value = saved_value(saved, key)
        if value is None or effective.get(key) == value:
            continue
        out[key] = value
        taken.append(f"{key} {value}")
    if not taken:
        return out, [f"--use-checkpoint-args: the flags agree with {load}'s checkpoint"]
    return out, [f"--use-checkpoint-args: from {load}'s checkpoint: {', '.join(taken)}"]

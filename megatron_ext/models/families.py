"""Model families: the one description of the model's architecture the rest of the project derives from.

Three families share megatron-core's ``GPTModel`` and differ in the flags of ``ModelConfig``
(``config/run.py``; Megatron-LM's names and meaning):

* ``gpt``   - GPT-2/3 block: LayerNorm, GELU MLP, learned positions, biases, multi-head attention;
* ``llama`` - LLaMA-3-style block: RMSNorm, SwiGLU, rotary positions, grouped-query attention, no
  biases (any of these flags makes a model ``llama``);
* ``moe``   - Qwen3-MoE-style block: the ``llama`` block whose MLP is megatron's ``MoELayer``
  (router top-k, experts sharded over ``--expert-model-parallel-size``).

Pure (no megatron, no torch.distributed; it reads a ``ModelConfig`` / ``RunConfig`` without
importing the config, which imports it): which family a config is (``family_of``), the checks
that need the world size (``validate``), the widths every consumer must agree on
(``swiglu_ffn_hidden_size``), and each family's Hugging Face adapters. Derived from it: megatron's TransformerConfig fields and layer specs
(``runtime/families.py``), the DeepSpeed PipelineModule's blocks (``deepspeed_patches/gpt.py``),
Hydro's small models (``hydro/models.py``), the Hugging Face tables (``convert/hf.py``) and the
FLOPs shape (``models/flops.spec_of_model``: ResiHP's detector and planner, the GPU check's MFU and
the runtime's ``--log-throughput`` count it).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from megatron_ext.compat.devices import resolve_backend, resolve_device
from megatron_ext.errors import ConfigError
from megatron_ext.engines import engine


# The checkpoint's names of the tensors (megatron-core's ``sharded_state_dict`` keys), by the name of
# the part in a transformer layer. megatron's local spec publishes its norms under the Transformer
# Engine names (fused into the next linear), so checkpoints are interchangeable between specs and
# engines: the DeepSpeed PipelineModule and the Hugging Face tables use these names too.
LAYER_PREFIX = "decoder.layers."
LAYER_KEYS = {
    "q_layernorm.weight": "self_attention.q_layernorm.weight",
    "q_layernorm.bias": "self_attention.q_layernorm.bias",
    "k_layernorm.weight": "self_attention.k_layernorm.weight",
    "k_layernorm.bias": "self_attention.k_layernorm.bias",
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "linear_qkv.weight": "self_attention.linear_qkv.weight",
    "linear_qkv.bias": "self_attention.linear_qkv.bias",
    "linear_proj.weight": "self_attention.linear_proj.weight",
    "linear_proj.bias": "self_attention.linear_proj.bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
    "linear_fc1.weight": "mlp.linear_fc1.weight",
    "linear_fc1.bias": "mlp.linear_fc1.bias",
    "linear_fc2.weight": "mlp.linear_fc2.weight",
    "linear_fc2.bias": "mlp.linear_fc2.bias",
    "router.weight": "mlp.router.weight",
    "expert_fc1.weight": "mlp.experts.experts.linear_fc1.weight",
    "expert_fc2.weight": "mlp.experts.experts.linear_fc2.weight",
}
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
FINAL_NORM_WEIGHT = "decoder.final_layernorm.weight"
FINAL_NORM_BIAS = "decoder.final_layernorm.bias"
OUTPUT_LAYER = "output_layer.weight"


def layer_key(part: str) -> str:
    """The checkpoint key of a transformer layer's ``part`` (``LAYER_KEYS``), layer index apart."""
    return LAYER_PREFIX + LAYER_KEYS[part]


def swiglu_ffn_hidden_size(hidden_size: int) -> int:
    """Megatron-LM's ``--swiglu`` default MLP width: ``int(8 h / 3 / 64) * 64``."""
    return int(hidden_size * 4 * 2 / 3 / 64) * 64


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    name: str
    summary: str
    engine_feature: str | None = None
    """The engine feature (``megatron_ext/engines.py``) the family needs beyond the dense GPT:
    an engine that refuses it refuses the family."""
    hf_adapters: tuple[str, ...] = ()
    """Its Hugging Face architectures (``module:attribute`` of a ``convert.hf_adapters.HFAdapter``), in
    the order the converter tries them: each adapter carries the config and the tensor table."""


_ADAPTERS = "megatron_ext.convert.hf_adapters:"
GPT = ModelFamily("gpt", "GPT-2/3 block: LayerNorm, GELU MLP, learned positions, biases",
                  hf_adapters=(_ADAPTERS + "GPT2_ADAPTER",))
LLAMA = ModelFamily("llama", "LLaMA-3-style block: RMSNorm, SwiGLU, rotary positions, GQA, no biases",
                    hf_adapters=(_ADAPTERS + "LLAMA_ADAPTER", _ADAPTERS + "QWEN3_ADAPTER"))
MOE = ModelFamily("moe", "Qwen3-MoE-style block: the llama block with megatron's MoELayer as MLP",
                  engine_feature="mixture_of_experts", hf_adapters=(_ADAPTERS + "QWEN3_MOE_ADAPTER",))
FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (GPT, LLAMA, MOE)}

# Flags (ModelConfig fields) that leave the GPT block, with the value that keeps it.
_GPT_VALUES: dict[str, Any] = {"normalization": "LayerNorm", "swiglu": False, "group_query_attention": False,
                               "position_embedding_type": "learned_absolute", "disable_bias_linear": False,
                               "qk_layernorm": False}


def family_of(m: Any) -> ModelFamily:
    if m.num_experts is not None:
        return MOE
    if any(getattr(m, k) != v for k, v in _GPT_VALUES.items()):
        return LLAMA
    return GPT


def non_gpt_flags(m: Any) -> list[str]:
    """The flags (``--name``) by which ``m`` differs from the GPT block."""
    out = ["--" + k.replace("_", "-") for k, v in _GPT_VALUES.items() if getattr(m, k) != v]
    if m.num_experts is not None:
        out.append("--num-experts")
    return out


# --- checks that need the world size and device -------------------------------------------------

def validate(cfg: Any, world_size: int) -> None:
    """Refuse bad combinations of model and layout flags before any model is built."""
    m, p = cfg.model, cfg.parallel
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    fam = family_of(m)
    if fam.engine_feature is not None:
        engine(p.engine).refuse(fam.engine_feature, f"model flags: {' '.join(non_gpt_flags(m))}")
    gptmodel = [f"--{k.replace('_', '-')}" for k, v in (("rotary_percent", 1.0), ("use_rope_scaling", False),
                                                        ("rotary_seq_len_interpolation_factor", None),
                                                        ("squared_relu", False)) if getattr(m, k) != v]
    if gptmodel:   # DeepSpeed's block rotates every channel at the plain frequencies, with GeLU or SwiGLU
        engine(p.engine).refuse("transformer_config_flags", " ".join(gptmodel))
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
    shared = m.moe_shared_expert_intermediate_size
    if shared is not None and shared % tp:
        raise ConfigError(f"--moe-shared-expert-intermediate-size ({shared}) is not divisible by "
                          f"--tensor-model-parallel-size ({tp})")
    refused_by = cfg.capability("no_shared_experts")
    if shared is not None and refused_by:
        raise ConfigError(f"--moe-shared-expert-intermediate-size with {refused_by}; drop one of them")
    if tp > 1 and not p.sequence_parallel:
        # megatron-core's MoELayer refuses to train this: with TP, the router and experts take the
        # sequence-parallel shard of the tokens (otherwise every TP rank routes every token).
        raise ConfigError(f"--num-experts with --tensor-model-parallel-size > 1 ({tp}) needs --sequence-parallel")
    on_gpu = resolve_device(p.device) == "cuda"
    gloo = resolve_backend(p.distributed_backend, "cuda" if on_gpu else "cpu") == "gloo"
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

        local = [f for f in (cfg.capability("local_layer_spec"),
                             "--doc-length-dist" if cfg.data.doc_length_dist else None) if f]
        if local or importlib.util.find_spec("transformer_engine") is None:
            why = (f"{' and '.join(local)} build{'s' if len(local) == 1 else ''} on megatron's local layer spec"
                   if local else "transformer_engine is not installed")
            raise ConfigError(f"--moe-grouped-gemm needs Transformer Engine's layer spec, but {why}: leave it off")

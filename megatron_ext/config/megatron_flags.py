"""Megatron-LM's flags beyond the hand-written sections (docs/runtime.md, "Megatron-LM flags").

Megatron-LM (core_v0.16.1, ``megatron/training/arguments.py``) generates most of its model flags
from megatron-core's ``TransformerConfig``: one flag per field of a simple type, named after the
field unless the field's ``argparse_meta`` names it otherwise (``layernorm_epsilon`` is
``--norm-epsilon``, ``layernorm_zero_centered_gamma`` is ``--apply-layernorm-1p``), ``--no-x`` and
``--disable-x`` for a field that defaults to True, the field's docstring as its help. Section
``transformer`` is generated the same way from the installed ``TransformerConfig``, leaving out the
fields Megatron-LM gives no flag, those the hand-written sections own (``config/run.py``: the model's
shape, the layout, the precision) and those of models this project does not build (``NOT_BUILT``).
What a run sets there reaches its ``TransformerConfig`` (``transformer_kwargs``, runtime/model.py).

Section ``megatron`` holds the Megatron-LM flags that are only handled by name here, and ``NAMED``
is the one table of flags ignored or refused, when, and why: ``settle`` applies it to a built
config (a refused flag is one ``ConfigError`` line before any rank starts; an ignored one goes back
to its default and is said once at start-up, on rank 0, through ``RunConfig.notes``), and the
table in docs/runtime.md is ``markdown_table()``'s output (tests/config/test_megatron_flags.py).
"""
from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import typing
from typing import Any, Callable, Iterable

from megatron_ext.config.base import ConfigError, doc, flag_name

# --- the generated section: TransformerConfig's fields --------------------------------------------

MEGATRON_NO_FLAG = frozenset({
    # Megatron-LM core_v0.16.1 generates no flag from these TransformerConfig fields (callables, types
    # its generator cannot read, fields set from other flags or by the training script).
    "timers", "finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func",
    "_cpu_offloading_context", "init_method", "output_layer_init_method", "embedding_init_method",
    "activation_func", "pipeline_model_parallel_layout", "window_size", "window_attn_skip_freq", "no_rope_freq",
    "moe_layer_freq", "linear_attention_freq", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
    "cp_comm_type", "cuda_graph_scope", "virtual_pipeline_model_parallel_size", "params_dtype", "enable_autocast",
    "autocast_dtype", "num_microbatches_with_partial_activation_checkpoints", "tp_comm_overlap_disable_qkv",
    "tp_comm_overlap_disable_fc1", "pipeline_dtype", "variable_seq_lengths", "batch_p2p_comm", "batch_p2p_sync",
    "deallocate_pipeline_outputs", "cpu_offloading", "cpu_offloading_activations", "cpu_offloading_weights",
    "cpu_offloading_double_buffering", "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
    "softmax_scale", "gated_linear_unit", "bias_activation_fusion", "activation_func_fp8_input_store", "test_mode",
    "memory_efficient_layer_norm", "fused_single_qkv_rope", "fp8_dot_product_attention", "fp8_multi_head_attention",
    "tp_only_amax_red", "use_kitchen", "moe_token_dropping", "cuda_graph_use_single_mempool",
    "cuda_graph_retain_backward_graph", "disable_parameter_transpose_cache", "inference_sampling_seed",
    "use_inference_optimized_layers", "heterogeneous_block_specs", "hetereogenous_dist_checkpoint", "quant_recipe",
    "tp_comm_atomic_ag", "tp_comm_atomic_rs", "moe_router_topk_limited_devices", "inference_rng_tracker",
    "use_te_rng_tracker", "log_max_attention_logit", "barrier_with_L1_time", "num_moe_experts", "fp8_param",
    "gradient_accumulation_fusion", "overlap_p2p_comm", "attention_softmax_in_fp32", "masked_softmax_fusion",
    "persist_layer_norm", "bias_dropout_fusion", "apply_rope_fusion",
})

OWNED = frozenset({
    # TransformerConfig fields a hand-written section of config/run.py sets, by its own flag.
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "hidden_dropout", "attention_dropout",
    "init_method_std", "normalization", "qk_layernorm", "num_query_groups", "add_bias_linear", "moe_router_topk",
    "moe_ffn_hidden_size", "moe_token_dispatcher_type", "moe_grouped_gemm", "moe_router_pre_softmax",
    "moe_router_score_function", "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size", "sequence_parallel",
    "bf16", "fp16", "calculate_per_token_loss",
})

NOT_BUILT: dict[str, str] = {
    # TransformerConfig fields (by name or prefix) of models and features this project does not build:
    # Megatron-LM has flags for them, this runtime leaves them unknown (docs/runtime.md).
    "mamba_": "Mamba and hybrid models", "moe_enable_deepep": "the DeepEP / HybridEP token dispatchers",
    "moe_flex_dispatcher_backend": "the DeepEP / HybridEP token dispatchers",
    "moe_deepep_num_sms": "the DeepEP / HybridEP token dispatchers",
    "moe_hybridep_num_sms": "the DeepEP / HybridEP token dispatchers", "is_hybrid_model": "Mamba and hybrid models",
    "use_mamba_mem_eff_path": "Mamba and hybrid models", "multi_latent_attention": "multi-latent attention",
    "experimental_attention_variant": "experimental attention variants", "dsa_": "experimental attention variants",
    "linear_": "linear attention", "mtp_": "multi-token prediction", "use_kitchen_attention": "NVIDIA Kitchen",
    "kitchen_attention_backend": "NVIDIA Kitchen", "qk_clip": "QK-clip (the Muon optimizer's)",
    "qk_clip_": "QK-clip (the Muon optimizer's)",
    "moe_enable_routing_replay": "reinforcement learning", "moe_latent_size": "MoE latent projections",
    "mrope_section": "multimodal rotary embeddings", "hierarchical_context_parallel_sizes": "context parallelism",
    "max_seqlen_per_dp_cp_rank": "context parallelism", "hybrid_context_parallel": "context parallelism",
    "moe_extended_tp": "(deprecated in megatron-core)", "flash_decode": "inference",
    "inference_fuse_tp_communication": "inference", "symmetric_ar_type": "inference",
    "mlp_chunks_for_prefill": "inference", "batch_invariant_mode": "inference",
    "use_fused_weighted_squared_relu": "squared-ReLU models",
}


def _not_built(name: str) -> bool:
    return any(name == k or (k.endswith("_") and name.startswith(k)) for k in NOT_BUILT)


@dataclasses.dataclass(kw_only=True)
class KernelSwitches:
    """Megatron-LM's hand-written flags over TransformerConfig fields whose defaults differ from the
    dataclass's. A fused kernel runs where the device has it (runtime/model.py decides); these flags
    can only switch one off, as in Megatron-LM."""

    masked_softmax_fusion: bool = doc("Fuse the attention scaling, masking and softmax where the device runs "
                                      "the kernel (--no-masked-softmax-fusion: never).", True)
    bias_gelu_fusion: bool = doc("Fuse the MLP bias and GeLU where the device runs the kernel.", True)
    bias_swiglu_fusion: bool = doc("Fuse the MLP bias and SwiGLU where the device runs the kernel.", True)
    bias_dropout_fusion: bool = doc("Fuse the bias, dropout and residual add where the device runs the kernel.",
                                    True)
    apply_rope_fusion: bool = doc("Fuse the rotary embedding where the device runs the kernel.", True,
                                  negatives=("--no-rope-fusion",))
    persist_layer_norm: bool = doc("Apex's persistent layer-norm kernel where it runs.", True)
    gradient_accumulation_fusion: bool = doc("Fuse weight-gradient accumulation into the GEMM where the device runs "
                                             "the kernel.", True)
    attention_softmax_in_fp32: bool = doc("Attention masking and softmax in fp32 under --bf16 / --fp16 "
                                          "(Megatron-LM's default: in the model's precision).", False)


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of ``cls`` and its dataclass bases, as one line each."""
    out: dict[str, str] = {}
    for klass in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):
        try:
            body = ast.parse(inspect.getsource(klass)).body[0].body
        except (OSError, TypeError, IndexError):
            continue
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                out[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return out


def _config_type(tp: Any) -> tuple[Any, tuple[Any, ...] | None] | None:
    """(annotation in a config section, choices) of a TransformerConfig field type, or None when
    it is not one a flag can carry (Megatron-LM's generator reads the same kinds)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    optional = False
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            return None
        tp, optional = inner[0], True
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    choices = None
    if tp in (bool, int, float, str):
        ann = tp
    elif origin is typing.Literal and all(isinstance(a, str) for a in args):
        ann, choices = str, tuple(args)
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):
        ann, choices = str, tuple(m.name for m in tp)
    elif origin in (list, typing.List) and len(args) == 1 and args[0] in (int, str, float):
        ann = list[args[0]]
    else:
        return None
    if optional and ann is not bool:
        ann = ann | None
    return ann, choices


def _generated_fields() -> list[tuple[str, Any, Any]]:
    """(field name, annotation, dataclasses.field) of each generated flag, in TransformerConfig's order."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    hints = typing.get_type_hints(TransformerConfig)
    docs = _field_docs(TransformerConfig)
    out = []
    for f in dataclasses.fields(TransformerConfig):
        if not f.init or f.name in MEGATRON_NO_FLAG or f.name in OWNED or _not_built(f.name):
            continue
        kind = _config_type(hints[f.name])
        if kind is None:
            continue
        ann, choices = kind
        meta = dict(f.metadata.get("argparse_meta", {}))
        names = meta.get("arg_names") or []
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if isinstance(default, enum.Enum):
            default = default.name
        if ann is bool:
            default = bool(default)
        name, negatives = f.name, ()
        if ann is bool and default:
            negatives = tuple(names) or ("--disable-" + f.name.replace("_", "-"),)
        elif names:
            name = names[0][2:].replace("-", "_")
        meta = doc(docs.get(f.name, "") or f"megatron-core's TransformerConfig.{f.name}.", choices=choices,
                   negatives=negatives).metadata
        meta = {**meta, "tc_field": f.name}
        if isinstance(default, list):
            field = dataclasses.field(default_factory=lambda d=tuple(default): list(d), metadata=meta)
        else:
            field = dataclasses.field(default=default, metadata=meta)
        out.append((name, ann, field))
    return out


TransformerFlags = dataclasses.make_dataclass(
    "TransformerFlags", _generated_fields(), bases=(KernelSwitches,), kw_only=True,
    namespace={"__doc__": "megatron-core TransformerConfig fields, as Megatron-LM names their flags "
                          "(generated: config/megatron_flags.py)."})
TransformerFlags.__module__ = __name__


def tc_field(name: str) -> str:
    """The TransformerConfig field a generated flag sets."""
    return next(f.metadata.get("tc_field", name) for f in dataclasses.fields(TransformerFlags) if f.name == name)


GENERATED = tuple(f.name for f in dataclasses.fields(TransformerFlags) if "tc_field" in f.metadata)
"""The generated fields (the section's others are ``KernelSwitches``)."""


# --- flags handled by name only ------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True)
class MegatronFlags:
    """Megatron-LM flags this runtime handles by name: ignored here, with why (the NAMED table)."""

    use_mcore_models: bool = doc("Megatron-LM's (deprecated) switch to megatron-core models: ignored, they are "
                                 "the only models here.", False)
    use_flash_attn: bool = doc("Megatron-LM's FlashAttention switch: ignored, see --attention-backend.", False)
    auto_detect_ckpt_format: bool = doc("Megatron-LM's checkpoint format detection: ignored, every reader here "
                                        "detects the format.", False)
    profile: bool = doc("Megatron-LM's nsys / PyTorch profiler range: ignored (per-operation timings: --timeline).",
                        False)
    use_pytorch_profiler: bool = doc("With --profile, PyTorch's profiler: ignored as --profile.", False)
    profile_step_start: int = doc("First profiled iteration of --profile: ignored as --profile.", 10)
    profile_step_end: int = doc("Last profiled iteration of --profile: ignored as --profile.", 12)
    profile_ranks: list[int] | None = doc("Ranks profiled by --profile: ignored as --profile.", None)
    overlap_param_gather: bool = doc("Megatron-LM's overlap of the distributed optimizer's parameter all-gather "
                                     "with the next forward: ignored (the all-gather follows the step).", False)
    fp8_param_gather: bool = doc("Keep fp8 parameters and all-gather them in fp8 (Transformer Engine's layers "
                                 "only; megatron-core's fp8_param).", False)
    recompute_activations: bool = doc("Megatron-LM's short form of --recompute-granularity selective.", False)
    use_rotary_position_embeddings: bool = doc("Megatron-LM's former spelling of --position-embedding-type rope.",
                                               False)
    decoder_seq_length: int | None = doc("The decoder's sequence length of Megatron-LM's encoder-decoder models: "
                                         "ignored, a GPT's is --seq-length.", None)
    legacy_tokenizer: bool = doc("Megatron-LM's switch to its legacy tokenizer classes: ignored, the tokenizers "
                                 "are megatron-core's (megatron.core.tokenizers).", False)
    hybrid_override_pattern: str | None = doc("Megatron-LM's layer pattern of hybrid Mamba models: refused, they are "
                                              "not built here.", None)
    async_save: bool = doc("Megatron-LM's asynchronous checkpoint save: refused, checkpoints are saved "
                           "synchronously here.", False)


ALIASES = {"recompute_activations": ("recompute_granularity", "selective"),
           "use_rotary_position_embeddings": ("position_embedding_type", "rope")}
"""Megatron-LM's older spellings: a switch that sets another flag's value, as Megatron-LM sets it."""


def resolve_aliases(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each alias in ``ALIASES`` that is on written as the flag it stands for (before
    the sections are built, so their checks see it)."""
    from megatron_ext.config.base import _parse_bool

    out = dict(values)
    for alias, (key, value) in ALIASES.items():
        given = out.get(alias)
        if given is None or not (given if isinstance(given, bool) else _parse_bool(given)):
            continue
        other = out.get(key)
        if other is not None and other != value:
            raise ConfigError(f"{flag_name(alias)} means {flag_name(key)} {value}, but {flag_name(key)} {other} "
                              "is given too: give one")
        out[key] = value
    return out


# --- the table ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Device:
    """What decides whether a mechanism runs: a GPU, and Transformer Engine's layers in this run."""

    gpu: bool
    te: bool
    """megatron's Transformer Engine layer spec builds the layers (a GPU, TE importable, no reason for
    the local spec: --transformer-impl local, --helix, --doc-length-dist)."""
    tp: int = 1


@dataclasses.dataclass(frozen=True)
class Named:
    """A Megatron-LM flag handled by name: ``verdict`` ("ignored" or "refused") ``why``, when the
    device condition ``when`` holds and the value passes ``value`` (default: differs from the
    default; ``values`` says which for the docs)."""

    key: str
    verdict: str
    why: str
    when: str = ""
    value: Callable[[Any, Device], bool] | None = None
    values: str = ""

    def applies(self, given: Any, default: Any, device: Device) -> bool:
        if not _CONDITIONS[self.when](device):
            return False
        return self.value(given, device) if self.value is not None else given != default


_CONDITIONS: dict[str, Callable[[Device], bool]] = {
    "": lambda d: True,
    "without Transformer Engine's layers": lambda d: not d.te,
    "on the CPU": lambda d: not d.gpu,
}
NO_TE = "without Transformer Engine's layers"
ON_CPU = "on the CPU"

_FP8 = ("fp8 and fp4 compute inside Transformer Engine's layers; this run's layers are megatron-core's local ones, "
        "so it computes in the model's precision (--bf16 / --fp16, else fp32)")
_TP_COMM = "Transformer Engine's userbuffers for tensor-parallel communication overlap are not set up here"
_PROFILE = "no profiler range is opened here (per-operation timings: --timeline)"


def _group(keys: Iterable[str], verdict: str, why: str, when: str = "") -> list[Named]:
    return [Named(k, verdict, why, when) for k in keys]


NAMED: list[Named] = [
    Named("sequence_parallel", "ignored", "with --tensor-model-parallel-size 1 there is no tensor-parallel region to "
          "split (Megatron-LM turns it off too)", "", lambda v, d: v and d.tp == 1, "with TP 1"),
    Named("use_mcore_models", "ignored", "megatron-core's GPTModel is the only model here (Megatron-LM's legacy "
          "models are not)"),
    Named("use_flash_attn", "ignored", "megatron-core picks its attention by --attention-backend (FlashAttention "
          "through Transformer Engine on a GPU)"),
    Named("auto_detect_ckpt_format", "ignored", "every reader here detects the format of the directory it is given "
          "(torch_dist or megatron_ext)"),
    *_group(("profile", "use_pytorch_profiler", "profile_step_start", "profile_step_end", "profile_ranks"),
            "ignored", _PROFILE),
    Named("perform_initialization", "ignored", "weights are always drawn by global name, the same model in every "
          "layout; --load then replaces them"),
    Named("init_model_with_meta_device", "ignored", "weights are drawn by global name on the device they train on"),
    Named("pipeline_model_parallel_comm_backend", "ignored", "pipeline sends and receives use the run's backend "
          "(--distributed-backend)"),
    *_group(("tp_comm_overlap", "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad", "tp_comm_overlap_ag", "tp_comm_overlap_rs",
             "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_split_rs", "tp_comm_bootstrap_backend"),
            "ignored", _TP_COMM),
    *_group(("enable_cuda_graph", "external_cuda_graph", "cuda_graph_impl", "cuda_graph_warmup_steps"), "ignored",
            "CUDA graphs are not captured here"),
    *_group(("cpu_offloading_num_layers", "fine_grained_activation_offloading", "offload_modules",
             "min_offloaded_tensor_size"), "ignored", "activations stay on the device that computed them here"),
    *_group(("overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "ep_overlap_early_attn_memory_release"),
            "ignored", "megatron's expert-parallel overlap runs on CUDA streams in its combined 1F1B schedule, "
            "which this runtime does not build"),
    Named("overlap_param_gather", "ignored", "the distributed optimizer all-gathers the updated parameters right "
          "after its step here (megatron's overlap with the next forward is not wired)"),
    Named("empty_unused_memory_level", "ignored", "there is no CUDA caching allocator to empty", ON_CPU),
    Named("use_ring_exchange_p2p", "ignored", "needs Megatron-LM's custom PyTorch build; pipeline p2p uses "
          "batched isend/irecv"),
    *_group(("fp8_format", "fp8_recipe", "fp8_margin", "fp8_interval", "fp8_amax_history_len", "fp8_amax_compute_algo",
             "fp8_wgrad", "fp8_quantizer_factory", "fp8_param_gather", "first_last_layers_bf16",
             "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "fp4_format", "fp4_recipe", "fp4_param_gather", "fp4_quantizer_factory",
             "moe_router_padding_for_fp8", "moe_router_padding_for_quantization"), "ignored", _FP8, NO_TE),
    Named("attention_backend", "ignored", "Transformer Engine's attention kernels; megatron-core's local "
          "attention (DotProductAttention) runs", NO_TE, lambda v, d: v in ("flash", "fused", "unfused"),
          "flash, fused, unfused"),
    *_group(("moe_permute_fusion", "moe_router_fusion", "use_te_activation_func"), "ignored",
            "Transformer Engine's fused kernels; megatron-core's unfused code runs", NO_TE),
    Named("cross_entropy_fusion_impl", "ignored", "Transformer Engine's fused cross entropy; megatron-core's native "
          "one runs", NO_TE, lambda v, d: v == "te", "te"),
    Named("moe_shared_expert_overlap", "ignored", "overlaps the shared experts on a CUDA stream", ON_CPU),
    Named("softmax_type", "refused", "megatron-core 0.16.1's local attention allocates its softmax offsets on CUDA",
          ON_CPU, lambda v, d: v != "vanilla", "off-by-one, learnable"),
    Named("transformer_impl", "refused", "inference-optimized layers are megatron-core's inference path; training "
          "builds Transformer Engine's or the local layers", "", lambda v, d: v == "inference_optimized",
          "inference_optimized"),
    Named("context_parallel_size", "refused", "context parallelism is not built here (the layout is TP x PP x DP, "
          "with EP; megatron-core's context-parallel attention also needs Transformer Engine)", "",
          lambda v, d: v > 1, "> 1"),
    Named("expert_tensor_parallel_size", "refused", "expert layers are split over --tensor-model-parallel-size "
          "here (leave it unset or equal)", "", lambda v, d: v is not None and v != d.tp, "other than TP"),
    Named("decoder_seq_length", "ignored", "only Megatron-LM's encoder-decoder models (T5) read it; a GPT's "
          "sequence length is --seq-length", "", lambda v, d: v is not None, "given"),
    Named("legacy_tokenizer", "ignored", "the tokenizers here are megatron-core's (megatron.core.tokenizers), which "
          "Megatron-LM's default uses too; tools/preprocess_data.py writes the legacy GPT-2 BPE's ids byte for byte"),
    Named("hybrid_override_pattern", "refused", "hybrid Mamba models are not built here (the layers are "
          "megatron-core's GPT block)", "", lambda v, d: v is not None, "given"),
    Named("async_save", "refused", "checkpoints are saved synchronously here (megatron's asynchronous writer, a "
          "process per rank that finishes the save during training, is not wired)"),
    *_group(("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"), "refused",
            "stages hold megatron's even split or --pipeline-stage-layers, with the embedding on the first and the "
            "loss on the last"),
]
_BY_KEY = {n.key: n for n in NAMED}


def device_of(cfg: Any, *, gpu: bool | None = None) -> Device:
    """The device facts of a run, resolved as the runtime resolves them (compat/devices.py);
    ``gpu``: already resolved."""
    from megatron_ext.compat.devices import resolve_device
    from megatron_ext.compat.kernels import transformer_engine_available

    if gpu is None:
        gpu = resolve_device(cfg.parallel.device) == "cuda"
    section = cfg.ext("transformer")
    local = (section.transformer_impl == "local" or bool(cfg.data.doc_length_dist)
             or cfg.capability("local_layer_spec") is not None)
    return Device(gpu=gpu, te=gpu and not local and transformer_engine_available(),
                  tp=cfg.parallel.tensor_model_parallel_size)


def _sections_of(cfg: Any) -> list[Any]:
    return [cfg.model, cfg.parallel, cfg.training, cfg.ext("transformer"), cfg.ext("megatron")]


def _negative(key: str) -> str:
    """How Megatron-LM spells switching off a flag that defaults to on (``--no-initialization``)."""
    for cls in (TransformerFlags, MegatronFlags):
        for f in dataclasses.fields(cls):
            if f.name == key and f.metadata.get("negatives"):
                return f.metadata["negatives"][0]
    return "--no-" + key.replace("_", "-")


def _shown(key: str, value: Any) -> str:
    if value is True:
        return flag_name(key)
    if value is False:
        return _negative(key)
    if isinstance(value, (list, tuple)):
        return f"{flag_name(key)} {' '.join(map(str, value))}"
    return f"{flag_name(key)} {value}"


def settle(cfg: Any, device: Device | None = None) -> list[str]:
    """Apply ``NAMED`` to a built config: raise ``ConfigError`` for the first refused flag; reset each
    ignored one to its default and return one note per flag (``ignored --x: why``)."""
    device = device or device_of(cfg)
    notes = []
    for section in _sections_of(cfg):
        for f in dataclasses.fields(section):
            named = _BY_KEY.get(f.name)
            if named is None:
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            value = getattr(section, f.name)
            if not named.applies(value, default, device):
                continue
            where = f" {named.when}" if named.when else ""
            if named.verdict == "refused":
                raise ConfigError(f"{_shown(f.name, value)}{where}: {named.why}")
            notes.append(f"ignored {_shown(f.name, value)}{where}: {named.why}")
            setattr(section, f.name, default)
    given = changed(cfg)
    moe = [k for k in given if k.startswith("moe_")]
    if moe and cfg.model.num_experts is None:
        raise ConfigError(f"{', '.join(flag_name(k) for k in moe)} need{'s' if len(moe) == 1 else ''} --num-experts")
    if given:
        from megatron_ext.engines import engine

        shown = ", ".join(_shown(k, v) for k, v in given.items())
        engine(cfg.parallel.engine).refuse("transformer_config_flags", shown)
    return notes


def _default(key: str) -> Any:
    f = next(f for f in dataclasses.fields(TransformerFlags) if f.name == key)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def changed(cfg: Any) -> dict[str, Any]:
    """The generated flags this run sets away from their defaults: flag field -> value."""
    section = cfg.ext("transformer")
    return {k: getattr(section, k) for k in GENERATED if getattr(section, k) != _default(k)}


def transformer_kwargs(cfg: Any, *, te: bool) -> dict[str, Any]:
    """TransformerConfig keyword arguments of the generated flags this run sets (TransformerConfig's
    own defaults stand for the rest, so a run without them builds the config it always did).

    ``te``: Transformer Engine's layers build the model. Without them the attention backend is not
    passed: the local spec's attention is the same whatever it says, and megatron's GPTModel asserts
    that every model of a process was built with the same one (it records it in NVTE_* variables)."""
    from megatron.core.transformer.enums import AttnBackend

    out = {}
    for key, value in changed(cfg).items():
        name = tc_field(key)
        if name == "attention_backend":
            if te:
                out[name] = AttnBackend[value]
            continue
        out[name] = value
    if te and cfg.ext("megatron").fp8_param_gather:
        out["fp8_param"] = True  # Megatron-LM's --fp8-param-gather is TransformerConfig.fp8_param
    return out


def kernel_switches(cfg: Any) -> dict[str, bool]:
    """The run's fused-kernel switches (``KernelSwitches``): the runtime turns a kernel on only where
    the device runs it and the switch allows it."""
    section = cfg.ext("transformer")
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(KernelSwitches)}


def transformer_impl(cfg: Any) -> str:
    return cfg.ext("transformer").transformer_impl


# --- the docs' table ------------------------------------------------------------------------------

def _spelled(n: Named) -> str:
    default = next((f.default for cls in (TransformerFlags, MegatronFlags) for f in dataclasses.fields(cls)
                    if f.name == n.key), None)
    flag = _negative(n.key) if default is True else flag_name(n.key)
    return f"`{flag}`" + (f" {n.values}" if n.values else "")


def markdown_table() -> str:
    """docs/runtime.md's table of the flags handled by name, from ``NAMED`` (one row per reason)."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for n in NAMED:
        groups.setdefault((n.verdict, n.when, n.why), []).append(_spelled(n))
    rows = ["| flags | when | verdict: why |", "|---|---|---|"]
    for (verdict, when, why), flags in groups.items():
        rows.append(f"| {', '.join(flags)} | {when or 'given'} | {verdict}: {why} |")
    return "\n".join(rows)


if __name__ == "__main__":  # pragma: no cover - prints the docs' table
    print(markdown_table())

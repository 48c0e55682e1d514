"""The run configuration of ``pretrain_gpt.py``: one dataclass per subsystem, flags + strict YAML.

Sections register themselves with ``@section("name")``; extensions (helix, resihp, hydro bubbles,
pipeline events) add theirs the same way, and ``RunConfig.extensions`` carries them by name.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
from typing import Any, Callable, Sequence

from megatron_ext.config.base import (ArgumentParser, ConfigError, add_flags, build, check_unknown, doc,
                                      field_names, load_yaml, renamed_keys, renames)
from megatron_ext.data.blend import DEFAULT_SPLIT, SPLIT_NAMES, Blend, parse_blend, parse_split
from megatron_ext.data.tokenizer_types import CHOICES as TOKENIZER_TYPES
from megatron_ext.data.tokenizer_types import TIKTOKEN_PATTERNS
from megatron_ext.data.tokenizer_types import check_request as check_tokenizer_request
from megatron_ext.engines import engine
from megatron_ext.layout import Layout, check_divides
from megatron_ext.models.families import swiglu_ffn_hidden_size
from megatron_ext.config import megatron_flags

_SECTIONS: dict[str, type] = {}
# Core sections are attributes of RunConfig; the rest are extension sections.
_CORE = ("model", "parallel", "training", "data", "tokenizer", "logging", "checkpoint")
# Extension modules are entry points of the installed package (setup.py, group
# "megatron_ext.extensions"); importing one registers its config section and factory. Another
# package adds an extension the same way, without editing this one.
EXTENSION_GROUP = "megatron_ext.extensions"


def extension_modules() -> list[str]:
    from importlib.metadata import entry_points

    mods = sorted({ep.value for ep in entry_points(group=EXTENSION_GROUP)})
    if not mods:
        raise RuntimeError(f"no {EXTENSION_GROUP!r} entry points: megatron-ext is not installed in this "
                           "Python (run `make setup`, or `pip install -e .` in the repository)")
    return mods


def section(name: str):
    def register(cls: type) -> type:
        if name in _SECTIONS and _SECTIONS[name] is not cls:
            raise ValueError(f"config section {name!r} registered twice")
        clash = set(field_names(cls)) & {f for s in _SECTIONS.values() for f in field_names(s)}
        if clash and name not in _SECTIONS:
            raise ValueError(f"config section {name!r} reuses flag names {sorted(clash)}")
        _SECTIONS[name] = cls
        return cls

    return register


def sections() -> dict[str, type]:
    for mod in extension_modules():
        importlib.import_module(mod)
    return dict(_SECTIONS)


@section("model")
@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """Model shape: the GPT block, or the LLaMA-style / MoE families by the flags below (Megatron-LM's
    names and meaning; models/families.py describes them, runtime/families.py builds them)."""

    num_layers: int = doc("Number of transformer layers.", 4)
    hidden_size: int = doc("Transformer hidden size.", 64)
    num_attention_heads: int = doc("Number of attention heads.", 4)
    ffn_hidden_size: int | None = doc("MLP hidden size; default 4 x hidden-size, or with --swiglu "
                                      "Megatron-LM's int(8 x hidden-size / 3 / 64) x 64.", None)
    seq_length: int = doc("Training sequence length in tokens.", 64)
    max_position_embeddings: int | None = doc("Learned position table size; default seq-length.", None)
    hidden_dropout: float = doc("Dropout after attention and MLP (Megatron-LM's default; LLaMA recipes give 0).", 0.1)
    attention_dropout: float = doc("Dropout on attention probabilities (Megatron-LM's default; LLaMA recipes give 0).",
                                   0.1)
    init_method_std: float = doc("Std of the normal weight initialisation.", 0.02)
    position_embedding_type: str = doc("Position embedding.", "learned_absolute",
                                       choices=("learned_absolute", "rope"))
    untie_embeddings_and_output_weights: bool = doc("Separate output layer weights from the embedding.", False)
    rotary_base: int = doc("Base period of rotary position embeddings (--position-embedding-type rope).", 10000)
    rotary_percent: float = doc("Fraction of each head's channels that rotary embeddings rotate.", 1.0)
    use_rope_scaling: bool = doc("LLaMA-3.x's rotary frequency scaling (megatron-core's rope_scaling).", False)
    rope_scaling_factor: float = doc("The factor of --use-rope-scaling.", 8.0)
    rotary_seq_len_interpolation_factor: int | None = doc("Divide rotary positions by this factor (sequence length "
                                                          "interpolation).", None)
    normalization: str = doc("Normalisation layers.", "LayerNorm", choices=("LayerNorm", "RMSNorm"))
    swiglu: bool = doc("SwiGLU MLP: a gated linear unit with SiLU (three weight matrices).", False)
    squared_relu: bool = doc("Squared ReLU instead of GeLU in the MLP (Nemotron's).", False)
    group_query_attention: bool = doc("Grouped-query attention: --num-query-groups key/value heads.", False)
    num_query_groups: int | None = doc("Key/value head groups with --group-query-attention.", None)
    disable_bias_linear: bool = doc("No biases in the linear layers.", False)
    qk_layernorm: bool = doc("Normalise queries and keys per head before attention (the --normalization kind).",
                             False)
    num_experts: int | None = doc("Mixture of experts: experts per MoE layer (every layer's MLP); unset = dense.",
                                  None)
    moe_router_topk: int = doc("Experts each token is routed to.", 2)
    moe_ffn_hidden_size: int | None = doc("Hidden size of each expert's MLP; default --ffn-hidden-size.", None)
    moe_token_dispatcher_type: str = doc("How tokens reach their experts' ranks.", "allgather",
                                         choices=("allgather", "alltoall"))
    moe_router_load_balancing_type: str = doc(
        "Router load balancing: aux_loss (GShard/Switch, over the micro-batch), seq_aux_loss (per sequence), "
        "sinkhorn, or none.", "aux_loss", choices=("aux_loss", "seq_aux_loss", "sinkhorn", "none"))
    moe_aux_loss_coeff: float = doc("Weight of the load-balancing loss; when > 0 the loss is also logged "
                                    "(moe_load_balancing_loss / moe_seq_load_balancing_loss).", 0.0)
    moe_grouped_gemm: bool = doc("Run a rank's experts as one grouped GEMM (GPU with Transformer Engine only).",
                                 False)
    moe_router_pre_softmax: bool = doc("Score all experts (softmax, or sigmoid) before the top-k selection instead "
                                       "of a softmax over the top-k logits; megatron-core needs it with "
                                       "--moe-router-topk 1 and the softmax score function.", False)
    moe_router_score_function: str = doc("How the router scores the experts (sigmoid: DeepSeek-V3 style; with "
                                         "top-k > 1 the chosen scores are renormalised).", "softmax",
                                         choices=("softmax", "sigmoid"))
    moe_router_topk_scaling_factor: float | None = doc("Multiply the top-k routing weights by this factor "
                                                       "(e.g. with --moe-router-pre-softmax); unset = 1.", None)
    moe_shared_expert_intermediate_size: int | None = doc(
        "Shared experts: MLP width every token passes through besides its routed experts (number of shared "
        "experts x the width of each); unset = none.", None)
    moe_layer_freq: str = doc("Which layers are MoE layers (Megatron-LM's 1:N ratio or [1,0,...] pattern); "
                              "megatron-ext makes every layer's MLP an MoE layer, so only 1 is accepted.", "1")
    make_vocab_size_divisible_by: int = doc(
        "Pad the vocabulary to a multiple of this x --tensor-model-parallel-size (Megatron-LM's rule), with the "
        "launch's TP; a --load checkpoint's own padding of the same vocabulary is kept.", 128)

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "make_vocab_size_divisible_by"):
            if getattr(self, key) < 1:
                raise ConfigError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(self, key)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"--hidden-size ({self.hidden_size}) is not divisible by "
                              f"--num-attention-heads ({self.num_attention_heads})")
        if self.ffn_hidden_size is None:
            # Megatron-LM's default: 4h, or for SwiGLU 2/3 of it (same parameters) rounded down to 64.
            self.ffn_hidden_size = swiglu_ffn_hidden_size(self.hidden_size) if self.swiglu else 4 * self.hidden_size
            if self.ffn_hidden_size < 1:
                raise ConfigError(f"--swiglu with --hidden-size {self.hidden_size} gives Megatron-LM's default "
                                  "--ffn-hidden-size of 0: give --ffn-hidden-size")
        if self.ffn_hidden_size < 1:
            raise ConfigError(f"--ffn-hidden-size must be >= 1, got {self.ffn_hidden_size}")
        self._check_families()
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.max_position_embeddings < self.seq_length:
            raise ConfigError(f"--max-position-embeddings ({self.max_position_embeddings}) is smaller than "
                              f"--seq-length ({self.seq_length})")


    def _check_families(self) -> None:
        """Field checks of the LLaMA-style and MoE flags (layout checks: models/families.validate)."""
        rotary = [f"--{k.replace('_', '-')}" for k, default in (
            ("rotary_base", 10000), ("rotary_percent", 1.0), ("use_rope_scaling", False), ("rope_scaling_factor", 8.0),
            ("rotary_seq_len_interpolation_factor", None)) if getattr(self, k) != default]
        if rotary and self.position_embedding_type != "rope":
            raise ConfigError(f"{', '.join(rotary)} need{'s' if len(rotary) == 1 else ''} --position-embedding-type "
                              "rope")
        if self.squared_relu and self.swiglu:
            raise ConfigError("--squared-relu and --swiglu each choose the MLP's activation: give one")
        if not 0 < self.rotary_percent <= 1:
            raise ConfigError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if self.rotary_base < 1:
            raise ConfigError(f"--rotary-base must be >= 1, got {self.rotary_base}")
        if self.group_query_attention:
            g = self.num_query_groups
            if g is None:
                raise ConfigError("--group-query-attention needs --num-query-groups")
            if g < 1 or self.num_attention_heads % g:
                raise ConfigError(f"--num-attention-heads ({self.num_attention_heads}) is not divisible by "
                                  f"--num-query-groups ({g})")
        elif self.num_query_groups is not None:
            raise ConfigError("--num-query-groups needs --group-query-attention")
        if self.num_experts is None:
            moe_set = [f"--{k.replace('_', '-')}" for k, default in (
                ("moe_router_topk", 2), ("moe_ffn_hidden_size", None), ("moe_token_dispatcher_type", "allgather"),
                ("moe_router_load_balancing_type", "aux_loss"), ("moe_aux_loss_coeff", 0.0),
                ("moe_grouped_gemm", False), ("moe_router_pre_softmax", False),
                ("moe_router_score_function", "softmax"), ("moe_router_topk_scaling_factor", None),
                ("moe_shared_expert_intermediate_size", None), ("moe_layer_freq", "1")) if getattr(self, k) != default]
            if moe_set:
                raise ConfigError(f"{', '.join(moe_set)} need{'s' if len(moe_set) == 1 else ''} --num-experts")
            return
        if self.num_experts < 1:
            raise ConfigError(f"--num-experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.moe_router_topk <= self.num_experts:
            raise ConfigError(f"--moe-router-topk ({self.moe_router_topk}) must be between 1 and --num-experts "
                              f"({self.num_experts})")
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.moe_ffn_hidden_size < 1:
            raise ConfigError(f"--moe-ffn-hidden-size must be >= 1, got {self.moe_ffn_hidden_size}")
        if self.moe_aux_loss_coeff < 0:
            raise ConfigError(f"--moe-aux-loss-coeff must be >= 0, got {self.moe_aux_loss_coeff}")
        scale = self.moe_router_topk_scaling_factor
        if scale is not None and not scale > 0:
            raise ConfigError(f"--moe-router-topk-scaling-factor must be > 0, got {scale}")
        shared = self.moe_shared_expert_intermediate_size
        if shared is not None and shared < 1:
            raise ConfigError(f"--moe-shared-expert-intermediate-size must be >= 1, got {shared}")
        if str(self.moe_layer_freq).strip() != "1":
            # One layer spec for every layer: the checkpoint keys of a layer, ResiHP's FLOPs model and the
            # Hugging Face tables all assume that every MLP is an MoE layer.
            raise ConfigError(f"--moe-layer-freq {self.moe_layer_freq}: megatron-ext makes every layer's MLP an "
                              "MoE layer (one layer spec for all layers), so dense layers between MoE layers are "
                              "not supported: leave it at 1")

@section("parallel")
@dataclasses.dataclass(kw_only=True)
class ParallelConfig:
    """Parallel layout; data-parallel size is derived from the world size."""

    tensor_model_parallel_size: int = doc("Tensor-parallel group size.", 1)
    pipeline_model_parallel_size: int = doc("Number of pipeline stages.", 1)
    expert_model_parallel_size: int = doc("Expert-parallel group size (MoE): experts are split over this many "
                                          "data-parallel ranks.", 1)
    virtual_pipeline_model_parallel_size: int | None = doc(
        "Model chunks per pipeline stage (interleaved 1F1B); unset = plain 1F1B.", None)
    num_layers_per_virtual_pipeline_stage: int | None = doc(
        "Megatron-LM's spelling of interleaving: layers per model chunk (the chunks per stage follow).", None)
    num_virtual_stages_per_pipeline_rank: int | None = doc(
        "Megatron-LM's spelling of --virtual-pipeline-model-parallel-size.", None)
    decoder_first_pipeline_num_layers: int | None = doc(
        "Megatron-LM's uneven stages: layers of the first stage (the others share the rest evenly).", None)
    decoder_last_pipeline_num_layers: int | None = doc(
        "Megatron-LM's uneven stages: layers of the last stage (the others share the rest evenly).", None)
    pipeline_stage_layers: list[int] | None = doc(
        "Transformer layers of each pipeline stage, first to last (uneven stages, e.g. 3 1 for 4 layers on "
        "PP2; megatron's pipeline layout with the embedding on the first stage and the loss on the last); "
        "unset = an even split.", None)
    data_parallel_microbatches: list[int] | None = doc(
        "Micro-batches of each data-parallel replica, first to last (uneven work split, e.g. 3 1); they sum "
        "to --global-batch-size / --micro-batch-size, and the loss is weighted per token so the global "
        "batch's gradient is the even split's; unset = an even split.", None)
    sequence_parallel: bool = doc("Megatron sequence parallelism inside tensor-parallel regions.", False)
    overlap_grad_reduce: bool = doc("Overlap data-parallel gradient reduce with backward.", False)
    use_distributed_optimizer: bool = doc(
        "megatron's DistributedOptimizer: fp32 master weights and Adam moments sharded over "
        "data-parallel ranks (ZeRO-1); checkpoints stay layout-independent.", False)
    distributed_timeout_minutes: float = doc("Timeout of every collective (under --ft-on-stop continue, the "
                                             "fault-tolerance core's own --ft-continue-timeout-s).", 10)
    distributed_backend: str = doc("torch.distributed backend; auto = nccl on GPU, gloo on CPU.", "auto",
                                   choices=("auto", "gloo", "nccl"))
    device: str = doc("Where to train; auto = cuda when available.", "auto", choices=("auto", "cpu", "cuda"))
    engine: str = doc("Training engine (megatron_ext/engines.py): megatron-core schedules, or DeepSpeed's "
                      "PipelineEngine (PP x DP).", "megatron", choices=("megatron", "deepspeed"))
    deepspeed: bool = doc("Megatron-DeepSpeed's switch: train on DeepSpeed (--engine deepspeed), with the user's "
                          "--deepspeed_config.", False)
    deepspeed_config: str | None = doc(
        "DeepSpeed's config (Megatron-DeepSpeed's flag): a ds_config.json path, or the JSON itself. Its "
        "optimizer, scheduler, gradient_clipping, bf16 and zero_optimization sections are what runs; the batch "
        "sizes must agree with the Megatron flags (docs/pipeline.md, 'A DeepSpeed user's config').", None,
        aliases=("--deepspeed_config",))
    zero_stage: int | None = doc("ZeRO stage (Megatron-DeepSpeed's flag): must agree with the config's "
                                 "zero_optimization.stage; unset = the config's, else 0. Stages 0-1 with "
                                 "pipeline parallelism, 0-3 without.", None)
    universal_checkpoint: bool = doc("Megatron-DeepSpeed's flag: --load holds DeepSpeed's universal checkpoint "
                                     "(ds_to_universal's output, named by its latest_universal), loaded into this "
                                     "run's TP / PP / DP layout (DeepSpeed's checkpoint.load_universal).", False)
    no_pipeline_parallel: bool = doc("Megatron-DeepSpeed's flag: DeepSpeed's plain engine instead of its "
                                     "PipelineEngine (needs --pipeline-model-parallel-size 1; ZeRO-1 and above "
                                     "with one stage take the plain engine anyway).", False)

    def __post_init__(self) -> None:
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(self, key)}")
        if not self.distributed_timeout_minutes > 0:
            raise ConfigError(f"--distributed-timeout-minutes must be > 0, got {self.distributed_timeout_minutes}")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and (vpp < 1 or (vpp > 1 and self.pipeline_model_parallel_size < 2)):
            raise ConfigError("--virtual-pipeline-model-parallel-size needs --pipeline-model-parallel-size >= 2 "
                              f"and a value >= 1, got {vpp}")
        if self.deepspeed:
            self.engine = "deepspeed"
        if self.deepspeed_config is not None and self.engine != "deepspeed":
            raise ConfigError("--deepspeed_config needs --deepspeed (or --engine deepspeed)")
        if self.zero_stage is not None and (self.zero_stage not in (0, 1, 2, 3) or self.engine != "deepspeed"):
            raise ConfigError(f"--zero-stage {self.zero_stage}: needs --deepspeed and a stage of 0, 1, 2 or 3")
        if self.universal_checkpoint and self.engine != "deepspeed":
            raise ConfigError("--universal-checkpoint (DeepSpeed's universal checkpoint) needs --deepspeed")
        if self.no_pipeline_parallel and (self.engine != "deepspeed" or self.pipeline_model_parallel_size > 1):
            raise ConfigError("--no-pipeline-parallel (DeepSpeed's plain engine) needs --deepspeed and "
                              f"--pipeline-model-parallel-size 1, got {self.pipeline_model_parallel_size}")
        spec = engine(self.engine)
        if self.use_distributed_optimizer:
            spec.refuse("distributed_optimizer")
        stages = self.pipeline_stage_layers
        if stages is not None:
            if len(stages) != self.pipeline_model_parallel_size or min(stages) < 1:
                raise ConfigError(f"--pipeline-stage-layers needs one count >= 1 per pipeline stage "
                                  f"(--pipeline-model-parallel-size {self.pipeline_model_parallel_size}), got {stages}")
            if (vpp or 1) > 1:
                raise ConfigError("--pipeline-stage-layers and --virtual-pipeline-model-parallel-size cannot be "
                                  "combined (uneven stages are for plain 1F1B)")
        split = self.data_parallel_microbatches
        if split is not None:
            if min(split) < 1:
                raise ConfigError(f"--data-parallel-microbatches needs counts >= 1, got {split}")
            if (vpp or 1) > 1:
                raise ConfigError("--data-parallel-microbatches needs --engine megatron and plain 1F1B "
                                  "(no --virtual-pipeline-model-parallel-size)")
            spec.refuse("data_parallel_microbatches")
        if self.tensor_model_parallel_size > 1:
            spec.refuse("tensor_parallel")
        if (vpp or 1) > 1:
            spec.refuse("virtual_pipeline")

    def launch_layout(self, world_size: int) -> Layout:
        """The layout this launch request asks for over ``world_size`` ranks (members
        ``0..world-1``); ``ConfigError`` where TP x PP does not divide the world. The request is
        never rewritten: after launch the job reads its context's layout (``DistContext.layout``),
        which a live re-layout replaces."""
        stages, mbs = self.pipeline_stage_layers, self.data_parallel_microbatches
        try:
            return Layout.from_world(world_size, self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                                     vp=self.virtual_pipeline_model_parallel_size or 1,
                                     stage_layers=tuple(stages) if stages else None,
                                     replica_microbatches=tuple(mbs) if mbs else None)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def megatron_stage_spellings(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with Megatron-LM's spellings of the pipeline's chunks and stages written as ours
    (before the sections are built, so their checks see them): --num-layers-per-virtual-pipeline-stage
    and --num-virtual-stages-per-pipeline-rank as --virtual-pipeline-model-parallel-size (one chunk is
    plain 1F1B), --decoder-first/last-pipeline-num-layers as --pipeline-stage-layers."""
    out = dict(values)

    def value(key: str, cls: type) -> Any:
        given = out.get(key)
        return int(given) if given is not None else next(f.default for f in dataclasses.fields(cls) if f.name == key)

    per_chunk = out.get("num_layers_per_virtual_pipeline_stage")
    chunks = out.get("num_virtual_stages_per_pipeline_rank")
    first, last = out.get("decoder_first_pipeline_num_layers"), out.get("decoder_last_pipeline_num_layers")
    if per_chunk is None and chunks is None and first is None and last is None:
        return out
    layers, pp = value("num_layers", ModelConfig), value("pipeline_model_parallel_size", ParallelConfig)
    if per_chunk is not None and chunks is not None:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank each "
                          "set the model chunks per stage: give one")
    if per_chunk is not None or chunks is not None:
        vpp = int(chunks) if chunks is not None else _chunks_per_stage(layers, pp, int(per_chunk))
        ours = out.get("virtual_pipeline_model_parallel_size")
        if ours is not None and int(ours) != vpp:
            raise ConfigError(f"--virtual-pipeline-model-parallel-size {ours} and Megatron-LM's spelling of it "
                              f"({vpp} chunks per stage) disagree: give one")
        out["virtual_pipeline_model_parallel_size"] = vpp if vpp > 1 else None
    if first is not None or last is not None:
        if out.get("pipeline_stage_layers") is not None:
            raise ConfigError("--pipeline-stage-layers and --decoder-first/last-pipeline-num-layers each set the "
                              "stages' layers: give one")
        out["pipeline_stage_layers"] = _uneven_stages(layers, pp, first, last)
    return out


def _chunks_per_stage(layers: int, pp: int, per_chunk: int) -> int:
    if per_chunk < 1 or layers % pp or (layers // pp) % per_chunk:
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {per_chunk}: --num-layers ({layers}) must split "
                          f"into --pipeline-model-parallel-size ({pp}) stages of whole chunks of {per_chunk} layers")
    return layers // pp // per_chunk


def _uneven_stages(layers: int, pp: int, first: Any, last: Any) -> list[int]:
    """Megatron-LM's first and last stage sizes, the stages between them sharing the rest evenly."""
    ends = [int(v) for v in (first, last) if v is not None]
    middle = pp - len(ends)
    rest = layers - sum(ends)
    if pp < 2 or min(ends) < 1 or rest < middle or (middle and rest % middle) or (not middle and rest):
        raise ConfigError(f"--decoder-first/last-pipeline-num-layers ({first}, {last}): --num-layers ({layers}) "
                          f"less those must split evenly over the other stages of --pipeline-model-parallel-size "
                          f"({pp})")
    each = rest // middle if middle else 0
    return ([int(first)] if first is not None else []) + [each] * middle + ([int(last)] if last is not None else [])


@section("training")
@dataclasses.dataclass(kw_only=True)
class TrainingConfig:
    """Optimisation: batch sizes, iterations, optimizer and learning-rate schedule."""

    micro_batch_size: int = doc("Sequences per micro-batch per data-parallel rank.", 2)
    global_batch_size: int = doc("Sequences per iteration over all data-parallel ranks.", 8)
    train_iters: int | None = doc("Number of training iterations; unset = 50, or as many as --train-samples makes.",
                                  None)
    train_samples: int | None = doc(
        "Train over this many samples instead (Megatron-LM's sample-based training): the iterations are "
        "derived as Megatron-LM derives them, and the learning-rate schedule counts samples.", None)
    rampup_batch_size: list[int] | None = doc(
        "START INCREMENT SAMPLES: grow the global batch from START by INCREMENT up to --global-batch-size over "
        "the first SAMPLES samples (megatron-core's micro-batch calculator); the schedule counts samples.", None)
    skip_train: bool = doc("Megatron-LM's --skip-train: no training iteration; the validation (--eval-iters "
                           "iterations) runs at the loaded checkpoint's iteration and the job exits, saving "
                           "nothing. The optimizer's state is not loaded (as --no-load-optim). Also "
                           "--eval-only.", False, aliases=("--eval-only",))
    lr: float = doc("Peak learning rate.", 1e-3)
    min_lr: float = doc("Learning rate at the end of decay.", 0.0)
    lr_warmup_iters: int = doc("Linear warm-up iterations.", 0)
    lr_decay_iters: int | None = doc("Iterations over which the LR decays; default train-iters.", None)
    lr_warmup_samples: int = doc("Linear warm-up samples (with --train-samples).", 0)
    lr_decay_samples: int | None = doc("Samples over which the LR decays (with --train-samples); default "
                                       "--train-samples.", None)
    lr_warmup_fraction: float | None = doc("Warm up over this fraction of the decay (iterations or samples), "
                                           "instead of --lr-warmup-iters / --lr-warmup-samples.", None)
    lr_warmup_init: float = doc("Learning rate the warm-up starts from.", 0.0)
    lr_decay_style: str = doc("Decay after warm-up.", "linear",
                              choices=("constant", "linear", "cosine", "inverse-square-root"))
    weight_decay: float = doc("Decoupled weight decay (AdamW); not applied to biases and norms.", 0.01)
    adam_beta1: float = doc("Adam beta1.", 0.9)
    adam_beta2: float = doc("Adam beta2.", 0.999)
    adam_eps: float = doc("Adam epsilon.", 1e-8)
    clip_grad: float = doc("Clip the global gradient norm to this value; 0 disables.", 1.0)
    seed: int = doc("Random seed (weights, data order, dropout).", 1234)
    bf16: bool = doc("bf16 weights with fp32 master weights in megatron's optimizer (on CPU too, slowly).",
                     False)
    fp16: bool = doc("fp16 weights with fp32 master weights and loss scaling in megatron's optimizer (on CPU too, "
                     "slowly).", False)
    grad_reduce_in_bf16: bool = doc("With --bf16, accumulate and reduce gradients in bf16 instead of fp32.", False)
    loss_scale: float | None = doc("With --fp16, a constant loss scale; unset = dynamic loss scaling.", None)
    initial_loss_scale: float = doc("With --fp16, the dynamic loss scale to start from.", 2.0 ** 32)
    min_loss_scale: float = doc("With --fp16, the dynamic loss scale's floor.", 1.0)
    loss_scale_window: float = doc("With --fp16, iterations without an overflow before the loss scale doubles.",
                                   1000)
    hysteresis: int = doc("With --fp16, overflows tolerated before the loss scale halves.", 2)
    decoupled_lr: float | None = doc("A learning rate of its own for the input and output layers (embedding and "
                                     "output weights); unset = --lr.", None)
    decoupled_min_lr: float | None = doc("With --decoupled-lr, their rate at the end of decay; unset = --min-lr.", None)
    manual_gc: bool = doc("Switch Python's garbage collector off for the run and collect at the same points on "
                          "every rank (--manual-gc-interval, around validation): runtime/housekeeping.py.", False)
    manual_gc_interval: int = doc("With --manual-gc, collect every N iterations; 0 = never during training.", 0)
    manual_gc_eval: bool = doc("With --manual-gc, collect before and after each validation.", True)
    empty_unused_memory_level: int = doc("On a GPU, empty the CUDA caching allocator after each iteration (1 or 2, "
                                         "Megatron-LM's levels; 0 = never).", 0, choices=(0, 1, 2))
    log_num_zeros_in_grad: bool = doc("Count the gradient's zero entries at every optimizer step and log them "
                                      "(Megatron-LM's flag: 'num zeros' in the line, num-zeros in TensorBoard, "
                                      "num_zeros_in_grad in the metrics rows).", False)
    calculate_per_token_loss: bool = doc(
        "Average the loss over the global batch's tokens (loss sums and token counts reduced over the micro-batches "
        "and replicas) instead of over its micro-batches.", False)
    override_opt_param_scheduler: bool = doc(
        "On resume (--load), take the learning-rate schedule from these flags (--lr, --min-lr, --lr-warmup-iters, "
        "--lr-decay-iters, --lr-decay-style, --weight-decay) instead of the checkpoint's, at the checkpoint's "
        "iteration: how a finished run is trained on (Megatron-LM's --override-opt_param-scheduler). Without it "
        "the checkpoint's schedule wins.", False, aliases=("--override-opt_param-scheduler",))

    def __post_init__(self) -> None:
        for key in ("micro_batch_size", "global_batch_size", "train_iters", "train_samples"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(self, key)}")
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"need 0 <= --min-lr <= --lr, got min-lr={self.min_lr} lr={self.lr}")
        for key in ("lr_warmup_iters", "lr_warmup_samples"):
            if getattr(self, key) < 0:
                raise ConfigError(f"--{key.replace('_', '-')} must be >= 0, got {getattr(self, key)}")
        if not 0 <= self.lr_warmup_init <= self.lr:
            raise ConfigError(f"need 0 <= --lr-warmup-init <= --lr, got {self.lr_warmup_init}")
        if self.manual_gc_interval < 0:
            raise ConfigError(f"--manual-gc-interval must be >= 0, got {self.manual_gc_interval}")
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 each set the model's precision: give one")
        if self.grad_reduce_in_bf16 and not self.bf16:
            raise ConfigError("--grad-reduce-in-bf16 needs --bf16 (gradients are reduced in the model's precision)")
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise ConfigError("--decoupled-min-lr needs --decoupled-lr")
        low = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
        if self.decoupled_lr is not None and not 0 <= low <= self.decoupled_lr:
            raise ConfigError(f"need 0 <= --decoupled-min-lr <= --decoupled-lr, got {low} and {self.decoupled_lr}")
        self._check_rampup()
        self._resolve_length()
        if self.clip_grad < 0:
            raise ConfigError(f"--clip-grad must be >= 0, got {self.clip_grad}")

    def _check_rampup(self) -> None:
        ramp = self.rampup_batch_size
        if ramp is None:
            return
        if len(ramp) != 3:
            raise ConfigError(f"--rampup-batch-size takes START INCREMENT SAMPLES (three numbers), got "
                              f"{' '.join(map(str, ramp))}")
        start, increment, samples = ramp
        if start < 1 or increment < 1 or samples < 0:
            raise ConfigError(f"--rampup-batch-size {start} {increment} {samples}: START and INCREMENT must be >= 1 "
                              "and SAMPLES >= 0")
        gap = self.global_batch_size - start
        if gap < 0 or gap % increment:
            raise ConfigError(f"--rampup-batch-size {start} {increment} {samples}: the batch must grow from {start} "
                              f"to --global-batch-size ({self.global_batch_size}) in steps of {increment}")

    def _resolve_length(self) -> None:
        """The run's iterations, and which schedule flags go with its length (Megatron-LM's checks):
        --train-samples with the --lr-*-samples flags, --train-iters with the --lr-*-iters ones."""
        from megatron_ext.config.samples import iterations_for_samples

        if self.train_samples is not None:
            given = [flag for flag, on in (("--lr-warmup-iters", self.lr_warmup_iters),
                                           ("--lr-decay-iters", self.lr_decay_iters is not None)) if on]
            if given:
                raise ConfigError(f"{', '.join(given)} count iterations; with --train-samples the schedule counts "
                                  "samples: give --lr-warmup-samples / --lr-decay-samples")
            iterations = iterations_for_samples(self.train_samples, self.global_batch_size, self.micro_batch_size,
                                                self.rampup_batch_size)
            if iterations < 1:
                raise ConfigError(f"--train-samples {self.train_samples} is less than one global batch "
                                  f"({self.global_batch_size})")
            if self.train_iters is not None and self.train_iters != iterations:
                raise ConfigError(f"--train-iters {self.train_iters} and --train-samples {self.train_samples} "
                                  f"({iterations} iterations) both give the run's length: give one")
            self.train_iters = iterations
        else:
            given = [flag for flag, on in (("--lr-warmup-samples", self.lr_warmup_samples),
                                           ("--lr-decay-samples", self.lr_decay_samples is not None)) if on]
            if given:
                raise ConfigError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} --train-samples "
                                  "(with --train-iters: --lr-warmup-iters / --lr-decay-iters)")
            if self.train_iters is None:
                self.train_iters = 50
            if self.lr_decay_iters is None:
                self.lr_decay_iters = self.train_iters
        if self.lr_warmup_fraction is not None:
            if not 0 <= self.lr_warmup_fraction < 1:
                raise ConfigError(f"--lr-warmup-fraction must be in [0, 1), got {self.lr_warmup_fraction}")
            if self.lr_warmup_iters or self.lr_warmup_samples:
                raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters / --lr-warmup-samples each set the "
                                  "warm-up: give one")

    def global_batch_at(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after ``consumed_samples`` samples: the ramp's
        (--rampup-batch-size), else --global-batch-size."""
        if self.rampup_batch_size is None:
            return self.global_batch_size
        from megatron_ext.config.samples import rampup_batch

        return rampup_batch(self.rampup_batch_size, self.global_batch_size, self.micro_batch_size, consumed_samples)


@section("data")
@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """Training data as Megatron-LM takes it: indexed datasets (.bin/.idx), blends and splits.

    megatron-core's GPTDataset reads them, its BlendedMegatronDatasetBuilder blends them (data/dataset.py)."""

    data_path: list[str] | None = doc(
        "Indexed dataset prefix (path without .bin/.idx), or a blend: WEIGHT PREFIX WEIGHT PREFIX ... (drawn in "
        "proportion to the weights), or PREFIX PREFIX ... (in proportion to their sizes); split by --split. "
        "Unset = the embedded default corpus, built on first use.", None)
    split: str | None = doc(
        "Train, valid and test proportions of --data-path, read as Megatron-LM reads them (the numbers in the "
        f"text: 969,30,1 or 99/1/0); default Megatron-LM's {DEFAULT_SPLIT}.", None)
    data_args_path: str | None = doc("A file holding --data-path's value (whitespace-separated weights and "
                                     "prefixes), for a blend too long for a command line (Megatron-LM's flag).", None)
    train_data_path: list[str] | None = doc("The training data on its own (a prefix or a blend, as --data-path); "
                                            "instead of --data-path and --split.", None)
    valid_data_path: list[str] | None = doc("The validation data on its own (with --train-data-path).", None)
    test_data_path: list[str] | None = doc("The test data on its own (with --train-data-path).", None)
    mock_data: bool = doc("Train on megatron-core's MockGPTDataset (generated token sequences) instead of data "
                          "files.", False)
    data_cache_path: str | None = doc(
        "Where the dataset index caches (and the default corpus) live; default $MEGATRON_EXT_CACHE or "
        "~/.cache/megatron_ext.", None, renamed_from="data_cache_dir")
    doc_length_dist: str | None = doc("Pack each sequence from documents with lengths drawn from this "
                                      "distribution (fixed:N, uniform:LO,HI, lognormal:MU,SIGMA, pareto:ALPHA,XMIN); "
                                      "attention stays within a document, so compute follows the lengths.", None)
    eod_mask_loss: bool = doc("Leave the end-of-document tokens out of the loss (megatron-core's GPTDataset).", False)
    reset_position_ids: bool = doc("Restart the position ids after each end-of-document token (megatron-core's "
                                   "GPTDataset).", False)
    reset_attention_mask: bool = doc("Megatron-LM's per-document attention mask from the dataset: not supported "
                                     "(--doc-length-dist packs documents that attend only within themselves).", False)
    create_attention_mask_in_dataloader: bool = doc(
        "Megatron-LM builds the causal mask in its data loader unless --no-create-attention-mask-in-dataloader; "
        "here the attention applies it itself, so both train the same.", True)
    mmap_bin_files: bool = doc("Read the .bin files through a memory map (--no-mmap-bin-files: file reads; "
                               "megatron-core's IndexedDataset).", True)
    num_dataset_builder_threads: int = doc("Threads per rank building a blend's datasets (megatron-core's builder).",
                                           1)
    dataloader_type: str | None = doc("Megatron-LM's sampler: single is this runtime's order (each global batch the "
                                      "next samples, data-parallel ranks taking contiguous shares); cyclic and "
                                      "external are not built.", None, choices=("single", "cyclic", "external"))
    num_workers: int = doc("Megatron-LM's data loader worker processes: accepted, no effect (samples are read in the "
                           "training loop).", 2)

    def __post_init__(self) -> None:
        if self.data_args_path is not None:
            if self.data_path:
                raise ConfigError("give --data-path or --data-args-path, not both")
            try:
                with open(self.data_args_path, encoding="utf-8") as fh:
                    self.data_path = fh.read().split()
            except OSError as exc:
                raise ConfigError(f"--data-args-path {self.data_args_path}: {exc.strerror}") from None
            if not self.data_path:
                raise ConfigError(f"--data-args-path {self.data_args_path}: the file is empty")
        if self.reset_attention_mask:
            raise ConfigError("--reset-attention-mask is not supported: megatron-core's per-sample document masks "
                              "are not passed to the attention here; --doc-length-dist packs documents that attend "
                              "only within themselves")
        if self.dataloader_type in ("cyclic", "external"):
            raise ConfigError(f"--dataloader-type {self.dataloader_type} is not built: samples are read in order, "
                              "each global batch the next ones (Megatron-LM's single), which is what a resume and a "
                              "layout change rely on")
        if self.num_dataset_builder_threads < 1:
            raise ConfigError(f"--num-dataset-builder-threads must be >= 1, got {self.num_dataset_builder_threads}")
        per_split = {f"--{name}-data-path": getattr(self, f"{name}_data_path") for name in SPLIT_NAMES}
        sources = [flag for flag, given in (("--data-path", self.data_path), ("--mock-data", self.mock_data),
                                            ("--train-data-path etc.", any(per_split.values()))) if given]
        if len(sources) > 1:
            raise ConfigError(f"{' and '.join(sources)} are each a whole data source: give one")
        for flag, items in (("--data-path", self.data_path), *per_split.items()):
            if items is not None:
                try:
                    parse_blend(items, flag)
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
        if any(per_split.values()):
            if not self.train_data_path:
                given = [flag for flag, items in per_split.items() if items]
                raise ConfigError(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --train-data-path")
            if self.split is not None:
                raise ConfigError("--split divides --data-path; --train-data-path, --valid-data-path and "
                                  "--test-data-path are already the splits: leave --split out")
        else:
            self.split = DEFAULT_SPLIT if self.split is None else self.split
            try:
                parse_split(self.split)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if self.doc_length_dist is not None:
            from megatron_ext.data.packing import LengthDistribution

            try:
                LengthDistribution.parse(self.doc_length_dist)
            except ValueError as exc:
                raise ConfigError(f"--doc-length-dist: {exc}") from None

    def blends(self) -> list[tuple[str, Blend]]:
        """(flag, blend) of every data path given: --data-path, or the per-split paths."""
        flags = [("--data-path", self.data_path)] + [(f"--{n}-data-path", getattr(self, f"{n}_data_path"))
                                                     for n in SPLIT_NAMES]
        return [(flag, parse_blend(items, flag)) for flag, items in flags if items]

    def prefixes(self) -> list[str]:
        """Every dataset prefix the run reads, in flag order, each once."""
        return list(dict.fromkeys(p for _, blend in self.blends() for p in blend.prefixes))


@section("tokenizer")
@dataclasses.dataclass(kw_only=True)
class TokenizerConfig:
    """The tokenizer: Megatron-LM's --tokenizer-type and its files, or the data's own BPE.

    Built through megatron-core's megatron.core.tokenizers (data/tokenizer_types.py); without a type, the BPE
    the data was preprocessed with."""

    tokenizer_type: str | None = doc(
        "Megatron-LM's tokenizer type; unset = the data's own BPE (--tokenizer-file), or GPT2BPETokenizer when "
        "--vocab-file and --merge-file are given (Megatron-LM's pretrain_gpt.py default).", None, choices=TOKENIZER_TYPES)
    tokenizer_model: str | None = doc("SentencePiece .model, Hugging Face tokenizer directory (or hub name), or "
                                      "Megatron-LM's tiktoken .json, as the type reads.", None)
    vocab_file: str | None = doc("GPT2BPETokenizer: GPT-2's vocab.json.", None)
    merge_file: str | None = doc("GPT2BPETokenizer: GPT-2's merges.txt.", None)
    vocab_size: int | None = doc("NullTokenizer: ids 0..N-1 (and N, the end of a document); TikTokenizer: the "
                                 "vocabulary with its special tokens (megatron-core's default 131072). Other types "
                                 "take their size from their files.", None)
    tiktoken_pattern: str | None = doc("TikTokenizer: the pre-tokenization regex (megatron-core's default v2).", None,
                                       choices=TIKTOKEN_PATTERNS)
    tiktoken_num_special_tokens: int = doc("TikTokenizer: special tokens before the vocabulary's own.", 1000)
    padded_vocab_size: int | None = doc("The model's vocabulary rows, as given (Megatron-LM's flag; the tensor-"
                                        "parallel size must divide it); unset: the tokenizer's size padded to "
                                        "--make-vocab-size-divisible-by x TP.", None)
    tokenizer_special_tokens: list[str] | None = doc("Special tokens added to a SentencePiece, tiktoken or Hugging "
                                                     "Face tokenizer (megatron-core's special_tokens / "
                                                     "additional_special_tokens).", None)
    trust_remote_code: bool = doc("HuggingFaceTokenizer: let transformers run the tokenizer's own code from its "
                                  "directory or hub repository.", False)
    tokenizer_hf_use_fast: bool = doc("HuggingFaceTokenizer: transformers' fast (Rust) tokenizer.", False)
    tokenizer_hf_include_special_tokens: bool = doc("HuggingFaceTokenizer: add the tokenizer's special tokens "
                                                    "(bos/eos) when encoding.", False)
    tokenizer_sentencepiece_legacy: bool = doc("SentencePiece tokenizers: megatron-core's legacy handling of "
                                               "special tokens.", False)
    tokenizer_file: str | None = doc("The BPE's tokenizers JSON (no --tokenizer-type); default: "
                                     "<data-path>.tokenizer.json, or the default corpus's.", None)

    def __post_init__(self) -> None:
        check_tokenizer_request(self)


@section("logging")
@dataclasses.dataclass(kw_only=True)
class LoggingConfig:
    """Progress lines, validation, TensorBoard and Weights & Biases (Megatron-LM's flags, defaults and tags)."""

    log_interval: int = doc("Print a progress line every N iterations (and at the run's first and last).", 100)
    log_format: str = doc("The progress and validation lines: ours, or Megatron-LM's (its fields, order and "
                          "number formats, for log parsers that read them).", "megatron-ext",
                          choices=("megatron-ext", "megatron"))
    eval_interval: int | None = doc("Validate every N iterations (and at the end); unset = only at the end.", None)
    eval_iters: int = doc("Validation iterations per evaluation; 0 disables validation.", 100)
    tensorboard_dir: str | None = doc("Write TensorBoard scalars here (last rank writes).", None)
    tensorboard_log_interval: int = doc("Write the training scalars every N iterations.", 1)
    tensorboard_queue_size: int = doc("Scalars TensorBoard holds before it writes them to disk.", 1000)
    log_throughput: bool = doc("TFLOP/s per device of each iteration (the model's FLOPs, models/flops.py, over the "
                               "iteration time and the world size) in the progress line and the metrics file.", False)
    log_timers_to_tensorboard: bool = doc("Write the iteration time (and with --log-throughput the TFLOP/s per "
                                          "device; with --timing-log-level 1 the forward-backward and optimizer "
                                          "times) to TensorBoard and Weights & Biases.", False)
    timing_log_level: int = doc("0: time the iteration only; 1 (and 2, the same here: per-operation times are "
                                "the timeline's, --timeline): also its forward-backward and optimizer step, on the "
                                "logging rank.", 0, choices=(0, 1, 2))
    log_validation_ppl_to_tensorboard: bool = doc("Write the validation perplexity to TensorBoard too.", False)
    log_loss_scale_to_tensorboard: bool = doc("Write the loss scale to TensorBoard (1.0 unless the optimizer "
                                              "scales the loss).", True)
    log_world_size_to_tensorboard: bool = doc("Write the number of ranks to TensorBoard.", False)
    log_params_norm: bool = doc("Compute the L2 norm of the model's parameters after every iteration and log it "
                                "(Megatron-LM's flag: 'params norm' in the progress line, params-norm in "
                                "TensorBoard, params_norm in the metrics rows).", False)
    wandb_project: str | None = doc("Log the scalars to this Weights & Biases project too (needs the wandb "
                                    "package; WANDB_MODE=offline keeps the run in local files). Unset or empty: "
                                    "no Weights & Biases, whatever the other --wandb-* flags say.", None)
    wandb_exp_name: str | None = doc("The Weights & Biases run's name; default wandb's.", None)
    wandb_save_dir: str | None = doc("Where Weights & Biases keeps the run's files; default <--save>/wandb, "
                                     "else ./wandb.", None)
    wandb_entity: str | None = doc("The Weights & Biases entity (team or user) of the project; default yours.",
                                   None)
    metrics_file: str | None = doc("Append one JSON line of metrics per iteration and evaluation here.", None)
    progress: bool = doc("Print progress lines (iteration, loss, lr, tokens/s, ETA).", True)

    def __post_init__(self) -> None:
        for key in ("log_interval", "tensorboard_log_interval", "tensorboard_queue_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(self, key)}")
        if self.eval_interval is not None and self.eval_interval < 1:
            raise ConfigError(f"--eval-interval must be >= 1, got {self.eval_interval}")
        if self.eval_iters < 0:
            raise ConfigError(f"--eval-iters must be >= 0, got {self.eval_iters}")
        # As in Megatron-LM, the project switches Weights & Biases on; the other --wandb-* flags alone do not.
        if self.wandb_project:
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                raise ConfigError("--wandb-project needs the wandb package, which is not installed: "
                                  "pip install wandb (or leave --wandb-project unset)")


@section("checkpoint")
@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    """Sharded, atomic, integrity-checked checkpoints."""

    save: str | None = doc("Checkpoint directory to save into.", None)
    load: str | None = doc("Checkpoint directory to resume from (latest iteration).", None)
    save_interval: int | None = doc("Save every N iterations (and at the end when --save is set).", None)
    keep_last: int = doc("Keep this many newest checkpoints in --save; 0 keeps all.", 0)
    pretrained_checkpoint: str | None = doc(
        "Where --load holds no checkpoint, start from this one's weights (Megatron-LM's fine-tuning start: "
        "iteration 0, a fresh optimizer, schedule and RNG).", None)
    finetune: bool = doc("Take only the weights of --load's checkpoint: iteration 0, a fresh optimizer, schedule and "
                         "RNG.", False)
    load_optim: bool = doc("Restore the optimizer's state and the learning-rate schedule from --load (--no-load-optim: "
                           "fresh ones, as in Megatron-LM).", True)
    load_rng: bool = doc("Restore the RNG states from --load (in the same layout).", True)
    ckpt_format: str = doc("Format of the checkpoints --save writes: torch_dist, Megatron-LM's (its default; "
                           "megatron.core.dist_checkpointing, loadable by Megatron-LM in any layout), megatron_ext, "
                           "the project's former own format, or deepspeed (DeepSpeed's global_stepN/ and latest, "
                           "--engine deepspeed only; ZeRO-1 and above always write it). Loading reads any of them, "
                           "whatever this says.",
                           "torch_dist")
    ckpt_step: int | None = doc("Load this iteration of --load instead of its newest (Megatron-LM's flag).", None)
    use_checkpoint_args: bool = doc("Take the model's flags from the checkpoint --load holds, as Megatron-LM does: "
                                    "its shape where the flags do not give it, the rest always "
                                    "(config/checkpoint_args.py).", False)
    use_tokenizer_model_from_checkpoint_args: bool = doc("With --use-checkpoint-args, the tokenizer's type and "
                                                         "model from the checkpoint too.", True)
    use_mp_args_from_checkpoint_args: bool = doc("With --use-checkpoint-args, the TP/PP/VP/EP sizes from the "
                                                 "checkpoint too.", False)
    exit_signal_handler: bool = doc("On --exit-signal, every rank agrees at the next iteration boundary, saves a "
                                    "checkpoint (with --save) and exits 0: a preempted or time-limited job loses "
                                    "nothing (Megatron-LM's flag).", False)
    exit_signal: str = doc("The signal --exit-signal-handler catches, by name (Slurm's warning signal before a "
                           "time limit is what the batch script asks for: SIGUSR1 in scripts/slurm/).", "SIGTERM")
    exit_duration_in_mins: int | None = doc("Save (with --save) and exit 0 once the run has trained this many "
                                            "minutes (all ranks agree at an iteration boundary).", None)
    exit_interval: int | None = doc("Save (with --save) and exit 0 after an iteration divisible by this.", None)

    def __post_init__(self) -> None:
        if self.save_interval is not None and self.save_interval < 1:
            raise ConfigError(f"--save-interval must be >= 1, got {self.save_interval}")
        if self.keep_last < 0:
            raise ConfigError(f"--keep-last must be >= 0, got {self.keep_last}")
        for key in ("exit_duration_in_mins", "exit_interval"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(self, key)}")
        if self.ckpt_format not in ("torch_dist", "megatron_ext", "deepspeed"):
            other = {"torch": "Megatron-LM's legacy per-rank files", "zarr": "a deprecated dist_checkpointing backend",
                     "torch_dcp": "PyTorch DCP without megatron's metadata",
                     "fsdp_dtensor": "Megatron-FSDP's DTensor layout"}.get(self.ckpt_format)
            raise ConfigError(f"--ckpt-format {self.ckpt_format}" + (f" ({other})" if other else "") +
                              " is not written here: use torch_dist (Megatron-LM's default, which it loads), "
                              "megatron_ext, or deepspeed (DeepSpeed's own, --engine deepspeed)")
        if self.ckpt_step is not None and self.ckpt_step < 0:
            raise ConfigError(f"--ckpt-step must be >= 0, got {self.ckpt_step}")
        if self.exit_signal_handler:
            import signal

            if self.exit_signal not in signal.Signals.__members__ or self.exit_signal in ("SIGKILL", "SIGSTOP"):
                raise ConfigError(f"--exit-signal must name a signal a process can catch (SIGTERM, SIGUSR1, "
                                  f"SIGUSR2, SIGINT, ...), got {self.exit_signal!r}")


# Megatron-LM's TransformerConfig flags (generated from megatron-core's dataclass) and the flags handled
# by name only (ignored or refused, with why): config/megatron_flags.py, which reads them.
section("transformer")(megatron_flags.TransformerFlags)
section("megatron")(megatron_flags.MegatronFlags)


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    model: ModelConfig
    parallel: ParallelConfig
    training: TrainingConfig
    data: DataConfig
    tokenizer: TokenizerConfig
    logging: LoggingConfig
    checkpoint: CheckpointConfig
    extensions: dict[str, Any] = dataclasses.field(default_factory=dict)
    source: str = "defaults"
    notes: list[str] = dataclasses.field(default_factory=list)
    """Said once at start-up (rank 0): e.g. a former flag name that was used."""

    def ext(self, name: str) -> Any:
        """The section registered as ``name``: read only inside the package that registers it
        (tests/config/test_sections.py); other packages ask ``capability``."""
        return self.extensions.get(name)

    def capability(self, name: str) -> str | None:
        """What asks for capability ``name``, or None when no section does. A section declares
        what the rest of the job must know of it through a ``capabilities()`` method returning
        ``{capability: why}`` (e.g. Helix: ``"local_layer_spec"``), so the model layer and the
        fault-tolerance core never read another package's section. The first declaring section
        (in registration order) is the one named."""
        for sec in self.extensions.values():
            declared = getattr(sec, "capabilities", None)
            why = declared().get(name) if callable(declared) else None
            if why:
                return why
        return None

    def flat(self) -> dict[str, Any]:
        """All keys as one flat mapping (what a YAML file holds)."""
        out: dict[str, Any] = {}
        for name in _CORE:
            out.update(dataclasses.asdict(getattr(self, name)))
        for cfg in self.extensions.values():
            out.update(dataclasses.asdict(cfg))
        return out

    def validate(self, world_size: int) -> None:
        """Checks that need the world size; raise before any model is built."""
        tp = self.parallel.tensor_model_parallel_size
        pp = self.parallel.pipeline_model_parallel_size
        try:
            check_divides(world_size, tp, pp)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        dp = world_size // (tp * pp)
        if self.training.skip_train and self.logging.eval_iters == 0:
            raise ConfigError("--skip-train runs only the validation, and --eval-iters 0 turns it off: give "
                              "--eval-iters N (N > 0)")
        vpp = self.parallel.virtual_pipeline_model_parallel_size or 1
        stages = self.parallel.pipeline_stage_layers
        if stages is not None and sum(stages) != self.model.num_layers:
            raise ConfigError(f"--pipeline-stage-layers {' '.join(map(str, stages))} sums to {sum(stages)}, "
                              f"not --num-layers ({self.model.num_layers})")
        if stages is None and self.model.num_layers % (pp * vpp):
            what = f"--pipeline-model-parallel-size ({pp})" + (
                f" x --virtual-pipeline-model-parallel-size ({vpp})" if vpp > 1 else "")
            raise ConfigError(f"--num-layers ({self.model.num_layers}) is not divisible by {what}")
        if self.model.num_attention_heads % tp:
            raise ConfigError(f"--num-attention-heads ({self.model.num_attention_heads}) is not divisible by "
                              f"--tensor-model-parallel-size ({tp})")
        if self.model.ffn_hidden_size % tp:
            raise ConfigError(f"--ffn-hidden-size ({self.model.ffn_hidden_size}) is not divisible by "
                              f"--tensor-model-parallel-size ({tp})")
        mbs, gbs = self.training.micro_batch_size, self.training.global_batch_size
        split = self.parallel.data_parallel_microbatches
        if split is not None and (len(split) != dp or sum(split) * mbs != gbs):
            raise ConfigError(f"--data-parallel-microbatches {' '.join(map(str, split))} needs one count per "
                              f"data-parallel replica ({dp}) summing to --global-batch-size ({gbs}) / "
                              f"--micro-batch-size ({mbs}) = {gbs // mbs}")
        if split is None and gbs % (mbs * dp):
            raise ConfigError(
                f"--global-batch-size ({gbs}) is not divisible by --micro-batch-size ({mbs}) x "
                f"data-parallel size ({dp} = world size {world_size} / (TP {tp} x PP {pp})) = {mbs * dp}")
        if vpp > 1 and (gbs // (mbs * dp)) % pp:
            raise ConfigError(f"interleaved 1F1B needs the number of micro-batches ({gbs // (mbs * dp)}) "
                              f"to be a multiple of --pipeline-model-parallel-size ({pp})")
        self._validate_rampup(dp, pp, vpp)
        if self.parallel.sequence_parallel and self.model.seq_length % tp:
            raise ConfigError(f"--sequence-parallel needs --seq-length ({self.model.seq_length}) divisible by "
                              f"--tensor-model-parallel-size ({tp})")
        from megatron_ext.models.families import validate as validate_family

        validate_family(self, world_size)
        self._validate_data()
        ck = self.checkpoint
        same = ck.save is not None and ck.load is not None and os.path.realpath(ck.save) == os.path.realpath(ck.load)
        if ck.pretrained_checkpoint is not None and not os.path.isdir(ck.pretrained_checkpoint):
            raise ConfigError(f"--pretrained-checkpoint {ck.pretrained_checkpoint}: no such directory")
        if ck.load is not None and not os.path.isdir(ck.load) and not same:  # --save X --load X: X may come later
            raise ConfigError(f"--load {ck.load}: no such directory")

    def _validate_data(self) -> None:
        """The data and tokenizer files exist (their contents: ``data/check.py``, at launch)."""
        from megatron_ext.data.tokenizer_types import missing_files, resolved_type

        for flag, blend in self.data.blends():
            for prefix in blend.prefixes:
                missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
                if missing:
                    hint = (" (a prefix is the path without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else "")
                    raise ConfigError(f"{flag} {prefix}: missing {' and '.join(missing)}{hint}; build it with "
                                      "tools/preprocess_data.py or leave --data-path unset for the default corpus")
        missing = missing_files(self.tokenizer)
        if missing:
            raise ConfigError(f"{', '.join(missing)}: no such file")
        kind = resolved_type(self.tokenizer)
        if kind is not None and not self.data.blends() and not self.data.mock_data:
            raise ConfigError(f"--tokenizer-type {kind} needs --data-path (or --mock-data): the embedded default "
                              "corpus is tokenized with its own BPE")

    def _validate_rampup(self, dp: int, pp: int, vpp: int) -> None:
        """Every global batch of --rampup-batch-size splits into whole micro-batches per data-parallel
        replica (megatron-core's calculator asserts it at each size), a multiple of PP under interleaving."""
        t = self.training
        if t.rampup_batch_size is None:
            return
        from megatron_ext.config.samples import rampup_sizes

        ramp = " ".join(map(str, t.rampup_batch_size))
        if self.parallel.data_parallel_microbatches is not None:
            raise ConfigError(f"--rampup-batch-size {ramp} and --data-parallel-microbatches: the replicas' "
                              "micro-batches are fixed there, the global batch grows here: give one")
        engine(self.parallel.engine).refuse("batch_size_rampup")
        for size in rampup_sizes(t.rampup_batch_size, t.global_batch_size):
            per = t.micro_batch_size * dp
            if size % per or (vpp > 1 and (size // per) % pp):
                need = f"--micro-batch-size ({t.micro_batch_size}) x data-parallel size ({dp})" + (
                    f" x --pipeline-model-parallel-size ({pp}) under interleaving" if vpp > 1 else "")
                raise ConfigError(f"--rampup-batch-size {ramp}: its global batch {size} is not a multiple of {need}")

    def validate_launch(self, world_size: int) -> None:
        """``validate``, and each extension section's own checks against the world the job is
        launched with (``check_world``: e.g. a fault injected into a rank it lacks), before any rank
        starts. A layout change later (fewer ranks after a loss) is checked by ``validate`` alone:
        those name ranks at launch."""
        self.validate(world_size)
        from megatron_ext.data.check import check_data

        check_data(self.data, self.tokenizer)   # builds the tokenizer and reads the data's token ids
        for ext in self.extensions.values():
            check_world = getattr(ext, "check_world", None)
            if callable(check_world):
                check_world(world_size)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="pretrain_gpt.py",
        description="GPT pretraining on megatron-core with the megatron-ext extensions. "
                    "Every flag is also a key of --config YAML; flags override YAML.",
        allow_abbrev=False)
    parser.add_argument("--config", default=None, help="YAML file with the same keys as the flags.")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                        help="Start N ranks on this machine (after checking the configuration for N ranks); "
                             "not needed under torchrun or srun.")
    for name, cls in sections().items():
        add_flags(parser, cls, title=name)
    return parser


def all_keys() -> list[str]:
    return [f for cls in sections().values() for f in field_names(cls)]


def parse_run_config(argv: Sequence[str] | None = None, *, defaults: dict[str, Any] | None = None,
                     saved_config: Callable[[str], dict[str, Any] | None] | None = None) -> RunConfig:
    """Flags over YAML over ``defaults`` over dataclass defaults. Raises ConfigError on bad input.
    ``saved_config``: the flat config of the checkpoint a ``--load`` directory holds, or None where it
    holds none (``runtime.checkpoint.saved_config``), for ``--use-checkpoint-args``: the runtime is a
    layer above, so its reader is handed in; without one the flag is refused."""
    parser = build_parser()
    args = parser.parse_args(argv)
    renamed = renames(sections().values())
    values: dict[str, Any] = dict(defaults or {})
    notes: list[str] = []
    source = "defaults"
    where = "command line"
    if args.config:
        # Each source is renamed on its own: a former key in the YAML and the new flag on the
        # command line are an override, not a clash.
        yaml_values, notes = renamed_keys(load_yaml(args.config), renamed, args.config)
        check_unknown(yaml_values, all_keys(), args.config)
        values.update(yaml_values)
        source = args.config
        where = f"{args.config} / command line"
    cli, cli_notes = renamed_keys({k: v for k, v in vars(args).items() if k not in ("config", "nproc_per_node")},
                                  renamed, "command line")
    values.update({k: v for k, v in cli.items() if v is not None})
    if values.get("use_checkpoint_args"):
        from megatron_ext.config import checkpoint_args

        if saved_config is None:
            raise ConfigError("--use-checkpoint-args is taken by pretrain_gpt.py (it reads the checkpoint); "
                              "give the model's flags here")
        given = {k for k, v in cli.items() if v is not None} | (set(yaml_values) if args.config else set())
        values, taken = checkpoint_args.apply(values, given, all_keys(),
                                              config_from_values(dict(values), where=where, source=source).flat(),
                                              saved_config)
        notes += taken
    cfg = config_from_values(values, where=where, source=source)
    cfg.notes[:0] = [n for n in dict.fromkeys(notes + cli_notes) if n not in cfg.notes]
    return cfg


def config_from_values(values: dict[str, Any], *, where: str = "config", source: str = "values") -> RunConfig:
    values, notes = renamed_keys(values, renames(sections().values()), where)
    check_unknown(values, all_keys(), where)
    values = megatron_stage_spellings(megatron_flags.resolve_aliases(values))
    secs = sections()
    built = {name: build(cls, values, where) for name, cls in secs.items()}
    core = {name: built.pop(name) for name in _CORE}
    cfg = RunConfig(**core, extensions=built, source=source, notes=notes)
    cfg.notes += megatron_flags.settle(cfg)
    return cfg

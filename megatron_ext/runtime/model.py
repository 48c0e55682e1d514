"""GPTModel on megatron-core, wrapped in megatron DistributedDataParallel.

Weights are initialised *by global name*: every parameter shard is cut from a full tensor drawn
from a generator seeded with (seed, checkpoint key, global layer). The same seed therefore gives the
same model in every TP/PP/DP layout, which the parity tests and live relayout rely on.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from typing import Any, Callable, Iterator

import torch

from megatron_ext.compat.devices import resolve_device
from megatron_ext.compat.kernels import apex_fused_softmax_available
from megatron_ext.config import megatron_flags
from megatron_ext.config.base import ConfigError
from megatron_ext.config.run import RunConfig
from megatron_ext.layout import Layout
from megatron_ext.runtime import families
from megatron_ext.runtime.distributed import DistContext

logger = logging.getLogger(__name__)

VOCAB_MULTIPLE = 128
"""Megatron-LM's --make-vocab-size-divisible-by default."""

def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = VOCAB_MULTIPLE) -> int:
    """Megatron-LM's padding: round up to a multiple of ``divisible_by`` x ``tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def pads_vocabulary(rows: int, vocab_size: int) -> bool:
    """``rows`` is Megatron-LM's padding of ``vocab_size`` for some power-of-two multiple (128 x TP):
    no fewer rows, and fewer extra rows than the largest power of two dividing ``rows``."""
    return rows >= vocab_size and rows - vocab_size < (rows & -rows)


def model_vocab_size(cfg: RunConfig, vocab_size: int, tp: int | None = None, saved_rows: int | None = None) -> int:
    """The embedding rows of the run's model: the tokenizer's ``vocab_size`` padded by Megatron-LM's rule
    with the *launch's* TP (a live layout change keeps the model's shape), or ``saved_rows``, the rows of
    the --load checkpoint's embedding (``checkpoint.embedding_rows``), when they pad the same vocabulary
    otherwise (a resume in another layout keeps its model). ``tp``: the layout in force, which must
    divide the rows (ValueError otherwise)."""
    rows = padded_vocab_size(vocab_size, cfg.parallel.tensor_model_parallel_size,
                             cfg.model.make_vocab_size_divisible_by)
    given = cfg.tokenizer.padded_vocab_size
    if given is not None:  # Megatron-LM's --padded-vocab-size: the rows as given
        if given < vocab_size:
            from megatron_ext.errors import ConfigError

            raise ConfigError(f"--padded-vocab-size {given} is smaller than the tokenizer's {vocab_size} tokens")
        rows = given
    if saved_rows is not None and saved_rows >= vocab_size:
        rows = saved_rows
    if tp is not None and rows % tp:
        raise ValueError(f"the vocabulary is padded to {rows} rows, which --tensor-model-parallel-size {tp} does not "
                         "divide: set --make-vocab-size-divisible-by to a multiple of it")
    return rows


@dataclasses.dataclass
class ModelBundle:
    """The model chunks of this rank (one per virtual stage) and their shared TransformerConfig."""

    chunks: list[torch.nn.Module]
    config: Any  # megatron.core.transformer.TransformerConfig
    vocab_size: int

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for chunk in self.chunks:
            yield from chunk.parameters()

    def train(self) -> None:
        for c in self.chunks:
            c.train()

    def eval(self) -> None:
        for c in self.chunks:
            c.eval()

    def zero_grad_buffer(self) -> None:
        for c in self.chunks:
            c.zero_grad_buffer()

    def sharded_state_dicts(self) -> list[dict[str, Any]]:
        return [unwrap(c).sharded_state_dict() for c in self.chunks]


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


def stage_layout(stage_layers: list[int] | None) -> list[list[str]] | None:
    """megatron's pipeline layout for uneven stages: the embedding on the first stage, the loss on
    the last, ``stage_layers[s]`` decoder layers on stage s (None: megatron's even split)."""
    if stage_layers is None:
        return None
    last = len(stage_layers) - 1
    return [(["embedding"] if s == 0 else []) + ["decoder"] * n + (["loss"] if s == last else [])
            for s, n in enumerate(stage_layers)]


def transformer_config(cfg: RunConfig, ctx: DistContext) -> Any:
    """megatron-core's TransformerConfig of this run on this rank's device; a configuration megatron-core
    refuses is a ``ConfigError`` naming the flags (``check_config`` runs the same before any rank starts)."""
    return build_transformer_config(cfg, on_gpu=ctx.device.type == "cuda", layout=ctx.layout)


def build_transformer_config(cfg: RunConfig, *, on_gpu: bool, layout: Layout | None = None) -> Any:
    """``layout``: the layout in force (default: the launch request's)."""
    try:
        return _transformer_config(cfg, on_gpu=on_gpu, layout=layout or _requested(cfg))
    except MEGATRON_REFUSALS as exc:
        raise ConfigError(refusal_line(cfg, exc, on_gpu=on_gpu)) from None


def _transformer_config(cfg: RunConfig, *, on_gpu: bool, layout: Layout) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, p, t = cfg.model, cfg.parallel, cfg.training
    # --bf16 holds bf16 weights on CPU too (slow, but it is how the mixed-precision optimizer and
    # its checkpoints are tested without a GPU).
    dtype = torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32
    # Megatron-LM's TransformerConfig flags this run sets (generated from the dataclass), and its
    # switches of the fused kernels, which can only turn off what the device runs.
    passed = megatron_flags.transformer_kwargs(cfg, te=on_gpu and megatron_flags.device_of(cfg, gpu=on_gpu).te)
    fused = megatron_flags.kernel_switches(cfg)
    return TransformerConfig(
        **families.transformer_config_kwargs(m),
        **{k: v for k, v in passed.items() if k != "use_cpu_initialization"},
        tensor_model_parallel_size=layout.tp,
        expert_model_parallel_size=p.expert_model_parallel_size,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vp if layout.vp > 1 else None,
        pipeline_model_parallel_layout=stage_layout(layout.stage_layers),
        calculate_per_token_loss=layout.replica_microbatches is not None or t.calculate_per_token_loss,
        sequence_parallel=p.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not on_gpu or passed.get("use_cpu_initialization", False),
        # CPU: no fused CUDA kernels, no cuda.synchronize after batched p2p (docs/runtime.md, "Set in the
        # TransformerConfig instead").
        batch_p2p_sync=on_gpu,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=on_gpu and fused["bias_swiglu_fusion" if m.swiglu else "bias_gelu_fusion"],
        # apex's compiled kernels, imported unguarded by megatron at the first forward (compat/kernels.py).
        masked_softmax_fusion=on_gpu and apex_fused_softmax_available() and fused["masked_softmax_fusion"],
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=on_gpu and fused["bias_dropout_fusion"],
        attention_softmax_in_fp32=fused["attention_softmax_in_fp32"],
    )


# --- megatron-core's own checks, before any rank starts ---------------------------------------------

MEGATRON_REFUSALS = (ValueError, AssertionError, NotImplementedError)
"""What TransformerConfig.__post_init__ raises for a configuration it refuses."""

# The run's flags that reach TransformerConfig (``_transformer_config``): the model's, and these.
_PARALLEL_FLAGS = ("tensor_model_parallel_size", "expert_model_parallel_size", "pipeline_model_parallel_size",
                   "virtual_pipeline_model_parallel_size", "pipeline_stage_layers", "data_parallel_microbatches",
                   "sequence_parallel", "device", "bf16", "fp16", "calculate_per_token_loss")


def check_config(cfg: RunConfig, world: int | None = None) -> None:
    """The megatron engine's check before any rank starts (``engines.py``): build megatron-core's
    TransformerConfig of the run as a rank would (device and virtual stages resolved the same way),
    so that what megatron-core refuses is one line here instead of a traceback from every rank."""
    del world  # nothing here depends on it
    if cfg.checkpoint.ckpt_format == "deepspeed":
        raise ConfigError("--ckpt-format deepspeed (DeepSpeed's own checkpoints) needs --engine deepspeed")
    build_transformer_config(cfg, on_gpu=_on_gpu(cfg))


def _on_gpu(cfg: RunConfig) -> bool:
    return resolve_device(cfg.parallel.device) == "cuda"


def _requested(cfg: RunConfig) -> Layout:
    """The launch request's layout over one replica (TransformerConfig does not depend on DP)."""
    p = cfg.parallel
    return p.launch_layout(p.tensor_model_parallel_size * p.pipeline_model_parallel_size)


def _message(exc: BaseException) -> str:
    """megatron-core's message, or for a bare ``assert`` where it failed."""
    text = " ".join(str(exc).split())
    if text:
        return text
    import traceback

    frame = traceback.extract_tb(exc.__traceback__)[-1]
    where = frame.filename.split("site-packages/")[-1]
    return f"{type(exc).__name__} at {where}:{frame.lineno} ({(frame.line or '').strip()})"


def refusal_line(cfg: RunConfig, exc: BaseException, *, on_gpu: bool) -> str:
    """One line for megatron-core's refusal ``exc``, naming the flags it is about: each flag set away
    from its default whose default (everything else kept) makes this refusal go away."""
    from megatron_ext.config.base import flag_name
    from megatron_ext.config.run import config_from_values

    message = _message(exc)
    values = cfg.flat()
    defaults = config_from_values({}).flat()
    keys = [f.name for f in dataclasses.fields(cfg.model)] + list(_PARALLEL_FLAGS) + list(megatron_flags.changed(cfg))
    involved = []
    for key in keys:
        if values.get(key) == defaults.get(key):
            continue
        try:
            trial = config_from_values({k: v for k, v in values.items() if k != key})
        except ConfigError:
            continue  # this flag alone cannot go back to its default
        try:
            _transformer_config(trial, on_gpu=on_gpu if key != "device" else _on_gpu(trial), layout=_requested(trial))
        except MEGATRON_REFUSALS as other:
            if _message(other) == message:
                continue
        involved.append(key)

    def shown(key: str) -> str:
        value = values[key]
        if value is True:
            return flag_name(key)
        if isinstance(value, (list, tuple)):
            return f"{flag_name(key)} {' '.join(map(str, value))}"
        return f"{flag_name(key)} {value}"

    what = ", ".join(shown(k) for k in involved) if involved else "the model configuration"
    return f"{what}: megatron-core refuses it (TransformerConfig): {message}"


def layer_spec(on_gpu: bool, *, per_document_attention: bool = False, local: bool = False,
               model: Any = None) -> Any:
    """The layer spec of ``model``'s family (default: the GPT block); see ``families.layer_spec``."""
    from megatron_ext.config.run import ModelConfig

    return families.layer_spec(model if model is not None else ModelConfig(), on_gpu,
                               per_document_attention=per_document_attention, local=local)


def build_model(cfg: RunConfig, ctx: DistContext, vocab_size: int, *,
                wrap_ddp: bool = True, saved_vocab_rows: int | None = None) -> ModelBundle:
    """``vocab_size``: the tokenizer's (padded here, ``model_vocab_size``); ``saved_vocab_rows``: the
    embedding rows of the checkpoint the model is built to load."""
    import functools

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel

    tconfig = transformer_config(cfg, ctx)
    spec = families.layer_spec(cfg.model, ctx.device.type == "cuda",
                               per_document_attention=bool(cfg.data.doc_length_dist),
                               local=(cfg.capability("local_layer_spec") is not None
                                      or megatron_flags.transformer_impl(cfg) == "local"))
    vocab = model_vocab_size(cfg, vocab_size, ctx.layout.tp, saved_vocab_rows)
    chunks = []
    n_chunks = ctx.vpp or 1
    for vp in range(n_chunks):
        vp_stage = vp if ctx.vpp else None
        model = GPTModel(
            config=tconfig,
            transformer_layer_spec=spec,
            vocab_size=vocab,
            max_sequence_length=cfg.model.max_position_embeddings,
            # The first chunk of the first stage embeds, the last chunk of the last stage has the head.
            pre_process=ctx.is_first_stage and vp == 0,
            post_process=ctx.is_last_stage and vp == n_chunks - 1,
            share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
            vp_stage=vp_stage,
            pg_collection=ctx.pgs,
            **families.gpt_model_kwargs(cfg.model),
        )
        model.to(ctx.device)
        chunks.append(model)
    init_by_name(chunks, seed=cfg.training.seed, std=cfg.model.init_method_std, num_layers=cfg.model.num_layers,
                 embedding_std=tconfig.embedding_init_method_std,
                 zero_centered_gamma=tconfig.layernorm_zero_centered_gamma)
    if tconfig.bf16 or tconfig.fp16:
        # As megatron's own training does: the last stage hands fp32 logits/losses back, and the
        # first stage's float inputs are cast to bf16 / fp16 before they meet the weights.
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(tconfig, c) for c in chunks]
    if wrap_ddp:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=not cfg.training.grad_reduce_in_bf16,
            overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
            use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        )
        chunks = [
            DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=c,
                                    disable_bucketing=(i > 0), pg_collection=ctx.pgs)
            for i, c in enumerate(chunks)
        ]
        tconfig.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
        tconfig.finalize_model_grads_func = functools.partial(finalize_model_grads, pg_collection=ctx.pgs)
    return ModelBundle(chunks=chunks, config=tconfig, vocab_size=vocab)


# --- initialisation by global name -------------------------------------------------------------

_OUTPUT_SCALED = ("linear_proj.weight", "linear_fc2.weight")


def _seed_for(seed: int, key: str, index: tuple[int, ...]) -> int:
    digest = hashlib.sha256(f"{seed}:{key}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


_EMBEDDINGS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")


def _full_value(key: str, shape: tuple[int, ...], seed: int, std: float, num_layers: int, *,
                embedding_std: float | None = None, zero_centered_gamma: bool = False) -> torch.Tensor:
    """What the unsharded tensor named ``key`` is initialised to (megatron's init rules: the
    embeddings' std is --embedding-init-method-std where given; a zero-centered norm gain
    (--apply-layernorm-1p) starts at zero, its scale 1 + gain at one)."""
    leaf = key.rsplit(".", 1)[-1]
    if leaf.endswith("bias"):
        return torch.zeros(shape)
    # Norm gains: "final_layernorm.weight", or fused into a linear as "...layer_norm_weight".
    if "norm" in leaf or ("norm" in key and leaf == "weight"):
        return torch.zeros(shape) if zero_centered_gamma else torch.ones(shape)
    gen = torch.Generator().manual_seed(seed)
    if key.endswith(_OUTPUT_SCALED):
        scale = std / math.sqrt(2.0 * num_layers)
    elif embedding_std is not None and key.endswith(_EMBEDDINGS):
        scale = embedding_std
    else:
        scale = std
    return torch.randn(shape, generator=gen) * scale


def iter_sharded_tensors(sharded: dict[str, Any]) -> Iterator[Any]:
    """The ShardedTensors of a ``sharded_state_dict()``, factories expanded.

    A SwiGLU ``linear_fc1`` is a ShardedTensorFactory: this rank's weight is [W shard; V shard], and
    the factory cuts it into two ShardedTensors (views into the parameter) that sit at their own
    offsets of the unsharded [W; V] — so initialisation and checkpoints see layout-independent pieces."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for value in sharded.values():
        if isinstance(value, ShardedTensor):
            yield value
        elif isinstance(value, ShardedTensorFactory):
            yield from _expand_factory(value)


def _expand_factory(factory: Any) -> Iterator[Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    built = factory.build()
    stack = [built]
    while stack:
        item = stack.pop(0)
        if isinstance(item, ShardedTensor):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        else:
            raise TypeError(f"sharded-state factory {factory.key} built a {type(item).__name__}")


def shard_slices(st: Any) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    """(indices into the prepended axes, slices into the unsharded tensor) of a ShardedTensor."""
    pre = st.prepend_axis_num
    index = tuple(st.global_offset[:pre])
    local = st.data.shape
    slices = tuple(slice(off, off + n) for off, n in zip(st.global_offset[pre:], local))
    return index, slices


def init_by_name(chunks: list[torch.nn.Module], *, seed: int, std: float, num_layers: int,
                 embedding_std: float | None = None, zero_centered_gamma: bool = False) -> None:
    """Overwrite every parameter with its slice of a layout-independent full tensor."""
    seen: set[int] = set()
    # One list over all chunks, not a generator: factory pieces are fresh views, and the ids in
    # ``seen`` must not be reused by a later view while the loop runs.
    tensors = [st for chunk in chunks for st in iter_sharded_tensors(unwrap(chunk).sharded_state_dict())]
    with torch.no_grad():
        for st in tensors:
            if id(st.data) in seen or not isinstance(st.data, torch.Tensor) or not st.data.is_floating_point():
                continue
            seen.add(id(st.data))
            index, slices = shard_slices(st)
            full_shape = tuple(st.global_shape[st.prepend_axis_num:])
            full = _full_value(st.key, full_shape, _seed_for(seed, st.key, index), std, num_layers,
                               embedding_std=embedding_std, zero_centered_gamma=zero_centered_gamma)
            st.data.copy_(full[slices].to(st.data.dtype))


def count_parameters(chunks: list[torch.nn.Module]) -> int:
    return sum(p.numel() for c in chunks for p in c.parameters())


def stage_loss_func(loss_mask: torch.Tensor, *, per_token: bool = False) -> Callable[[torch.Tensor], tuple]:
    """Mean token loss of one micro-batch (every micro-batch has the same token count, so the mean
    over micro-batches and data-parallel ranks is the global mean).

    ``per_token`` (uneven micro-batches per replica, ``calculate_per_token_loss``): the loss *sum*
    and the token count, megatron's three-part form; the schedule and ``finalize_model_grads`` then
    divide by the tokens of the whole global batch, so a replica's share weighs what its tokens do.
    The reported value is ``[sum, count]``."""

    def loss_func(output_tensor: torch.Tensor):
        losses = output_tensor.float().view(-1)
        mask = loss_mask.view(-1).float()
        total = torch.sum(losses * mask)
        if per_token:
            count = mask.sum().to(torch.int)
            return total, count, {"lm loss": torch.stack([total.detach(), mask.sum()])}
        loss = total / mask.sum().clamp(min=1.0)
        return loss, {"lm loss": loss.detach().clone()}

    return loss_func

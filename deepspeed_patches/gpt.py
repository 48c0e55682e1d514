"""The GPT of ``runtime/model.py`` as a DeepSpeed ``PipelineModule`` (TP x PP x DP).

Plain torch modules whose math and parameter layout follow megatron-core's local-spec GPT
(``get_gpt_layer_local_spec``) op for op: learned word + position embeddings transposed to
[sequence, batch, hidden], pre-LayerNorm transformer layers with a fused QKV weight laid out per head
(``[q_h; k_h; v_h]`` for each head h, as megatron's ``get_query_key_value_tensors`` splits it), causal
softmax attention scaled by 1/sqrt(head dim) with masked scores set to -10000, exact GELU MLP, biases
added after the matmul (megatron's ``skip_bias_add`` + bias-dropout-add), a final LayerNorm and an
output head tied to the word embedding (``TiedLayerSpec``), the vocabulary padded to a multiple of 128,
and megatron's per-token cross entropy averaged over the loss mask.

The LLaMA-style family (runtime/families.py) is mirrored the same way: RMSNorm (torch's, as
megatron's ``WrappedTorchNorm``), SwiGLU (``linear_fc1`` = [W; V], ``silu(x W^T) * (x V^T)``), rotary
embeddings (megatron's ``RotaryEmbedding`` + ``_apply_rotary_pos_emb_bshd``, not interleaved) in place of
learned positions, grouped-query attention (``linear_qkv`` per group: [q heads of the group; k; v], K and V
``repeat_interleave``d to the query heads), per-head q/k norms before the rotation, and no biases.

Tensor parallelism is megatron's (``ColumnParallelLinear`` / ``RowParallelLinear``): the fused QKV
weight is cut into contiguous query groups, ``linear_fc1`` into [W_r; V_r] (SwiGLU) or rows, and
``linear_proj`` / ``linear_fc2`` into columns whose partial outputs are summed over the TP group
(megatron-core's own ``copy_to`` / ``reduce_from`` tensor-parallel region functions, with the group
passed explicitly); with sequence parallelism the layer norms and dropouts run on sequence shards
(``gather_from`` / ``reduce_scatter_to`` the sequence-parallel region) and the gradients of what
they hold are summed over the TP group before the update. The word embedding and output head stay
whole on every TP rank (megatron splits them over the vocabulary; the loss is the same cross
entropy); DeepSpeed's grid (``PipeModelDataParallelTopology``) orders ranks as megatron does, TP
fastest.

Every parameter is named by its megatron ``sharded_state_dict`` key and global layer
(``shard_entries``), so weights are initialised by the same (seed, key, layer) rule as the megatron
engine (same seed, same model) and checkpoints use the same files: a checkpoint moves between engines.
"""
from __future__ import annotations

import contextlib
import io
import logging
import math
from typing import Any, Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron_ext.layout import even_stage_layers
from megatron_ext.models.families import (FINAL_NORM_BIAS, FINAL_NORM_WEIGHT, OUTPUT_LAYER, POSITION_EMBEDDINGS,
                                          WORD_EMBEDDINGS, layer_key)
from megatron_ext.runtime.reshard import ShardEntry
from megatron_ext.runtime.model import _full_value, _seed_for

logger = logging.getLogger(__name__)

TIED_KEY = "embed"
# megatron's attention_mask_func fills masked scores with this (not -inf): kept for bitwise-close parity.
MASKED_SCORE = -10000.0


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # megatron's linear layers run matmul(x, W^T) and add the bias separately; F.linear fuses the
    # bias into addmm, which rounds differently.
    out = torch.matmul(x, weight.t())
    return out if bias is None else out + bias


class Shard(NamedTuple):
    """One local tensor (a parameter or a view of one) and where it sits in the unsharded tensor;
    ``tp_replica``: every TP rank holds the same one (written from TP rank 0 only)."""

    key: str
    index: tuple[int, ...]
    tensor: torch.Tensor
    offset: tuple[int, ...]
    global_shape: tuple[int, ...]
    tp_replica: bool


def _whole(key: str, index: tuple[int, ...], param: torch.Tensor, tp: "TensorParallel") -> Shard:
    return Shard(key, index, param, (0,) * param.dim(), tuple(param.shape), tp.size > 1)


class TensorParallel:
    """This rank's place in its tensor-parallel group (size 1: no collectives)."""

    def __init__(self, size: int = 1, rank: int = 0, group: Any = None, sequence_parallel: bool = False) -> None:
        self.size, self.rank, self.group = size, rank, group
        self.sequence_parallel = sequence_parallel and size > 1

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Into a column-parallel linear: the whole sequence (SP: all-gathered), gradient summed."""
        if self.size == 1:
            return x
        from megatron.core.tensor_parallel import mappings

        if self.sequence_parallel:
            return mappings.gather_from_sequence_parallel_region(x, group=self.group)
        return mappings.copy_to_tensor_model_parallel_region(x, group=self.group)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """Out of a row-parallel linear: partial sums added (SP: reduce-scattered along the sequence)."""
        if self.size == 1:
            return x
        from megatron.core.tensor_parallel import mappings

        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(x, group=self.group)
        return mappings.reduce_from_tensor_model_parallel_region(x, group=self.group)

    def whole_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """Before a head that every TP rank holds whole (SP: the sequence all-gathered; the gradient
        is split back, not summed: every rank computes the same one)."""
        if not self.sequence_parallel:
            return x
        from megatron.core.tensor_parallel import mappings

        return mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=self.group)

    def split(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by tensor-model-parallel-size ({self.size})")
        return n // self.size


def _mark_sequence_parallel(*params: nn.Parameter | None) -> None:
    """Parameters that see only this rank's sequence shard (megatron's ``sequence_parallel`` attribute):
    their gradients are summed over the TP group before the update."""
    for p in params:
        if p is not None:
            p.sequence_parallel = True


class EmbeddingPipe(nn.Module):
    """Word (+ learned position) embeddings; also the tied output head on the last stage."""

    def __init__(self, vocab_size: int, hidden_size: int, max_positions: int, dropout: float,
                 with_positions: bool, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp or TensorParallel()
        self.word_embeddings = nn.Embedding(vocab_size, hidden_size)
        # Only the stage that embeds needs positions; the last stage builds this module for its
        # tied head only, and an unused parameter would have no gradient.
        self.position_embeddings = nn.Embedding(max_positions, hidden_size) if with_positions else None
        self.dropout = dropout

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, position_ids = inputs
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:  # learned positions; rotary ones live in the layers
            x = x + self.position_embeddings(position_ids)
        x = x.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h], megatron's activation layout
        if self.tp.sequence_parallel:  # megatron's embedding: this rank's sequence shard from here on
            from megatron.core.tensor_parallel import mappings

            x = mappings.scatter_to_sequence_parallel_region(x, group=self.tp.group)
        return F.dropout(x, self.dropout, self.training)

    def shard_params(self) -> Iterator[Shard]:
        yield _whole(WORD_EMBEDDINGS, (), self.word_embeddings.weight, self.tp)
        if self.position_embeddings is not None:
            yield _whole(POSITION_EMBEDDINGS, (), self.position_embeddings.weight, self.tp)


def output_logits(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """The tied output head: [s, b, h] -> logits [s, b, padded vocab], whole on every TP rank (SP: the
    sequence all-gathered first; each rank's gradient is its own shard of the same whole one)."""
    return _linear(embedding.tp.whole_sequence(hidden), embedding.word_embeddings.weight)


def _norm(kind: str, size: int, eps: float) -> nn.Module:
    return nn.RMSNorm(size, eps=eps) if kind == "RMSNorm" else nn.LayerNorm(size, eps=eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TransformerLayerPipe(nn.Module):
    """One pre-norm transformer layer of the GPT or LLaMA-style block; ``layer_number`` is its global
    index (0-based); ``model_cfg`` is the run's ModelConfig."""

    def __init__(self, layer_number: int, model_cfg: Any, eps: float, tp: TensorParallel | None = None) -> None:
        super().__init__()
        m = model_cfg
        h = m.hidden_size
        self.tp = tp = tp or TensorParallel()
        self.layer_number = layer_number
        self.head_dim = h // m.num_attention_heads
        groups = m.num_query_groups if m.group_query_attention else m.num_attention_heads
        # this rank's heads and query groups (megatron's ColumnParallelLinear over [q_g; k_g; v_g] per group)
        self.num_heads = tp.split(m.num_attention_heads, "num-attention-heads")
        self.num_groups = tp.split(groups, "num-query-groups")
        self.hidden_dropout = m.hidden_dropout
        self.attention_dropout = m.attention_dropout
        self.swiglu = m.swiglu
        bias = not m.disable_bias_linear
        qkv_out = (self.num_heads + 2 * self.num_groups) * self.head_dim
        ffn = tp.split(m.ffn_hidden_size, "ffn-hidden-size")
        self.input_layernorm = _norm(m.normalization, h, eps)
        self.linear_qkv = nn.Linear(h, qkv_out, bias=bias)
        self.linear_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_layernorm = _norm(m.normalization, self.head_dim, eps) if m.qk_layernorm else None
        self.k_layernorm = _norm(m.normalization, self.head_dim, eps) if m.qk_layernorm else None
        self.pre_mlp_layernorm = _norm(m.normalization, h, eps)
        self.linear_fc1 = nn.Linear(h, (2 if m.swiglu else 1) * ffn, bias=bias)
        self.linear_fc2 = nn.Linear(ffn, h, bias=bias)
        if tp.sequence_parallel:
            _mark_sequence_parallel(*self.input_layernorm.parameters(), *self.pre_mlp_layernorm.parameters(),
                                    self.linear_proj.bias, self.linear_fc2.bias)
        if tp.size > 1:
            # DeepSpeed's gradient norms count a parameter without this mark on TP rank 0 only
            # (runtime.utils.is_model_parallel_parameter; megatron's attribute of the same name)
            for p in (*self.linear_qkv.parameters(), *self.linear_fc1.parameters(), self.linear_proj.weight,
                      self.linear_fc2.weight):
                p.tensor_model_parallel = True
        self.rotary_inv_freq: torch.Tensor | None = None
        if m.position_embedding_type == "rope":
            d = self.head_dim  # megatron's RotaryEmbedding(kv_channels, rotary_percent=1.0)
            self.rotary_inv_freq = 1.0 / (m.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))

    def _rotary(self, t: torch.Tensor) -> torch.Tensor:
        """megatron's ``_apply_rotary_pos_emb_bshd`` (not interleaved) on [s, b, heads, d]."""
        seq = torch.arange(t.shape[0], dtype=torch.float32, device=t.device)
        freqs = torch.outer(seq, self.rotary_inv_freq.to(t.device))
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        return t * torch.cos(emb).to(t.dtype) + _rotate_half(t) * torch.sin(emb).to(t.dtype)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        n, g, d = self.num_heads, self.num_groups, self.head_dim
        h = n * d  # this rank's heads
        qkv = _linear(x, self.linear_qkv.weight, self.linear_qkv.bias)
        # per group: [q heads of the group; k; v] (megatron's get_query_key_value_tensors)
        q, k, v = torch.split(qkv.view(s, b, g, (n // g + 2) * d), [n // g * d, d, d], dim=3)
        q = q.reshape(s, b, n, d)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if self.rotary_inv_freq is not None:
            q, k = self._rotary(q), self._rotary(k)
        if n // g > 1:
            k = k.repeat_interleave(n // g, dim=2)
            v = v.repeat_interleave(n // g, dim=2)
        q = q.reshape(s, b * n, d).transpose(0, 1)                  # [b n, s, d]
        k = k.reshape(s, b * n, d).transpose(0, 1).transpose(1, 2)  # [b n, d, s]
        scores = torch.baddbmm(torch.empty(b * n, s, s, dtype=x.dtype, device=x.device), q, k,
                               beta=0.0, alpha=1.0 / math.sqrt(d)).view(b, n, s, s)
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=x.device), diagonal=1)
        probs = torch.softmax(scores.masked_fill(causal, MASKED_SCORE), dim=-1)
        probs = F.dropout(probs, self.attention_dropout, self.training)
        ctx = torch.bmm(probs.view(b * n, s, s), v.reshape(s, b * n, d).transpose(0, 1))
        return ctx.view(b, n, s, d).permute(2, 0, 1, 3).contiguous().view(s, b, h)

    def _bias_dropout_add(self, residual: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # megatron's bias_dropout_add: residual + dropout(out + bias)
        return residual + F.dropout(out if bias is None else out + bias, self.hidden_dropout, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        attn = tp.leave(_linear(self._attention(tp.enter(self.input_layernorm(x))), self.linear_proj.weight))
        x = self._bias_dropout_add(x, attn, self.linear_proj.bias)
        hidden = _linear(tp.enter(self.pre_mlp_layernorm(x)), self.linear_fc1.weight)
        if self.linear_fc1.bias is not None:
            hidden = hidden + self.linear_fc1.bias
        if self.swiglu:
            gate, up = torch.chunk(hidden, 2, dim=-1)  # megatron's glu: activation(x[0]) * x[1]
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(hidden)
        mlp = tp.leave(_linear(hidden, self.linear_fc2.weight))
        return self._bias_dropout_add(x, mlp, self.linear_fc2.bias)

    def shard_params(self) -> Iterator[Shard]:
        tp, index = self.tp, (self.layer_number,)
        for name, param in self.named_parameters():
            key, shape = layer_key(name), tuple(param.shape)
            module, _, attr = name.partition(".")
            if module == "linear_fc1" and self.swiglu:
                # [W_r; V_r] here, [W; V] whole (megatron's SwiGLU sharded factory): two pieces
                half = shape[0] // 2
                whole = (2 * half * tp.size, *shape[1:])
                for k, part in enumerate((param[:half], param[half:])):
                    yield Shard(key, index, part, (k * half * tp.size + tp.rank * half,) + (0,) * (len(shape) - 1),
                                whole, False)
            elif module in ("linear_qkv", "linear_fc1"):          # column parallel: rows
                yield Shard(key, index, param, (tp.rank * shape[0],) + (0,) * (len(shape) - 1),
                            (shape[0] * tp.size, *shape[1:]), False)
            elif module in ("linear_proj", "linear_fc2") and attr == "weight":   # row parallel: columns
                yield Shard(key, index, param, (0, tp.rank * shape[1]), (shape[0], shape[1] * tp.size), False)
            else:                                                  # norms, row-parallel biases: whole
                yield Shard(key, index, param, (0,) * len(shape), shape, tp.size > 1)


class FinalNormPipe(nn.Module):
    def __init__(self, normalization: str, hidden_size: int, eps: float, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp or TensorParallel()
        self.norm = _norm(normalization, hidden_size, eps)
        if self.tp.sequence_parallel:
            _mark_sequence_parallel(*self.norm.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def shard_params(self) -> Iterator[Shard]:
        yield _whole(FINAL_NORM_WEIGHT, (), self.norm.weight, self.tp)
        if getattr(self.norm, "bias", None) is not None:
            yield _whole(FINAL_NORM_BIAS, (), self.norm.bias, self.tp)


class OutputHeadPipe(nn.Module):
    """Untied output head (``--untie-embeddings-and-output-weights``)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp or TensorParallel()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _linear(self.tp.whole_sequence(hidden), self.weight)

    def shard_params(self) -> Iterator[Shard]:
        yield _whole(OUTPUT_LAYER, (), self.weight, self.tp)


def lm_loss(logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean token cross entropy over the loss mask of one micro-batch (megatron's loss_func)."""
    target, loss_mask = labels
    s, b, v = logits.shape
    # logits are [s, b, v]; megatron transposes labels to [s, b] and the loss back to [b, s]
    per_token = F.cross_entropy(logits.float().view(s * b, v), target.transpose(0, 1).reshape(s * b),
                                reduction="none").view(s, b).transpose(0, 1)
    mask = loss_mask.float()
    return torch.sum(per_token.reshape(-1) * mask.reshape(-1)) / mask.sum().clamp(min=1.0)


def layer_specs(model_cfg: Any, vocab_size: int, tp: TensorParallel | None = None) -> list[Any]:
    """Embedding, the transformer layers, final norm and output head as DeepSpeed layer specs."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    m = model_cfg
    tp = tp or TensorParallel()
    eps = 1e-5  # megatron TransformerConfig.layernorm_epsilon default
    embed = dict(vocab_size=vocab_size, hidden_size=m.hidden_size, max_positions=m.max_position_embeddings,
                 dropout=m.hidden_dropout, tp=tp)
    learned = m.position_embedding_type == "learned_absolute"
    specs: list[Any] = [TiedLayerSpec(TIED_KEY, EmbeddingPipe, **embed, with_positions=learned,
                                      tied_weight_attr="word_embeddings.weight")]
    specs += [LayerSpec(TransformerLayerPipe, i, m, eps, tp) for i in range(m.num_layers)]
    specs.append(LayerSpec(FinalNormPipe, m.normalization, m.hidden_size, eps, tp))
    if m.untie_embeddings_and_output_weights:
        specs.append(LayerSpec(OutputHeadPipe, m.hidden_size, vocab_size, tp))
    else:
        # The first occurrence of the key on a stage builds the module: on the last stage (PP > 1)
        # that is this head, built without position embeddings.
        specs.append(TiedLayerSpec(TIED_KEY, EmbeddingPipe, **embed, with_positions=False, forward_fn=output_logits,
                                   tied_weight_attr="word_embeddings.weight"))
    return specs


def stage_parts(num_layers: int, num_stages: int, stage_layers: list[int] | None = None) -> list[int]:
    """Spec boundaries per stage, megatron's split: stage s holds layers [s L/p, (s+1) L/p) (or
    ``stage_layers[s]`` layers, ``--pipeline-stage-layers``), the first stage also the embedding,
    the last also the final norm and the head."""
    if stage_layers is None:
        stage_layers = list(even_stage_layers(num_layers, num_stages))
    if len(stage_layers) != num_stages or sum(stage_layers) != num_layers or min(stage_layers) < 1:
        raise ValueError(f"stage layers {stage_layers}: need {num_stages} counts >= 1 summing to {num_layers}")
    bounds, total = [0], 0
    for n in stage_layers[:-1]:
        total += n
        bounds.append(1 + total)
    return bounds + [num_layers + 3]


def build_gpt_pipeline(model_cfg: Any, *, vocab_size: int, num_stages: int, seed: int, std: float,
                       quiet: bool = True, stage_layers: list[int] | None = None, tensor_parallel: int = 1,
                       sequence_parallel: bool = False) -> Any:
    """The GPT ``PipelineModule`` of this rank's stage and TP rank, initialised by global name;
    ``stage_layers`` for uneven stages (DeepSpeed's own partitioner is bypassed either way). The grid
    is DeepSpeed's ``PipeModelDataParallelTopology`` over the default group: TP fastest, then DP, then PP."""
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    class GPTPipelineModule(PipelineModule):
        """PipelineModule with megatron's layer split and megatron-keyed shard entries."""

        def _partition_layers(self, method: str = "uniform") -> None:
            # DeepSpeed's balanced partitioners may move the zero-weight embedding / head to a
            # neighbouring stage; fix the split to megatron's so layouts and checkpoints agree.
            self.parts = stage_parts(model_cfg.num_layers, self.num_stages, stage_layers)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

        def shard_entries(self) -> list[ShardEntry]:
            return gpt_shard_entries(self)

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % (num_stages * tensor_parallel):
        raise ValueError(f"world size {world} is not divisible by pipeline ({num_stages}) x tensor "
                         f"({tensor_parallel}) parallel sizes")
    topo = PipeModelDataParallelTopology(num_pp=num_stages, num_mp=tensor_parallel,
                                         num_dp=world // (num_stages * tensor_parallel))
    rank = dist.get_rank() if dist.is_initialized() else 0
    tp = TensorParallel(tensor_parallel, topo.get_coord(rank).model, None, sequence_parallel)
    # PipelineModule prints its seed and partition to stdout on rank 0; keep progress output clean.
    out = io.StringIO()
    with contextlib.redirect_stdout(out) if quiet else contextlib.nullcontext():
        module = GPTPipelineModule(layers=layer_specs(model_cfg, vocab_size, tp), topology=topo,
                                   loss_fn=lm_loss, partition_method="uniform")
    tp.group = module._grid.get_slice_parallel_group() if tensor_parallel > 1 else None
    module.tensor_parallel = tp
    init_entries(module.shard_entries(), seed=seed, std=std, num_layers=model_cfg.num_layers)
    return module


class TiedHead(nn.Module):
    """The output head tied to ``embedding``'s word embedding, as a module of its own so that ZeRO-3
    gathers the weight when the head runs (the embedding is its child: one parameter, two users)."""

    def __init__(self, embedding: EmbeddingPipe) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return output_logits(self.embedding, hidden)


class GPTModule(nn.Module):
    """The same GPT as one module for DeepSpeed's plain engine (one pipeline stage): embedding, layers,
    final norm and head of ``layer_specs``, each a direct child (shard entries and ZeRO-3's leaf
    modules find them), the loss inside ``forward``."""

    def __init__(self, model_cfg: Any, vocab_size: int, tp: TensorParallel, grid: Any) -> None:
        super().__init__()
        m = model_cfg
        eps = 1e-5  # megatron TransformerConfig.layernorm_epsilon default
        self._grid = grid
        self.embedding = EmbeddingPipe(vocab_size, m.hidden_size, m.max_position_embeddings, m.hidden_dropout,
                                       m.position_embedding_type == "learned_absolute", tp)
        self.num_layers = m.num_layers
        for i in range(m.num_layers):
            self.add_module(f"layer{i:03d}", TransformerLayerPipe(i, m, eps, tp))
        self.final_norm = FinalNormPipe(m.normalization, m.hidden_size, eps, tp)
        self.head = (OutputHeadPipe(m.hidden_size, vocab_size, tp) if m.untie_embeddings_and_output_weights
                     else TiedHead(self.embedding))
        self.tied_modules = nn.ModuleDict()  # none: the head holds the embedding itself
        self.tensor_parallel = tp

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
                loss_mask: torch.Tensor) -> torch.Tensor:
        x = self.embedding((tokens, position_ids))
        for i in range(self.num_layers):
            x = getattr(self, f"layer{i:03d}")(x)
        return lm_loss(self.head(self.final_norm(x)), (labels, loss_mask))

    def shard_entries(self) -> list[ShardEntry]:
        return gpt_shard_entries(self)


def build_gpt_model(model_cfg: Any, *, vocab_size: int, seed: int, std: float, tensor_parallel: int = 1) -> GPTModule:
    """The GPT of this rank's TP rank for DeepSpeed's plain engine, initialised by global name (the same
    weights as the megatron engine's and the pipeline's). Its grid is DeepSpeed's
    ``PipelineParallelGrid`` with one stage (TP fastest, then DP), handed to DeepSpeed as its ``mpu``."""
    import torch.distributed as dist
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % tensor_parallel:
        raise ValueError(f"world size {world} is not divisible by the tensor-parallel size {tensor_parallel}")
    topo = PipeModelDataParallelTopology(num_pp=1, num_mp=tensor_parallel, num_dp=world // tensor_parallel)
    grid = PipelineParallelGrid(topology=topo)
    tp = TensorParallel(tensor_parallel, grid.get_slice_parallel_rank(),
                        grid.get_slice_parallel_group() if tensor_parallel > 1 else None)
    module = GPTModule(model_cfg, vocab_size, tp, grid)
    init_entries(module.shard_entries(), seed=seed, std=std, num_layers=model_cfg.num_layers)
    return module


def z3_leaf_classes() -> list[type]:
    """The modules whose parameters ZeRO-3 gathers whole before they run: each reads its children's
    weights directly (``_linear``), not by calling them."""
    return [EmbeddingPipe, TransformerLayerPipe, FinalNormPipe, OutputHeadPipe, TiedHead]


def _stage_modules(module: Any) -> Iterator[nn.Module]:
    for child in module.children():
        if hasattr(child, "shard_params"):
            yield child
    yield from module.tied_modules.values()


def gpt_shard_entries(module: Any) -> list[ShardEntry]:
    """Shard entries with megatron's keys, global layer indices and TP offsets.

    ``main`` (the replica that is written) is data-parallel rank 0, TP rank 0 for what every TP rank
    holds whole, and for the tied word embedding the first stage (the last stage's copy is the
    output head, as in megatron's checkpoints)."""
    grid = module._grid
    dp_main = grid.get_data_parallel_rank() == 0
    tp_main = grid.get_slice_parallel_rank() == 0
    first_stage = grid.get_stage_id() == 0
    entries = []
    for sub in _stage_modules(module):
        for sh in sub.shard_params():
            main = dp_main and (tp_main or not sh.tp_replica) and (first_stage or sh.key != WORD_EMBEDDINGS)
            entries.append(ShardEntry(key=sh.key, index=sh.index, offset=sh.offset, shape=tuple(sh.tensor.shape),
                                      global_shape=sh.global_shape, param=sh.tensor, main=main))
    return entries


def universal_patterns(module: Any) -> dict[str, list[str]]:
    """How DeepSpeed's universal checkpoint (``ds_to_universal``, and its loader) merges and splits this
    rank's parameters over TP, by DeepSpeed's ``universal_checkpoint_info`` keys, each parameter named
    exactly (its name in ``module.named_parameters()``, which is DeepSpeed's). By the parameter's role in
    megatron's split, whatever this run's TP size (a TP1 checkpoint loads into TP2 by the same roles):
    row-parallel weights (``linear_proj``, ``linear_fc2``) split along columns; SwiGLU's ``linear_fc1``
    as two halves split along rows; the other column-parallel ones (``linear_qkv``, a GELU
    ``linear_fc1``) along rows, DeepSpeed's default; everything else whole on every TP rank. The tied
    embedding's copy on the last stage is pipeline-replicated."""
    out: dict[str, list[str]] = {"tp_replicated_parameter_patterns": [],
                                 "parameter_with_row_parallelism_patterns": [],
                                 "parameter_with_2_sub_params_cat_dim_0": [],
                                 "pipeline_replicated_parameter_patterns": []}
    for name, _ in module.named_parameters():
        parts = name.split(".")
        owner, attr = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
        if owner in ("linear_proj", "linear_fc2") and attr == "weight":
            kind = "parameter_with_row_parallelism_patterns"
        elif owner == "linear_fc1" and module_swiglu(module):
            kind = "parameter_with_2_sub_params_cat_dim_0"
        elif owner in ("linear_qkv", "linear_fc1"):
            kind = None   # column parallel: DeepSpeed's default split
        else:
            kind = "tp_replicated_parameter_patterns"
        if kind is not None:
            out[kind].append(name)
        if name.startswith("tied_modules."):
            out["pipeline_replicated_parameter_patterns"].append(name)
    return {k: sorted(v) for k, v in out.items()}


def module_swiglu(module: Any) -> bool:
    return any(getattr(m, "swiglu", False) for m in module.modules() if isinstance(m, TransformerLayerPipe))


def init_entries(entries: list[ShardEntry], *, seed: int, std: float, num_layers: int) -> None:
    """megatron_ext's initialisation by global name (runtime/model.py) applied to shard entries."""
    with torch.no_grad():
        for e in entries:
            full = _full_value(e.key, e.global_shape, _seed_for(seed, e.key, e.index), std, num_layers)
            region = tuple(slice(o, o + n) for o, n in zip(e.offset, e.shape))
            e.param.copy_(full[region].to(e.param.dtype))


def norm_params(module: Any) -> list[nn.Parameter]:
    """Parameters counted in the global gradient norm over the pipeline and the TP group: each once
    (the last stage's copy of the tied embedding is not counted, like megatron's
    ``param_is_not_shared``; what every TP rank holds whole counts on TP rank 0, like
    ``param_is_not_tensor_parallel_duplicate``). A SwiGLU ``linear_fc1`` is one parameter of two pieces."""
    first_stage = module._grid.get_stage_id() == 0
    tp_main = module._grid.get_slice_parallel_rank() == 0
    out: dict[int, nn.Parameter] = {}
    for sub in _stage_modules(module):
        params = dict((id(p), p) for p in sub.parameters())
        for sh in sub.shard_params():
            if (first_stage or sh.key != WORD_EMBEDDINGS) and (tp_main or not sh.tp_replica):
                base = sh.tensor if sh.tensor._base is None else sh.tensor._base
                if id(base) in params:
                    out[id(base)] = params[id(base)]
    return list(out.values())


def sequence_parallel_params(module: Any) -> list[nn.Parameter]:
    """Parameters whose gradients are summed over the TP group before the update (SP)."""
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]

"""Expected forward and backward FLOPs of one micro-batch on one pipeline stage, and of an iteration.

The model's one FLOPs count, pure (numpy only), below the runtime and the extensions: ResiHP's
detector and planner need to know how much work a micro-batch *should* take before they can call a
slow one abnormal; the runtime's ``--log-throughput`` (TFLOP/s per device) and the GPU check's MFU
count an iteration with ``iteration_flops``. For a GPT stage the work splits in two classes that
run at different speeds:

* linear terms, proportional to the tokens of the micro-batch: the QKV, output, MLP and (last
  stage) vocabulary projections, 2 FLOPs per multiply-add;
* attention, proportional to the sum over documents of the squared document length: with packed
  sequences and per-document (block-diagonal) attention, a document only attends to itself, so a
  micro-batch of many short documents costs far less than one long document of the same tokens;
* for mixture-of-experts layers, the experts: proportional to the (token, expert) pairs the
  rank's own experts compute, which the routing decides per micro-batch (the MoE analogue of the
  document lengths: under expert parallelism one rank's experts may get most of a micro-batch).

Counting convention (what ``torch.utils.flop_counter.FlopCounterMode`` counts on the same layers):
matrix products only; normalisations, softmax, activations, embedding lookups and the loss are not
counted; attention counts the full score matrix of each document even when the mask is causal.
Backward is twice the forward for every product (input and weight gradients); attention backward
is twice its forward, or 2.5 times with a flash kernel that recomputes the scores
(``flash_attention=True``). Full activation recomputation adds one forward to the backward.

Everything here is per micro-batch; per-rank values divide by the tensor-parallel size, since
megatron shards every one of these products across the TP group.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import numpy as np

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The shape of a GPT model as far as FLOPs go (megatron's names)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    ffn_hidden_size: int | None = None       # default 4 * hidden_size
    num_query_groups: int | None = None      # GQA; default num_attention_heads (plain MHA)
    kv_channels: int | None = None           # default hidden_size // num_attention_heads
    gated_linear_unit: bool = False          # SwiGLU-style MLP: three matrices instead of two
    num_experts: int | None = None           # MoE: every layer's MLP is a router + this many experts
    moe_router_topk: int = 2                 # experts per token (MoE only)
    moe_ffn_hidden_size: int | None = None   # each expert's MLP width; default ffn
    shared_expert_ffn_hidden_size: int = 0   # MoE: a dense MLP beside the experts that every token takes
    flash_attention: bool = False            # attention backward recomputes the scores
    recompute: bool = False                  # full activation recomputation in backward

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"ModelSpec: hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}; give kv_channels")
        if self.num_attention_heads % self.groups:
            raise ValueError(f"ModelSpec: num_attention_heads {self.num_attention_heads} is not a multiple "
                             f"of num_query_groups {self.groups}")
        if self.num_experts is not None and not 1 <= self.moe_router_topk <= self.num_experts:
            raise ValueError(f"ModelSpec: moe_router_topk {self.moe_router_topk} must be between 1 and "
                             f"num_experts {self.num_experts}")
        if self.shared_expert_ffn_hidden_size < 0 or (self.shared_expert_ffn_hidden_size and self.num_experts is None):
            raise ValueError(f"ModelSpec: shared_expert_ffn_hidden_size {self.shared_expert_ffn_hidden_size} needs "
                             "to be >= 0, and 0 for a dense model (num_experts unset)")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn

    @property
    def groups(self) -> int:
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "model") -> "ModelSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"{where}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class Flops:
    """FLOPs split into classes that run at different speeds: linear (per token of the
    micro-batch), attention (per squared document length) and, for MoE layers, expert (per
    (token, expert) pair the rank's experts compute)."""

    linear: float
    attention: float
    expert: float = 0.0

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.expert


@dataclasses.dataclass(frozen=True)
class StageCost:
    """FLOPs of one stage (or model chunk) as coefficients: ``flops = per_token * tokens +
    per_sq * sum(length ** 2) + per_pair * routed_pairs`` for forward and backward. Cheap to
    apply to many micro-batches.

    ``routed_pairs`` is how many (token, expert) pairs this rank's experts computed over the
    chunk's MoE layers; where it is not known, uniform routing is assumed: ``pairs_per_token *
    tokens`` (top-k pairs per token and MoE layer; on average every expert-parallel rank gets
    as many pairs as its own tokens would make, since the ranks of an EP group hold micro-batches
    of the same size)."""

    fwd_per_token: float
    fwd_per_sq: float
    bwd_per_token: float
    bwd_per_sq: float
    fwd_per_pair: float = 0.0
    bwd_per_pair: float = 0.0
    pairs_per_token: float = 0.0

    def pairs(self, tokens: float, routed_pairs: float | None) -> float:
        return self.pairs_per_token * tokens if routed_pairs is None else routed_pairs

    def forward(self, tokens: float, sum_sq: float, routed_pairs: float | None = None) -> Flops:
        return Flops(self.fwd_per_token * tokens, self.fwd_per_sq * sum_sq,
                     self.fwd_per_pair * self.pairs(tokens, routed_pairs))

    def backward(self, tokens: float, sum_sq: float, routed_pairs: float | None = None) -> Flops:
        return Flops(self.bwd_per_token * tokens, self.bwd_per_sq * sum_sq,
                     self.bwd_per_pair * self.pairs(tokens, routed_pairs))


def spec_of_model(m: Any, vocab_size: int) -> ModelSpec:
    """A run's model (``config.run.ModelConfig``: whichever family its flags make it) as the FLOPs
    model sees it: GQA groups, SwiGLU and experts included."""
    return ModelSpec(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
                     vocab_size=vocab_size, ffn_hidden_size=m.ffn_hidden_size,
                     num_query_groups=m.num_query_groups if m.group_query_attention else None,
                     gated_linear_unit=m.swiglu, num_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
                     moe_ffn_hidden_size=m.moe_ffn_hidden_size,
                     shared_expert_ffn_hidden_size=(getattr(m, "moe_shared_expert_intermediate_size", None) or 0)
                     if m.num_experts else 0)


def layer_linear_flops_per_token(spec: ModelSpec) -> float:
    """Forward FLOPs per token of one transformer layer's projections on the rank's own tokens:
    QKV, output projection and the MLP, or for an MoE layer the router and the shared expert, if
    any (the routed experts are counted per routed pair, ``layer_expert_flops_per_pair``)."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.groups * d
    qkv = 2 * h * (q + 2 * kv)
    proj = 2 * q * h
    matrices = 3 if spec.gated_linear_unit else 2
    mlp = 2 * h * spec.ffn * matrices if spec.num_experts is None else \
        2 * h * spec.num_experts + 2 * h * spec.shared_expert_ffn_hidden_size * matrices
    return float(qkv + proj + mlp)


def layer_expert_flops_per_pair(spec: ModelSpec) -> float:
    """Forward FLOPs of one expert MLP on one token (0 for a dense model). Every token goes through
    exactly top-k experts (dropless routing), so a layer's total is ``top-k * tokens`` pairs
    whatever the routing; which expert-parallel rank computes them is what the routing decides."""
    if spec.num_experts is None:
        return 0.0
    matrices = 3 if spec.gated_linear_unit else 2
    return float(2 * spec.hidden_size * spec.expert_ffn * matrices)


def layer_attention_flops_per_sq(spec: ModelSpec) -> float:
    """Forward FLOPs of one layer's attention per squared document length (QK^T and AV)."""
    return float(4 * spec.num_attention_heads * spec.head_dim)


def stage_cost(spec: ModelSpec, num_layers: int, *, first_stage: bool = False, last_stage: bool = False,
               tp: int = 1) -> StageCost:
    """Coefficients for a stage (or model chunk) holding ``num_layers`` transformer layers.

    ``first_stage`` holds the embedding (no counted FLOPs: a lookup), ``last_stage`` the output
    layer (a vocabulary projection per token). ``tp`` divides everything (per-rank FLOPs).
    """
    if num_layers < 0:
        raise ValueError(f"num_layers must be >= 0, got {num_layers}")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    del first_stage  # the embedding lookup does no counted FLOPs; kept for the call sites' clarity
    lin = num_layers * layer_linear_flops_per_token(spec)
    att = num_layers * layer_attention_flops_per_sq(spec)
    pair = layer_expert_flops_per_pair(spec)
    head = 2.0 * spec.hidden_size * spec.vocab_size if last_stage else 0.0
    bwd_lin = 2 * lin + (lin if spec.recompute else 0.0) + 2 * head
    bwd_att = (2.5 if spec.flash_attention else 2.0) * att + (att if spec.recompute else 0.0)
    bwd_pair = 2 * pair + (pair if spec.recompute else 0.0)
    # Routed pairs are summed over the chunk's MoE layers, so the per-pair cost is one layer's.
    pairs_per_token = float(num_layers * spec.moe_router_topk) if spec.num_experts is not None else 0.0
    return StageCost((lin + head) / tp, att / tp, bwd_lin / tp, bwd_att / tp, pair / tp, bwd_pair / tp,
                     pairs_per_token)


def microbatch_flops(spec: ModelSpec, doc_lengths: Sequence[int], num_layers: int, *,
                     first_stage: bool = False, last_stage: bool = False, tp: int = 1,
                     routed_pairs: float | None = None) -> tuple[Flops, Flops]:
    """(forward, backward) FLOPs of one micro-batch whose packed sequences hold documents of
    ``doc_lengths`` tokens (padding that is computed counts as a document). MoE: ``routed_pairs``
    (token, expert) pairs computed by this rank's experts over the layers; default uniform routing."""
    tokens, sum_sq = doc_stats(doc_lengths)
    cost = stage_cost(spec, num_layers, first_stage=first_stage, last_stage=last_stage, tp=tp)
    return cost.forward(tokens, sum_sq, routed_pairs), cost.backward(tokens, sum_sq, routed_pairs)


def doc_stats(doc_lengths: Sequence[int]) -> tuple[float, float]:
    """(tokens, sum of squared lengths) of a micro-batch's documents."""
    a = np.asarray(doc_lengths, dtype=float)
    if a.ndim != 1 or (a < 0).any():
        raise ValueError(f"doc_lengths must be a flat list of non-negative lengths, got {list(doc_lengths)[:8]}")
    return float(a.sum()), float((a * a).sum())


def iteration_flops(spec: ModelSpec, seq_length: int, global_batch: int) -> float:
    """Model FLOPs of one iteration (forward + backward over every stage) of ``global_batch``
    sequences of ``seq_length`` tokens: each sequence one document whose attention is counted over
    the whole score matrix (the usual MFU convention), experts at top-k per token."""
    fwd, bwd = microbatch_flops(spec, [seq_length] * global_batch, spec.num_layers, first_stage=True,
                                last_stage=True)
    return fwd.total + bwd.total


def model_iteration_flops(cfg: Any, vocab_size: int, global_batch: int | None = None) -> float:
    """``iteration_flops`` of a run config's model (``config.run.RunConfig``: whichever family its
    flags make it) with the output layer over ``vocab_size`` entries (the padded vocabulary the model
    computes); ``global_batch`` default the config's ``--global-batch-size``."""
    batch = cfg.training.global_batch_size if global_batch is None else global_batch
    return iteration_flops(spec_of_model(cfg.model, vocab_size), cfg.model.seq_length, batch)


def stage_layer_counts(num_layers: int, pp: int, vp: int = 1) -> list[list[int]]:
    """Layers of each [stage][chunk] under megatron's even split: model chunk ``v`` of stage
    ``s`` is virtual stage ``v * pp + s`` and each virtual stage holds ``num_layers / (pp * vp)``."""
    if pp < 1 or vp < 1:
        raise ValueError(f"pp and vp must be >= 1, got pp={pp}, vp={vp}")
    if num_layers % (pp * vp):
        raise ValueError(f"num_layers {num_layers} is not divisible by pp * vp = {pp * vp}; "
                         "give the per-stage layer counts explicitly")
    per = num_layers // (pp * vp)
    return [[per] * vp for _ in range(pp)]


def stage_costs(spec: ModelSpec, pp: int, vp: int = 1, tp: int = 1,
                layers: Sequence[Sequence[int]] | None = None) -> list[list[StageCost]]:
    """Per-rank costs of each [stage][chunk]: the first virtual stage holds the embedding, the
    last one the output layer."""
    layers = stage_layer_counts(spec.num_layers, pp, vp) if layers is None else layers
    if len(layers) != pp or any(len(row) != vp for row in layers):
        raise ValueError(f"layers must be a {pp} x {vp} table of layer counts, got {layers}")
    if sum(map(sum, layers)) != spec.num_layers:
        raise ValueError(f"layers {layers} hold {sum(map(sum, layers))} layers, the model has {spec.num_layers}")
    return [[stage_cost(spec, layers[s][v], first_stage=(s == 0 and v == 0),
                        last_stage=(s == pp - 1 and v == vp - 1), tp=tp) for v in range(vp)]
            for s in range(pp)]

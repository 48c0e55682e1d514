"""Per-document causal attention for packed sequences on CPU.

Packed micro-batches carry a block-diagonal causal mask (documents do not attend to each other).
megatron's local ``DotProductAttention`` applies such a mask to the full ``s x s`` score matrix, so
its cost does not depend on the documents. ``DocumentAttention`` is a drop-in subclass that reads
the document boundaries off the mask and attends within each document only, so compute follows the
sum of squared document lengths, as it does with varlen kernels on GPUs. The result equals the dense
masked softmax (masked scores are -10000 before the softmax and vanish in float32); the tests check
parity with ``DotProductAttention``.
"""
from __future__ import annotations

import math

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention


def document_starts(mask: torch.Tensor) -> list[list[int]]:
    """Start offsets of the documents of each sequence from a ``[b, 1, s, s]`` block-causal mask
    (True = masked): position i starts a document when it may not attend to position i - 1."""
    b, _, s, _ = mask.shape
    if s == 1:
        return [[0] for _ in range(b)]
    idx = torch.arange(1, s, device=mask.device)
    sub = mask[:, 0, idx, idx - 1]  # [b, s-1]
    out = []
    for row in sub.cpu():
        out.append([0] + (torch.nonzero(row, as_tuple=False).flatten() + 1).tolist())
    return out


class DocumentAttention(DotProductAttention):
    """``DotProductAttention`` that skips the masked-out cross-document blocks."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[0] != query.shape[1]:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        assert packed_seq_params is None and attention_bias is None
        heads = self.num_attention_heads_per_partition
        groups = self.num_query_groups_per_partition
        if heads // groups > 1:
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        s, b = query.shape[0], query.shape[1]
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
        context = query.new_empty(s, b, heads, value.shape[-1])
        starts = document_starts(attention_mask)
        for j in range(b):
            bounds = starts[j] + [s]
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                q = query[lo:hi, j].transpose(0, 1)  # [heads, n, hd]
                k = key[lo:hi, j].transpose(0, 1)
                v = value[lo:hi, j].transpose(0, 1)
                scores = torch.bmm(q, k.transpose(1, 2)) * scale  # [heads, n, n]
                n = hi - lo
                causal = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
                probs = torch.softmax(scores.float().masked_fill(causal, float("-inf")), dim=-1).to(q.dtype)
                if not self.config.sequence_parallel:
                    with tensor_parallel.get_cuda_rng_tracker().fork():
                        probs = self.attention_dropout(probs)
                else:
                    probs = self.attention_dropout(probs)
                context[lo:hi, j] = torch.bmm(probs, v).transpose(0, 1)
        return context.reshape(s, b, self.hidden_size_per_partition)

"""Packed sequences with variable document lengths drawn from a configured distribution.

Each training sequence (a contiguous chunk of the corpus) is cut into documents whose lengths are
drawn from ``--doc-length-dist``; documents do not attend to each other (block-diagonal causal
mask), and positions restart at every document. With ``runtime.attention.DocumentAttention`` the
attention work of a micro-batch then really follows the sum of squared document lengths — the
variable work that ResiHP's FLOPs model prices. Lengths are drawn from a generator seeded by
(seed, global sample index), so they do not depend on the layout and survive a resume.

Distribution specs: ``fixed:N``, ``uniform:LO,HI``, ``lognormal:MU,SIGMA`` (of the natural log of
the length), ``pareto:ALPHA,XMIN`` (heavy tail). Draws are rounded and clipped to [1, seq_length].
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

_KINDS = {"fixed": 1, "uniform": 2, "lognormal": 2, "pareto": 2}


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, spec: str) -> "LengthDistribution":
        kind, _, rest = spec.partition(":")
        kind = kind.strip().lower()
        if kind not in _KINDS:
            raise ValueError(f"document length distribution {spec!r}: kind must be one of "
                             f"{', '.join(_KINDS)} (e.g. lognormal:5,1)")
        try:
            params = tuple(float(x) for x in rest.split(",")) if rest.strip() else ()
        except ValueError:
            raise ValueError(f"document length distribution {spec!r}: parameters must be numbers") from None
        if len(params) != _KINDS[kind]:
            raise ValueError(f"document length distribution {spec!r}: {kind} takes {_KINDS[kind]} "
                             f"parameter(s), got {len(params)}")
        if kind == "fixed" and params[0] < 1:
            raise ValueError(f"document length distribution {spec!r}: length must be >= 1")
        if kind == "uniform" and not 1 <= params[0] <= params[1]:
            raise ValueError(f"document length distribution {spec!r}: need 1 <= LO <= HI")
        if kind == "lognormal" and params[1] < 0:
            raise ValueError(f"document length distribution {spec!r}: SIGMA must be >= 0")
        if kind == "pareto" and (params[0] <= 0 or params[1] < 1):
            raise ValueError(f"document length distribution {spec!r}: need ALPHA > 0 and XMIN >= 1")
        return cls(kind, params)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        p = self.params
        if self.kind == "fixed":
            x = np.full(n, p[0])
        elif self.kind == "uniform":
            x = rng.uniform(p[0], p[1] + 1, size=n)
        elif self.kind == "lognormal":
            x = rng.lognormal(p[0], p[1], size=n)
        else:
            x = p[1] * (1.0 + rng.pareto(p[0], size=n))
        return np.maximum(np.floor(x), 1).astype(np.int64)


def split_sequence(seq_length: int, dist: LengthDistribution, seed: int, sample_index: int) -> list[int]:
    """Document lengths of one packed sequence (they sum to ``seq_length``; the last is cut)."""
    rng = np.random.default_rng([seed, sample_index])
    out: list[int] = []
    total = 0
    while total < seq_length:
        for n in dist.sample(rng, 16):
            n = int(min(n, seq_length - total))
            out.append(n)
            total += n
            if total >= seq_length:
                break
    return out


def block_causal_mask(doc_lengths: list[list[int]], seq_length: int) -> torch.Tensor:
    """``[b, 1, s, s]`` bool mask, True = may not attend (megatron's convention)."""
    b = len(doc_lengths)
    allowed = torch.zeros(b, seq_length, seq_length, dtype=torch.bool)
    for j, docs in enumerate(doc_lengths):
        start = 0
        for n in docs:
            allowed[j, start:start + n, start:start + n] = True
            start += n
    allowed &= torch.ones(seq_length, seq_length, dtype=torch.bool).tril()
    return (~allowed).unsqueeze(1)


def reset_positions(doc_lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in docs]) for docs in doc_lengths])


def pack(batch: dict, dist: LengthDistribution, seed: int, first_sample_index: int) -> dict:
    """Turn a plain micro-batch (``tokens``, ``labels`` ...) into a packed one in place."""
    b, s = batch["tokens"].shape
    docs = [split_sequence(s, dist, seed, first_sample_index + j) for j in range(b)]
    batch["doc_lengths"] = docs
    batch["attention_mask"] = block_causal_mask(docs, s)
    batch["position_ids"] = reset_positions(docs)
    return batch

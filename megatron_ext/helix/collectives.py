"""Traceable model-parallel regions: collectives that appear in the graph as issue + wait nodes.

Megatron's tensor-, sequence- and expert-parallel regions call ``torch.distributed`` in place,
which Dynamo cannot capture as graph nodes. These versions are written with the functional
collectives (``torch.ops._c10d_functional.*`` followed by ``wait_tensor``), so every collective
is a visible, schedulable pair of nodes in the Dynamo graph and in the AOT forward/backward
graphs, and they run eagerly too (the reference for parity tests).

The conjugate pairs of Megatron (identity forward / all-reduce backward and the reverse, all-gather
forward / reduce-scatter backward, ...) need their own backward, so each is a small
``autograd.Function``; Dynamo turns it into one ``autograd_function_apply`` node whose forward and
backward bodies carry the collectives.

Groups are passed as :class:`GroupRef` (name, rank, size): plain constants for the tracer, and the
name is what ends up in the graph -- identical on every rank.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

logger = logging.getLogger(__name__)

_ops = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class GroupRef:
    """A process group as the tracer sees it: its registered name, this rank's index, its size."""

    name: str
    rank: int
    size: int

    @classmethod
    def of(cls, group=None) -> "GroupRef":
        """From a ``ProcessGroup`` (default: the world group)."""
        import torch.distributed as dist

        pg = group if group is not None else dist.group.WORLD
        return cls(name=pg.group_name, rank=dist.get_rank(pg), size=dist.get_world_size(pg))


# -- raw collectives (no autograd): one issue node + one wait node each ---------------------------

def all_reduce(x: torch.Tensor, group: GroupRef, op: str = "sum") -> torch.Tensor:
    return _ops.wait_tensor(_ops.all_reduce(x, op, group.name))


def all_gather_dim0(x: torch.Tensor, group: GroupRef) -> torch.Tensor:
    return _ops.wait_tensor(_ops.all_gather_into_tensor(x.contiguous(), group.size, group.name))


def reduce_scatter_dim0(x: torch.Tensor, group: GroupRef, op: str = "sum") -> torch.Tensor:
    if x.shape[0] % group.size:
        raise ValueError(f"reduce-scatter: dim 0 ({x.shape[0]}) is not divisible by the group size {group.size}")
    return _ops.wait_tensor(_ops.reduce_scatter_tensor(x.contiguous(), op, group.size, group.name))


def all_to_all_dim0(x: torch.Tensor, group: GroupRef) -> torch.Tensor:
    """Equal-split all-to-all: chunk ``r`` of dim 0 goes to rank ``r``."""
    if x.shape[0] % group.size:
        raise ValueError(f"all-to-all: dim 0 ({x.shape[0]}) is not divisible by the group size {group.size}")
    splits = [x.shape[0] // group.size] * group.size
    return _ops.wait_tensor(_ops.all_to_all_single(x.contiguous(), splits, splits, group.name))


def _split_dim(x: torch.Tensor, dim: int, group: GroupRef) -> torch.Tensor:
    if x.shape[dim] % group.size:
        raise ValueError(f"split: dim {dim} ({x.shape[dim]}) is not divisible by the group size {group.size}")
    n = x.shape[dim] // group.size
    return x.narrow(dim, group.rank * n, n).contiguous()


def _gather_last(x: torch.Tensor, group: GroupRef) -> torch.Tensor:
    # Gather along dim 0 (what the collective does), then move the rank axis next to the last dim.
    out = all_gather_dim0(x.movedim(-1, 0), group)
    out = out.view(group.size, x.shape[-1], *x.shape[:-1]).movedim(1, -1)  # [g, ..., d]
    return out.movedim(0, -2).reshape(*x.shape[:-1], group.size * x.shape[-1])


# -- Megatron's conjugate pairs --------------------------------------------------------------------

class _CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward (input of a column-parallel linear)."""

    @staticmethod
    def forward(ctx, x, name, rank, size):
        ctx.group = GroupRef(name, rank, size)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.group), None, None, None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward (output of a row-parallel linear)."""

    @staticmethod
    def forward(ctx, x, name, rank, size):
        return all_reduce(x, GroupRef(name, rank, size))

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None


class _GatherFromSequence(torch.autograd.Function):
    """All-gather along the sequence dim forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, name, rank, size):
        ctx.group = GroupRef(name, rank, size)
        return all_gather_dim0(x, ctx.group)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_dim0(g, ctx.group), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence dim forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, name, rank, size):
        ctx.group = GroupRef(name, rank, size)
        return reduce_scatter_dim0(x, ctx.group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim0(g, ctx.group), None, None, None


class _ScatterToSequence(torch.autograd.Function):
    """Keep this rank's chunk of the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, name, rank, size):
        ctx.group = GroupRef(name, rank, size)
        return _split_dim(x, 0, ctx.group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim0(g, ctx.group), None, None, None


class _GatherFromTensor(torch.autograd.Function):
    """All-gather along the last dim forward, keep this rank's chunk backward."""

    @staticmethod
    def forward(ctx, x, name, rank, size):
        ctx.group = GroupRef(name, rank, size)
        return _gather_last(x, ctx.group)

    @staticmethod
    def backward(ctx, g):
        return _split_dim(g, g.dim() - 1, ctx.group), None, None, None


class _ScatterToTensor(torch.autograd.Function):
    """Keep this rank's chunk of the last dim forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, name, rank, size):
        ctx.group = GroupRef(name, rank, size)
        return _split_dim(x, x.dim() - 1, ctx.group)

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g, ctx.group), None, None, None


class _AllToAll(torch.autograd.Function):
    """Expert-parallel token exchange: equal-split all-to-all forward and backward."""

    @staticmethod
    def forward(ctx, x, name, rank, size):
        ctx.group = GroupRef(name, rank, size)
        return all_to_all_dim0(x, ctx.group)

    @staticmethod
    def backward(ctx, g):
        return all_to_all_dim0(g, ctx.group), None, None, None


def _apply(fn: type[torch.autograd.Function], x: torch.Tensor, group: GroupRef) -> torch.Tensor:
    if group.size == 1:
        return x
    return fn.apply(x, group.name, group.rank, group.size)


def copy_to_tensor_parallel_region(x: torch.Tensor, group: GroupRef) -> torch.Tensor:
    return _apply(_CopyToRegion, x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: GroupRef) -> torch.Tensor:
    return _apply(_ReduceFromRegion, x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: GroupRef) -> torch.Tensor:
    return _apply(_GatherFromTensor, x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: GroupRef) -> torch.Tensor:
    return _apply(_ScatterToTensor, x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: GroupRef) -> torch.Tensor:
    return _apply(_GatherFromSequence, x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: GroupRef) -> torch.Tensor:
    return _apply(_ReduceScatterToSequence, x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: GroupRef) -> torch.Tensor:
    return _apply(_ScatterToSequence, x, group)


def all_to_all(x: torch.Tensor, group: GroupRef) -> torch.Tensor:
    return _apply(_AllToAll, x, group)


def all_reduce_max_no_grad(x: torch.Tensor, group: GroupRef) -> torch.Tensor:
    """Max over the group of a value that needs no gradient (e.g. the logit max of a softmax)."""
    if group.size == 1:
        return x.detach()
    return all_reduce(x.detach(), group, "max")


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: GroupRef) -> torch.Tensor:
    """Cross entropy over vocabulary-parallel logits ``[..., V/tp]``; per-token loss ``[...]``.

    Built from the conjugate g-region: every rank computes the same loss from all-reduced sums,
    so the identity backward of g gives each rank exactly the gradient of its own logit shard
    (softmax minus one-hot on its vocabulary slice), as Megatron's fused version does.
    """
    logits = logits.float()
    part = logits.shape[-1]
    start = group.rank * part
    local_max = logits.detach().amax(dim=-1)
    shifted = logits - all_reduce_max_no_grad(local_max, group).unsqueeze(-1)
    in_range = (target >= start) & (target < start + part)
    local_t = torch.where(in_range, target - start, torch.zeros_like(target))
    picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * in_range.to(shifted.dtype)
    sum_exp = reduce_from_tensor_parallel_region(shifted.exp().sum(dim=-1), group)
    picked = reduce_from_tensor_parallel_region(picked, group)
    return torch.log(sum_exp) - picked

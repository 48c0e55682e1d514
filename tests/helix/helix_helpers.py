"""Helpers shared by the Helix tests: fake process groups, small layers, a tiling-only backend."""
from __future__ import annotations

import contextlib
import copy
import re
from typing import Callable

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_ext.helix.blocks import MoELayer, TPEPLayer, TPTransformerLayer, capacity_for
from megatron_ext.helix.collectives import GroupRef

B, S, H, HEADS = 4, 16, 64, 4


def rank0_graphs(log: str) -> list[str]:
    """The index of every graph rank 0 compiled, from a launch's log (the compiler's one line per
    graph, behind pretrain_gpt.py's ``[time rank0]`` prefix)."""
    return re.findall(r"\[[\d:]+ rank0\] megatron_ext\.helix\.compiler: helix graph (\d+):", log)


@contextlib.contextmanager
def fake_world(rank: int = 0, world: int = 2):
    """A fake default process group: collectives are traced and run as no-ops, so a single process
    can compile what rank ``rank`` of ``world`` would compile."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield GroupRef.of()
    finally:
        dist.destroy_process_group()


def build_block(kind: str, g: GroupRef) -> torch.nn.Module:
    if kind == "tp":
        return TPTransformerLayer(H, HEADS, 4 * H, g)
    if kind == "moe":
        return MoELayer(H, 4 * H, g, capacity_for(S, g.size))
    if kind == "tpep":
        return TPEPLayer(H, HEADS, 4 * H, g, g, capacity_for(S, g.size))
    raise ValueError(kind)


def tiling_backend(tiles: int = 2, reports: list | None = None, **kw) -> Callable:
    """torch.compile backend that only tiles (no collectives needed), then runs aot_eager-style."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from megatron_ext.helix.passes.tiling import tile_graph

    def compile_graph(gm, example_inputs):
        tiled, report = tile_graph(gm, tiles, **kw)
        if reports is not None:
            reports.append((tiled, report))
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward),
                            bw_compiler=lambda g, _: make_boxed_func(g.forward))(tiled, example_inputs)

    return compile_graph


def parity(fn: Callable, compiled: Callable, inputs: list[torch.Tensor], params: list[torch.nn.Parameter]
           ) -> dict[str, float]:
    """Max abs differences of outputs and of all gradients between ``fn`` and ``compiled``."""
    def run(f):
        for t in (*inputs, *params):
            t.grad = None
        out = f(*inputs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        loss = sum((o.float() * (1 + torch.arange(o.numel()).view(o.shape) % 7)).sum()
                   for o in outs if o.is_floating_point())
        loss.backward()
        grads = [None if t.grad is None else t.grad.clone() for t in (*inputs, *params)]
        return [o.detach().clone() for o in outs], grads

    ref_out, ref_grads = run(fn)
    out, grads = run(compiled)
    err = {"out": max((a - b).abs().max().item() for a, b in zip(ref_out, out)),
           "grad": max(((a - b).abs().max().item() for a, b in zip(ref_grads, grads)
                        if a is not None and b is not None), default=0.0)}
    err["missing_grads"] = sum((a is None) != (b is None) for a, b in zip(ref_grads, grads))
    return err


def clone_module(m: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(m)

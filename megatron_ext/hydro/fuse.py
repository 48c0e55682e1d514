"""``fuse_model``: a torch.fx pass that turns one model into B trials of it (the Trial Binder).

The graph is kept as traced; only leaf modules are swapped for their ``hydro.nn`` twins, built by
stacking B replicas. Because fused activations are trial-major in the batch dimension, every
other node already computes the right thing for B trials, provided the model never mixes samples
(BatchNorm and losses are the usual culprits, and BatchNorm has a fused twin). The one-forward
check after the pass catches models that do mix samples, and names the first node that diverges.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch import nn

from .fx_common import (EXTRA_LEAVES, PassError, first_tensor, leaf_problems, reinitialize,
                        replicate, run_nodes, state_snapshot, tensors_close, trace)
from .models import SelfAttention
from .nn import (FusedBatchNorm, FusedConv2d, FusedDropout, FusedEmbedding, FusedLayerNorm, FusedLinear,
                 FusedRMSNorm, FusedSelfAttention, expand_trials)
from .nn.base import FusedModule

logger = logging.getLogger(__name__)

# Order matters only for subclasses; isinstance picks the first match (MuReadout -> FusedLinear).
FUSERS: list[tuple[type, Callable[[Sequence[nn.Module]], FusedModule]]] = [
    (SelfAttention, FusedSelfAttention.from_plain),
    (nn.Linear, FusedLinear.from_plain),
    (nn.Embedding, FusedEmbedding.from_plain),
    (nn.LayerNorm, FusedLayerNorm.from_plain),
    (nn.RMSNorm, FusedRMSNorm.from_plain),
    (nn.BatchNorm1d, FusedBatchNorm.from_plain),
    (nn.BatchNorm2d, FusedBatchNorm.from_plain),
    (nn.Conv2d, FusedConv2d.from_plain),
    (nn.Dropout, FusedDropout.from_plain),
]


def register_fuser(plain_type: type, fuser: Callable[[Sequence[nn.Module]], FusedModule]) -> None:
    """Teach ``fuse_model`` a new module type (checked before the built-in ones)."""
    FUSERS.insert(0, (plain_type, fuser))
    EXTRA_LEAVES.append(plain_type)


def _fuser_for(m: nn.Module) -> Callable[[Sequence[nn.Module]], FusedModule] | None:
    for tp, fn in FUSERS:
        if isinstance(m, tp):
            return fn
    return None


def fuse_model(model: nn.Module, num_trials: int, *, replicas: Sequence[nn.Module] | None = None,
               seeds: Sequence[int] | None = None, example_inputs: Sequence[Any] | None = None,
               check: bool = True, rtol: float = 1e-4) -> fx.GraphModule:
    """B trials of ``model`` as one GraphModule whose inputs and outputs are ``[B*N, ...]``.

    Trial b's parameters come from ``replicas[b]`` if given, else from a copy of ``model``
    re-initialized with ``seeds[b]`` if given, else from a plain copy of ``model``. With
    ``check`` (the default) one forward on ``example_inputs`` (unfused shapes ``[N, ...]``,
    given to every trial) must match each replica run alone.
    """
    if num_trials < 1:
        raise PassError(f"num_trials must be >= 1, got {num_trials}")
    gm = trace(model)
    bad = leaf_problems(gm)
    if bad:
        raise PassError("fuse_model: unsupported modules (would be left unfused): " + ", ".join(bad))
    if replicas is None:
        replicas = replicate(model, num_trials)
        if seeds is not None:
            if len(seeds) != num_trials:
                raise PassError(f"got {len(seeds)} seeds for {num_trials} trials")
            for rep, s in zip(replicas, seeds):
                reinitialize(rep, s)
    if len(replicas) != num_trials:
        raise PassError(f"got {len(replicas)} replicas for {num_trials} trials")

    fused_count = 0
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        sub = gm.get_submodule(node.target)
        fuser = _fuser_for(sub)
        if fuser is None:
            continue  # a parameter-free passthrough leaf
        try:
            fused = fuser([r.get_submodule(node.target) for r in replicas])
        except ValueError as exc:
            raise PassError(f"fuse_model: cannot fuse {node.target} ({type(sub).__name__}): {exc}") from None
        gm.set_submodule(node.target, fused)
        fused_count += 1
    gm.delete_all_unused_submodules()
    gm.recompile()
    logger.debug("fuse_model: %d modules fused into %d trials", fused_count, num_trials)
    if check:
        if example_inputs is None:
            raise PassError("fuse_model(check=True) needs example_inputs (or pass check=False)")
        check_fused(gm, replicas, example_inputs, rtol=rtol)
    return gm


def check_fused(gm: fx.GraphModule, replicas: Sequence[nn.Module], example_inputs: Sequence[Any],
                rtol: float = 1e-4) -> float:
    """One forward in eval mode: each trial's slice of the fused output must equal its replica's.

    Returns the largest relative difference; raises ``PassError`` naming the first diverging node.
    State (BatchNorm running stats) is restored afterwards, so the check leaves no trace.
    """
    B = len(replicas)
    was_training = gm.training
    snap = state_snapshot(gm)
    gm.eval()
    try:
        with torch.no_grad():
            fused_in = [expand_trials(x, B) if isinstance(x, torch.Tensor) else x for x in example_inputs]
            out = gm(*fused_in)
            worst = 0.0
            for b, rep in enumerate(replicas):
                rep_training = rep.training
                rep.eval()
                ref = rep(*example_inputs)
                rep.train(rep_training)
                got, want = first_tensor(out), first_tensor(ref)
                if got is None or want is None:
                    raise PassError("fuse_model check: the model returned no tensor")
                n = want.shape[0]
                if got.shape[0] != B * n or got.shape[1:] != want.shape[1:]:
                    raise PassError(f"fuse_model check: fused output shape {tuple(got.shape)} is not "
                                    f"{B} x {tuple(want.shape)}")
                ok, rel = tensors_close(got[b * n:(b + 1) * n], want, rtol)
                worst = max(worst, rel)
                if not ok:
                    raise PassError(f"fuse_model check: trial {b} differs from its model run alone "
                                    f"(max rel diff {rel:.2e}); first diverging node: "
                                    f"{_first_divergence(gm, replicas[0], example_inputs, B, rtol)}")
    finally:
        gm.load_state_dict(snap)
        gm.train(was_training)
    return worst


def _first_divergence(gm: fx.GraphModule, plain: nn.Module, example_inputs: Sequence[Any], B: int,
                      rtol: float) -> str:
    plain_gm = trace(plain).eval()
    want = run_nodes(plain_gm, *example_inputs)
    got = run_nodes(gm, *[expand_trials(x, B) if isinstance(x, torch.Tensor) else x for x in example_inputs])
    for node in gm.graph.nodes:
        w, g = want.get(node.name), got.get(node.name)
        if isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor):
            n = w.shape[0] if w.dim() else 1
            gs = g[:n] if g.dim() and g.shape[0] == B * n else g
            ok, rel = tensors_close(gs, w, rtol)
            if not ok:
                return f"{node.name} ({node.op} {node.target}; shape {tuple(g.shape)} vs {tuple(w.shape)}, rel {rel:.2e}) - it probably mixes samples of the batch"
    return "none found per node (the output itself differs)"


def num_trials_of(model: nn.Module) -> int:
    """B of a fused model: the leading dim of its first fused module's state."""
    for m in model.modules():
        if isinstance(m, FusedModule):
            return m.num_trials
    raise ValueError(f"{type(model).__name__} contains no fused module")

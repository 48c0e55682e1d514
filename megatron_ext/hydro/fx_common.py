"""What the torch.fx passes (fuse, shrink) agree on: which modules are leaves and which are safe."""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .models import SelfAttention

#: modules with parameters that both passes understand (isinstance, so mup.MuReadout counts as Linear)
PARAM_LEAVES: tuple[type, ...] = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.BatchNorm1d,
                                  nn.BatchNorm2d, nn.Conv2d, SelfAttention)
#: parameter-free modules that treat each sample on its own, so the fused batch layout is safe
PASSTHROUGH_LEAVES: tuple[type, ...] = (nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Identity,
                                        nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.Dropout, nn.Flatten)
#: module types taught to the passes at run time (``fuse.register_fuser``)
EXTRA_LEAVES: list[type] = []


def known_leaf(m: nn.Module) -> bool:
    return isinstance(m, PARAM_LEAVES + PASSTHROUGH_LEAVES + tuple(EXTRA_LEAVES))


class PassError(ValueError):
    """A model the pass cannot transform; the message names the modules or nodes at fault."""


class HydroTracer(fx.Tracer):
    """Leaves are torch.nn's own modules plus the ones our passes know (MuReadout, SelfAttention)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if known_leaf(m):
            return True
        return super().is_leaf_module(m, qualname)


def trace(model: nn.Module) -> fx.GraphModule:
    tracer = HydroTracer()
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # fx raises many types; all mean "not symbolically traceable"
        raise PassError(f"torch.fx could not trace {type(model).__name__}: {exc}. Data-dependent control "
                        "flow must be removed or moved into a leaf module.") from exc
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def leaf_problems(gm: fx.GraphModule) -> list[str]:
    """Leaf modules and raw parameter reads the passes would not handle, as 'name (Type)' strings."""
    bad = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            m = gm.get_submodule(node.target)
            if known_leaf(m):
                if isinstance(m, nn.Flatten) and m.start_dim == 0:
                    bad.append(f"{node.target} (Flatten(start_dim=0) mixes samples)")
                continue
            bad.append(f"{node.target} ({type(m).__name__})")
        elif node.op == "get_attr":
            bad.append(f"{node.target} (parameter read directly; wrap it in a supported layer)")
    return bad


def run_nodes(gm: fx.GraphModule, *args: Any) -> dict[str, Any]:
    """Every node's value for one run (for diagnosing where a transformed graph diverges)."""
    values: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            values[n.name] = out
            return out

    Recorder(gm).run(*args)
    return values


def state_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def replicate(model: nn.Module, n: int) -> list[nn.Module]:
    return [copy.deepcopy(model) for _ in range(n)]


def reinitialize(model: nn.Module, seed: int) -> nn.Module:
    """Fresh parameters from ``seed``: every submodule's ``reset_parameters`` in module order."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in model.modules():
            if hasattr(m, "reset_parameters") and m is not model:
                m.reset_parameters()
    return model


def tensors_close(a: Any, b: Any, rtol: float) -> tuple[bool, float]:
    """(close?, relative max difference) of two tensors."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return True, 0.0
    if a.shape != b.shape:
        return False, float("inf")
    if not a.is_floating_point():
        return bool(torch.equal(a, b)), 0.0
    scale = b.abs().max().clamp_min(1e-12)
    rel = float((a - b).abs().max() / scale)
    return rel <= rtol, rel


def first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x:
        return first_tensor(x[0])
    return None

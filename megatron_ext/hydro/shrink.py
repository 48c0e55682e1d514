"""``shrink_model``: a torch.fx pass that scales a model's widths (the Model Shrinker).

Which widths may change is found by following feature dimensions through the graph. Every
tensor's feature dimension (last dim; channels for convolutions) gets a *slot*; slots that must be
equal are unified (a residual add, a LayerNorm over its input, a Linear's ``in_features`` and the
tensor it reads). A slot is *fixed* when it touches the model's inputs or outputs (vocabulary,
classes, image channels) or an op we do not understand (a reshape, a reduction, ...); every other
slot (hidden size, FFN size, attention width, conv channels) is scaled by ``ratio``, and each leaf
module on it is rebuilt at the new width with a fresh initialization. Attention keeps its head
dimension and scales the number of heads (``mode="heads"``), or the reverse (``mode="head_dim"``).

A check follows: one forward on ``example_inputs`` must give the original output shape and finite
values. ``gm.shrink_report`` lists each changed module and each fixed slot with the reason.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import math
import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from .fx_common import PassError, known_leaf, leaf_problems, trace
from .models import SelfAttention

logger = logging.getLogger(__name__)

# Ops that keep the feature dim and treat features elementwise: their tensor operands share a slot.
_ELEMENTWISE_FN = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, torch.add,
                   torch.sub, torch.mul, torch.tanh, torch.relu, torch.sigmoid, F.gelu, F.relu, F.silu,
                   F.dropout, torch.nn.functional.tanh}
_ELEMENTWISE_METHOD = {"add", "sub", "mul", "div", "relu", "sigmoid", "tanh", "contiguous", "float", "to",
                       "type_as", "clone"}
# Ops on shapes or non-feature dims: no tensor slot to track.
_SHAPE_METHOD = {"size", "dim"}


@dataclasses.dataclass
class _Slot:
    size: int
    fixed_reason: str = ""


class _Slots:
    def __init__(self) -> None:
        self.parent: list[int] = []
        self.info: list[_Slot] = []

    def new(self, size: int, fixed_reason: str = "") -> int:
        self.parent.append(len(self.parent))
        self.info.append(_Slot(size, fixed_reason))
        return len(self.parent) - 1

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, a: int, b: int, where: str) -> int:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return ra
        ia, ib = self.info[ra], self.info[rb]
        ia.size = ia.size or ib.size   # 0 = not known yet (model inputs, outputs of opaque ops)
        ib.size = ib.size or ia.size
        if ia.size != ib.size:
            raise PassError(f"shrink_model: {where} ties widths {ia.size} and {ib.size} together")
        self.parent[rb] = ra
        ia.fixed_reason = ia.fixed_reason or ib.fixed_reason
        return ra

    def fix(self, i: int, reason: str) -> None:
        r = self.find(i)
        if not self.info[r].fixed_reason:
            self.info[r].fixed_reason = reason


@dataclasses.dataclass
class ShrinkReport:
    ratio: float
    mode: str
    changed: dict[str, str] = dataclasses.field(default_factory=dict)   # module -> "old -> new"
    fixed: list[str] = dataclasses.field(default_factory=list)          # "width N: reason"

    def __str__(self) -> str:
        lines = [f"shrink ratio {self.ratio} (attention: scale {self.mode})"]
        lines += [f"  {k}: {v}" for k, v in self.changed.items()]
        lines += [f"  kept {f}" for f in self.fixed]
        return "\n".join(lines)


def _meta_shape(node: Any) -> tuple[int, ...] | None:
    tm = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    return tuple(tm.shape) if tm is not None and hasattr(tm, "shape") else None


def _analyse(gm: fx.GraphModule) -> tuple[_Slots, dict[str, dict[str, int]]]:
    """Slots per node and, per leaf module, which slot each of its widths sits on."""
    slots = _Slots()
    of: dict[fx.Node, int] = {}
    mods: dict[str, dict[str, int]] = {}

    def slot_in(arg: Any) -> int | None:
        return of.get(arg) if isinstance(arg, fx.Node) else None

    def opaque(node: fx.Node, why: str) -> None:
        for a in node.all_input_nodes:
            if a in of:
                slots.fix(of[a], why)
        if _meta_shape(node):
            of[node] = slots.new(0, why)

    for node in gm.graph.nodes:
        where = f"node {node.name}"
        if node.op == "placeholder":
            of[node] = slots.new(0, f"model input {node.name}")
        elif node.op == "output":
            for a in node.all_input_nodes:
                if a in of:
                    slots.fix(of[a], "model output")
        elif node.op == "call_module":
            m = gm.get_submodule(node.target)
            x = node.args[0] if node.args else None
            sx = slot_in(x)
            if isinstance(m, nn.Linear):
                s_in = slots.new(m.in_features)
                if sx is not None:
                    slots.union(s_in, sx, f"{node.target} input")
                of[node] = slots.new(m.out_features)
                mods[node.target] = {"in": s_in, "out": of[node]}
            elif isinstance(m, nn.Embedding):
                of[node] = slots.new(m.embedding_dim)
                mods[node.target] = {"out": of[node]}
            elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                s = slots.new(m.normalized_shape[-1])
                if sx is not None:
                    slots.union(s, sx, f"{node.target} input")
                of[node] = s
                mods[node.target] = {"dim": s}
            elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
                s = slots.new(m.num_features)
                if sx is not None:
                    slots.union(s, sx, f"{node.target} input")
                of[node] = s
                mods[node.target] = {"dim": s}
            elif isinstance(m, SelfAttention):
                s = slots.new(m.d_model)
                if sx is not None:
                    slots.union(s, sx, f"{node.target} input")
                of[node] = s
                mods[node.target] = {"dim": s}
            elif isinstance(m, nn.Conv2d):
                s_in = slots.new(m.in_channels)
                if sx is not None:
                    slots.union(s_in, sx, f"{node.target} input")
                of[node] = slots.new(m.out_channels)
                if m.groups != 1:  # grouped channels would have to scale with the group count
                    slots.fix(s_in, f"{node.target} is a grouped convolution")
                    slots.fix(of[node], f"{node.target} is a grouped convolution")
                mods[node.target] = {"in": s_in, "out": of[node]}
            elif isinstance(m, nn.Flatten):
                _flatten(node, m.start_dim, sx, of, slots, opaque)
            elif known_leaf(m):  # parameter-free, per-feature: activations, dropout, pooling
                if sx is not None:
                    of[node] = sx
            else:
                opaque(node, f"unknown module {node.target}")
        elif node.op in ("call_function", "call_method"):
            tgt = node.target
            if node.op == "call_method" and tgt in _SHAPE_METHOD:
                continue
            if tgt is torch.flatten or (node.op == "call_method" and tgt == "flatten"):
                start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
                _flatten(node, start, slot_in(node.args[0]), of, slots, opaque)
                continue
            elementwise = (node.op == "call_function" and tgt in _ELEMENTWISE_FN) or \
                          (node.op == "call_method" and tgt in _ELEMENTWISE_METHOD)
            if not _meta_shape(node):
                continue  # shape arithmetic, getitem on sizes, ...
            if elementwise:
                out_shape = _meta_shape(node)
                ins = [of[a] for a in node.all_input_nodes
                       if a in of and _meta_shape(a) and _meta_shape(a)[-1:] == out_shape[-1:]
                       and len(_meta_shape(a)) == len(out_shape)]
                if ins:
                    s = ins[0]
                    for o in ins[1:]:
                        s = slots.union(s, o, where)
                    of[node] = s
                    for a in node.all_input_nodes:  # broadcast operands of another shape: keep width
                        if a in of and of[a] not in ins:
                            slots.fix(of[a], f"broadcast in {node.name}")
                    continue
            opaque(node, f"{node.op} {getattr(tgt, '__name__', tgt)} at {node.name}")
        elif node.op == "get_attr":
            opaque(node, f"parameter {node.target} read directly")
    return slots, mods


def _flatten(node: fx.Node, start_dim: int, sx: int | None, of: dict, slots: _Slots, opaque) -> None:
    # flatten(x, 1) after global pooling ([N, C, 1, 1] -> [N, C]) keeps the channel slot.
    shape = _meta_shape(node.args[0]) if node.args else None
    if sx is not None and shape and start_dim == 1 and math.prod(shape[2:]) == 1:
        of[node] = sx
    else:
        opaque(node, f"flatten at {node.name}")


def _new_width(size: int, ratio: float, min_width: int) -> int:
    return max(min_width, int(round(size * ratio)))


def shrink_model(model: nn.Module, ratio: float, *, example_inputs: Sequence[Any], mode: str = "heads",
                 min_width: int = 1, check: bool = True) -> fx.GraphModule:
    """A copy of ``model`` with every scalable width multiplied by ``ratio`` (0 < ratio <= 1 to
    shrink; > 1 widens, which is how tests build the wide twin of a model)."""
    if not ratio > 0:
        raise PassError(f"shrink ratio must be > 0, got {ratio}")
    if mode not in ("heads", "head_dim"):
        raise PassError(f"mode must be 'heads' or 'head_dim', got {mode!r}")
    model = copy.deepcopy(model)
    for m in model.modules():
        # An un-shaped mup.MuReadout cannot run; shrinking happens before muP is applied, so give it
        # the neutral width multiplier 1 (the shrunk copy gets fresh modules anyway).
        if hasattr(m, "output_mult") and isinstance(m, nn.Linear) and not hasattr(m.weight, "infshape"):
            import mup
            mup.set_base_shapes(m, None, rescale_params=False, do_assert=False)
    gm = trace(model)
    bad = leaf_problems(gm)
    if bad:
        raise PassError("shrink_model: unsupported modules: " + ", ".join(bad))
    was_training = gm.training
    gm.eval()
    with torch.no_grad():
        ShapeProp(gm).propagate(*example_inputs)
    out_shape = _out_shape(gm, example_inputs)
    slots, mods = _analyse(gm)
    report = ShrinkReport(ratio=ratio, mode=mode)

    new_size: dict[int, int] = {}
    heads_for: dict[int, tuple[int, int]] = {}   # root slot -> (n_heads, head_dim) after scaling
    attn_plan: dict[str, tuple[int, int, int]] = {}   # attention module -> (n_heads, head_dim, kv_heads)
    for target, ms in mods.items():
        m = gm.get_submodule(target)
        if isinstance(m, SelfAttention):
            r = slots.find(ms["dim"])
            if slots.info[r].fixed_reason:
                continue
            hd = m.d_model // m.n_heads
            kv = getattr(m, "kv_heads", m.n_heads)
            if mode == "heads":
                h2, hd2 = max(1, int(round(m.n_heads * ratio))), hd
                g2 = _kv_heads(h2, kv * h2 / m.n_heads) if kv != m.n_heads else h2
            else:
                h2, hd2, g2 = m.n_heads, max(1, int(round(hd * ratio))), kv
                if getattr(m, "rotary_base", 0.0) and hd2 % 2:
                    # Rotary embeddings rotate pairs of a head's features: the nearest even head dim
                    # towards the original (which is even), reported with the new width.
                    hd2 = hd2 + 1 if hd2 < hd else hd2 - 1
            if r in heads_for and heads_for[r][0] * heads_for[r][1] != h2 * hd2:
                raise PassError(f"shrink_model: attention layers on one residual stream disagree on width ({target})")
            heads_for[r] = (h2, hd2)
            attn_plan[target] = (h2, hd2, g2)
            new_size[r] = h2 * hd2
    for i in range(len(slots.parent)):
        r = slots.find(i)
        if r in new_size or slots.info[r].fixed_reason:
            continue
        new_size[r] = _new_width(slots.info[r].size, ratio, min_width)

    def width(slot: int) -> int:
        r = slots.find(slot)
        return slots.info[r].size if slots.info[r].fixed_reason else new_size[r]

    for target, ms in mods.items():
        m = gm.get_submodule(target)
        new, desc = _rebuild(m, {k: width(v) for k, v in ms.items()}, attn_plan.get(target))
        if new is not None:
            gm.set_submodule(target, new.to(_device_dtype(m)))
            report.changed[target] = desc
    seen = set()
    for i in sorted({s for ms in mods.values() for s in ms.values()}):
        r = slots.find(i)
        if r not in seen and slots.info[r].fixed_reason and slots.info[r].size:
            seen.add(r)
            report.fixed.append(f"width {slots.info[r].size}: {slots.info[r].fixed_reason}")
    gm.recompile()
    gm.train(was_training)
    gm.shrink_report = report
    logger.info("%s", report)
    if check:
        check_shrunk(gm, example_inputs, out_shape)
    return gm


def _device_dtype(m: nn.Module) -> torch.dtype:
    for p in m.parameters():
        return p.dtype
    return torch.get_default_dtype()


def _kv_heads(n_heads: int, want: float) -> int:
    """Key/value heads for ``n_heads`` query heads: the divisor of ``n_heads`` nearest ``want``
    (the scaled group count), the larger one on a tie, so the group size stays near the original."""
    divisors = [g for g in range(1, n_heads + 1) if n_heads % g == 0]
    return min(divisors, key=lambda g: (abs(g - want), -g))


def _rebuild(m: nn.Module, w: dict[str, int], heads: tuple[int, int, int] | None) -> tuple[nn.Module | None, str]:
    if isinstance(m, SelfAttention):
        kv = getattr(m, "kv_heads", m.n_heads)
        if heads is None or (heads[0] * heads[1] == m.d_model and heads[2] == kv):
            return None, ""
        h2, hd2, g2 = heads
        hd = m.d_model // m.n_heads
        # Keep the parametrization's rule: 1/sqrt(d) stays 1/sqrt(d'), c/d becomes c/d'.
        if math.isclose(m.scale, 1 / math.sqrt(hd), rel_tol=1e-9):
            scale = 1 / math.sqrt(hd2)
        else:
            scale = m.scale * hd / hd2
        new = SelfAttention(h2 * hd2, h2, scale, m.causal, m.qkv.bias is not None,
                            n_query_groups=g2 if g2 != h2 else 0, rotary_base=getattr(m, "rotary_base", 0.0))
        groups = (lambda h, g: f", {g} query group{'s' if g > 1 else ''}" if g != h else "")
        return new, (f"attention {m.d_model} ({m.n_heads} heads{groups(m.n_heads, kv)}, head dim {hd}) -> "
                     f"{h2 * hd2} ({h2} heads{groups(h2, g2)}, head dim {hd2})")
    if isinstance(m, nn.Linear):
        if (w["in"], w["out"]) == (m.in_features, m.out_features):
            return None, ""
        if hasattr(m, "output_mult"):  # mup.MuReadout: keep its multiplier and zero-init choice
            import mup
            new = type(m)(w["in"], w["out"], bias=m.bias is not None, output_mult=m.output_mult,
                          readout_zero_init=getattr(m, "readout_zero_init", False))
            mup.set_base_shapes(new, None, rescale_params=False, do_assert=False)
        else:
            new = nn.Linear(w["in"], w["out"], bias=m.bias is not None)
        return new, f"Linear {m.in_features}x{m.out_features} -> {w['in']}x{w['out']}"
    if isinstance(m, nn.Embedding):
        if w["out"] == m.embedding_dim:
            return None, ""
        return nn.Embedding(m.num_embeddings, w["out"]), f"Embedding dim {m.embedding_dim} -> {w['out']}"
    if isinstance(m, nn.LayerNorm):
        if w["dim"] == m.normalized_shape[-1]:
            return None, ""
        return nn.LayerNorm(w["dim"], eps=m.eps, bias=m.bias is not None), f"LayerNorm {m.normalized_shape[-1]} -> {w['dim']}"
    if isinstance(m, nn.RMSNorm):
        if w["dim"] == m.normalized_shape[-1]:
            return None, ""
        return nn.RMSNorm(w["dim"], eps=m.eps), f"RMSNorm {m.normalized_shape[-1]} -> {w['dim']}"
    if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
        if w["dim"] == m.num_features:
            return None, ""
        return type(m)(w["dim"], eps=m.eps, momentum=m.momentum), f"{type(m).__name__} {m.num_features} -> {w['dim']}"
    if isinstance(m, nn.Conv2d):
        if (w["in"], w["out"]) == (m.in_channels, m.out_channels):
            return None, ""
        new = nn.Conv2d(w["in"], w["out"], m.kernel_size, m.stride, m.padding, m.dilation, m.groups,
                        m.bias is not None, m.padding_mode)
        return new, f"Conv2d {m.in_channels}->{m.out_channels} to {w['in']}->{w['out']}"
    return None, ""


def _out_shape(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[int, ...]:
    for node in gm.graph.nodes:
        if node.op == "output":
            arg = node.args[0]
            shape = _meta_shape(arg)
            if shape is None:
                raise PassError("shrink_model: the model must return one tensor")
            return shape
    raise PassError("shrink_model: graph has no output")


def check_shrunk(gm: fx.GraphModule, example_inputs: Sequence[Any], out_shape: tuple[int, ...]) -> None:
    """One forward (eval mode, state restored): same output shape as before, finite values."""
    snap = {k: v.clone() for k, v in gm.state_dict().items()}
    was = gm.training
    gm.eval()
    try:
        with torch.no_grad():
            out = gm(*example_inputs)
    except Exception as exc:
        raise PassError(f"shrink_model check: the shrunk model fails to run ({exc}); a width is probably "
                        "hard-coded in a reshape. Report:\n" + str(gm.shrink_report)) from exc
    finally:
        gm.load_state_dict(snap)
        gm.train(was)
    if tuple(out.shape) != out_shape:
        raise PassError(f"shrink_model check: output shape {tuple(out.shape)} != original {out_shape}")
    if not torch.isfinite(out).all():
        raise PassError("shrink_model check: the shrunk model produces non-finite values")

"""Make megatron-core's ``MoELayer`` traceable: static-shape token dispatch with graph collectives.

megatron-core's drop-free token dispatchers cannot be captured as one static graph: the number of
tokens each expert receives is data-dependent (``masked_select``, split sizes read back with
``.tolist()``), the collectives are ``torch.distributed`` calls in place, and the router moves its
weight with a ``.data`` assignment. Dynamo breaks the MoE layer into dozens of graphs with no
collective in any of them, so nothing can be overlapped.

:func:`make_moe_traceable` rebinds, on the *instance* of one ``MoELayer``, its ``forward`` (and
its router's ``forward`` and aux-loss hook) to versions with static shapes, written with
:mod:`megatron_ext.helix.collectives`. megatron's own router computation (score function, top-k,
capacity dropping, load-balancing loss and its logging) and megatron's own expert MLPs run
unchanged; only the movement of tokens is re-expressed:

* **Tokens batch-major.** The layer's ``[s, b, h]`` input is flattened as ``[b * s, h]``, so that
  a tile of the batch is a contiguous block of tokens (megatron flattens sequence-major, which
  interleaves the sequences of every tile).
* **Padded dispatch, capacity = every token.** Each destination gets a slot for every token of
  every source (``expand``), and each local expert runs on all slots it receives, weighted by the
  routing probabilities -- zero where the token was not routed to it, which makes the slot's
  contribution exactly zero. No token can be dropped by the dispatch, so the result is megatron's
  drop-free (or capacity-dropped, when the router drops) output, up to summation order.
  ``alltoall``: an equal-split all-to-all over EP out and back (then the sum over sources), with
  an all-gather / reduce-scatter over expert TP around the experts when it is > 1.
  ``allgather`` (or EP = 1): all-gather over TP x EP, reduce-scatter back, as megatron's.
* **Cost.** The padding moves EP / top-k times the bytes of megatron's drop-free all-to-all on
  average (the same for EP 2, top-2) and runs E / top-k times the expert FLOPs (each local expert
  sees every token). Exact, static, tileable -- not free: the logs and docs/helix.md say so.

Refused with an error (not implemented): shared experts, grouped-GEMM / TE experts, the flex
dispatcher, sequence-level and global aux losses, z-loss, expert bias, input jitter, latent
projections, probabilities applied on the input, fused router/permute kernels, routing replay,
padding masks, and partial (CUDA-graph) execution maps.
"""
from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F

from megatron_ext.helix.collectives import (GroupRef, all_reduce, all_to_all, gather_from_sequence_parallel_region,
                                            reduce_scatter_to_sequence_parallel_region)


def _refusals(layer: Any) -> list[str]:
    cfg = layer.config
    router = layer.router
    bad = []
    if cfg.moe_token_dispatcher_type not in ("alltoall", "allgather"):
        bad.append(f"--moe-token-dispatcher-type {cfg.moe_token_dispatcher_type}")
    if getattr(layer, "use_shared_expert", False):
        bad.append("shared experts")
    if type(layer.experts).__name__ != "SequentialMLP":
        bad.append(f"{type(layer.experts).__name__} experts (grouped GEMM); use the local spec's SequentialMLP")
    if list(getattr(layer, "fwd_execution_map", ["route", "expert_compute", "postprocess"])) != \
            ["route", "expert_compute", "postprocess"]:
        bad.append("a partial execution map (CUDA-graph capture)")
    if type(router).__name__ != "TopKRouter":
        bad.append(f"router {type(router).__name__}")
    routing = router.routing_type if isinstance(router.routing_type, list) else [router.routing_type]
    for kind in routing:
        if kind not in ("aux_loss", "none"):
            bad.append(f"--moe-router-load-balancing-type {kind}")
    for name in ("moe_z_loss_coeff", "moe_router_enable_expert_bias", "moe_input_jitter_eps", "moe_latent_size",
                 "moe_apply_probs_on_input", "moe_router_padding_for_quantization", "moe_router_force_load_balancing",
                 "moe_router_fusion", "moe_permute_fusion", "moe_enable_routing_replay"):
        if getattr(cfg, name, None):
            bad.append(name)
    return bad


def _router_forward(self, input: torch.Tensor, padding_mask: torch.Tensor | None = None):
    """megatron's ``TopKRouter.forward`` without the weight's device move (a ``.data``
    assignment, a no-op on the device the weight is already on) and with the gate as a plain
    linear in the router dtype (megatron's ``RouterGatingLinearFunction`` computes the same
    product; its custom backward only saves memory)."""
    dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
    logits = F.linear(input.to(dtype), self.weight.to(dtype), None if self.bias is None else self.bias.to(dtype))
    return self.routing(logits, padding_mask=padding_mask)


def _router_apply_aux_loss(self, probs: torch.Tensor, scores_for_aux_loss: torch.Tensor, routing_map: torch.Tensor,
                           with_padding_mask: bool = False) -> torch.Tensor:
    """megatron-core 0.16.1's ``TopKRouter._apply_aux_loss``, with the token counts all-reduced
    over TP x CP as a graph collective (megatron's is an in-place ``torch.distributed`` call)."""
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

    coeff = self.get_aux_loss_coeff("aux_loss")
    if coeff == 0:
        return probs
    if with_padding_mask:
        raise ValueError("helix MoE: padding masks are not supported")
    g = self._helix_tp_cp
    local = routing_map.sum(dim=0)
    tokens_per_expert = all_reduce(local, g) if g.size > 1 else local
    local_num_tokens = routing_map.shape[0]
    aux_loss = switch_load_balancing_loss_func(
        probs=scores_for_aux_loss, tokens_per_expert=tokens_per_expert, total_num_tokens=local_num_tokens * g.size,
        topk=self.topk, num_experts=self.config.num_moe_experts, moe_aux_loss_coeff=coeff,
        fused=self.config.moe_router_fusion)
    return self.attach_and_log_load_balancing_loss(probs, coeff, aux_loss, "load_balancing_loss", self.tp_cp_group,
                                                   valid_token_count=local_num_tokens)


@torch.library.custom_op("megatron_ext::moe_aux_loss_scale", mutates_args=())
def moe_aux_loss_scale(like: torch.Tensor) -> torch.Tensor:
    """megatron's current backward scale of the MoE auxiliary losses, shaped and typed like
    ``like``. The schedule sets it (``MoEAuxLossAutoScaler.set_loss_scale``, in place) after a
    micro-batch's forward and before its backward, so it must be read when the backward runs: an
    op, opaque to the tracer, rather than a tensor saved in the forward (the in-place update would
    fail autograd's version check) or the class attribute megatron's own backward reads (Dynamo
    cannot trace it)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    if scale is None:  # megatron's default before any schedule ran
        return torch.ones_like(like)
    return scale.to(device=like.device, dtype=like.dtype).reshape(()).expand(like.shape).clone()


@moe_aux_loss_scale.register_fake
def _(like: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(like)


class _AttachAuxLoss(torch.autograd.Function):
    """megatron's ``MoEAuxLossAutoScaler``: identity forward; in the backward the auxiliary loss
    gets megatron's current loss scale as its gradient (:func:`moe_aux_loss_scale`)."""

    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.save_for_backward(aux_loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, moe_aux_loss_scale(aux_loss)


def _router_attach_and_log(self, activation: torch.Tensor, aux_loss_coeff: float, aux_loss: torch.Tensor,
                           aux_loss_name: str, reduce_group: Any, reduce_group_has_dp: bool = False,
                           valid_token_count: Any = None) -> torch.Tensor:
    """megatron-core 0.16.1's ``TopKRouter.attach_and_log_load_balancing_loss`` (logged to megatron's
    aux-loss tracker as there), attaching through :class:`_AttachAuxLoss`."""
    from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

    num_layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
    save_to_aux_losses_tracker(aux_loss_name, aux_loss / aux_loss_coeff, self.layer_number, num_layers,
                               reduce_group=reduce_group, reduce_group_has_dp=reduce_group_has_dp)
    if self.calculate_per_token_loss:
        num_tokens = valid_token_count if valid_token_count is not None else activation.shape[0]
        aux_loss = aux_loss * num_tokens
    return _AttachAuxLoss.apply(activation, aux_loss)


def _experts(layer: Any, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Sum over this rank's experts of ``expert(tokens, probs[..., l])`` (megatron's expert MLP,
    probabilities applied after the activation as in megatron): slots not routed to an expert
    have probability 0 and contribute exactly 0."""
    out = None
    for l, expert in enumerate(layer.experts.local_experts):
        y, bias = expert(tokens, probs[..., l])
        if bias is not None:
            raise ValueError("helix MoE: expert MLPs returned a separate bias")
        out = y if out is None else out + y
    return out


def _moe_forward(self, hidden_states: torch.Tensor, intermediate_tensors: Any = None,
                 padding_mask: torch.Tensor | None = None):
    if intermediate_tensors is not None or padding_mask is not None:
        raise ValueError("helix MoE: intermediate tensors and padding masks are not supported")
    if self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel:
        raise ValueError("During training, performance may degrade if MoE and tensor parallelism"
                         "are enabled without also enabling sequence parallelism.")
    s, b, h = hidden_states.shape
    tokens = hidden_states.transpose(0, 1).reshape(b * s, h)          # batch-major: tiles are row blocks
    probs, routing_map = self.router(tokens)
    probs = probs * routing_map.to(probs.dtype)                       # exactly 0 where not routed
    lo, hi = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
    ep, etp, tp_ep = self._helix_ep, self._helix_etp, self._helix_tp_ep
    n = tokens.shape[0]
    if self.config.moe_token_dispatcher_type == "alltoall" and ep.size > 1:
        # Destination r gets a slot for every token and the probabilities of r's experts.
        send = tokens.unsqueeze(0).expand(ep.size, n, h)                       # [EP dst, T, h]
        send_p = probs.view(n, ep.size, hi - lo).permute(1, 0, 2)               # [EP dst, T, L]
        x, p = all_to_all(send, ep), all_to_all(send_p, ep)                     # [EP src, T, ...]
        x, p = gather_from_sequence_parallel_region(x, etp), gather_from_sequence_parallel_region(p, etp)
        # megatron reduce-scatters expert outputs in the probabilities' dtype
        y = reduce_scatter_to_sequence_parallel_region(_experts(self, x, p).to(probs.dtype), etp)
        out = all_to_all(y.to(hidden_states.dtype), ep).sum(dim=0)             # sum over expert ranks
    else:
        x = gather_from_sequence_parallel_region(tokens.unsqueeze(0), tp_ep)    # [TP x EP, T, h]
        p = gather_from_sequence_parallel_region(probs.unsqueeze(0), tp_ep)[..., lo:hi]
        out = reduce_scatter_to_sequence_parallel_region(_experts(self, x, p).to(probs.dtype), tp_ep).squeeze(0)
    return out.to(hidden_states.dtype).view(b, s, h).transpose(0, 1).contiguous(), None


def cost_note(layer: Any) -> str:
    """What the static dispatch costs against megatron's drop-free one, for the log."""
    cfg, ep = layer.config, layer._helix_ep.size
    k = cfg.moe_router_topk
    a2a = (f", the all-to-all {ep / k:.1f}x its bytes on average"
           if cfg.moe_token_dispatcher_type == "alltoall" and ep > 1 else "")
    return (f"static-shape MoE dispatch: each expert runs on every token ({cfg.num_moe_experts / k:.1f}x megatron's "
            f"drop-free expert FLOPs{a2a})")


def make_moe_traceable(name: str, layer: Any) -> None:
    """Rebind ``layer`` (a megatron-core ``MoELayer``) and its router to the static-shape versions,
    in place; raises ``ValueError`` naming what is not supported."""
    bad = _refusals(layer)
    if bad:
        raise ValueError(f"helix adapter: {name} (MoELayer) uses {', '.join(bad)}, which the traceable MoE "
                         "dispatch does not implement -- turn it off for --helix")
    d = layer.token_dispatcher
    layer._helix_ep, layer._helix_etp, layer._helix_tp_ep = GroupRef.of(d.ep_group), GroupRef.of(d.tp_group), \
        GroupRef.of(d.tp_ep_group)
    layer.router._helix_tp_cp = GroupRef.of(layer.router.tp_cp_group)
    layer.forward = types.MethodType(_moe_forward, layer)
    layer.router.forward = types.MethodType(_router_forward, layer.router)
    layer.router._apply_aux_loss = types.MethodType(_router_apply_aux_loss, layer.router)
    layer.router.attach_and_log_load_balancing_loss = types.MethodType(_router_attach_and_log, layer.router)


REBOUND = (_moe_forward, _router_forward, _router_apply_aux_loss, _router_attach_and_log)
ATTRS = ("_helix_ep", "_helix_etp", "_helix_tp_ep", "_helix_tp_cp")

"""Make megatron-core's GPTModel traceable: its TP/SP regions become graph collectives.

megatron-core's tensor-parallel layers call ``torch.distributed`` in place (and inside custom
autograd functions with asynchronous handles), which Dynamo cannot capture as collective nodes.
:func:`make_traceable` rebinds, on the *instances* of one model, the forward of every
``ColumnParallelLinear``, ``RowParallelLinear`` and ``VocabParallelEmbedding`` and the model's
``compute_language_model_loss`` to equivalents built from :mod:`megatron_ext.helix.collectives`
(functional collectives + the f/g conjugate pairs). Nothing global is patched: other models,
and the classes themselves, are untouched; :func:`restore` undoes it.

Covered: tensor parallelism with and without sequence parallelism, the local layer spec
(``get_gpt_layer_local_spec()``) of every family (GPT, LLaMA-style, MoE), vocabulary-parallel
embedding and cross entropy; megatron's ``MoELayer`` gets a static-shape token dispatch with
graph collectives (:mod:`megatron_ext.helix.adapter_moe`). Not covered:
Transformer Engine layers (they have their own comm/overlap machinery), gradient-accumulation
fusion, deferred embedding wgrad, CPU offloading -- the adapter refuses those with an error.
"""
from __future__ import annotations

import dataclasses
import logging
import types
from typing import Any

import torch
import torch.nn.functional as F

from megatron_ext.helix.collectives import (GroupRef, copy_to_tensor_parallel_region,
                                            gather_from_sequence_parallel_region,
                                            gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
                                            reduce_scatter_to_sequence_parallel_region,
                                            scatter_to_tensor_parallel_region, vocab_parallel_cross_entropy)

logger = logging.getLogger(__name__)

SUPPORTED_MEGATRON_CORE = ("0.16.1",)
# Attributes the rebound forwards read; a test fails when one disappears upstream.
REQUIRED_ATTRS = {
    "ColumnParallelLinear": ("weight", "bias", "skip_bias_add", "sequence_parallel", "explicit_expert_comm",
                             "disable_grad_reduce", "gather_output", "tp_group", "config"),
    "RowParallelLinear": ("weight", "bias", "skip_bias_add", "sequence_parallel", "explicit_expert_comm",
                          "input_is_parallel", "tp_group"),
    "VocabParallelEmbedding": ("weight", "vocab_start_index", "vocab_end_index", "reduce_scatter_embeddings",
                               "tp_group"),
}


@dataclasses.dataclass
class TraceableReport:
    column: int = 0
    row: int = 0
    embedding: int = 0
    loss: int = 0
    moe: int = 0

    @property
    def total(self) -> int:
        return self.column + self.row + self.embedding + self.loss + self.moe


def _check_version() -> None:
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    if version not in SUPPORTED_MEGATRON_CORE:
        raise RuntimeError(f"helix adapter: megatron-core {version} is not supported "
                           f"(tested: {', '.join(SUPPORTED_MEGATRON_CORE)}); check REQUIRED_ATTRS and the forwards "
                           "in megatron_ext/helix/adapter.py against the new version")


def _group(module: torch.nn.Module, pg: Any) -> GroupRef:
    ref = GroupRef.of(pg)
    module._helix_tp = ref  # a constant for the tracer: name, rank, size
    return ref


def _column_forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                    runtime_gather_output: bool | None = None):
    g = self._helix_tp
    weight = self.weight if weight is None else weight
    bias = self.bias if not self.skip_bias_add else None
    if self.sequence_parallel and not self.explicit_expert_comm:
        x = gather_from_sequence_parallel_region(input_, g)     # all-gather fwd, reduce-scatter bwd
    elif self.explicit_expert_comm or self.disable_grad_reduce:
        x = input_
    else:
        x = copy_to_tensor_parallel_region(input_, g)            # identity fwd, all-reduce bwd
    out = F.linear(x, weight, bias)
    gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
    if gather:
        out = gather_from_tensor_parallel_region(out, g)
    return out, (self.bias if self.skip_bias_add else None)


def _row_forward(self, input_: torch.Tensor):
    g = self._helix_tp
    x = input_ if self.input_is_parallel else scatter_to_tensor_parallel_region(input_, g)
    out = F.linear(x, self.weight)
    if self.explicit_expert_comm:
        reduced = out
    elif self.sequence_parallel:
        reduced = reduce_scatter_to_sequence_parallel_region(out, g)
    else:
        reduced = reduce_from_tensor_parallel_region(out, g)
    if self.skip_bias_add:
        return reduced, self.bias
    return (reduced + self.bias if self.bias is not None else reduced), None


def _embedding_forward(self, input_: torch.Tensor) -> torch.Tensor:
    g = self._helix_tp
    if g.size > 1:
        # Same as megatron's masked lookup, without in-place index writes (not tileable).
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        ids = torch.where(outside, torch.zeros_like(input_), input_ - self.vocab_start_index)
        out = F.embedding(ids, self.weight) * (~outside).unsqueeze(-1).to(self.weight.dtype)
    else:
        out = F.embedding(input_, self.weight)
    if self.reduce_scatter_embeddings:
        return reduce_scatter_to_sequence_parallel_region(out.transpose(0, 1).contiguous(), g)
    return reduce_from_tensor_parallel_region(out, g)


def _lm_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(), self._helix_tp)
    return loss.transpose(0, 1).contiguous()


def _check_config(config: Any) -> None:
    bad = [name for name in ("gradient_accumulation_fusion", "defer_embedding_wgrad_compute", "cpu_offloading")
           if getattr(config, name, False)]
    if getattr(config, "cross_entropy_loss_fusion", False):
        bad.append("cross_entropy_loss_fusion")
    if bad:
        raise ValueError(f"helix adapter: TransformerConfig has {', '.join(bad)} set; the traceable regions "
                         "do not implement them -- turn them off for --helix")


def make_traceable(model: torch.nn.Module) -> TraceableReport:
    """Rebind the TP/SP regions of a megatron-core model (GPTModel, possibly DDP-wrapped) to
    traceable collectives, in place. Returns how many modules were changed."""
    _check_version()
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding)
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_ext.helix.adapter_moe import cost_note, make_moe_traceable

    classes = {"ColumnParallelLinear": ColumnParallelLinear, "RowParallelLinear": RowParallelLinear,
               "VocabParallelEmbedding": VocabParallelEmbedding}
    report = TraceableReport()
    for name, mod in model.named_modules():
        kind = type(mod).__name__
        for base, cls in classes.items():
            missing = [a for a in REQUIRED_ATTRS[base] if isinstance(mod, cls) and not hasattr(mod, a)]
            if missing:
                raise RuntimeError(f"helix adapter: {name} ({kind}) lacks {missing}; megatron-core changed")
        if isinstance(mod, ColumnParallelLinear):
            _check_config(mod.config)
            _group(mod, mod.tp_group)
            mod.forward = types.MethodType(_column_forward, mod)
            report.column += 1
        elif isinstance(mod, RowParallelLinear):
            _group(mod, mod.tp_group)
            mod.forward = types.MethodType(_row_forward, mod)
            report.row += 1
        elif isinstance(mod, VocabParallelEmbedding):
            _group(mod, mod.tp_group)
            mod.forward = types.MethodType(_embedding_forward, mod)
            report.embedding += 1
        elif isinstance(mod, MoELayer):
            make_moe_traceable(name, mod)
            if not report.moe:
                logger.info("helix adapter: %s", cost_note(mod))
            report.moe += 1
        elif isinstance(mod, LanguageModule):
            _check_config(mod.config)
            _group(mod, mod.pg_collection.tp)
            mod.compute_language_model_loss = types.MethodType(_lm_loss, mod)
            report.loss += 1
        elif "TE" in kind and ("Linear" in kind or "LayerNorm" in kind):
            raise ValueError(f"helix adapter: {name} is a Transformer Engine module ({kind}); use the local "
                             "layer spec (get_gpt_layer_local_spec()) with --helix")
    if report.column + report.row == 0:
        raise ValueError("helix adapter: no megatron tensor-parallel layers found in the model")
    logger.info("helix adapter: traceable regions installed (%d column, %d row, %d embedding, %d loss%s)",
                report.column, report.row, report.embedding, report.loss,
                f", {report.moe} mixture-of-experts" if report.moe else "")
    return report


def prefill_first_call_state(model: torch.nn.Module, micro_batch_size: int, seq_length: int) -> int:
    """Create, before ``model`` is compiled, the megatron-core state its first forward would create;
    returns how many entries it created or grew.

    Two of megatron-core's globals are filled at the first call: ``DotProductAttention`` takes its
    ``baddbmm`` input from the global memory buffer (``get_tensor(..., "mpu")`` allocates it), and
    the router's aux-loss logging adds its loss's entry to the MoE logging tracker. Traced before
    that first call, the graph creates them and Dynamo guards on their absence: the second
    micro-batch fails the guard and the whole chunk is traced, partitioned and scheduled again (a
    second graph per chunk, as long again as the first on CPU). Created here with megatron's own
    calls -- the attention buffer at the size each attention asks for (a shorter sequence fits in
    it, a longer one makes megatron grow it), the tracker entry with a zero loss added -- the first
    trace reads them as every later call does: one graph per chunk."""
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import (get_moe_layer_wise_logging_tracker,
                                                         save_to_aux_losses_tracker)

    buffer = parallel_state.get_global_memory_buffer()
    tracker = get_moe_layer_wise_logging_tracker()
    created = 0
    for mod in model.modules():
        if isinstance(mod, DotProductAttention):
            cp = getattr(mod.config, "context_parallel_size", 1) or 1
            s = seq_length // cp
            shape = (micro_batch_size * mod.num_attention_heads_per_partition, s, s)
            key = ("mpu", mod.config.params_dtype)
            before = buffer.buffer.get(key)
            buffer.get_tensor(shape, mod.config.params_dtype, "mpu")  # megatron's own call and name
            created += buffer.buffer.get(key) is not before
        elif isinstance(mod, MoELayer) and mod.router.layer_number is not None \
                and mod.router.get_aux_loss_coeff("aux_loss") > 0:
            # what adapter_moe._router_attach_and_log logs, the only aux loss the traceable router has
            created += "load_balancing_loss" not in tracker
            cfg = mod.config
            save_to_aux_losses_tracker("load_balancing_loss", torch.zeros((), device=mod.router.weight.device),
                                       mod.router.layer_number, cfg.num_layers + (cfg.mtp_num_layers or 0),
                                       reduce_group=mod.router.tp_cp_group)
    return created


def restore(model: torch.nn.Module) -> int:
    """Undo :func:`make_traceable` on ``model`` (the class methods apply again)."""
    from megatron_ext.helix import adapter_moe

    rebound = (_column_forward, _row_forward, _embedding_forward, _lm_loss, *adapter_moe.REBOUND)
    n = 0
    for mod in model.modules():
        for attr in ("forward", "compute_language_model_loss", "_apply_aux_loss",
                     "attach_and_log_load_balancing_loss"):
            if attr in mod.__dict__ and getattr(mod.__dict__[attr], "__func__", None) in rebound:
                del mod.__dict__[attr]
                n += 1
        for attr in ("_helix_tp", *adapter_moe.ATTRS):
            mod.__dict__.pop(attr, None)
    return n

"""Checkpoints to and from Megatron-LM (``--ckpt-format torch_dist``), across layouts.

A two-rank launch (megatron_lm_checkpoints.py) writes one checkpoint as Megatron-LM's save_checkpoint
does, under TP2, and one by the runtime under PP2. On one rank here:
- the runtime loads Megatron-LM's at TP1 with the saving model's logits (1e-6), its iteration and data
  position, and says in one line that the optimizer starts fresh;
- a fresh megatron-core GPTModel built from our checkpoint's saved ``args`` loads it with
  ``dist_checkpointing.load`` (megatron's own loader, the reference) and computes the logits the runtime
  computes from the same checkpoint.
"""
from __future__ import annotations

import logging
import os

import pytest
import torch

from megatron_ext.convert import hf as hf_export
from megatron_ext.runtime import dist_ckpt
from tests.conftest import run_torchrun
from tests.runtime.megatron_lm_checkpoints import BASE, ITERATION, tokens
from tests.runtime.trainer_helpers import one_rank

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def ctx():
    yield from one_rank(BASE)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_lm")
    run_torchrun("tests/runtime/megatron_lm_checkpoints.py", str(root), nproc=2)
    return {"megatron_lm": str(root / "megatron_lm_tp2"), "ours": str(root / "ours_pp2")}


def test_a_megatron_lm_checkpoint_loads_at_another_layout(ctx, saved, caplog):
    from megatron_ext.config.run import config_from_values
    from megatron_ext.runtime.loop import Trainer

    path = saved["megatron_lm"]
    expected = torch.load(os.path.join(path, "logits.pt"))
    ours = hf_export.megatron_logits(path, tokens(), ctx)  # the runtime's loader, TP1
    assert (ours - expected).abs().max().item() <= 1e-6 * max(1.0, expected.abs().max().item())
    with caplog.at_level(logging.WARNING, logger="megatron_ext.runtime.dist_ckpt"):
        t = Trainer(config_from_values({**BASE, "load": path, "train_iters": ITERATION + 1}), ctx).setup()
    assert (t.iteration, t.train_stream.consumed_samples) == (ITERATION, ITERATION * BASE["global_batch_size"])
    assert [r.getMessage() for r in caplog.records if "fresh" in r.getMessage() or "schedule" in r.getMessage()] == [
        f"{path}/iter_{ITERATION:07d}: the optimizer starts fresh: it holds no optimizer state this run reads "
        "(no step counts)",
        f"{path} holds no learning-rate schedule: the schedule starts from its beginning"]
    t.run()  # and trains on


def megatron_core_model(args):
    """A GPTModel from a checkpoint's args, the way Megatron-LM's model provider builds one (local spec)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        normalization=args.normalization, gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu, add_bias_linear=args.add_bias_linear,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=args.init_method_std,
        qk_layernorm=args.qk_layernorm, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, use_cpu_initialization=True)
    spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    return GPTModel(config, spec, vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                    rotary_percent=args.rotary_percent)


def test_ours_loads_into_megatron_cores_own_model(ctx, saved):
    from megatron.core import dist_checkpointing

    path = os.path.join(saved["ours"], "iter_0000003")
    assert open(os.path.join(saved["ours"], "latest_checkpointed_iteration.txt")).read() == "3"
    args = dist_ckpt.read_common(path)["args"]
    assert (args.pipeline_model_parallel_size, args.iteration) == (2, 3)
    model = megatron_core_model(args)
    # As Megatron-LM's load_checkpoint: the model under "model", the common state beside it
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    assert loaded["iteration"] == 3 and loaded["checkpoint_version"] == 3.0
    model.load_state_dict(loaded["model"], strict=True)
    model.eval()
    toks = tokens()
    positions = torch.arange(toks.shape[1]).unsqueeze(0).expand_as(toks)
    with torch.no_grad():
        theirs = model(toks, positions, None).float()
    ours = hf_export.megatron_logits(saved["ours"], toks, ctx)
    assert (ours - theirs).abs().max().item() <= 1e-6 * max(1.0, theirs.abs().max().item())

"""Packed variable-length documents: distributions, masks, and per-document attention parity."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_ext.config.base import ConfigError
from megatron_ext.config.defaults import FORMER_DEFAULTS
from megatron_ext.config.run import config_from_values
from megatron_ext.data.packing import LengthDistribution, block_causal_mask, pack, reset_positions, split_sequence
from megatron_ext.runtime import distributed


@pytest.mark.parametrize("spec", ["fixed:16", "uniform:4,40", "lognormal:3,1", "pareto:1.2,4"])
def test_split_sums_to_sequence_and_is_deterministic(spec):
    dist = LengthDistribution.parse(spec)
    for idx in range(20):
        docs = split_sequence(128, dist, seed=7, sample_index=idx)
        assert sum(docs) == 128 and all(n >= 1 for n in docs)
        assert docs == split_sequence(128, dist, seed=7, sample_index=idx)
    assert split_sequence(128, dist, 7, 0) != split_sequence(128, dist, 7, 1) or spec.startswith("fixed")


@pytest.mark.parametrize("spec,message", [
    ("gauss:1,2", "kind must be one of fixed, uniform, lognormal, pareto"),
    ("uniform:9,3", "need 1 <= LO <= HI"),
    ("lognormal:3", "lognormal takes 2 parameter(s), got 1"),
    ("pareto:a,b", "parameters must be numbers"),
])
def test_bad_distribution(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LengthDistribution.parse(spec)
    with pytest.raises(ConfigError, match="--doc-length-dist"):
        config_from_values({"doc_length_dist": spec})


def test_mask_and_positions():
    mask = block_causal_mask([[2, 3]], 5)[0, 0]
    allowed = ~mask
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]],
                            dtype=torch.bool)
    assert torch.equal(allowed, expected)
    assert reset_positions([[2, 3]]).tolist() == [[0, 1, 0, 1, 2]]
    batch = {"tokens": torch.zeros(2, 32, dtype=torch.long)}
    pack(batch, LengthDistribution.parse("uniform:3,9"), seed=1, first_sample_index=10)
    assert batch["doc_lengths"][1] == split_sequence(32, LengthDistribution.parse("uniform:3,9"), 1, 11)


@pytest.fixture(scope="module")
def ctx():
    cfg = config_from_values({"tensor_model_parallel_size": 1})
    context = distributed.setup(cfg.parallel, seed=1)
    yield context
    distributed.teardown()


def test_document_attention_matches_dense_masked_attention(ctx):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.runtime.attention import DocumentAttention, document_starts
    from megatron_ext.runtime.model import transformer_config

    cfg = config_from_values({**FORMER_DEFAULTS, "hidden_size": 64, "num_attention_heads": 4})   # no dropout
    tconf = transformer_config(cfg, ctx)
    dense = DotProductAttention(tconf, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    docs = DocumentAttention(tconf, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    s, b, h, d = 24, 2, 4, 16
    lengths = [[5, 11, 8], [24]]
    mask = block_causal_mask(lengths, s)
    assert document_starts(mask) == [[0, 5, 16], [0]]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, b, h, d, generator=gen, requires_grad=True) for _ in range(3))
    out_dense = dense(q, k, v, mask)
    grads_dense = torch.autograd.grad(out_dense.square().sum(), (q, k, v))
    out_docs = docs(q, k, v, mask)
    grads_docs = torch.autograd.grad(out_docs.square().sum(), (q, k, v))
    assert torch.allclose(out_docs, out_dense, rtol=1e-5, atol=1e-6)
    for a, g in zip(grads_docs, grads_dense):
        assert torch.allclose(a, g, rtol=1e-4, atol=1e-6)
    # without a mask it is the plain causal attention
    assert torch.allclose(docs(q, k, v, None), dense(q, k, v, None))


def test_packed_training_runs_and_reports_documents(ctx):
    from megatron_ext.runtime.loop import Trainer

    cfg = config_from_values({"train_iters": 2, "eval_iters": 0, "progress": False, "num_layers": 2,
                              "hidden_size": 32, "num_attention_heads": 2, "seq_length": 64,
                              "global_batch_size": 2, "micro_batch_size": 1, "doc_length_dist": "lognormal:2.5,0.8"})
    trainer = Trainer(cfg, ctx).setup()
    history = trainer.run()
    assert all(np.isfinite(h["loss"]) for h in history)
    docs = trainer.last_batches[0]["doc_lengths"]
    assert sum(docs[0]) == 64 and len(docs[0]) > 1

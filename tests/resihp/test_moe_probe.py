"""The MoE probe on megatron-core's own MoE layers (one process, the runtime's MoE model, all-to-all
dispatcher): exact routed counts, one span per dispatcher collective in forward and backward, no
change to any gradient; and the join of probe rows with pipeline events (pure)."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from megatron_ext.config.run import config_from_values
from megatron_ext.pipeline.events import EVENT_DTYPE, EventRecorder, Phase
from megatron_ext.resihp import moe_probe
from megatron_ext.resihp.moe_probe import COLLECTIVE, PROBE_DTYPE, ROUTED, MoEProbe, op_tables
from megatron_ext.runtime import distributed
from megatron_ext.config.defaults import FORMER_DEFAULTS
from megatron_ext.runtime.model import build_model, unwrap

SMALL = {**FORMER_DEFAULTS, "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "group_query_attention": True,
         "num_query_groups": 2, "normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
         "disable_bias_linear": True, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 24,
         "moe_token_dispatcher_type": "alltoall", "seq_length": 16, "train_iters": 1, "eval_iters": 0,
         "progress": False}
SEQ, BATCH = 16, 2


@pytest.fixture(scope="module")
def moe_model():
    from megatron_ext.compat import megatron_cpu

    shims_before = megatron_cpu.applied()
    cfg = config_from_values(dict(SMALL))
    ctx = distributed.setup(cfg.parallel, seed=cfg.training.seed)
    bundle = build_model(cfg, ctx, vocab_size=100, wrap_ddp=False)
    yield bundle
    distributed.teardown()
    if not shims_before:  # leave the process as found (tests/compat checks apply() from scratch)
        megatron_cpu.remove()


def step(model, recorder: EventRecorder | None = None) -> dict[str, torch.Tensor]:
    """One forward and backward of a fixed batch, each as one pipeline event; the gradients."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 100, (BATCH, SEQ), generator=g)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    model.zero_grad()
    slot = recorder.begin(Phase.FORWARD, 0, 0) if recorder is not None else -1
    loss = model(tokens, positions, None, labels=torch.roll(tokens, -1, 1)).float().mean()
    if recorder is not None:
        recorder.end(slot)
        slot = recorder.begin(Phase.BACKWARD, 0, 0)
    loss.backward()
    if recorder is not None:
        recorder.end(slot)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_megatron_core_has_what_the_probe_hooks():
    assert moe_probe.missing_symbols() == []


def test_probe_counts_routed_pairs_times_collectives_and_leaves_gradients_alone(moe_model):
    model = unwrap(moe_model.chunks[0])
    reference = step(model)
    disp = importlib.import_module(moe_probe.DISPATCHER_MODULE)
    originals = {name: getattr(disp, name) for name in moe_probe.COLLECTIVES}
    recorder = EventRecorder(64)
    probe = MoEProbe(recorder).install(moe_model.chunks)
    try:
        assert probe.layers_per_chunk == [2]
        with pytest.raises(RuntimeError, match="already installed"):
            MoEProbe(recorder).install(moe_model.chunks)
        grads = step(model, recorder)
        rows = probe.rows()
        events = recorder.events()
    finally:
        probe.uninstall()
    # Identity autograd functions around the collectives: every gradient is bit-for-bit the same.
    assert grads.keys() == reference.keys()
    for name, g in grads.items():
        assert torch.equal(g, reference[name]), name
    assert {name: getattr(disp, name) for name in moe_probe.COLLECTIVES} == originals
    # Dropless top-2 over one EP rank: each of the 2 layers computes 2 pairs per token.
    routed = rows[rows["kind"] == ROUTED]
    assert routed["value"].tolist() == [2.0 * SEQ * BATCH] * 2
    assert (routed["event"] == 0).all()
    coll = rows[rows["kind"] == COLLECTIVE]
    # EP = TP = 1: no count all-gather; per layer the token and prob all-to-alls and the combine,
    # each once in forward (event 0) and once in backward (event 1).
    assert (coll["event"] == 0).sum() == 6 and (coll["event"] == 1).sum() == 6
    assert (coll["t1"] >= coll["t0"]).all()
    for e in (0, 1):
        inside = coll[coll["event"] == e]
        assert (inside["t0"] >= events[e]["t0"]).all() and (inside["t1"] <= events[e]["t1"]).all()
    tables = op_tables(events, rows, num_chunks=1, num_microbatches=1, layers_per_chunk=probe.layers_per_chunk)
    assert tables["routed"].tolist() == [[2 * 2.0 * SEQ * BATCH]]
    assert 0 < tables["collective_fwd_s"][0, 0] < events[0]["t1"] - events[0]["t0"]
    assert 0 < tables["collective_bwd_s"][0, 0] < events[1]["t1"] - events[1]["t0"]
    assert probe.collective_total_s() >= tables["collective_fwd_s"][0, 0] + tables["collective_bwd_s"][0, 0] - 1e-9


def _events(*ops: tuple[int, int, int, float, float]) -> np.ndarray:
    ev = np.zeros(len(ops), dtype=EVENT_DTYPE)
    for i, (phase, chunk, mb, t0, t1) in enumerate(ops):
        ev[i] = (t0, t1, phase, 0, chunk, mb)
    return ev


def _rows(*rows: tuple[int, int, float, float, float]) -> np.ndarray:
    return np.array(list(rows), dtype=PROBE_DTYPE)


def test_op_tables_join_rows_to_their_ops():
    ev = _events((Phase.FORWARD, 0, 0, 0.0, 1.0), (Phase.RECV, 0, -1, 1.0, 2.0), (Phase.FORWARD, 0, 1, 2.0, 3.0),
                 (Phase.BACKWARD, 0, 0, 3.0, 5.0))
    rows = _rows((0, ROUTED, 0.1, 0.1, 30.0), (0, ROUTED, 0.5, 0.5, 34.0), (0, COLLECTIVE, 0.2, 0.3, 0.1),
                 (2, ROUTED, 2.1, 2.1, 10.0),                       # mb 1 saw one of its two layers
                 (1, COLLECTIVE, 1.2, 1.4, 0.2),                    # inside a receive: no op's
                 (3, COLLECTIVE, 3.0, 3.5, 0.5), (3, COLLECTIVE, 3.2, 3.6, 0.4),   # overlapping: 0.6 s
                 (3, ROUTED, 4.0, 4.0, 64.0))                       # recomputed forward: not counted again
    t = op_tables(ev, rows, num_chunks=1, num_microbatches=2, layers_per_chunk=[2])
    assert t["routed"][0, 0] == 64.0 and np.isnan(t["routed"][0, 1])
    assert t["collective_fwd_s"].tolist() == [[pytest.approx(0.1), 0.0]]
    assert t["collective_bwd_s"].tolist() == [[pytest.approx(0.6), 0.0]]

"""The schedule orders are checked against the real schedules, op for op.

megatron-core's schedule functions are run for real with the forward/backward steps and the p2p
communicator replaced by recorders (no model, no communication); DeepSpeed's ``TrainSchedule``
instruction streams are read directly.
"""
from __future__ import annotations

import types

import pytest

from megatron_ext.pipeline.schedule_orders import (
    BACKWARD, FORWARD, Op, deepspeed_train, megatron_1f1b, megatron_interleaved, schedule_order)


def _keys(ops):
    return [op.key for op in ops]


# ---------------------------------------------------------------- megatron-core, run for real
@pytest.fixture(scope="module")
def mcore():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    from megatron.core.enums import ModelType
    from megatron.core.transformer import TransformerConfig

    # megatron asks the groups for rank/size only when torch.distributed is initialised; a
    # one-rank fake group satisfies that and the pipeline group itself is a stand-in below.
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    yield types.SimpleNamespace(torch=torch, S=schedules, ModelType=ModelType, TransformerConfig=TransformerConfig)
    if owned:
        dist.destroy_process_group()


class _Group:
    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _run_megatron(mc, monkeypatch, p: int, stage: int, m: int, vp: int | None = None, group: int | None = None):
    """Run megatron's schedule for one pipeline rank and return the (phase, mb, chunk) it ran."""
    torch, S = mc.torch, mc.S
    cfg = mc.TransformerConfig(num_layers=p * (vp or 1), hidden_size=8, num_attention_heads=1,
                               pipeline_model_parallel_size=p, virtual_pipeline_model_parallel_size=vp,
                               microbatch_group_size_per_vp_stage=group, batch_p2p_sync=False,
                               pipeline_dtype=torch.float32)
    ran = []

    class Comm:
        def __init__(self):
            self.pp_group, self.config, self.virtual_pipeline_model_parallel_size = _Group(p, stage), cfg, vp

        def __getattr__(self, name):
            if not name.startswith(("send", "recv")):
                raise AttributeError(name)

            def transfer(*args, **kwargs):
                if name == "send_forward_backward_recv_forward_backward":
                    return torch.zeros(1), torch.zeros(1)
                return torch.zeros(1) if "recv" in name else None
            return transfer

    class Chunk(torch.nn.Module):
        def __init__(self, index):
            super().__init__()
            self.config, self.model_type, self.index = cfg, mc.ModelType.encoder_or_decoder, index

    def forward_step(func, data, model, num_mb, inp, store, config, *args, current_microbatch=None, **kw):
        out = torch.zeros(1)
        out.tag = (current_microbatch, model.index)
        ran.append((FORWARD, current_microbatch, model.index))
        return [out], torch.tensor(1)

    def backward_step(inp, out, out_grad, model_type, config):
        out = out[0] if isinstance(out, list) else out
        ran.append((BACKWARD,) + out.tag)
        return [None]

    zeros = torch.zeros
    monkeypatch.setattr(S, "forward_step", forward_step)
    monkeypatch.setattr(S, "backward_step", backward_step)
    # total_num_tokens is allocated on "cuda"; only the device is in the way.
    monkeypatch.setattr(torch, "zeros", lambda *a, device=None, **k: zeros(*a, **k))
    pgs = types.SimpleNamespace(tp=_Group(1, 0), cp=_Group(1, 0), pp=_Group(p, stage), embd=None,
                                pos_embd=None, dp_cp=_Group(1, 0))
    kwargs = dict(forward_step_func=None, num_microbatches=m, seq_length=4, micro_batch_size=1,
                  p2p_communicator=Comm(), pg_collection=pgs)
    if vp is None:
        S.forward_backward_pipelining_without_interleaving(data_iterator=None, model=Chunk(0), **kwargs)
    else:
        S.forward_backward_pipelining_with_interleaving(
            data_iterator=[None] * vp, model=[Chunk(v) for v in range(vp)], **kwargs)
    monkeypatch.undo()
    return ran


@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (2, 5), (4, 3), (4, 8)])
def test_1f1b_matches_megatron(mcore, monkeypatch, p, m):
    order = megatron_1f1b(p, m)
    for s in range(p):
        assert _keys(order.stages[s]) == _run_megatron(mcore, monkeypatch, p, s, m), f"stage {s}"


@pytest.mark.parametrize("p,m,vp,group", [(2, 4, 2, None), (4, 8, 2, None), (2, 6, 3, None),
                                          (4, 12, 2, 6), (2, 5, 2, 3), (4, 4, 3, None)])
def test_interleaved_matches_megatron(mcore, monkeypatch, p, m, vp, group):
    order = megatron_interleaved(p, m, vp, group)
    for s in range(p):
        assert _keys(order.stages[s]) == _run_megatron(mcore, monkeypatch, p, s, m, vp, group), f"stage {s}"


def test_interleaved_refuses_what_megatron_refuses():
    with pytest.raises(ValueError, match=r"num_microbatches % microbatch_group_size = 1 must be 0 or >= num_stages=4"):
        megatron_interleaved(4, 9, 2)
    with pytest.raises(ValueError, match=r"microbatch_group_size must lie in \[num_stages=4, num_microbatches=8\], got 2"):
        megatron_interleaved(4, 8, 2, microbatch_group_size=2)


# ---------------------------------------------------------------- DeepSpeed TrainSchedule
def _deepspeed_stream(p: int, stage: int, m: int):
    """(compute ops, deferred flags) read from DeepSpeed's instruction stream. Buffers are reused
    cyclically, so micro-batch ids are recovered by counting (forwards and backwards both run in
    micro-batch order) and checked against the buffer each instruction names."""
    sched_mod = pytest.importorskip("deepspeed.runtime.pipe.schedule")
    sched = sched_mod.TrainSchedule(micro_batches=m, stages=p, stage_id=stage)
    steps = list(sched)
    nbuf = sched.num_pipe_buffers()
    ops, deferred, sent_at = [], {}, {}
    n_fwd = n_bwd = 0
    for t, cmds in enumerate(steps):
        names = [type(c).__name__ for c in cmds]
        for c in cmds:
            kind = type(c).__name__
            if kind == "ForwardPass":
                assert c.buffer_id == n_fwd % nbuf
                ops.append((FORWARD, n_fwd, 0))
                sent_at[c.buffer_id] = (n_fwd, t)
                n_fwd += 1
            elif kind == "BackwardPass":
                assert c.buffer_id == n_bwd % nbuf
                ops.append((BACKWARD, n_bwd, 0))
                n_bwd += 1
            elif kind == "SendActivation":
                mb, t_fwd = sent_at.pop(c.buffer_id)
                assert t == t_fwd + 1
                # Deferred when a RecvGrad precedes the send within its step.
                deferred[mb] = "RecvGrad" in names[:names.index("SendActivation")]
    return ops, deferred


@pytest.mark.parametrize("p,m", [(1, 4), (2, 1), (2, 4), (3, 5), (4, 6), (5, 2), (8, 16)])
def test_deepspeed_matches_train_schedule(p, m):
    order = deepspeed_train(p, m)
    for s in range(p):
        ops, deferred = _deepspeed_stream(p, s, m)
        assert _keys(order.stages[s]) == ops, f"stage {s}"
        got = {op.microbatch: op.deferred_send for op in order.stages[s] if op.phase == FORWARD}
        expected = {mb: deferred.get(mb, False) for mb in range(m)}
        assert got == expected, f"stage {s}"


def test_deepspeed_runs_megatron_1f1b_order_but_defers_sends():
    ds, mg = deepspeed_train(4, 6), megatron_1f1b(4, 6)
    assert [_keys(s) for s in ds.stages] == [_keys(s) for s in mg.stages]
    # Stage 0's fourth forward waits for the first backward's gradient before it leaves.
    assert [op.microbatch for op in ds.stages[0] if op.deferred_send] == [3, 4, 5]
    assert not any(op.deferred_send for op in ds.stages[3])


# ---------------------------------------------------------------- invariants and topology
@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 7, 1), ("interleaved", 4, 8, 3), ("deepspeed", 3, 5, 1)])
def test_every_op_once_and_producers_exist(name, p, m, v):
    order = schedule_order(name, p, m, v)
    position = {}
    for s, k, op in order.ops():
        position[(s, op.key)] = k
    assert len(position) == 2 * p * m * v
    for s, k, op in order.ops():
        prod = order.producer(s, op)
        if prod is None:
            assert op.phase == FORWARD and s == 0 and op.chunk == 0
            continue
        ps, pop = prod
        assert (ps, pop.key) in position
        if ps == s:  # the last virtual stage's backward follows its own forward
            assert position[(ps, pop.key)] < k


def test_producer_chain_through_chunks():
    order = megatron_interleaved(2, 4, 2)
    assert order.producer(0, Op(FORWARD, 3, 1)) == (1, Op(FORWARD, 3, 0))
    assert order.producer(1, Op(BACKWARD, 2, 0)) == (0, Op(BACKWARD, 2, 1))
    assert order.producer(1, Op(BACKWARD, 2, 1)) == (1, Op(FORWARD, 2, 1))
    assert order.producer(0, Op(FORWARD, 0, 0)) is None


def test_extra_warmup_runs_forwards_ahead_of_megatrons_1f1b():
    # ADAPTRA's adapted schedule, scored by the resilience simulator; no extra is megatron's own.
    assert megatron_1f1b(4, 8, (0, 0, 0, 0)) == megatron_1f1b(4, 8)
    adapted = megatron_1f1b(4, 8, (2, 1, 0, 0))
    first_backward = [next(i for i, op in enumerate(ops) if op.phase == BACKWARD) for ops in adapted.stages]
    assert first_backward == [6, 4, 2, 1]   # warm-up forwards, then one more before the first backward
    # the same ops on every stage, in another order
    assert [sorted(_keys(ops)) for ops in adapted.stages] == [sorted(_keys(ops)) for ops in megatron_1f1b(4, 8).stages]


def test_schedule_order_errors():
    with pytest.raises(ValueError, match="unknown schedule 'gpipe'; expected one of 1f1b, interleaved, deepspeed"):
        schedule_order("gpipe", 2, 2)
    with pytest.raises(ValueError, match="schedule '1f1b' runs one model chunk per stage, got num_chunks=2"):
        schedule_order("1f1b", 2, 2, 2)
    with pytest.raises(ValueError, match="num_microbatches must be >= 1, got 0"):
        megatron_1f1b(2, 0)
    with pytest.raises(ValueError, match=r"extra_warmup: one count per stage \(2\), got \[1\]"):
        megatron_1f1b(2, 4, (1,))

"""Scenarios that need real collectives: run once on 2 gloo ranks (mp.spawn), results to the tests.

Every scenario runs on both ranks and returns a dict; an exception becomes ``{"error": traceback}``
so that each test reports its own failure. Rank 0's results are returned (rank 1 checks its own
parity too and reports a failure through ``"rank1_error"``).
"""
from __future__ import annotations

import os
import time
import traceback

import torch
import torch.distributed as dist

from helix_helpers import B, H, S, build_block, parity


def _blocks(g) -> dict:
    from megatron_ext.helix import HelixBackend
    from megatron_ext.helix.measure import step_peak_bytes, train_step
    from megatron_ext.helix.passes.checks import check_dependencies

    out = {}
    for kind in ("tp", "moe", "tpep"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = build_block(kind, g)
        x = torch.randn(B, S, H, requires_grad=True)
        be = HelixBackend(2, interconnect="cross_node", mode="helix")
        compiled = torch.compile(m, backend=be)
        err = parity(m, compiled, [x], list(m.parameters()))
        s = be.summaries[0]
        for tag in ("fw", "bw"):
            check_dependencies(None, s.graphs[tag].graph)
        gy = torch.randn(B, S, H)
        train_step(compiled, x, gy, m.parameters())
        # median of three steps: gloo frees some buffers from its own threads, a step may see one late
        peak = sorted(step_peak_bytes(compiled, x, gy, m.parameters()) for _ in range(3))[1]
        out[kind] = {**err, "tiled": s.tiled, "graphs": len(be.summaries), "peak": peak,
                     "sim_peak": s.chosen.peak_bytes, "order": s.order}
    return out


def _bucketing(g) -> dict:
    from megatron_ext.helix import HelixBackend
    from megatron_ext.helix.cost import Interconnect

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = build_block("tp", g)
    be = HelixBackend(2, interconnect=Interconnect("latency-bound", latency_s=0.02, bandwidth_Bps=1e12),
                      mode="helix")
    err = parity(m, torch.compile(m, backend=be), [torch.randn(B, S, H, requires_grad=True)], list(m.parameters()))
    return {**err, "taken": be.summaries[0].bucketing.taken}


def _emulation(g) -> dict:
    from megatron_ext.helix.cost import Interconnect
    from megatron_ext.helix.interconnect import emulated_issue, emulated_wait, emulation_stats, reset_emulation

    link = Interconnect("slow", latency_s=2e-3, bandwidth_Bps=100e6)
    x = torch.full((1 << 18,), float(g.rank + 1))  # 1 MiB
    expected = 2e-3 + x.numel() * 4 / 100e6          # all-reduce on 2 ranks moves the payload once
    reset_emulation()
    dist.barrier()
    t0 = time.perf_counter()
    c1 = torch.ops._c10d_functional.all_reduce(x, "sum", g.name)
    d1 = emulated_issue(c1, g.name, expected)
    c2 = torch.ops._c10d_functional.all_reduce(x * 2, "sum", g.name)
    d2 = emulated_issue(c2, g.name, expected)
    issued = time.perf_counter() - t0
    y1 = emulated_wait(c1, d1)
    t1 = time.perf_counter() - t0
    y2 = emulated_wait(c2, d2)
    t2 = time.perf_counter() - t0
    st = emulation_stats()
    from megatron_ext.helix.calibrate import measure_collectives
    from megatron_ext.helix.cost import fit_link

    samples = measure_collectives(g.name, g.size, ["all_reduce", "all_to_all"], reps=3)
    fitted = {k: fit_link(k, k, g.size, v) for k, v in samples.items()}
    return {"fitted": {k: (f.latency_s, f.bandwidth_Bps) for k, f in fitted.items()},
            "samples": {k: [b for b, _ in v] for k, v in samples.items()},
            "expected": expected, "issued": issued, "first": t1, "second": t2, "sum1": float(y1[0]), "sum2": float(y2[0]),
            "collectives": st.collectives, "waits": st.waits, "exposed": st.exposed_s}


def _gpt(g) -> dict:
    from megatron_ext.compat import megatron_cpu

    megatron_cpu.apply()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.helix import HelixBackend
    from megatron_ext.helix.adapter import make_traceable, restore

    ps.initialize_model_parallel(2, 1)
    model_parallel_cuda_manual_seed(123)
    b, s, vocab = 4, 16, 128

    def build(sp: bool):
        cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                                hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=2,
                                sequence_parallel=sp, gradient_accumulation_fusion=False,
                                bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
                                bias_dropout_fusion=False, params_dtype=torch.float32, batch_p2p_sync=False)
        return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                        max_sequence_length=s)

    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (b, s))
    labels = torch.randint(0, vocab, (b, s))
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.tril(torch.ones(1, 1, s, s)) < 0.5

    def loss_of(model):
        def fn(ids_):
            return model(ids_, pos, mask, labels=labels)
        return fn

    out = {}
    # (megatron-core 0.16.1's local spec rejects sequence parallelism: its torch LayerNorm asserts
    # it off; the SP regions are checked by the "sp" scenario instead.)
    for sp in (False,):
        torch._dynamo.reset()
        model = build(sp)
        params = list(model.parameters())
        original = loss_of(model)
        ref_loss, ref_grads = _loss_and_grads(original, ids, params)
        report = make_traceable(model)
        eager_loss, eager_grads = _loss_and_grads(original, ids, params)
        res = {"modules": report.total,
               "eager_loss": (eager_loss - ref_loss).abs().max().item(),
               "eager_grad": max((a - r).abs().max().item() for a, r in zip(eager_grads, ref_grads))}
        if not sp:
            be = HelixBackend(2, interconnect="cross_node", mode="helix", batch_size=b)
            compiled = torch.compile(model, backend=be)

            def compiled_fn(ids_):
                return compiled(ids_, pos, mask, labels=labels)

            c_loss, c_grads = _loss_and_grads(compiled_fn, ids, params)
            res["compiled_loss"] = (c_loss - ref_loss).abs().max().item()
            res["compiled_grad"] = max((a - r).abs().max().item() for a, r in zip(c_grads, ref_grads))
            res["graphs"] = len(be.summaries)
            res["tiled_graphs"] = sum(x.tiled for x in be.summaries)
        res["restored"] = restore(model)
        out["sp" if sp else "tp"] = res
    ps.destroy_model_parallel()
    return out


def _loss_and_grads(fn, ids, params):
    for p in params:
        p.grad = None
    loss = fn(ids)
    (loss * (1 + torch.arange(loss.numel()).view(loss.shape) % 5)).sum().backward()
    return loss.detach().clone(), [p.grad.clone() for p in params]


def _sp(g) -> dict:
    """Sequence-parallel MLP ([s, b, h], sequence split over ranks: all-gather in, reduce-scatter
    out) against the same weights run on the whole sequence without any parallelism."""
    import torch.nn.functional as F

    from megatron_ext.helix import HelixBackend
    from megatron_ext.helix.collectives import (gather_from_sequence_parallel_region,
                                                gather_from_tensor_parallel_region,
                                                reduce_scatter_to_sequence_parallel_region)

    torch.manual_seed(0)
    s, b, h, f = 16, 4, 32, 64
    w1, w2 = torch.randn(f, h) * 0.1, torch.randn(h, f) * 0.1      # full weights, same on both ranks
    x = torch.randn(s, b, h)
    cols = slice(g.rank * f // 2, (g.rank + 1) * f // 2)
    p1 = torch.nn.Parameter(w1[cols].clone())
    p2 = torch.nn.Parameter(w2[:, cols].clone())

    def sp_mlp(x_local):
        full = gather_from_sequence_parallel_region(x_local, g)
        return x_local + reduce_scatter_to_sequence_parallel_region(F.linear(F.gelu(F.linear(full, p1)), p2), g)

    def gathered_hidden(x_local):  # column-parallel output gathered along the last dim
        return gather_from_tensor_parallel_region(F.linear(gather_from_sequence_parallel_region(x_local, g), p1), g)

    rows = slice(g.rank * s // 2, (g.rank + 1) * s // 2)
    w1r, w2r = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    ref = x + F.linear(F.gelu(F.linear(x, w1r)), w2r)
    ref.sum().backward()
    x_local = x[rows].clone().requires_grad_()
    y = sp_mlp(x_local)
    y.sum().backward()
    out = {"eager_out": (y - ref[rows]).abs().max().item(),
           "eager_grad_w1": (p1.grad - w1r.grad[cols]).abs().max().item(),
           "gather_last": (gathered_hidden(x[rows]) - F.linear(x, w1)).abs().max().item()}
    be = HelixBackend(2, interconnect="cross_node", mode="helix", batch_size=b)
    err = parity(sp_mlp, torch.compile(sp_mlp, backend=be), [x[rows].clone().requires_grad_()], [p1, p2])
    out.update({f"compiled_{k}": v for k, v in err.items()})
    out["tiled"] = be.summaries[0].tiled
    out["order"] = be.summaries[0].order
    return out


SCENARIOS = {"blocks": _blocks, "bucketing": _bucketing, "emulation": _emulation, "sp": _sp, "gpt": _gpt}


def worker(rank: int, world: int, port: int, names: list[str], queue) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron_ext.helix.collectives import GroupRef

    g = GroupRef.of()
    results = {}
    for name in names:
        try:
            results[name] = SCENARIOS[name](g)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    if rank == 0:
        queue.put(results)
    else:
        queue.put({name: {"rank1": r} for name, r in results.items()})
    dist.barrier()
    dist.destroy_process_group()

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

from tests.helix.helix_helpers import B, H, S, build_block, parity


def _blocks(g) -> dict:
    from megatron_ext.helix import HelixBackend
    from megatron_ext.helix.measure import all_ranks_agree, step_peak_bytes, train_step
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
        # a step whose allocator accounting does not close (a free made on gloo's thread) is re-run
        peak = step_peak_bytes(compiled, x, gy, m.parameters(), agree=all_ranks_agree())
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
    from megatron_ext.helix.interconnect import emulated_issue, emulated_wait, emulation_stats, reset_emulation

    x = torch.full((1 << 18,), float(g.rank + 1))  # 1 MiB
    # a slow link of 2 ms + 100 MB/s; an all-reduce on 2 ranks moves the payload once
    expected = 2e-3 + x.numel() * 4 / 100e6
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
    """The GPTModel that pretrain_gpt.py trains (``runtime.model.build_model``: local layer spec on
    CPU, weights initialised by name), TP2, compiled the way ``--helix`` compiles it
    (``HelixExtension.setup``), with the tiled schedule forced. Inputs as the training loop passes
    them: ``[b, s]`` ids, positions and labels, no attention mask -- so megatron builds the causal
    mask itself and applies it in place (``masked_fill_``) to a view of the attention scores."""
    import types

    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(g.rank), str(g.size)  # runtime.distributed reads them
    from megatron_ext.config.defaults import FORMER_DEFAULTS
    from megatron_ext.config.run import config_from_values
    from megatron_ext.helix.config import HelixConfig
    from megatron_ext.helix.extension import HelixExtension
    from megatron_ext.helix.passes.checks import check_dependencies
    from megatron_ext.runtime import distributed
    from megatron_ext.runtime.model import build_model

    b, s = 2, 16
    cfg = config_from_values({**FORMER_DEFAULTS, "tensor_model_parallel_size": 2, "num_layers": 2,
                              "hidden_size": 32, "num_attention_heads": 4, "seq_length": s, "micro_batch_size": b,
                              "global_batch_size": b})
    ctx = distributed.setup(cfg.parallel, seed=cfg.training.seed)
    model = build_model(cfg, ctx, vocab_size=200, wrap_ddp=False).chunks[0]
    params = list(model.parameters())
    torch.manual_seed(0)
    ids = torch.randint(0, 200, (b, s))
    labels = torch.randint(0, 200, (b, s))
    pos = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()

    def loss_of(forward):
        return lambda ids_: forward(ids_, pos, None, labels=labels)

    ref_loss, ref_grads = _loss_and_grads(loss_of(model), ids, params)     # megatron's own modules
    ext = HelixExtension(HelixConfig(helix=True, helix_tiles=2, helix_cost_model="analytical",
                                     helix_mode="tiled"))
    trainer = types.SimpleNamespace(model=types.SimpleNamespace(chunks=[model]), ctx=ctx,
                                    cfg=types.SimpleNamespace(training=types.SimpleNamespace(micro_batch_size=b)))
    ext.setup(trainer)
    # The traceable regions run eagerly (the class's forward, not the compiled instance attribute) ...
    eager_loss, eager_grads = _loss_and_grads(loss_of(lambda *a, **k: type(model).forward(model, *a, **k)), ids,
                                              params)
    # ... and compiled: model(...) calls the compiled forward, as megatron's schedule does.
    c_loss, c_grads = _loss_and_grads(loss_of(model), ids, params)
    summaries = ext.backend.summaries
    for su in summaries:
        for tag in ("fw", "bw"):
            check_dependencies(None, su.graphs[tag].graph)
    res = {"eager_loss": _rel(eager_loss, ref_loss), "eager_grad": max(map(_rel, eager_grads, ref_grads)),
           "compiled_loss": _rel(c_loss, ref_loss), "compiled_grad": max(map(_rel, c_grads, ref_grads)),
           "modules": sum(1 for m in model.modules() if "_helix_tp" in m.__dict__),
           "graphs": len(summaries), "tiled_graphs": sum(su.tiled for su in summaries),
           "joins": [j for su in summaries for j in (su.tiling.joins if su.tiling else [])],
           "order": [su.order for su in summaries]}
    ext.teardown(trainer)
    res["restored"] = sum(1 for m in model.modules() if "_helix_tp" in m.__dict__ or "forward" in m.__dict__)
    again, _ = _loss_and_grads(loss_of(model), ids, params)
    res["after_teardown"] = _rel(again, ref_loss)
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    return {"tp": res}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference relative to the reference tensor's largest magnitude."""
    return ((a - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


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

"""Join per-rank events into an IterationRecord (collective over the default process group)."""
from __future__ import annotations

import socket

import numpy as np
import torch
import torch.distributed as dist

from megatron_ext.pipeline.bubbles import busy_seconds
from megatron_ext.pipeline.events import EventRecorder
from megatron_ext.pipeline.timeline import IterationRecord, RankEvents


def clock_offsets(clock, device: torch.device | str = "cpu") -> float:
    """This rank's clock minus rank 0's, estimated after barriers; 0 when every rank shares a host
    (perf_counter is CLOCK_MONOTONIC, one clock per machine). ``device``: the job's (where the
    default group's backend takes tensors: a CUDA device for NCCL)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    if len(set(hosts)) == 1:
        return 0.0
    samples = []
    for _ in range(5):
        dist.barrier()
        now = torch.tensor([clock()], dtype=torch.float64, device=device)
        ref = now.clone()
        dist.broadcast(ref, src=0)
        samples.append(float(now - ref))
    return float(np.median(samples))


def gather_record(recorder: EventRecorder, *, rank: int, stage: int, tp: int, dp: int, offset_s: float,
                  iteration: int, schedule: str, num_stages: int, num_microbatches: int, num_chunks: int,
                  doc_lengths: list, dst: int | None = None) -> IterationRecord | None:
    """Collective. Returns the record on ``dst`` (every rank when ``dst`` is None), else None."""
    events = recorder.events()
    events["t0"] -= offset_s
    events["t1"] -= offset_s
    mine = (rank, stage, tp, dp, events, doc_lengths)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        parts = [mine]
    elif dst is None:
        parts = [None] * world
        dist.all_gather_object(parts, mine)
    else:
        parts = [None] * world if rank == dst else None
        dist.gather_object(mine, parts, dst=dst)
        if rank != dst:
            return None
    ranks = {p[0]: RankEvents(rank=p[0], stage=p[1], tp=p[2], dp=p[3], events=p[4]) for p in parts}
    # Every rank of a data-parallel replica runs the same micro-batches: keep one list per replica.
    replicas: dict[int, list] = {}
    for p in sorted(parts, key=lambda p: p[0]):
        replicas.setdefault(p[3], p[5])
    return IterationRecord(iteration=iteration, schedule=schedule, num_stages=num_stages,
                           num_microbatches=num_microbatches, num_chunks=num_chunks, ranks=ranks,
                           doc_lengths=doc_lengths, replica_doc_lengths=replicas)


def stage_bubble_fractions(recorder: EventRecorder, *, stage: int, num_stages: int, is_representative: bool,
                           offset_s: float, device: torch.device | str = "cpu") -> list[float]:
    """Per-stage bubble fraction of the last iteration from two tiny all-reduces (no event gather)
    of tensors on ``device``, the job's."""
    ev = recorder.events()
    comp = ev[ev["phase"] <= 1]
    first = float(ev["t0"].min()) - offset_s if len(ev) else float("inf")
    last = float(comp["t1"].max()) - offset_s if len(comp) else float("-inf")
    busy = busy_seconds(zip(comp["t0"] - offset_s, comp["t1"] - offset_s), first, last) if len(comp) else 0.0
    bounds = torch.tensor([-first, last], dtype=torch.float64, device=device)
    busy_per_stage = torch.zeros(num_stages, dtype=torch.float64, device=device)
    if is_representative:
        busy_per_stage[stage] = busy
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
        dist.all_reduce(busy_per_stage)
    span = float(bounds[0] + bounds[1])
    return [float(1.0 - b / span) if span > 0 else 0.0 for b in busy_per_stage]

"""Hand-made two-stage pipeline timelines for the link and NIC detectors' tests (test_links.py,
test_nic.py): per-rank events as the pipeline recorder keeps them, each send held by its link."""
from __future__ import annotations

import numpy as np

from megatron_ext.pipeline.events import EVENT_DTYPE, Call, Phase
from megatron_ext.pipeline.timeline import IterationRecord, RankEvents


def two_stage(m: int = 4, *, link_s: float = 0.0, f1: float = 0.01, offset: float = 0.0, tp_dp=(0, 0)) -> dict:
    """Events of ranks (stage 0, stage 1) of one replica running m forwards then backwards, each
    send held ``link_s`` by its link; stage 1's forwards take ``f1``. ``offset`` is added to stage 1's
    clock (what a clock offset left between two hosts would do)."""
    f, b = 0.01, 0.02
    s0, s1 = [], []
    t, deliv_f = 0.0, []
    for i in range(m):
        s0.append((t, t + f, Phase.FORWARD, Call.NONE, i))
        t += f
        s0.append((t, t + link_s, Phase.SEND, Call.SEND_FORWARD, -1))
        t += link_s
        deliv_f.append(t)
    t1, deliv_b = 0.0, []
    for i in range(m):
        start = max(t1, deliv_f[i])
        s1.append((t1, start, Phase.RECV, Call.RECV_FORWARD, -1))
        t1 = start
        s1.append((t1, t1 + f1, Phase.FORWARD, Call.NONE, i))
        t1 += f1
        s1.append((t1, t1 + b, Phase.BACKWARD, Call.NONE, i))
        t1 += b
        s1.append((t1, t1 + link_s, Phase.SEND, Call.SEND_BACKWARD, -1))
        t1 += link_s
        deliv_b.append(t1)
    for i in range(m):
        start = max(t, deliv_b[i])
        s0.append((t, start, Phase.RECV, Call.RECV_BACKWARD, -1))
        t = start
        s0.append((t, t + b, Phase.BACKWARD, Call.NONE, i))
        t += b

    def arr(rows, shift=0.0):
        ev = np.zeros(len(rows), dtype=EVENT_DTYPE)
        for j, (a, z, ph, call, mb) in enumerate(rows):
            ev[j] = (a + shift, z + shift, int(ph), int(call), 0, mb)
        return ev

    tp, dp = tp_dp
    return {"s0": arr(s0), "s1": arr(s1, offset), "tp": tp, "dp": dp}


def record(*replicas: dict, m: int = 4, iteration: int = 1) -> IterationRecord:
    """Replica d's stage 0 is rank d, its stage 1 rank len(replicas) + d (megatron's order at TP 1)."""
    n = len(replicas)
    ranks = {}
    for d, r in enumerate(replicas):
        ranks[d] = RankEvents(rank=d, stage=0, tp=0, dp=d, events=r["s0"])
        ranks[n + d] = RankEvents(rank=n + d, stage=1, tp=0, dp=d, events=r["s1"])
    return IterationRecord(iteration=iteration, schedule="1f1b", num_stages=2, num_microbatches=m, num_chunks=1,
                           ranks=ranks)

"""Shared helpers of the cluster-simulator tests."""
from __future__ import annotations

import os

from megatron_ext.cluster.config import ClusterSimConfig
from megatron_ext.cluster.trace import Job, default_trace

DATA = os.path.join(os.path.dirname(__file__), "data")
# The full Philly trace: the package's embedded default (megatron_ext/cluster/data/NOTICE.md).
FULL_TRACE, FULL_VC = default_trace()


def data(name: str) -> str:
    return os.path.join(DATA, name)


def cfg(**kw) -> ClusterSimConfig:
    return ClusterSimConfig(**kw)


def job(job_id: str, submit: float, duration: float, gpus: int = 1, vc: str = "vc", **kw) -> Job:
    return Job(job_id, 0, submit, duration, gpus, vc, **kw)


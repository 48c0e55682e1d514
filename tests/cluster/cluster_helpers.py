"""Shared helpers of the cluster-simulator tests."""
from __future__ import annotations

import os

import pytest

from megatron_ext.cluster.config import ClusterSimConfig
from megatron_ext.cluster.trace import Job

DATA = os.path.join(os.path.dirname(__file__), "data")
# The full Philly trace lives beside the repository when the shared data set is present.
FULL_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "cluster")
FULL_TRACE = os.path.join(FULL_DIR, "philly.csv")
FULL_VC = os.path.join(FULL_DIR, "philly_vc.csv")


def data(name: str) -> str:
    return os.path.join(DATA, name)


def cfg(**kw) -> ClusterSimConfig:
    return ClusterSimConfig(**kw)


def job(job_id: str, submit: float, duration: float, gpus: int = 1, vc: str = "vc", **kw) -> Job:
    return Job(job_id, 0, submit, duration, gpus, vc, **kw)


needs_full_trace = pytest.mark.skipif(
    not (os.path.isfile(FULL_TRACE) and os.path.isfile(FULL_VC)),
    reason="full Philly trace not present at ../shared/data/cluster (see its README)")

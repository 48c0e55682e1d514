"""Trace-driven GPU-cluster scheduler simulator (pure Python + numpy; docs/cluster.md).

Pure core: no torch, no framework imports. Entry point: ``python -m megatron_ext.cluster``.
"""
from megatron_ext.cluster.config import POLICIES, ClusterSimConfig
from megatron_ext.cluster.engine import SimRun, VCSimulator, simulate
from megatron_ext.cluster.metrics import summarize
from megatron_ext.cluster.trace import Job, Trace, TraceError, VCSpec, read_trace, read_vc_config

__all__ = ["POLICIES", "ClusterSimConfig", "SimRun", "VCSimulator", "simulate", "summarize", "Job", "Trace",
           "TraceError", "VCSpec", "read_trace", "read_vc_config"]

"""Helix: communication-computation overlap by scheduling the torch.compile graph.

Tiling (K tile streams along the batch), segmented round-robin reordering around waits, and
bucketing chosen by dynamic programming over a makespan + memory simulator. Entry point:
``torch.compile(model, backend=megatron_ext.helix.backend(tiles=2))``. See docs/helix.md.
"""
from megatron_ext.helix.compiler import GraphSummary, HelixBackend, backend, backend_from_config
from megatron_ext.helix.config import HelixConfig
from megatron_ext.helix.cost import PRESETS, AnalyticalCostModel, DeviceSpec, Interconnect, InterconnectPreset

__all__ = ["backend", "backend_from_config", "HelixBackend", "HelixConfig", "GraphSummary", "Interconnect",
           "InterconnectPreset", "DeviceSpec", "AnalyticalCostModel", "PRESETS"]

"""megatron-ext: extension layer over megatron-core and DeepSpeed.

Subpackages: config (typed configs), compat (version-guarded shims), runtime (layout, model, data,
optimizer, checkpoint, loop), pipeline (events and bubble timelines), helix (graph scheduling),
resihp (resilience), hydro (fused tuning trials), cluster (scheduler simulator).
"""
__version__ = "0.1.0"

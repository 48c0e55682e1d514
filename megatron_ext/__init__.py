"""megatron-ext: extension layer over megatron-core and DeepSpeed.

Subpackages: config (typed configs), compat (version-guarded shims), runtime (layout, model, data,
optimizer, checkpoint, loop), pipeline (events and bubble timelines), helix (graph scheduling),
resihp (resilience), hydro (fused tuning trials), cluster (scheduler simulator).
"""
__version__ = "0.1.0"

from megatron_ext.compat import megatron_import as _megatron_import

_megatron_import.install()  # on CPU, importing megatron-core does not import TorchDynamo (see there)

"""megatron-ext: extension layer over megatron-core and DeepSpeed.

What it holds, bottom layer first (docs/architecture.md; ``tests/test_imports.py`` keeps the layers):

- ``errors.py``: the user-error types and how every entry point reports one.
- ``engines.py``: one ``EngineSpec`` per training engine (megatron-core, DeepSpeed).
- ``layout.py``: the one layout value (TP x PP x DP sizes, stage layers, per-replica micro-batches,
  members).
- ``models/``: the model's one description (families); ``data/``: corpus, tokenizer, packing;
  ``compat/``: megatron-core's CPU shims, its optional kernels, what ``auto`` device means.
- ``config/``: typed configs, flags + YAML -> ``RunConfig``.
- ``runtime/``: the megatron-core job (process groups, model, optimizer, checkpoint, the loop);
  ``ft/``: fault tolerance (store, membership, liveness, the layout transaction, recovery);
  ``pipeline/``: pipeline events, timelines, bubbles, schedule orders and their simulator.
- extensions, which never import one another: ``helix/`` (graph scheduling of collectives),
  ``resihp/`` (fail-slow detection and re-planning), ``hydro/`` (fused tuning trials; ``squeezer/``
  runs them in the bubbles), ``cluster/`` (scheduler simulator), ``convert/`` (Hugging Face export
  and import); the DeepSpeed engine is the top-level package ``deepspeed_patches``.
- ``bench/``: how the benchmarks measure and report; ``resilience/``: the resilience simulator.
"""
__version__ = "0.1.0"

from megatron_ext.compat import megatron_import as _megatron_import

_megatron_import.install()  # on CPU, importing megatron-core does not import TorchDynamo (see there)

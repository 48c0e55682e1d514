"""How every ``tools/bench_*.py`` measures and reports (docs/benchmarks.md).

``harness``: arms interleaved in a rotated order with an A/A copy of the reference arm (the noise
floor), bootstrap intervals on every ratio, provenance and load average on the JSON line.
``figures`` (with ``import_graph``, ``figure_marks`` and ``figure_reruns``): which source files each
benchmark loads, which kept figures in docs/figures/ are stale, the marks beside the docs' quotes of
them, and ``make figures``. Not imported here: a benchmark imports the harness, and a change to the
figures' bookkeeping is no change to what a benchmark measures.

The top layer of tests/test_imports.py: it may import any package, and no package imports it.
Importing it imports numpy at most.
"""
from megatron_ext.bench.harness import (Interleaved, Report, compare, format_comparison, interleave,
                                        load_average, provenance, ratio_interval, rotated_order)

__all__ = ["Interleaved", "Report", "compare", "format_comparison", "interleave", "load_average", "provenance",
           "ratio_interval", "rotated_order"]

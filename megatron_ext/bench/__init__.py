"""How every ``tools/bench_*.py`` measures and reports (docs/benchmarks.md).

``harness``: arms interleaved in a rotated order with an A/A copy of the reference arm (the noise
floor), bootstrap intervals on every ratio, provenance and load average on the JSON line.
``figures``: which source files each benchmark exercises, and the check that a figure kept in
docs/figures/ was measured on a commit that has them all.

The top layer of tests/test_imports.py: it may import any package, and no package imports it.
Importing it imports numpy at most.
"""
from megatron_ext.bench.figures import BENCH_FILES, check_figures, figure_provenance
from megatron_ext.bench.harness import (Interleaved, Report, compare, format_comparison, interleave,
                                        load_average, provenance, ratio_interval, rotated_order)

__all__ = ["BENCH_FILES", "Interleaved", "Report", "check_figures", "compare", "figure_provenance",
           "format_comparison", "interleave", "load_average", "provenance", "ratio_interval", "rotated_order"]

"""Helix graph passes: tiling (tiling.py + rules), segmented round-robin reordering, bucketing, checks."""

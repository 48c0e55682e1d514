"""ResiHP: fail-slow / fail-stop detection (this package) ahead of live relayout.

Pure parts, no torch.distributed and no framework import: ``flops`` (expected FLOPs per op),
``pipesim`` (pipeline-schedule simulation), ``detector`` / ``stats`` (FLOPs-normalised detection
and the raw-time baseline), ``heartbeat`` (fail-stop), ``trace`` (format v1), ``replay``,
``synthetic`` and ``metrics``. See docs/resihp.md.
"""

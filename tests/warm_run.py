"""``torchrun --standalone --nproc_per_node N SCRIPT ARGS...`` for the tests' scenario scripts, with
the ranks forked from a parent that has already imported torch and megatron-core.

Every rank process of a plain torchrun launch spends some 3.5 CPU-seconds importing before its first
step; on the suite's 2 cores that is a third of the multi-rank pass. Here torch's own elastic agent
(``elastic_launch``, the code behind torchrun, same rendezvous and environment per rank) starts the
ranks with ``start_method="fork"`` from this process after the imports, so each launch pays them
once. CPU only (a forked process cannot use a CUDA context its parent made; nothing here makes one).

    python tests/warm_run.py N SCRIPT [ARGS...]
"""
from __future__ import annotations

import os
import runpy
import sys
import uuid


# What every rank would import again (torch with them): megatron-core's parallel state and
# tensor-parallel layers, and torch._dynamo (torch.optim's first step imports it).
PRELOADED = ("megatron.core.parallel_state", "megatron.core.tensor_parallel", "torch._dynamo")


def _rank(script: str, args: list[str]) -> None:
    """One rank: SCRIPT run as ``__main__``, as ``python SCRIPT ARGS`` would."""
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python tests/warm_run.py N SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    nproc, script, args = int(argv[0]), argv[1], argv[2:]
    import warnings

    warnings.filterwarnings("ignore")
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", start_method="fork",
                          max_restarts=0, monitor_interval=0.1)
    elastic_launch(config, _rank)(script, args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

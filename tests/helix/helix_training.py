"""``pretrain_gpt.py`` with and without ``--helix`` in the same ranks, run by test_training.py under
``torchrun --nproc_per_node 2`` (one launch: megatron's import costs 8-20 s per rank on 2 cores).

``python tests/helix/helix_training.py OUT_DIR [extra pretrain_gpt.py flags]`` writes one metrics
file per run: ``OUT_DIR/{name}.jsonl``. The Helix runs come first, before anything has allocated
megatron's global attention buffer: the extension allocates it before compiling, so each run
compiles one graph (test_training.py checks the log), as a real ``--helix`` run does.
"""
from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import pretrain_gpt  # noqa: E402
from megatron_ext.config.defaults import former_default_flags  # noqa: E402

# A tiny model: what is checked is the math of the compiled graphs, and torch.compile is slow on CPU.
TINY = [*former_default_flags(), "--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "32", "--train-iters", "5", "--eval-iters", "0",
        "--global-batch-size", "4", "--micro-batch-size", "2", "--lr-decay-style", "constant", "--lr", "3e-3"]

RUNS = {
    # The tiled schedule forced (the simulator could decline it on a loaded host, and then nothing
    # tiled would be checked); analytical costs skip the micro-benchmarks.
    "helix_tiled": ["--helix", "--helix-tiles", "2", "--helix-mode", "tiled", "--helix-cost-model", "analytical"],
    # The defaults (calibrated costs, the simulator decides per graph): what a user runs.
    "helix": ["--helix"],
    "eager": [],
}


def _keep_process_group() -> None:
    """Between runs, tear down megatron's parallel state but keep the default process group: gloo
    cannot connect a second default group in the same torchrun rendezvous (stale store keys)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def main() -> None:
    from megatron_ext.runtime import distributed

    out_dir, extra = sys.argv[1], sys.argv[2:]
    teardown = distributed.teardown
    distributed.teardown = _keep_process_group  # pretrain_gpt.main looks it up when it runs
    try:
        for name, flags in RUNS.items():
            rc = pretrain_gpt.main([*TINY, *extra, *flags, "--metrics-file", os.path.join(out_dir, f"{name}.jsonl")])
            if rc != 0:
                raise SystemExit(f"pretrain_gpt.py {' '.join(flags)} exited {rc}")
    finally:
        distributed.teardown = teardown
        teardown()


if __name__ == "__main__":
    main()

"""Multi-rank timeline scenarios for test_timeline.py, run under torchrun --nproc_per_node 4.

Each scenario trains a few iterations with --timeline and pickles the joined IterationRecord of its
last iteration (rank 0 writes the file)."""
from __future__ import annotations

import os
import pickle
import sys
import warnings

warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron_ext.config.run import config_from_values  # noqa: E402
from megatron_ext.runtime import distributed  # noqa: E402
from megatron_ext.runtime.extension import build_extensions  # noqa: E402
from megatron_ext.runtime.loop import Trainer  # noqa: E402
from tests.scenario_helpers import TIMELINE  # noqa: E402

SCENARIOS = {
    "pp4_m4": {"pipeline_model_parallel_size": 4, "global_batch_size": 4},
    "pp4_m8": {"pipeline_model_parallel_size": 4, "global_batch_size": 8},
    "pp2dp2_m4": {"pipeline_model_parallel_size": 2, "global_batch_size": 8},
    "pp2_vpp2_m4": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2,
                    "global_batch_size": 8},
}


def main() -> None:
    out_dir = sys.argv[1]
    cfg = config_from_values(dict(TIMELINE))
    ctx = distributed.setup(cfg.parallel, seed=cfg.training.seed)
    for name, values in SCENARIOS.items():
        cfg = config_from_values({**TIMELINE, **values, "timeline_out": os.path.join(out_dir, name)})
        cfg.validate(ctx.world_size)
        ctx = distributed.relayout(ctx, tp=1, pp=cfg.parallel.pipeline_model_parallel_size,
                                   vpp=cfg.parallel.virtual_pipeline_model_parallel_size, seed=cfg.training.seed)
        exts = build_extensions(cfg)
        trainer = Trainer(cfg, ctx, exts).setup()
        trainer.run()
        # the teardown uninstalled the hooks, but the recorder still holds the last iteration
        record = exts[0].record(trainer, trainer.iteration, dst=0)
        if record is not None:
            with open(os.path.join(out_dir, f"{name}.pkl"), "wb") as fh:
                pickle.dump(record, fh)
    distributed.teardown()


if __name__ == "__main__":
    main()

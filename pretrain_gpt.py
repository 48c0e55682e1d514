#!/usr/bin/env python
"""GPT pretraining on megatron-core (or DeepSpeed's pipeline engine) with the megatron-ext extensions.

    torchrun --nproc_per_node 4 pretrain_gpt.py --config configs/demo_tp2pp2.yaml [--flag value ...]

Every flag is also a YAML key; flags override YAML. ``--help`` lists them all. Bad configuration is
reported before any model is built.
"""
from __future__ import annotations

import logging
import os
import sys

# Keep megatron's and DeepSpeed's import-time chatter out of the progress output.
os.environ.setdefault("PYTHONWARNINGS", "ignore")


def main(argv: list[str] | None = None) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_ext.config.base import ConfigError
    from megatron_ext.config.run import parse_run_config
    from megatron_ext.runtime.distributed import world_from_env

    rank, world, _ = world_from_env()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s rank{rank}] %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("megatron", "megatron.core", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        cfg = parse_run_config(argv)
        cfg.validate(world)
        if cfg.parallel.engine == "deepspeed":
            from deepspeed_patches.trainer import check_config

            check_config(cfg)
    except ConfigError as exc:
        if rank == 0:
            print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr)
        return 2

    from megatron_ext.runtime import distributed
    from megatron_ext.runtime.extension import build_extensions

    if cfg.parallel.engine == "deepspeed":
        from deepspeed_patches import trainer as ds

        ctx = ds.setup_distributed(cfg.parallel, seed=cfg.training.seed)
        trainer_cls, teardown = ds.DeepSpeedTrainer, ds.teardown
    else:
        from megatron_ext.runtime.loop import Trainer

        ctx = distributed.setup(cfg.parallel, seed=cfg.training.seed)
        trainer_cls, teardown = Trainer, distributed.teardown
    try:
        trainer = trainer_cls(cfg, ctx, build_extensions(cfg)).setup()
        trainer.run()
    finally:
        teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""GPT pretraining on megatron-core (or DeepSpeed's pipeline engine) with the megatron-ext extensions.

    python pretrain_gpt.py --nproc-per-node 4 --config configs/demo.yaml [--flag value ...]
    torchrun --nproc_per_node 4 pretrain_gpt.py --config configs/demo.yaml [--flag value ...]

Every flag is also a YAML key; flags override YAML. ``--help`` lists them all. Bad configuration is
reported before any model is built: one line ``pretrain_gpt.py: error: ...``, exit code 2.
``--nproc-per-node N`` checks the configuration for N ranks first and then starts them (through
torch's elastic launcher, as torchrun would), so a bad layout is reported before any rank starts.
With ``--resihp-on-stop continue`` it starts them itself instead (``runtime/launch.py``): this
process hosts the rendezvous store and outlives every rank, and a rank that dies does not stop the
others, so the survivors can go on without it.
"""
from __future__ import annotations

import logging
import os
import sys

# Keep megatron's and DeepSpeed's import-time chatter out of the progress output.
os.environ.setdefault("PYTHONWARNINGS", "ignore")

PROG = "pretrain_gpt.py"


def _split_launcher_args(argv: list[str]) -> tuple[int | None, list[str]]:
    """(--nproc-per-node value or None, the remaining arguments)."""
    from megatron_ext.config.base import ConfigError

    rest, nproc, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--nproc-per-node", "--nproc_per_node") or arg.startswith(("--nproc-per-node=", "--nproc_per_node=")):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--nproc-per-node expects a positive integer, got {value!r}")
            nproc = int(value)
            continue
        rest.append(arg)
        i += 1
    return nproc, rest


def _continues(cfg) -> bool:
    resihp = cfg.ext("resihp")
    return resihp is not None and resihp.resihp_on_stop == "continue"


def _check(cfg, world: int, *, launcher: bool = False) -> None:
    from megatron_ext.resihp import failstop
    from megatron_ext.runtime.rundir import check_outputs

    cfg.validate(world)
    failstop.check(cfg, world, launcher=launcher)
    demo = os.path.basename(cfg.source) == "demo.yaml"
    check_outputs(save=cfg.checkpoint.save, load=cfg.checkpoint.load, metrics_file=cfg.logging.metrics_file,
                  tensorboard_dir=cfg.logging.tensorboard_dir, clean_hint=" (make clean-demo)" if demo else "")
    if cfg.parallel.engine == "deepspeed":
        from deepspeed_patches.trainer import check_config

        check_config(cfg)


def _launch(nproc: int, argv: list[str]) -> int:
    """Start ``nproc`` ranks of this script on this machine with torch's elastic agent.

    The agent's own failure report (a traceback and a table per rank) is replaced by one line; a
    rank that failed on a user error has already said why, so nothing more is printed for it."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from megatron_ext.errors import EXIT_USER_ERROR

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        torchrun.run(torchrun.parse_args(["--standalone", "--nproc-per-node", str(nproc),
                                          os.path.abspath(__file__), *argv]))
    except ChildFailedError as exc:
        codes = {rank: f.exitcode for rank, f in exc.failures.items()}
        if all(c in (EXIT_USER_ERROR, -15) for c in codes.values()):
            return EXIT_USER_ERROR
        rank, first = exc.get_first_failure()
        print(f"{PROG}: error: rank {rank} failed with exit code {first.exitcode} "
              f"({len(codes)} of {nproc} ranks failed); its output is above", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _launch_own(nproc: int, argv: list[str]) -> int:
    """``--resihp-on-stop continue``: start the ranks without torch's agent (which stops every rank
    when one dies), with the store in this process."""
    from megatron_ext.runtime.launch import run_job

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        code, codes = run_job([os.path.abspath(__file__), *argv], nproc)
    except KeyboardInterrupt:
        return 130
    lost = [r for r, c in enumerate(codes) if c < 0]
    if lost and code == 0:
        print(f"{PROG}: rank(s) {', '.join(map(str, lost))} were lost; the others trained on without them",
              file=sys.stderr, flush=True)
    elif code != 0:
        print(f"{PROG}: error: exit codes per rank {codes}; their output is above", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_ext.config.run import parse_run_config
    from megatron_ext.errors import UserError, exit_quietly_after_reporter, report
    from megatron_ext.runtime.distributed import world_from_env

    argv = list(sys.argv[1:] if argv is None else argv)
    rank, world, _ = world_from_env()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s rank{rank}] %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("megatron", "megatron.core", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    def fail(exc: BaseException) -> int:
        # Every rank meets the same user error (the checks are rank-independent, and checkpoint
        # loading agrees on failure across ranks): rank 0 says it, every rank exits with 2.
        if rank == 0:
            return report(PROG, exc)
        exit_quietly_after_reporter()
        return 2

    try:
        nproc, argv = _split_launcher_args(argv)
        cfg = parse_run_config(argv)
        if nproc is not None and "LOCAL_RANK" not in os.environ:
            _check(cfg, nproc, launcher=_continues(cfg))
            return _launch_own(nproc, argv) if _continues(cfg) else _launch(nproc, argv)
        _check(cfg, world)
    except UserError as exc:
        return fail(exc)

    from megatron_ext.runtime import distributed
    from megatron_ext.runtime.extension import build_extensions
    from megatron_ext.runtime.failover import RESTART_EXIT_CODE, RestartNeeded

    # With continue, nothing may wait for a lost rank longer than the continue timeout.
    timeout_s = cfg.ext("resihp").resihp_continue_timeout_s if _continues(cfg) else 600.0
    if cfg.parallel.engine == "deepspeed":
        from deepspeed_patches import trainer as ds

        ctx = ds.setup_distributed(cfg.parallel, seed=cfg.training.seed, timeout_s=timeout_s)
        trainer_cls, teardown = ds.DeepSpeedTrainer, ds.teardown
    else:
        from megatron_ext.runtime.loop import Trainer

        ctx = distributed.setup(cfg.parallel, seed=cfg.training.seed, timeout_s=timeout_s)
        trainer_cls, teardown = Trainer, distributed.teardown
    try:
        trainer = trainer_cls(cfg, ctx, build_extensions(cfg)).setup()
        trainer.run()
    except UserError as exc:
        return fail(exc)
    except RestartNeeded as exc:
        # The process groups may be broken: no teardown (it could wait on a lost rank), no traceback.
        where = cfg.checkpoint.save or cfg.checkpoint.load
        if exc.report:
            print(f"resihp: cannot continue: {exc}; restart from the last checkpoint"
                  + (f" (--load {where})" if where else " (none was saved: --save DIR)"), file=sys.stderr, flush=True)
        os._exit(RESTART_EXIT_CODE)
    finally:
        teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

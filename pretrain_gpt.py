#!/usr/bin/env python
"""GPT pretraining on megatron-core (or DeepSpeed's pipeline engine) with the megatron-ext extensions.

    python pretrain_gpt.py --nproc-per-node 4 --config configs/demo.yaml [--flag value ...]
    torchrun --nproc_per_node 4 pretrain_gpt.py --config configs/demo.yaml [--flag value ...]

Every flag is also a YAML key; flags override YAML. ``--help`` lists them all. Bad configuration is
reported before any model is built: one line ``pretrain_gpt.py: error: ...``, exit code 2.
``--nproc-per-node N`` checks the configuration for N ranks first and then starts them (through
torch's elastic launcher, as torchrun would), so a bad layout is reported before any rank starts.
Where the fault-tolerance core runs (``--ft``, ``--resihp``, ``--ft-on-stop continue``: ``ft.config.launcher_for``)
it starts them itself instead
(``ft/launch.py``): this process hosts the rendezvous store, outlives every rank and reports a
dead rank's exit into it, and a rank that dies does not stop the others: under ``abort`` the
survivors end the job with exit 75 and one line naming the lost rank (resume with ``--load``),
under ``continue`` they go on without it (and with ``--ft-respawn N`` it starts a lost rank
again, which rejoins). What happens when a rank dies: docs/fault_tolerance.md.
"""
from __future__ import annotations

import logging
import os
import sys

# Keep megatron's and DeepSpeed's import-time chatter out of the progress output.
os.environ.setdefault("PYTHONWARNINGS", "ignore")

PROG = "pretrain_gpt.py"
STOP_AFTER_FAILURE_S = 30.0
"""Under --ft-on-stop abort, how long the launcher leaves ranks running after one failed (torch's
agent waits as long between its SIGTERM and SIGKILL)."""


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


def _check(cfg, world: int, *, launcher: bool = False) -> None:
    from megatron_ext.ft import preflight
    from megatron_ext.runtime.rundir import check_outputs

    cfg.validate_launch(world)
    preflight.check(cfg, world, launcher=launcher)
    if int(os.environ.get("MEGATRON_EXT_INCARNATION", "0")) > 0:
        _engine_check(cfg, world)
        return  # a replacement process joins the running job: the outputs are that job's own
    demo = os.path.basename(cfg.source) == "demo.yaml"
    check_outputs(save=cfg.checkpoint.save, load=cfg.checkpoint.load, metrics_file=cfg.logging.metrics_file,
                  tensorboard_dir=cfg.logging.tensorboard_dir, clean_hint=" (make clean-demo)" if demo else "",
                  ckpt_format=cfg.checkpoint.ckpt_format)
    _engine_check(cfg, world)


def _saved_config(load_dir: str):
    """--use-checkpoint-args's reader: the flags the checkpoint in ``load_dir`` was saved with."""
    from megatron_ext.runtime.checkpoint import saved_config

    return saved_config(load_dir)


def _engine_check(cfg, world: int) -> None:
    from megatron_ext.engines import engine

    spec = engine(cfg.parallel.engine)
    if spec.check is not None:
        spec.load("check")(cfg, world)


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


def _launch_own(nproc: int, argv: list[str], respawn: int = 0, abort: bool = False, grace_s: float = 10.0) -> int:
    """The fault-tolerance core's launcher (``ft.config.launcher_for``): start the ranks without torch's agent (which stops every rank when one dies),
    with the store in this process. ``abort``: the survivors of a lost rank end the job themselves
    (exit 75); ranks still running 30 s after one failed (it died before the fault-tolerance core
    watched: the others wait in a collective) are stopped, as torch's agent would. ``grace_s``: a rank
    that has not followed the job's decision this long after (``--ft-grace-s``) is stopped."""
    from megatron_ext.ft.launch import run_job

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        code, results = run_job([os.path.abspath(__file__), *argv], nproc, respawn=respawn,
                                stop_after_failure_s=STOP_AFTER_FAILURE_S if abort else None, grace_s=grace_s)
    except KeyboardInterrupt:
        return 130
    lost = [r.rank for r in results if r.lost or len(r.incarnations) > 1]
    codes = [r.returncode for r in results]
    if code == 0 and lost:
        rejoined = [r.rank for r in results if len(r.incarnations) > 1 and r.returncode == 0 and not r.spare]
        spares = [r.rank for r in results if r.spare]
        names = lambda ranks: ", ".join(map(str, ranks))  # noqa: E731
        print(f"{PROG}: rank(s) {names(lost)} were lost; the others trained on"
              + (f"; rank(s) {names(rejoined)} rejoined" if rejoined else "")
              + (f"; rank(s) {names(spares)} ended as spares (no place in the layout)" if spares else ""),
              file=sys.stderr, flush=True)
    elif code != 0 and results and results[0].job_end is None:
        stopped = [r.rank for r in results if r.stopped]
        print(f"{PROG}: error: exit codes per rank {codes}"
              + (f" (rank(s) {', '.join(map(str, stopped))} stopped {STOP_AFTER_FAILURE_S:g} s after the first "
                 "failure)" if stopped else "") + "; their output is above", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_ext.config.run import parse_run_config
    from megatron_ext.errors import UserError, exit_quietly_after_reporter, report
    from megatron_ext.ft.config import launcher_for
    from megatron_ext.runtime.distributed import world_from_env

    from megatron_ext.runtime import ettr

    ettr.RUN_START_S = ettr.process_start_s()  # the run's time account starts with this process
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
        cfg = parse_run_config(argv, saved_config=_saved_config)
        if nproc is not None and "LOCAL_RANK" not in os.environ:
            launcher = launcher_for(cfg)
            _check(cfg, nproc, launcher=launcher.own)
            if launcher.own:
                return _launch_own(nproc, argv, respawn=launcher.respawn, abort=launcher.abort,
                                   grace_s=launcher.grace_s)
            return _launch(nproc, argv)
        _check(cfg, world)
        if rank == 0:
            for note in cfg.notes:
                print(f"{PROG}: note: {note}", file=sys.stderr, flush=True)
    except UserError as exc:
        return fail(exc)

    from megatron_ext.ft import errors as ft_errors
    from megatron_ext.ft.core import print_traceback
    from megatron_ext.runtime.extension import build_extensions

    try:
        trainer = _build_trainer(cfg, build_extensions(cfg))
        trainer.run()
    except UserError as exc:
        return fail(exc)
    except ft_errors.RankEnded as exc:
        # This rank's own exception ended it; the others go on without it (they know from the
        # store). One line, the one traceback worth reading, and no teardown: a collective with the
        # others could wait on them.
        print_traceback(exc.original, f"{PROG}: error: {exc}")
        os._exit(ft_errors.FAILED_EXIT_CODE)
    except ft_errors.JobFailed as exc:
        if exc.report:
            if exc.original is not None:
                print_traceback(exc.original, f"{PROG}: error: {exc}")
            else:
                print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        os._exit(exc.code)
    except ft_errors.RestartNeeded as exc:
        # The process groups may be broken: no teardown (it could wait on a lost rank), no traceback.
        where = cfg.checkpoint.save or cfg.checkpoint.load
        if exc.report:
            print(f"resihp: cannot continue: {exc}; restart from the last checkpoint"
                  + (f" (--load {where})" if where else " (none was saved: --save DIR)"), file=sys.stderr, flush=True)
        os._exit(ft_errors.RESTART_EXIT_CODE)
    finally:
        _teardown(cfg)
    return 0


def _build_trainer(cfg, extensions):
    """The engine's trainer, set up (or, in a process the launcher started again, waiting to join),
    with the fault-tolerance core where the run has one."""
    from megatron_ext.engines import engine
    from megatron_ext.ft import config as ft_config
    from megatron_ext.ft.core import FaultTolerance, FTConfig
    from megatron_ext.runtime import distributed

    timeout_s = ft_config.process_group_timeout_s(cfg)
    incarnation = int(os.environ.get("MEGATRON_EXT_INCARNATION", "0"))
    if ft_config.continues(cfg):
        # NCCL: an error in a collective must reach the survivor as an exception it can recover
        # from, not end its process (torch's default tears the process down).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    spec = engine(cfg.parallel.engine)
    setup, trainer_cls = spec.load("setup_distributed"), spec.load("trainer")
    ctx = setup(cfg.parallel, seed=cfg.training.seed, timeout_s=timeout_s, join=incarnation > 0)
    ft = None
    store_addr = distributed.rendezvous_address(ctx)
    launch_world = distributed.world_from_env()[1]
    if ft_config.enabled(cfg) and launch_world > 1 and store_addr is not None:
        ft = FaultTolerance(FTConfig.from_run(cfg), store_addr=store_addr, member=ctx.member, incarnation=incarnation)
        ft.backend = ctx.backend
    trainer = trainer_cls(cfg, ctx, extensions, ft=ft)
    return trainer.setup_spare() if incarnation > 0 else trainer.setup()


def _teardown(cfg) -> None:
    from megatron_ext.engines import engine

    engine(cfg.parallel.engine).load("teardown")()


if __name__ == "__main__":
    sys.exit(main())

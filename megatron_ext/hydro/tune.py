"""``python -m megatron_ext.hydro.tune --config tune.yaml [--flag value ...]``: run a Hydro study.

Flags override the YAML (one flag per ``HydroTuneConfig`` field). Progress lines go to stdout,
then a results table; ``<output-dir>/<study-name>.results.json`` holds the same data. Run the
same command again after a kill to resume the study; on SIGINT/SIGTERM the tuner prints one line of
where the study stands. Exit status: 0 with a best trial, 1 when the study has no usable result
(every trial pruned or diverged, or the target diverged) or a run-time error, 2 for a bad config,
128 + the signal number when interrupted.
"""
from __future__ import annotations

import logging
import math
import signal
import sys
import threading
from typing import Any

from megatron_ext.config.base import ArgumentParser, ConfigError, add_flags
from megatron_ext.errors import one_line, report

from .config import HydroTuneConfig, load_config
from .data import DataError
from .fx_common import PassError
from .tuner import HydroTuner, TuneResult, results_table

PROG = "python -m megatron_ext.hydro.tune"


class Interrupted(BaseException):
    """SIGINT/SIGTERM, raised where the tuner is. A BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` on the way swallows it. The trials in training stay RUNNING in the storage,
    which is what the next run resumes."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


def no_result_reason(res: TuneResult, study_name: str) -> str | None:
    """Why the study has no usable result, or None when it has one."""
    given = f"{res.n_given_back} given back unfinished, " if res.n_given_back else ""
    counts = f"{res.n_complete} complete, {res.n_pruned} pruned, {given}{res.n_failed} failed"
    if res.best_trial is None:
        return (f"study '{study_name}' has no complete trial ({counts}): there is no best config and no target "
                "was trained. Every finished trial was pruned or diverged; run more trials (--n-trials, the study "
                "continues), narrow the search space, or use a milder pruner")
    if res.target_loss is not None and not math.isfinite(res.target_loss):
        return (f"the full-width target diverged with trial #{res.best_trial}'s config ({counts}): the config does "
                "not transfer; narrow the learning-rate range or check the parametrization (mup)")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML file with the study (flat keys; see docs/hydro.md)")
    add_flags(parser, HydroTuneConfig, "study")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args = parser.parse_args(argv)
        overrides = {k: v for k, v in vars(args).items() if k != "config" and v is not None}
        cfg, space, defaults, dropout = load_config(args.config, overrides)
    except ConfigError as exc:
        return report(PROG, exc)
    if not space:
        print("warning: empty search_space: every trial uses the defaults", file=sys.stderr)
    print(f"hydro: study '{cfg.study_name}' at {cfg.resolved_storage()}: {cfg.n_trials} trials, "
          f"search {', '.join(space) or '(nothing)'}", flush=True)
    tuner = HydroTuner(cfg, space, defaults, dropout, log=lambda s: print(s, flush=True))
    # signal.signal only works in the main thread (the CLI's case; not an embedding caller's thread).
    handled = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
    previous = {s: signal.signal(s, _interrupt) for s in handled}
    try:
        res = tuner.run()
    except Interrupted as exc:
        for s in handled:           # a second Ctrl-C while the line is written just ends the process
            signal.signal(s, signal.SIG_DFL)
        try:
            where = tuner.status_line()
        except Exception as err:  # noqa: BLE001 - the storage may be what was interrupted
            where = f"study '{cfg.study_name}' at {cfg.resolved_storage()} (state unreadable: {err})"
        print(f"interrupted ({exc}): {where}", file=sys.stderr, flush=True)
        return 128 + exc.signum
    except DataError as exc:  # the user's data: a user error like a bad config
        return report(PROG, exc)
    except (PassError, MemoryError, RuntimeError) as exc:
        print(f"{PROG}: error: {one_line(exc)}", file=sys.stderr)
        return 1
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    print(results_table(res, space), flush=True)
    reason = no_result_reason(res, cfg.study_name)
    if reason:
        print(f"{PROG}: error: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

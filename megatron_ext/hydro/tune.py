"""``python -m megatron_ext.hydro.tune --config tune.yaml [--flag value ...]``: run a Hydro study.

Flags override the YAML (one flag per ``HydroTuneConfig`` field). Progress lines go to stdout,
then a results table; ``<output-dir>/<study-name>.results.json`` holds the same data. Run the
same command again after a kill to resume the study.
"""
from __future__ import annotations

import argparse
import logging
import sys

from megatron_ext.config.base import ConfigError, add_flags

from .config import HydroTuneConfig, load_config
from .data import DataError
from .fx_common import PassError
from .tuner import HydroTuner, results_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_ext.hydro.tune", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML file with the study (flat keys; see docs/hydro.md)")
    add_flags(parser, HydroTuneConfig, "study")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k != "config" and v is not None}
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg, space, defaults, dropout = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not space:
        print("warning: empty search_space: every trial uses the defaults", file=sys.stderr)
    print(f"hydro: study '{cfg.study_name}' at {cfg.resolved_storage()}: {cfg.n_trials} trials, "
          f"search {', '.join(space) or '(nothing)'}", flush=True)
    tuner = HydroTuner(cfg, space, defaults, dropout, log=lambda s: print(s, flush=True))
    try:
        res = tuner.run()
    except (DataError, PassError, MemoryError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(results_table(res, space), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

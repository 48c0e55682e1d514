"""Command line: ``python -m megatron_ext.cluster {simulate,compare,bubbles} ...``.

* ``simulate`` — one policy over a trace; a table, and with ``--json`` a last line holding one JSON
  object (``avg_jct_s``, ``p99_jct_s``, ``avg_queue_s``, ``makespan_s``, ``utilization``,
  ``per_vc``, ...). ``--out-dir`` writes summary.json, per_vc.csv and jobs.csv; ``--plot`` a JCT CDF.
* ``compare`` — several policies x load scales side by side; one CDF panel per load scale.
* ``bubbles`` — the built-in tuning scenario: makespan with and without pipeline-bubble resources.

Every field of :class:`ClusterSimConfig` is a flag (and a key of ``--config sim.yaml``). Without
``--trace`` and ``--vc-config``, ``simulate`` and ``compare`` run on the embedded Philly trace
(``megatron_ext/cluster/data``, see its NOTICE.md), so the commands work in a fresh clone.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Any, Sequence

from megatron_ext.cluster.tuning import TuningScenario, run_tuning_scenario
from megatron_ext.cluster.config import ClusterSimConfig
from megatron_ext.cluster.engine import SimRun, simulate
from megatron_ext.cluster.metrics import format_table, jcts, summarize, write_outputs
from megatron_ext.cluster.trace import Trace, TraceError, default_trace, read_trace, read_vc_config
from megatron_ext.errors import report
from megatron_ext.config.base import (ArgumentParser, ConfigError, add_flags, build, check_unknown, field_names,
                                      load_yaml)

logger = logging.getLogger(__name__)

_ROW_COLUMNS = [("policy", "policy", ""), ("load_scale", "load", "g"), ("jobs", "jobs", "d"),
                ("avg_jct_s", "avg JCT s", ".0f"), ("median_jct_s", "median s", ".0f"),
                ("p99_jct_s", "p99 JCT s", ".0f"), ("avg_queue_s", "avg queue s", ".0f"),
                ("makespan_s", "makespan s", ".0f"), ("utilization", "util", ".3f"),
                ("preemptions", "preempt", "d"), ("wall_s", "wall s", ".2f")]
_VC_COLUMNS = [("vc", "vc", ""), ("gpus", "GPUs", "d"), ("jobs", "jobs", "d"),
               ("avg_jct_s", "avg JCT s", ".0f"), ("p99_jct_s", "p99 JCT s", ".0f"),
               ("avg_queue_s", "avg queue s", ".0f"), ("makespan_s", "makespan s", ".0f"),
               ("utilization", "util", ".3f")]


def _config(args: argparse.Namespace, cls: type, where: str, overrides: dict[str, Any] | None = None) -> Any:
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values = load_yaml(args.config)
        check_unknown(values, field_names(cls), args.config)
        where = args.config
    for name in field_names(cls):
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    values.update(overrides or {})
    return build(cls, values, where)


def with_default_trace(cfg: ClusterSimConfig) -> ClusterSimConfig:
    """``cfg`` with the embedded Philly trace filled in when it names neither trace nor VC file."""
    if cfg.trace and cfg.vc_config:
        return cfg
    if cfg.trace or cfg.vc_config:
        # A user's trace with the Philly VC sizes (or the reverse) would silently drop or misplace jobs.
        given, missing = ("--trace", "--vc-config") if cfg.trace else ("--vc-config", "--trace")
        raise ConfigError(f"{given} needs {missing} too (give both, or neither for the embedded Philly trace)")
    trace, vcs = default_trace()
    print("trace: the embedded Philly trace (Microsoft, 2017; CC BY 4.0; sources and licences in "
          "megatron_ext/cluster/data/NOTICE.md). Pass --trace and --vc-config to use your own.", flush=True)
    return dataclasses.replace(cfg, trace=trace, vc_config=vcs)


def load(cfg: ClusterSimConfig, load_scale: float | None = None) -> Trace:
    if not cfg.trace or not cfg.vc_config:
        raise ConfigError("--trace and --vc-config are required")
    vcs = read_vc_config(cfg.vc_config, cfg.gpus_per_node, cfg.speed_table())
    return read_trace(cfg.trace, vcs, fmt=cfg.trace_format,
                      load_scale=cfg.load_scale if load_scale is None else load_scale,
                      skip_bad_rows=cfg.skip_bad_rows)


def run_one(cfg: ClusterSimConfig) -> tuple[SimRun, dict[str, Any]]:
    trace = load(cfg)
    run = simulate(trace, cfg)
    return run, summarize(run)


def _cmd_simulate(args: argparse.Namespace) -> int:
    cfg = with_default_trace(_config(args, ClusterSimConfig, "flags"))
    run, summary = run_one(cfg)
    print(format_table([summary | {"policy": cfg.policy}], _ROW_COLUMNS))
    print()
    print(format_table([{"vc": k, **v} for k, v in summary["per_vc"].items()], _VC_COLUMNS))
    if summary["dropped_jobs"]:
        print(f"\ndropped {sum(summary['dropped_jobs'].values())} jobs of VCs absent from "
              f"{cfg.vc_config}: " + ", ".join(f"{k}={v}" for k, v in summary["dropped_jobs"].items()))
    if args.out_dir:
        for path in write_outputs(run, summary, args.out_dir):
            print(f"wrote {path}")
    if args.plot:
        from megatron_ext.cluster.plot import plot_jct_cdf

        plot_jct_cdf({cfg.policy: jcts(run)}, args.plot, f"load scale {cfg.load_scale:g}")
        print(f"wrote {args.plot}")
    if args.json:
        print(json.dumps(summary))
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    base = with_default_trace(_config(args, ClusterSimConfig, "flags"))
    rows, panels = [], {}
    for scale in args.load_scales:
        trace = load(base, scale)
        for policy in args.policies:
            cfg = dataclasses.replace(base, policy=policy, load_scale=scale)
            run = simulate(trace, cfg)
            summary = summarize(run)
            rows.append(summary)
            panels.setdefault(scale, {})[policy] = jcts(run)
            logger.info("%s at load %g: avg JCT %.0f s (%.1f s wall)", policy, scale,
                        summary["avg_jct_s"], summary["wall_s"])
    print(format_table(rows, _ROW_COLUMNS))
    if args.plot:
        from megatron_ext.cluster.plot import plot_jct_cdf_panels

        label = "Helios-compatible" if base.helios_compat else "engine"
        plot_jct_cdf_panels(panels, args.plot, f"JCT CDF, {label} semantics")
        print(f"wrote {args.plot}")
    if args.json:
        keep = ("policy", "load_scale", "helios_compat", "jobs", "avg_jct_s", "median_jct_s", "p99_jct_s",
                "avg_queue_s", "makespan_s", "utilization", "preemptions", "wall_s")
        print(json.dumps({"runs": [{k: r[k] for k in keep} for r in rows]}))
    return 0


def _cmd_bubbles(args: argparse.Namespace) -> int:
    cfg = _config(args, ClusterSimConfig, "flags")
    scn = _config(args, TuningScenario, "flags")
    out = run_tuning_scenario(scn, cfg)
    print(format_table([out], [("makespan_exclusive_s", "exclusive only s", ".0f"),
                               ("makespan_bubbles_s", "with bubbles s", ".0f"),
                               ("makespan_ratio", "ratio", ".2f"),
                               ("usable_bubble_slots", "usable slots", ".0f"),
                               ("guest_speed", "guest speed", ".3f")]))
    if args.json:
        print(json.dumps(out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m megatron_ext.cluster",
                                     description="Trace-driven GPU-cluster scheduler simulator.")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help="YAML file with ClusterSimConfig keys (flags override it)")
        p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
        p.add_argument("-v", "--verbose", action="store_true", help="log progress")
        add_flags(p, ClusterSimConfig, "simulation")

    p = sub.add_parser("simulate", help="run one policy over a trace")
    common(p)
    p.add_argument("--out-dir", help="write summary.json, per_vc.csv and jobs.csv here")
    p.add_argument("--plot", help="write a JCT CDF plot (PNG) here")
    p.set_defaults(func=_cmd_simulate)

    p = sub.add_parser("compare", help="several policies x load scales side by side")
    common(p)
    p.add_argument("--policies", nargs="+", default=["fifo", "sjf", "srtf", "tiresias", "qssf", "ftf"])
    p.add_argument("--load-scales", nargs="+", type=float, default=[1.0])
    p.add_argument("--plot", help="write JCT CDF panels (PNG), one per load scale")
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("bubbles", help="tuning makespan with and without pipeline-bubble resources")
    common(p)
    add_flags(p, TuningScenario, "scenario")
    p.set_defaults(func=_cmd_bubbles)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except ConfigError as exc:
        return report(parser.prog, exc)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except (ConfigError, TraceError) as exc:
        return report(parser.prog, exc)

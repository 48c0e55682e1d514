"""How far ResiHP's planner's healthy iteration time is from bench_resilience's scorer, per layout,
and so how wrong the planner can be when it compares two healthy layouts (the error that
``PlannerConfig.min_gain_healthy`` is set against and that the measured shape factors of
``PlanPolicy.record_time`` correct for the shapes a job ran). Every node-aligned layout over 256 and 248
GPUs (a node lost) that fits, per model, and again over only the layouts the planner times within
10 % of its fastest (the ones it moves between); prints one row per model, then one JSON line.

Run: ``python tools/bench_planner_error.py`` (about a minute; kept in docs/figures/bench_planner_error/)."""
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_ext.bench.harness import Report  # noqa: E402
from megatron_ext.resilience import resihp_policy, setting  # noqa: E402
from megatron_ext.resilience.job import balanced_layers, fits, node_aligned_job, to_plan_layout  # noqa: E402

def main() -> None:
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    report = Report("bench_planner_error")
    rows = []

    out = {}
    rows.append(f"{'model':<16}{'layouts':>8}{'planner/scorer min':>20}{'max':>8}{'spread':>8}"
                f"{'near best':>11}{'min':>8}{'max':>8}{'spread':>8}")
    for model in ("llama2-7b", "llama2-13b", "llama2-70b", "qwen2.5-14b", "qwen2-57b-a14b"):
        ctx = setting.context(model)
        pol = resihp_policy.ResiHP()
        pol.start(ctx)
        planner, sh = pol.policy.planner, ctx.shape
        ratios = {}
        for n in (256, 248):
            for tp in (1, 2, 4, 8):
                for pp in range(1, 17):
                    dp = n // (tp * pp)
                    if dp < 1 or sh.num_attention_heads % tp or sh.num_query_groups % tp or pp > sh.num_layers:
                        continue
                    try:
                        job = node_aligned_job(sh, tp=tp, pp=pp, dp=dp, global_microbatches=setting.GLOBAL_MICROBATCHES,
                                               layers=balanced_layers(sh, pp))
                    except (ValueError, RuntimeError):
                        continue
                    if not fits(sh, job, ctx.hw, ctx.data.tokens):
                        continue
                    p = planner.iteration_s(to_plan_layout(job), np.ones(ctx.num_devices))
                    s = ctx.sim.healthy(job).time_s
                    if math.isfinite(p) and math.isfinite(s):
                        ratios[f"tp{tp}pp{pp}dp{dp}"] = (p, s)
        best = min(p for p, _ in ratios.values())
        row = {}
        for name, sel in (("all", ratios.values()), ("near_best", [(p, s) for p, s in ratios.values() if p <= 1.1 * best])):
            r = [p / s for p, s in sel]
            row[name] = {"layouts": len(r), "min": round(min(r), 4), "max": round(max(r), 4),
                         "spread": round(max(r) / min(r) - 1, 4)}
        out[model] = row
        a, b = row["all"], row["near_best"]
        rows.append(f"{model:<16}{a['layouts']:>8}{a['min']:>20.4f}{a['max']:>8.4f}{100 * a['spread']:>7.1f}%"
              f"{b['layouts']:>11}{b['min']:>8.4f}{b['max']:>8.4f}{100 * b['spread']:>7.1f}%")
    report.emit({"planner_healthy_error": out}, "\n".join(rows))


if __name__ == "__main__":
    main()

"""Live ResiHP scenarios for test_live.py, under torchrun --nproc_per_node 4 (PP2 x DP2).

Scenario "healthy": no fault, the detector must stay silent. Scenario "slow": rank 2 (stage 1, dp 0)
computes 3x slower from iteration 25 (2x sits inside the noise of
4 ranks sharing 2 cores in some runs: docs/resihp.md, "The README example"). Scenario "link": the
pipeline link between ranks 0 and 2 (replica 0's stage 0 -> 1) carries 2 MB/s from iteration 25 (a
64 KB activation: +33 ms per message), with the planner acting on the verdict. Scenario "nic": every
send of rank 1 at 4 MB/s from iteration 20 (+16 ms per 64 KB message, and its share of the gradient
all-reduce), the ring probe on (as in "healthy", where it must name nothing), and the planner
allowed other shapes over the same ranks. Scenario "path" (its own run: ``ALONE``): pure data
parallelism (DP 4, TP = PP = 1), the network path between launch ranks 0 and 1 (neighbours on the DP
ring and on the probe ring) at 3 MB/s both ways from iteration 20 (+21.8 ms per 64 KB probe message,
and the gradient all-reduce held for a ring's share at 3 MB/s while 0 and 1 are ring neighbours),
probing every iteration, the planner acting on the verdict. Verdicts and traces go to files under
OUT; a second argument names the scenarios to run (comma-separated; default all but ``ALONE``).
"""
from __future__ import annotations

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron_ext.config.run import config_from_values  # noqa: E402
from megatron_ext.runtime import distributed  # noqa: E402
from megatron_ext.runtime.extension import build_extensions  # noqa: E402
from megatron_ext.runtime.loop import Trainer  # noqa: E402
from tests.scenario_helpers import TINY, from_logging_rank  # noqa: E402

BASE = {**TINY, "pipeline_model_parallel_size": 2, "seq_length": 256, "micro_batch_size": 1,
        "doc_length_dist": "lognormal:3.5,1", "resihp": True, "resihp_warmup": 12, "lr_decay_style": "constant"}
SCENARIOS = {
    "healthy": {"train_iters": 45, "resihp_nic_probe_interval": 1},
    "slow": {"train_iters": 60, "inject_slow": ["2:25:3.0"]},
    # Acting on the verdict: the planner's plan applied live (the slow rank moved off the stage with
    # the output layer: a rank permutation), training goes on.
    "act": {"train_iters": 60, "inject_slow": ["2:25:3.0"], "resihp_act": "relayout"},
    # A slow link, named as a link (not a device), and re-placed around: the planner swaps the
    # replicas of one end so that the link carries no pipeline traffic.
    "link": {"train_iters": 70, "inject_slow_link": ["0:2:25:2"], "resihp_act": "relayout"},
    # A slow NIC (every send of rank 1 at 4 MB/s, its share of the gradient all-reduce included),
    # named by the ring probe as that device's; the planner reshapes around it (--resihp-act-reshape).
    "nic": {"train_iters": 40, "inject_slow_nic": ["1:20:4"], "resihp_nic_probe_interval": 1, "resihp_act": "relayout",
            "resihp_act_reshape": True},
    # A slow path on the data-parallel ring (0-1 at 3 MB/s both ways), named as the path between
    # two devices, not as either device's NIC; the planner reorders the ring so 0 and 1 are no
    # longer neighbours.
    "path": {"train_iters": 50, "pipeline_model_parallel_size": 1, "inject_slow_path": ["0:1:20:3"],
             "resihp_nic_probe_interval": 1, "resihp_act": "relayout"},
}
ALONE = ("path",)
"""Scenarios the default run leaves out: test_live.py runs each in its own launch."""


def main() -> None:
    out = sys.argv[1]
    ctx = distributed.setup(config_from_values(dict(BASE)).parallel, seed=1234)
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else [n for n in SCENARIOS if n not in ALONE]
    for name in names:
        values = SCENARIOS[name]
        cfg = config_from_values({**BASE, **values, "resihp_verdicts_out": os.path.join(out, f"{name}.verdicts.jsonl"),
                                  "resihp_trace_out": os.path.join(out, f"{name}.trace.jsonl")})
        ctx = distributed.relayout(ctx, tp=1, pp=cfg.parallel.pipeline_model_parallel_size, vpp=None,
                                   seed=cfg.training.seed)
        trainer = Trainer(cfg, ctx, build_extensions(cfg)).setup()
        trainer.run()
        ctx = trainer.ctx  # a re-layout rebuilt it
        # the logging rank's rows, wherever it is now
        train_rows, recovery = from_logging_rank(ctx, (sum(h["kind"] == "train" for h in trainer.history),
                                                       [h for h in trainer.history if h["kind"] == "layout_recovery"]))
        if trainer.ctx.rank == 0:
            with open(os.path.join(out, f"{name}.relayouts.json"), "w", encoding="utf-8") as fh:
                json.dump({"relayouts": trainer.relayouts, "iterations": trainer.iteration,
                           "stage_layers": trainer.cfg.parallel.pipeline_stage_layers,
                           "train_rows": train_rows, "recovery": recovery}, fh)
    distributed.teardown()


if __name__ == "__main__":
    main()

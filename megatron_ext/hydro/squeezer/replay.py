"""Re-run a bubble guest's bundle operations alone, and compare: the parity check of the squeezer.

    python -m megatron_ext.hydro.squeezer.replay --config tune.yaml runs/hydro/squeeze/oplog_rank0_pid123.jsonl

A guest records every bundle it built, every batch it drew, every step (with the losses), every
evaluation (with the values it reported to the pruner) and every resize (``guest.OpLog``). Replaying
the log with nobody else on the core, no windows and no pauses must give the same numbers: pause
points change when work happens, never what it computes. Prints the largest difference and
returns non-zero above ``--tolerance``.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from typing import Any

from megatron_ext.errors import UserError


class ReplayError(UserError, ValueError):
    """The operation log cannot be replayed (missing, torn, or not from this config)."""


def read_oplog(path: str) -> list[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.readlines()
    except OSError as exc:
        raise ReplayError(f"{path}: {exc.strerror}") from None
    ops = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ops.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if n == len(lines):    # a guest killed while writing leaves a torn last line
                break
            raise ReplayError(f"{path}:{n}: not JSON ({exc.msg})") from None
    return ops


def replay(config: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
    """Replay ``ops`` alone; returns the largest absolute differences of losses and values."""
    import torch

    from megatron_ext.hydro.config import load_config
    from megatron_ext.hydro.squeezer.guest import spec_from_json
    from megatron_ext.hydro.tuner import HydroTuner

    cfg, space, defaults, dropout = load_config(config, {"target_steps": 0, "threads": 1})
    torch.set_num_threads(1)
    tuner = HydroTuner(cfg, space, defaults, dropout, log=lambda s: None)
    tuner._setup_data()
    # The guest's batches by draw number: the same seeded stream, drawn on its own.
    stream = copy.copy(tuner.data)
    stream.gen = torch.Generator().manual_seed(cfg.seed)
    drawn: list[Any] = []

    def batch_at(k: int):
        if k < 0:
            raise ReplayError("a step's batch was not drawn from the tuner's data stream")
        while len(drawn) <= k:
            drawn.append(stream.train_batch())
        return drawn[k]

    tuner._setup_models()
    bundles: dict[int, Any] = {}
    worst_loss = worst_val = 0.0
    steps = evals = 0
    for k, op in enumerate(ops):
        kind = op["op"]
        if kind == "build":
            specs = [spec_from_json(s) for s in op["specs"]]
            bundles[op["bundle"]] = tuner._bundle(tuner.proxy_factory, specs, tuner.proxy_multipliers,
                                                  check=op["check"])
        elif kind == "resize":
            bundles[op["bundle"]].resize(op["keep"], [spec_from_json(s) for s in op["new"]])
        elif kind in ("step", "eval"):
            b = bundles[op["bundle"]]
            if list(b.trial_ids) != op["ids"]:
                raise ReplayError(f"operation {k + 1}: the bundle holds trials {b.trial_ids}, the log says "
                                  f"{op['ids']}: this log is not from this config")
            if kind == "step":
                got = b.train_step(*batch_at(op["batch"]))
                worst_loss = max(worst_loss, *(abs(a - g) for a, g in zip(op["losses"], got)))
                steps += 1
            else:
                got = b.evaluate(tuner.data.val_batches(cfg.eval_iters))
                worst_val = max(worst_val, *(abs(a - g) for a, g in zip(op["vals"], got)))
                evals += 1
        else:
            raise ReplayError(f"operation {k + 1}: unknown op {kind!r}")
    return {"steps": steps, "evals": evals, "max_abs_loss_diff": worst_loss, "max_abs_val_diff": worst_val}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_ext.hydro.squeezer.replay", description=__doc__.split("\n")[0])
    p.add_argument("oplog", help="an oplog_rank*_pid*.jsonl of a squeezer run")
    p.add_argument("--config", required=True, help="the tune YAML the guest ran")
    p.add_argument("--tolerance", type=float, default=1e-6)
    args = p.parse_args(argv)
    try:
        res = replay(args.config, read_oplog(args.oplog))
    except UserError as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2
    worst = max(res["max_abs_loss_diff"], res["max_abs_val_diff"])
    print(f"replayed {res['steps']} steps and {res['evals']} evaluations alone: max |loss diff| "
          f"{res['max_abs_loss_diff']:.3g}, max |validation diff| {res['max_abs_val_diff']:.3g}")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())

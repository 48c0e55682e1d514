#!/usr/bin/env python
"""Checkpoint save and load, Megatron-LM's torch_dist against the project's own format, and the pause
a preemption costs (issue 45).

    python tools/bench_checkpoint.py [--rounds 6] [--layers 8] [--hidden 512] [--preemptions 3]

* save / load: one in-process rank (gloo), a GPT of ``--layers`` x ``--hidden`` in fp32 with AdamW's
  state after one step (weights + two moments), saved and then loaded back by the runtime's own
  ``checkpoint.save`` / ``checkpoint.load`` in each format, into a fresh directory each time (the page
  cache holds what was just written: these are the formats' CPU costs, not the disk's). Arms
  interleaved, order rotated every round, torch_dist run twice per round (its A/A copy: the noise
  floor). Bytes: the checkpoint directory's size.
* preemption (the default format): ``pretrain_gpt.py`` on one rank with ``--exit-signal-handler
  --exit-signal SIGUSR1`` sent the signal once its metrics show iteration 20: seconds from the signal
  to the process's exit (it finishes the iteration, saves, exits 0); then the same line relaunched
  (``--save X --load X``, as a requeued job): seconds from the launch to its first iteration's metrics
  row, against a fresh launch's (no checkpoint) in the same round.

Prints the tables, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_ext.bench.harness import Report, compare, format_comparison, interleave  # noqa: E402
from megatron_ext.config.defaults import FORMER_DEFAULTS  # noqa: E402

FORMATS = ("torch_dist", "megatron_ext")


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def save_load_arms(values: dict, scratch: str) -> tuple[dict, dict]:
    """One callable per format returning save + load seconds; the seconds of each part and the bytes
    land in ``parts``."""
    from megatron_ext.config.run import config_from_values
    from megatron_ext.runtime import checkpoint as ckpt
    from megatron_ext.runtime import distributed
    from megatron_ext.runtime.loop import Trainer

    cfg = config_from_values(values)
    ctx = distributed.setup(cfg.parallel, seed=cfg.training.seed)
    trainer = Trainer(cfg, ctx).setup()
    trainer.run()  # one step: AdamW holds its moments
    fresh = Trainer(cfg, ctx).setup()
    parts: dict = {f: {"save_s": [], "load_s": [], "bytes": None} for f in FORMATS}
    count = [0]

    def arm(fmt: str, label: str):
        def run() -> float:
            count[0] += 1
            where = os.path.join(scratch, f"{label.replace(' ', '_').replace('/', '')}_{count[0]}")
            state = ckpt.TrainState(iteration=trainer.iteration, consumed_samples=trainer.train_stream.consumed_samples,
                                    scheduler=trainer.scheduler.state_dict())
            t0 = time.perf_counter()
            ckpt.save(where, model=trainer.model, optimizer=trainer.optimizer, state=state, config=cfg.flat(),
                      layout=trainer.layout_dict(), ckpt_format=fmt)
            t1 = time.perf_counter()
            ckpt.load(where, model=fresh.model, optimizer=fresh.optimizer, layout=fresh.layout_dict())
            t2 = time.perf_counter()
            parts[label]["save_s"].append(t1 - t0)
            parts[label]["load_s"].append(t2 - t1)
            parts[label]["bytes"] = _size(where)
            shutil.rmtree(where)
            return t2 - t0
        return run

    arms = {fmt: arm(fmt, fmt) for fmt in FORMATS}
    return arms, {"parts": parts, "params": sum(p.numel() for p in trainer.model.parameters())}


def _metrics_rows(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    rows = []
    for line in open(path, encoding="utf-8"):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def _first_row_s(argv: list[str], metrics: str, env: dict, timeout_s: float = 600) -> float:
    """Seconds from launching ``argv`` to its first train row in ``metrics``; the process then ends."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen = len([r for r in _metrics_rows(metrics) if r.get("kind") == "train"])
    try:
        while time.perf_counter() - t0 < timeout_s:
            if len([r for r in _metrics_rows(metrics) if r.get("kind") == "train"]) > seen:
                return time.perf_counter() - t0
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode} before its first iteration")
            time.sleep(0.02)
        raise RuntimeError(f"{' '.join(argv)}: no iteration in {timeout_s} s")
    finally:
        proc.kill()
        proc.wait()


def preemption(scratch: str, i: int, flags: list[str]) -> dict:
    """One preemption: signal -> exit seconds, and relaunch -> first iteration against a fresh launch."""
    # a child of its own: not this process's one-rank group (its rendezvous variables left out)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    run = os.path.join(scratch, f"pre{i}")
    metrics = os.path.join(run, "metrics.jsonl")
    line = [sys.executable, "pretrain_gpt.py", *flags, "--save", os.path.join(run, "ck"), "--load",
            os.path.join(run, "ck"), "--metrics-file", metrics, "--exit-signal-handler", "--exit-signal", "SIGUSR1"]
    os.makedirs(run)
    log = open(os.path.join(run, "log.txt"), "w")
    proc = subprocess.Popen(line, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    while not any(r.get("kind") == "train" and r["iteration"] >= 20 for r in _metrics_rows(metrics)):
        if proc.poll() is not None:
            tail = open(os.path.join(run, "log.txt")).read()[-2000:]
            raise RuntimeError(f"the run to preempt exited {proc.returncode} before iteration 20:\n{tail}")
        time.sleep(0.01)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGUSR1)
    code = proc.wait(timeout=600)
    exit_s = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"the preempted run exited {code}")
    resume_s = _first_row_s(line, metrics, env)
    fresh = os.path.join(scratch, f"fresh{i}")
    fresh_s = _first_row_s([sys.executable, "pretrain_gpt.py", *flags, "--save", os.path.join(fresh, "ck"),
                            "--metrics-file", os.path.join(fresh, "metrics.jsonl")], os.path.join(fresh, "metrics.jsonl"),
                           env)
    return {"signal_to_exit_s": exit_s, "relaunch_to_first_iteration_s": resume_s, "fresh_to_first_iteration_s": fresh_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--preemptions", type=int, default=3)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    report = Report("bench_checkpoint")
    values = {**FORMER_DEFAULTS, "num_layers": args.layers, "hidden_size": args.hidden, "num_attention_heads": 8,
              "seq_length": 64, "global_batch_size": 2, "micro_batch_size": 1, "train_iters": 1, "eval_iters": 0,
              "progress": False, "lr_decay_style": "constant"}
    scratch = tempfile.mkdtemp(prefix="bench_checkpoint_")
    try:
        arms, info = save_load_arms(values, scratch)
        parts = info["parts"]
        # torch_dist first: the reference, with its A/A copy (the same callable, twice a round)
        result = interleave(arms, args.rounds, warmup=1)
        td, own = parts["torch_dist"], parts["megatron_ext"]
        # the warm-up calls are not samples (torch_dist's two: its arm and its A/A copy, whose save
        # and load parts are pooled below)
        td_save, td_load = td["save_s"][2:], td["load_s"][2:]
        own_save, own_load = own["save_s"][1:], own["load_s"][1:]
        cmp_total = compare(result.samples, "torch_dist", higher_is_better=False)
        flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "64",
                 "--global-batch-size", "4", "--micro-batch-size", "1", "--train-iters", "200", "--eval-iters", "0",
                 "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--no-progress"]
        pre = [preemption(scratch, i, flags) for i in range(args.preemptions)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    import numpy as np

    med = lambda xs: float(np.median(xs))  # noqa: E731
    table = [f"save + load of one rank's checkpoint: {info['params'] / 1e6:.1f} M parameters, fp32 + AdamW state",
             format_comparison(cmp_total, "s"),
             "",
             f"{'format':<14} {'save s':>8} {'load s':>8} {'MB':>8}",
             f"{'torch_dist':<14} {med(td_save):>8.3f} {med(td_load):>8.3f} {td['bytes'] / 1e6:>8.1f}",
             f"{'megatron_ext':<14} {med(own_save):>8.3f} {med(own_load):>8.3f} {own['bytes'] / 1e6:>8.1f}",
             "(torch_dist's save and load medians are over both its arms, the A/A copy included)",
             "",
             "preemption (torch_dist, one rank): " + ", ".join(
                 f"{k} median {med([p[k] for p in pre]):.2f}" for k in pre[0])]
    figures = {
        "params_m": round(info["params"] / 1e6, 2),
        "total_s": {k: v["median"] for k, v in cmp_total["arms"].items()},
        # the ratio, torch_dist / own format: the inverse of own / torch_dist (the reference)
        "torch_dist_over_own": {
            "ratio": 1.0 / cmp_total["arms"]["megatron_ext"]["ratio_vs_reference"],
            "interval": [1.0 / x for x in reversed(cmp_total["arms"]["megatron_ext"]["interval"])]},
        "noise_floor": cmp_total["noise_floor"],
        "save_s": {"torch_dist": med(td_save), "megatron_ext": med(own_save)},
        "load_s": {"torch_dist": med(td_load), "megatron_ext": med(own_load)},
        "bytes": {"torch_dist": td["bytes"], "megatron_ext": own["bytes"]},
        "preemption": {k: med([p[k] for p in pre]) for k in pre[0]},
        "preemption_cases": pre,
        "rounds": args.rounds,
    }
    report.emit(figures, "\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Tokens/s of the tiny GPT per layout on 4 CPU ranks, and the runtime's overhead over a bare loop.

    python tools/bench_parallel.py [--iters 12] [--rounds 12]

Layouts: TP1 (x DP4), TP2xPP2, PP2xDP2, PP4, and TP2xPP2 on the DeepSpeed engine, each trained from the
same initialisation; its loss curve is compared with a single-rank run of the same model and data
(parity_max_rel_diff). Engines: megatron's and DeepSpeed's TP2xPP2 in blocks of steps interleaved in
rotated order with an A/A arm of megatron's (deepspeed_vs_megatron_tp2pp2: the median per-round ratio
of step times, with its 90 % interval and the A/A floor). Overhead: in
TP2xPP2, blocks of ``Trainer.train_step`` ("runtime"), of a bare loop ("bare") and of the runtime
again ("runtime (A/A)") run interleaved, their order rotated every round (megatron_ext.bench.harness,
docs/benchmarks.md); overhead = median of the per-round runtime/bare ratios - 1, with a bootstrap
90 % interval, printed beside the A/A ratio (runtime against itself): the noise floor of this run.
Use a multiple of 3 rounds so that each arm goes first equally often. The bare loop shares no code
with the runtime's step: it fetches its own micro-batches from the same megatron GPTDataset, has its
own forward step and loss, and calls megatron-core's schedule, the optimizer and the LR scheduler
directly (the same model and optimizer objects).
ZeRO: DeepSpeed's plain engine at stages 1, 2 and 3 in DP4 and its pipeline engine at ZeRO-1 in PP2xDP2,
each in blocks interleaved with megatron's on the same layout and an A/A arm of megatron's (step-time
ratio, parity with the single-rank curve, and the bytes of tensors each rank holds after a step against
ZeRO's theory for fp32 AdamW).
Prints a table, then one JSON line (with the commit, a dirty-tree flag, the command line and the
load average before and after).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Callable

from megatron_ext.config.defaults import FORMER_DEFAULTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {"tp1": (1, 1), "tp2pp2": (2, 2), "pp2dp2": (1, 2), "pp4": (1, 4)}
BASE = {**FORMER_DEFAULTS, "num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "seq_length": 128,
        "micro_batch_size": 2, "global_batch_size": 16, "lr": 1e-3, "lr_decay_style": "constant",
        "eval_iters": 0, "progress": False}


def worker(out_path: str, iters: int, rounds: int) -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from megatron_ext.config.run import config_from_values
    from megatron_ext.runtime import distributed
    from megatron_ext.runtime.loop import Trainer

    cfg = config_from_values({**BASE, "train_iters": iters})
    ctx = distributed.setup(cfg.parallel, seed=cfg.training.seed)
    result: dict = {"layouts": {}}

    def trainer_for(name: str, train_iters: int) -> Trainer:
        nonlocal ctx
        tp, pp = LAYOUTS[name]
        c = config_from_values({**BASE, "train_iters": train_iters, "tensor_model_parallel_size": tp,
                                "pipeline_model_parallel_size": pp})
        ctx = distributed.relayout(ctx, tp=tp, pp=pp, vpp=None, seed=c.training.seed)
        return Trainer(c, ctx).setup()

    def curve_of(trainer) -> dict:
        """``iters`` steps from the initialisation: the loss curve and the steady step time."""
        losses, times = [], []
        for _ in range(iters):
            m = trainer.train_step()
            losses.append(m.loss)
            times.append(m.iter_time_s)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, losses if trainer.ctx.is_last_stage else None)
        steady = statistics.median(times[2:])
        return {"tokens_per_s": BASE["global_batch_size"] * BASE["seq_length"] / steady, "iter_ms": steady * 1000,
                "losses": next(g for g in gathered if g is not None), "times": times[2:]}

    def steps_block(trainer) -> Callable[[], float]:
        """Seconds of ``block`` steps, between barriers (every rank's time is the slowest rank's)."""
        def run() -> float:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(block):
                trainer.train_step()
            dist.barrier()
            return time.perf_counter() - t0

        return run

    block = 6
    for name in LAYOUTS:
        result["layouts"][name] = curve_of(trainer_for(name, iters))

    # Overhead: the runtime's train_step against a bare loop written independently of the runtime
    # (its own batch fetch from the same megatron dataset, its own forward step and loss, megatron's
    # schedule, the same model and optimizer objects), so everything the runtime adds is measured.
    tr = trainer_for("tp2pp2", 10**6)
    dataset = tr.splits.train
    dp_rank, dp_size = ctx.coord.dp, ctx.layout.dp
    mbs, gbs = BASE["micro_batch_size"], BASE["global_batch_size"]
    bare_pos = [0]

    def bare_batches() -> list[dict]:
        import torch

        first = bare_pos[0] + dp_rank * (gbs // dp_size)
        bare_pos[0] += gbs
        out = []
        for m in range(gbs // dp_size // mbs):
            samples = [dataset[(first + m * mbs + j) % len(dataset)] for j in range(mbs)]
            out.append({k: torch.stack([x[k] for x in samples]) for k in samples[0]})
        return out

    def bare_forward_step(data_iterator, model):
        b = next(data_iterator)
        output = model(b["tokens"], b["position_ids"], b.get("attention_mask"), labels=b["labels"])
        mask = b["loss_mask"].view(-1).float()

        def loss_func(output_tensor):
            loss = (output_tensor.float().view(-1) * mask).sum() / mask.sum()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ext.bench.harness import interleave

    forward_backward = get_forward_backward_func()
    runtime_block = steps_block(tr)

    def bare_block() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(block):
            batches = bare_batches()
            tr.model.zero_grad_buffer()
            forward_backward(forward_step_func=bare_forward_step, data_iterator=iter(batches),
                             model=tr.model.chunks[0], num_microbatches=len(batches),
                             seq_length=BASE["seq_length"], micro_batch_size=mbs, forward_only=False)
            tr.optimizer.step()
            tr.scheduler.step(1)
        dist.barrier()
        return time.perf_counter() - t0

    # Every rank runs the same rotated order (it depends on the round index alone), so the
    # barriers and collectives inside the blocks pair up. Rank 0's block times are the samples:
    # each block ends with a barrier, so every rank's time is the slowest rank's.
    measured = interleave({"runtime": runtime_block, "bare": bare_block}, rounds, aa="runtime", warmup=1)
    result["overhead_samples"] = measured.samples
    result["overhead_orders"] = measured.orders
    # What the runtime does besides the schedule and the optimizer, timed alone: fetching the
    # iteration's micro-batches (the only per-iteration work of size > a few microseconds).
    t0 = time.perf_counter()
    for k in range(20):
        tr.train_stream.iteration(start=k * BASE["global_batch_size"])
    fetch_s = (time.perf_counter() - t0) / 20
    step_s = statistics.median(result["layouts"]["tp2pp2"]["times"]) if "times" in result["layouts"]["tp2pp2"] else None
    result["data_fetch_ms"] = fetch_s * 1000
    result["data_fetch_share"] = fetch_s / step_s if step_s else None

    # The engines side by side in TP2 x PP2: DeepSpeed's PipelineModule with megatron's tensor-parallel
    # layers (same model, data and seed) -- first its loss curve from the initialisation, as every
    # layout above, then blocks of steps interleaved with megatron's and an A/A arm of megatron's.
    from deepspeed_patches import trainer as ds

    def deepspeed_trainer(train_iters: int):
        c = config_from_values({**BASE, "train_iters": train_iters, "engine": "deepspeed",
                                "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2})
        return ds.DeepSpeedTrainer(c, ds.setup_distributed(c.parallel, seed=c.training.seed)).setup()

    result["layouts"]["deepspeed tp2pp2"] = curve_of(deepspeed_trainer(iters))
    dtr = deepspeed_trainer(10**6)
    measured = interleave({"megatron": steps_block(tr), "deepspeed": steps_block(dtr)}, rounds, aa="megatron",
                          warmup=1)
    result["engine_samples"] = measured.samples
    result["engine_orders"] = measured.orders
    del tr, dtr, runtime_block
    result["zero"] = zero_section(iters, rounds, curve_of, steps_block, trainer_for)
    if ctx.rank == 0:
        with open(out_path, "w", encoding="utf-8") as fh:
            json.dump(result, fh)
    distributed.teardown()


def model_state_bytes(trainer) -> dict:
    """Bytes of the tensors this rank's model, optimizer and engine hold when called, each storage
    counted once: everything reachable from them through attributes, lists, tuples and dicts (the
    parameters and their gradients, megatron's gradient buffers, ZeRO's flat partitions and buckets,
    the optimizer's moments), and ZeRO-3's partitions of the parameters. ``params``: of those, the
    model's parameters as this rank holds them (whole, or ZeRO-3's partition)."""
    import torch

    seen_storage: set[int] = set()
    seen: set[int] = set()
    total = 0

    def add(t) -> int:
        nonlocal total
        if t.device.type != "cpu":
            return 0
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if not ptr or ptr in seen_storage:
            return 0
        seen_storage.add(ptr)
        total += storage.nbytes()
        return storage.nbytes()

    def walk(obj, depth: int = 0) -> None:
        if depth > 12 or id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            add(obj)
            for attr in ("grad", "main_grad", "ds_tensor"):
                extra = getattr(obj, attr, None)
                if isinstance(extra, torch.Tensor):
                    walk(extra, depth + 1)
            return
        if isinstance(obj, dict):
            items = list(obj.keys()) + list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = list(obj)
        elif type(obj).__module__.startswith(("torch.distributed", "builtins", "logging", "threading")):
            return
        elif hasattr(obj, "__dict__"):
            items = list(vars(obj).values())
        else:
            return
        for item in items:
            walk(item, depth + 1)

    params = 0
    for p in trainer.model.parameters():
        params += add(p.ds_tensor) if hasattr(p, "ds_tensor") else add(p)
    for root in (trainer.model, trainer.optimizer, getattr(trainer, "engine", None)):
        walk(root)
    return {"total": total, "params": params}


ZERO_ARMS = {"megatron": None, "zero1": 1, "zero2": 2, "zero3": 3}
"""DP4 on 4 ranks: megatron's DDP and CPU AdamW, DeepSpeed's plain engine at ZeRO stages 1-3."""


ZERO3_SIZED = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 2_000_000, "stage3_prefetch_bucket_size": 500_000,
                                     "stage3_param_persistence_threshold": 0}}
"""ZeRO-3 with DeepSpeed's buckets sized to the bench's model (a memory-only row): the reduce bucket just
above the model's 1.33M parameters (on CPU a smaller one fails: ds_config.check_zero3_buckets)."""


def zero_section(iters: int, rounds: int, curve_of, steps_block, trainer_for) -> dict:
    """ZeRO on DeepSpeed's plain engine (DP4) and ZeRO-1 under its pipeline engine (PP2 x DP2), each
    beside the megatron engine on the same layout: loss curves from the initialisation, blocks of steps
    interleaved in rotated order with an A/A arm of megatron's, and the bytes each rank holds."""
    import torch.distributed as dist

    from deepspeed_patches import trainer as ds
    from megatron_ext.bench.harness import interleave
    from megatron_ext.config.run import config_from_values

    def deepspeed_trainer(train_iters: int, stage: int, pp: int = 1, config: dict | None = None):
        extra = {"deepspeed_config": json.dumps(config)} if config else {}
        c = config_from_values({**BASE, "train_iters": train_iters, "deepspeed": True, "zero_stage": stage,
                                "pipeline_model_parallel_size": pp, **extra})
        return ds.DeepSpeedTrainer(c, ds.setup_distributed(c.parallel, seed=c.training.seed)).setup()

    def held(trainer) -> list[dict]:
        """Each rank's bytes at the optimizer step (the commit vote, right before the update: the
        gradients are reduced and the optimizer's state exists), one more step into the run."""
        snapshot: dict = {}
        vote = trainer.commit_update

        def measured_vote() -> None:
            snapshot.update(model_state_bytes(trainer))
            vote()

        trainer.commit_update = measured_vote
        trainer.train_step()
        del trainer.commit_update
        mine = snapshot
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {**mine, "stage": trainer.ctx.coord.pp})
        return everyone

    out: dict = {"curves": {}, "bytes": {}, "params": None}
    for layout, arms in (("dp4", ZERO_ARMS), ("pp2dp2", {"megatron": None, "zero1": 1})):
        pp = 2 if layout == "pp2dp2" else 1
        trainers = {}
        for arm, stage in arms.items():
            name = f"{arm} {layout}"
            fresh = trainer_for("tp1" if pp == 1 else "pp2dp2", iters) if stage is None else \
                deepspeed_trainer(iters, stage, pp)
            out["curves"][name] = curve_of(fresh)
            out["bytes"][name] = held(fresh)   # after the curve: the optimizer's state exists
            del fresh
            # the megatron trainer last (trainer_for re-lays out megatron's global parallel state)
        for arm, stage in [a for a in arms.items() if a[1] is not None] + [("megatron", None)]:
            trainers[arm] = trainer_for("tp1" if pp == 1 else "pp2dp2", 10**6) if stage is None else \
                deepspeed_trainer(10**6, stage, pp)
        if out["params"] is None:
            out["params"] = sum(p.numel() for p in trainers["megatron"].model.parameters())
        blocks = {arm: steps_block(trainers[arm]) for arm in arms}
        measured = interleave(blocks, rounds, aa="megatron", warmup=1)
        out[f"samples {layout}"] = measured.samples
        out[f"orders {layout}"] = measured.orders
        del trainers, blocks
        if layout == "dp4":
            # Memory only: ZeRO-3 with its buffers sized to this model. DeepSpeed's defaults keep a
            # reduce bucket of 5e8 elements (2 GB in fp32) and every parameter under 1e5 elements
            # whole on every rank, which hides the partitioning in a model this small.
            fresh = deepspeed_trainer(iters, 3, 1, config=ZERO3_SIZED)
            out["curves"]["zero3 sized dp4"] = curve_of(fresh)
            out["bytes"]["zero3 sized dp4"] = held(fresh)
            del fresh
    return out


def zero_lines(zero: dict, reference: list[float]) -> tuple[list[str], dict]:
    """The ZeRO rows: step time against megatron's on the same layout (with the A/A floor), parity with
    the single-rank curve, and the largest bytes a rank holds against ZeRO's theory for fp32 AdamW."""
    from megatron_ext.bench.harness import compare, format_comparison, ratio_interval

    psi = zero["params"]
    lines = ["", f"ZeRO on DeepSpeed (fp32 AdamW, {psi} parameters; DP4: the plain engine, PP2xDP2: the pipeline "
                 "engine), blocks of 6 steps beside megatron's on the same layout:"]
    figures: dict = {"params": psi, "rows": {}}
    # Model states per rank in fp32 (4 bytes each of weights, gradients, and AdamW's two moments),
    # ZeRO's theory over N data-parallel ranks: stage 1 shards the moments and DeepSpeed's fp32 copy of
    # the weights, stage 2 also the gradients, stage 3 also the weights.
    theory = {"megatron": 16, "zero1": 8 + 12 / 4, "zero2": 4 + 16 / 4, "zero3": 20 / 4}
    lines.append(f"{'arm':<16} {'step / megatron':>16} {'90 % interval':>17} {'A/A':>7} {'parity':>9} "
                 f"{'max bytes/rank':>15} {'x params x4':>12} {'theory':>7}")
    for layout in ("dp4", "pp2dp2"):
        samples = zero[f"samples {layout}"]
        cmp = compare(samples, "megatron", higher_is_better=False)
        floor = cmp["noise_floor"]
        for arm in samples:
            if arm.endswith("(A/A)"):
                continue
            name = f"{arm} {layout}"
            ratio = ratio_interval(samples[arm], samples["megatron"])
            curve = zero["curves"][name]["losses"]
            parity = max(abs(a - b) / abs(b) for a, b in zip(curve, reference))
            per_rank = zero["bytes"][name]
            top = max(r["total"] for r in per_rank)
            multiple = top / (4 * psi)
            expect = theory[arm] / 4 / (2 if layout == "pp2dp2" else 1)
            figures["rows"][name] = {"step_ratio": ratio["median"], "interval": ratio["interval"],
                                     "aa": floor["ratio"], "aa_interval": floor["interval"],
                                     "parity_max_rel_diff": parity, "bytes_per_rank": [r["total"] for r in per_rank],
                                     "stage_of_rank": [r["stage"] for r in per_rank],
                                     "params_bytes_per_rank": [r["params"] for r in per_rank],
                                     "held_over_4psi": multiple, "theory_over_4psi": expect}
            lines.append(f"{name:<16} {ratio['median']:>16.3f} {ratio['interval'][0]:>8.3f}..{ratio['interval'][1]:<8.3f}"
                         f"{floor['ratio']:>7.3f} {parity:>9.1e} {top:>15,d} {multiple:>12.2f} {expect:>7.2f}")
        if layout == "dp4" and "zero3 sized dp4" in zero["bytes"]:
            name = "zero3 sized dp4"
            curve = zero["curves"][name]["losses"]
            parity = max(abs(a - b) / abs(b) for a, b in zip(curve, reference))
            per_rank = zero["bytes"][name]
            top = max(r["total"] for r in per_rank)
            figures["rows"][name] = {"parity_max_rel_diff": parity, "bytes_per_rank": [r["total"] for r in per_rank],
                                     "params_bytes_per_rank": [r["params"] for r in per_rank],
                                     "held_over_4psi": top / (4 * psi), "theory_over_4psi": theory["zero3"] / 4,
                                     "config": ZERO3_SIZED}
            lines.append(f"{name:<16} {'(memory only)':>16} {'':>17}{'':>7} {parity:>9.1e} {top:>15,d} "
                         f"{top / (4 * psi):>12.2f} {theory['zero3'] / 4:>7.2f}")
        lines += [format_comparison(cmp, "s")]
    lines.append("bytes/rank: the tensors a rank's model, optimizer and engine hold at the optimizer step (right "
                 "before the update), each storage once: weights, gradients, optimizer state, and what the engine "
                 "keeps besides (ZeRO's buckets, pipeline buffers); theory: model states only, in units of 4 bytes x "
                 "parameters (a PP2 stage holds about half the model). zero3 sized: ZeRO-3 with "
                 f"{json.dumps(ZERO3_SIZED['zero_optimization'])} (DeepSpeed's defaults keep a 5e8-element reduce "
                 "bucket and every parameter under 1e5 elements whole)")
    return lines, figures


def single_rank_curve(iters: int, tmp: str) -> list[float]:
    metrics = os.path.join(tmp, "single.jsonl")
    args = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--metrics-file", metrics,
            "--train-iters", str(iters)]
    for k, v in BASE.items():
        args += [f"--{k.replace('_', '-')}", str(v).lower() if isinstance(v, bool) else str(v)]
    subprocess.run(args, cwd=ROOT, check=True, capture_output=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return [r["loss"] for r in map(json.loads, open(metrics, encoding="utf-8")) if r["kind"] == "train"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=12,
                        help="interleaved overhead rounds (a multiple of 3: runtime, bare, runtime A/A)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.iters, args.rounds)
        return 0
    from megatron_ext.bench.harness import Report, compare, format_comparison, ratio_interval

    report = Report("bench_parallel")  # the load average before anything starts
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                        os.path.abspath(__file__), "--worker", out, "--iters", str(args.iters),
                        "--rounds", str(args.rounds)],
                       cwd=ROOT, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result = json.load(open(out, encoding="utf-8"))
        reference = single_rank_curve(args.iters, tmp)
    lines = [f"{'layout':<16} {'tokens/s':>10} {'iter ms':>9} {'parity max rel diff':>20}"]
    figures: dict = {"layouts": {}}
    for name, row in result["layouts"].items():
        diff = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], reference))
        figures["layouts"][name] = {"tokens_per_s": round(row["tokens_per_s"], 1), "parity_max_rel_diff": diff}
        lines.append(f"{name:<16} {row['tokens_per_s']:>10.0f} {row['iter_ms']:>9.1f} {diff:>20.2e}")
    samples = result["overhead_samples"]
    overhead = ratio_interval(samples["runtime"], samples["bare"])
    cmp = compare(samples, "runtime", higher_is_better=False)
    floor = cmp["noise_floor"]
    lo, hi = overhead["interval"]
    lines += ["", "TP2xPP2 blocks of 6 steps, seconds (bare: megatron's schedule loop, no runtime):",
              format_comparison(cmp, "s"), "",
              f"runtime overhead vs bare: {(overhead['median'] - 1) * 100:+.2f} % "
              f"(90 % interval {(lo - 1) * 100:+.2f} .. {(hi - 1) * 100:+.2f} %; A/A noise floor "
              f"{(floor['ratio'] - 1) * 100:+.2f} % [{(floor['interval'][0] - 1) * 100:+.2f} .. "
              f"{(floor['interval'][1] - 1) * 100:+.2f} %]; {cmp['rounds']} rounds)",
              f"runtime's own per-iteration work (data fetch) timed alone: {result['data_fetch_ms']:.2f} ms = "
              f"{result['data_fetch_share'] * 100:.2f} % of a TP2xPP2 step"]
    engines = compare(result["engine_samples"], "megatron", higher_is_better=False)
    ratio = ratio_interval(result["engine_samples"]["deepspeed"], result["engine_samples"]["megatron"])
    efloor = engines["noise_floor"]
    lines += ["", "TP2xPP2 blocks of 6 steps, seconds, by engine (same model, data and seed):",
              format_comparison(engines, "s"), "",
              f"deepspeed / megatron step time: {ratio['median']:.3f} (90 % interval {ratio['interval'][0]:.3f} .. "
              f"{ratio['interval'][1]:.3f}; A/A {efloor['ratio']:.3f} [{efloor['interval'][0]:.3f} .. "
              f"{efloor['interval'][1]:.3f}]; {engines['rounds']} rounds)"]
    figures.update(deepspeed_vs_megatron_tp2pp2=ratio["median"], deepspeed_vs_megatron_interval=ratio["interval"],
                   engines_noise_floor={"ratio": efloor["ratio"], "interval": efloor["interval"]},
                   engine_orders=result["engine_orders"])
    figures.update(overhead_vs_bare=overhead["median"] - 1.0,
                   overhead_interval=[lo - 1.0, hi - 1.0],
                   overhead_ratios=overhead["ratios"],
                   noise_floor={"ratio": floor["ratio"], "interval": floor["interval"]},
                   rounds=cmp["rounds"], orders=result["overhead_orders"],
                   data_fetch_share=result["data_fetch_share"])
    zlines, figures["zero"] = zero_lines(result["zero"], reference)
    lines += zlines
    report.emit(figures, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

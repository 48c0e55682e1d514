#!/usr/bin/env python
"""A chaos soak: one training job (4 CPU ranks, PP2 x DP2, the embedded corpus) that meets a seeded
random schedule of faults of every kind the project handles, then a verdict table (issue 46).

    python tools/chaos.py --seed 3 --faults 10          # one soak: its table, then one JSON line
    python tools/chaos.py --seeds 1,2,3,4,5 --faults 10  # the bench: a table per seed and the summary

The kinds: SIGKILL at an iteration's start, before the optimizer update (``step``), inside a
checkpoint save and inside the layout change that follows another loss (``relayout``); a hang inside
a forward (``compute``), the data fetch, a pipeline send/receive and an all-reduce; a fail-slow device;
a slow pipeline link; SIGTERM to every rank (a preemption: they agree, save, exit 0) and the job
launched again with ``--load`` (a requeue); the newest checkpoint corrupted before such a relaunch.
Every lost rank is started again (``--ft-respawn``) and rejoins. A fault that needs pipeline stages
(a pipeline hang, a slow link) comes first in a launch, after a requeue if need be: after a loss
ResiHP's planner may take the job off pipeline stages. Each fault expects one kind of
verdict: ``stop`` (a layout change naming it, killed by a signal), ``hang`` (named hung), ``slow`` /
``slow_link`` (ResiHP's verdict), ``resumed`` (the next launch resumed from the save), ``fell_back``
(the next launch loaded the newest complete checkpoint before the corrupt one), and for every loss
``rejoined`` (its replacement taken back in).

The soak passes when every fault got its verdict, no fault lost more iterations than the policy
states (0, but a stage with no copy goes back to its checkpoint, and a corrupt checkpoint to the one
before it), the job finished, and its loss curve equals a straight single-rank run's within 1e-5 or
within 3x the same job's without faults (the global batch is kept throughout; over a soak's length
float reduction order in the 4-rank layouts alone exceeds 1e-5, and both figures are reported).
ETTR comes from the last launch's account (``runtime/ettr.py``),
which carries the earlier launches'.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_ext.bench.harness import Report  # noqa: E402
from megatron_ext.config.defaults import former_default_flags  # noqa: E402

MODEL = [*former_default_flags(), "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2",
         "--seq-length", "32", "--global-batch-size", "8", "--micro-batch-size", "1", "--eval-iters", "0",
         "--log-interval", "5", "--lr-decay-style", "constant"]
HANG_TIMEOUT_S = 4.0
JOB = ["--pipeline-model-parallel-size", "2", "--resihp", "--resihp-warmup", "8", "--resihp-window", "4",
       "--ft-on-stop", "continue", "--ft-heartbeat-interval-s", "0.5", "--ft-heartbeat-timeout-s", "4",
       "--ft-continue-timeout-s", "60", "--ft-hang-timeout-s", str(HANG_TIMEOUT_S), "--ft-grace-s", "5",
       "--exit-signal-handler"]
SAVE_INTERVAL = 4
SLOW_FACTOR = 3.0
"""The fail-slow device's slowdown. The soak checks that each fault gets its kind of verdict inside one
job, not how small a slowdown the detector sees (tools/bench_detector.py measures that): at 2x, one CI
run on a noisy 2-core host never named the device in 28 iterations, its ranks' healthy noise putting
the detector's z bound (--resihp-zscore) above the slow device's scores; 3x is past both its bounds
there and past --resihp-severe-factor."""
KINDS = ("kill:start", "kill:step", "kill:save", "kill:relayout", "hang:compute", "hang:data", "hang:p2p",
         "hang:collective", "slow", "slow_link", "requeue", "corrupt")
EXPECT = {"kill": "stop", "hang": "hang", "slow": "slow", "slow_link": "slow_link", "requeue": "resumed",
          "corrupt": "fell_back"}
GAP = 14  # iterations between two faults: a replacement rejoins before the next one
NEEDS_PIPELINE = ("hang:p2p", "slow_link")
LOSS_TOLERANCE = 1e-5
FLOOR_FACTOR = 3.0
"""The curve passes within 1e-5 of the straight run's, or within 3x the fault-free 4-rank job's own
difference from it (float reduction order in another layout, amplified by training: over a soak's
150-200 iterations it exceeds 1e-5 with no fault at all)."""


@dataclasses.dataclass
class Fault:
    kind: str
    rank: int
    at: int
    peer: int | None = None      # slow_link's other end
    launch: int = 0              # which launch of the job it falls in
    verdict: str | None = None
    delay: str = ""
    action: str = ""
    lost: int | None = None
    bound: int = 0

    @property
    def expected(self) -> str:
        return EXPECT[self.kind.split(":")[0]]

    def flags(self) -> list[str]:
        kind, _, where = self.kind.partition(":")
        if kind == "kill":
            return ["--inject-stop", f"{self.rank}:{self.at}:{where}"]
        if kind == "hang":
            return ["--inject-hang", f"{self.rank}:{self.at}:{where}"]
        if kind == "slow":
            return ["--inject-slow", f"{self.rank}:{self.at}:{SLOW_FACTOR}"]
        if kind == "slow_link":
            return ["--inject-slow-link", f"{self.rank}:{self.peer}:{self.at}:0.2"]  # 20 ms per 4 KB activation
        return []


def schedule(seed: int, faults: int, start: int = 10) -> tuple[list[Fault], int]:
    """The seeded schedule: every kind once (in a random order) before any kind twice; the training
    iterations it needs."""
    rng = random.Random(seed)
    kinds: list[str] = []
    while len(kinds) < faults:
        more = list(KINDS)
        rng.shuffle(more)
        kinds += more
    kinds = kinds[:faults]
    out: list[Fault] = []
    it = start
    slow_ranks: set[int] = set()
    for kind in kinds:
        if kind == "corrupt" and (not out or out[-1].kind != "requeue"):
            out.append(Fault("requeue", 0, it))          # a corrupt checkpoint is met by a relaunch
        if kind in NEEDS_PIPELINE and out and out[-1].kind != "requeue":
            # After a loss ResiHP's planner may have taken the job off pipeline stages (on this host
            # it prefers data parallelism): a relaunch starts from the launch layout, PP2 x DP2.
            out.append(Fault("requeue", rng.randrange(4), it))
            it += GAP
        rank = rng.randrange(4)
        if kind == "slow":
            rank = rng.choice([r for r in range(4) if r not in slow_ranks] or [0])
            slow_ranks.add(rank)
        at = it
        if kind == "kill:save":
            at = (it + SAVE_INTERVAL - 1) // SAVE_INTERVAL * SAVE_INTERVAL
        if kind == "kill:relayout":
            # inside the change that a loss at the start of the same iteration causes
            other = (rank + 1 + rng.randrange(3)) % 4
            out.append(Fault("kill:start", other, at))
        peer = None
        if kind == "slow_link":  # a pipeline link: PP2 x DP2 puts stage 0 on ranks 0, 1 and stage 1 on 2, 3
            rank = rng.choice([0, 1])
            peer = rank + 2
        if kind == "corrupt":  # the checkpoint the requeue before it saved
            at = out[-1].at
        f = Fault(kind, rank, at, peer=peer)
        out.append(f)
        it = at + GAP
    launch = 0
    for f in out:
        f.launch = launch
        if f.kind == "requeue":
            launch += 1
    return out, it + GAP


def rows(path: str, kind: str | None = None) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [r for r in map(json.loads, fh) if kind is None or r.get("kind") == kind]


def rank_pids() -> list[int]:
    """This process's rank processes: the children of its zygotes (or of itself, spawned)."""
    import psutil

    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
            parent = " ".join(child.parent().cmdline())
        except (psutil.Error, AttributeError):
            continue
        if "pretrain_gpt.py" in cmd or ("megatron_ext.ft.zygote" in parent and "megatron_ext.ft.zygote" in cmd):
            out.append(child.pid)
    return out


def signal_at(metrics: str, iteration: int, done: threading.Event) -> threading.Thread:
    """SIGTERM every rank once the job's metrics show ``iteration`` (the scheduler's preemption)."""
    def watch():
        while not done.is_set():
            its = [r["iteration"] for r in rows(metrics, "train")]
            if its and max(its) >= iteration:
                for pid in rank_pids():
                    try:
                        os.kill(pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
                return
            time.sleep(0.1)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def corrupt_newest(save: str) -> str:
    """Flip bytes in the newest checkpoint's first tensor file; its directory's name."""
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as fh:
        newest = os.path.join(save, f"iter_{int(fh.read().strip()):07d}")
    victim = sorted(f for f in os.listdir(newest) if f.endswith(".distcp"))[0]
    with open(os.path.join(newest, victim), "r+b") as fh:
        fh.seek(64)
        data = fh.read(16)
        fh.seek(64)
        fh.write(bytes(b ^ 0xFF for b in data))
    return os.path.basename(newest)


def soak(seed: int, faults: int, out: str, *, log=print) -> dict:
    from megatron_ext.ft.launch import job_exit_code, launch_ranks

    plan, iters = schedule(seed, faults)
    os.makedirs(out, exist_ok=True)
    metrics, verdicts, save = (os.path.join(out, n) for n in ("metrics.jsonl", "verdicts.jsonl", "ck"))
    respawn = sum(1 for f in plan if f.kind.split(":")[0] in ("kill", "hang")) + 1
    base = [os.path.join(ROOT, "pretrain_gpt.py"), *MODEL, *JOB, "--train-iters", str(iters), "--save", save,
            "--load", save, "--save-interval", str(SAVE_INTERVAL), "--metrics-file", metrics,
            "--resihp-verdicts-out", verdicts, "--ft-respawn", str(respawn)]
    launches, logs = [], []
    t0 = time.monotonic()
    n_launches = 1 + sum(f.kind == "requeue" for f in plan)
    for k in range(n_launches):
        mine = [f for f in plan if f.launch == k and f.kind not in ("requeue", "corrupt")]
        requeue = next((f for f in plan if f.launch == k and f.kind == "requeue"), None)
        grouped: dict[str, list[str]] = {}
        for f in mine:  # one flag, several values (a flag given twice keeps its last values, as argparse does)
            flag, *values = f.flags() or [None]
            if flag:
                grouped.setdefault(flag, []).extend(values)
        flags = [x for flag, values in grouped.items() for x in (flag, *values)]
        argv = [*base, *flags]
        log(f"chaos: launch {k + 1} of {n_launches}: {' '.join(flags) or 'no fault'}"
            + (f"; SIGTERM at iteration {requeue.at}" if requeue else ""))
        done = threading.Event()
        if requeue is not None:
            signal_at(metrics, requeue.at, done)
        ranks = launch_ranks(argv, 4, cwd=ROOT, timeout_s=900, respawn=respawn, grace_s=10.0)
        done.set()
        launches.append({"codes": [r.incarnations for r in ranks], "job": job_exit_code(ranks)})
        logs.append("".join(r.output for r in ranks))
        with open(os.path.join(out, f"launch{k + 1}.log"), "w") as fh:
            fh.write("".join(f"===== rank {r.rank} =====\n{r.output}" for r in ranks))
        # a corrupt checkpoint is scheduled with the requeue that ends this launch: met by the next one
        corrupt = next((f for f in plan if f.kind == "corrupt" and requeue is not None and f.at == requeue.at), None)
        if corrupt is not None and os.path.isdir(save):
            corrupt.action = f"corrupted {corrupt_newest(save)}"
        if launches[-1]["job"] != 0:
            break
    wall = time.monotonic() - t0
    score(plan, metrics, verdicts, logs)
    straight = os.path.join(out, "straight.jsonl")
    subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *MODEL, "--train-iters", str(iters),
                    "--metrics-file", straight], cwd=ROOT, capture_output=True, check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    # The floor: the same job without faults against the straight run (float reduction order in
    # another layout, amplified by training over the soak's iterations).
    healthy = os.path.join(out, "healthy.jsonl")
    launch_ranks([os.path.join(ROOT, "pretrain_gpt.py"), *MODEL, *JOB, "--train-iters", str(iters),
                  "--metrics-file", healthy], 4, cwd=ROOT, timeout_s=900, grace_s=10.0)
    live = {r["iteration"]: r["loss"] for r in rows(metrics, "train")}
    ref = {r["iteration"]: r["loss"] for r in rows(straight, "train")}
    diff = max_rel(live, ref)
    floor = max_rel({r["iteration"]: r["loss"] for r in rows(healthy, "train")}, ref)
    ettr_rows = rows(metrics, "ettr")
    finished = bool(live) and max(live) == iters and all(x["job"] == 0 for x in launches)
    right = sum(f.verdict == f.expected for f in plan)
    within = all(f.lost is None or f.lost <= f.bound for f in plan)
    return {"seed": seed, "faults": [dataclasses.asdict(f) | {"expected": f.expected} for f in plan],
            "iterations": iters, "launches": launches, "finished": finished, "wall_s": round(wall, 1),
            "right_verdicts": right, "all_right": right == len(plan), "lost_within_bound": within,
            "rows_complete": sorted(live) == list(range(1, iters + 1)),
            "loss_max_rel_diff": diff, "loss_floor": floor, "ettr": ettr_rows[-1] if ettr_rows else None,
            "passed": finished and right == len(plan) and within and diff is not None and floor is not None
            and diff <= max(LOSS_TOLERANCE, FLOOR_FACTOR * floor) and sorted(live) == list(range(1, iters + 1))}


def max_rel(live: dict[int, float], ref: dict[int, float]) -> float | None:
    common = sorted(set(live) & set(ref))
    return max((abs(live[i] - ref[i]) / abs(ref[i]) for i in common), default=None)


def score(plan: list[Fault], metrics: str, verdicts: str, logs: list[str]) -> None:
    """Each fault's verdict, delay, action and iterations lost, from what the job wrote."""
    changes = rows(metrics, "layout_change")
    found = rows(verdicts)
    everything = "\n".join(logs)
    for f in plan:
        kind = f.kind.split(":")[0]
        if kind in ("kill", "hang"):
            hit = next((c for c in changes if f.rank in c.get("lost_ranks", []) and c["iteration"] + 1 >= f.at - 1
                        and c["iteration"] < f.at + GAP), None)
            if hit is not None:
                why = hit["lost_why"].get(str(f.rank), "")
                stopped = why.startswith(("killed", "process ended"))
                f.verdict = "hang" if why.startswith("hung") else "stop" if stopped else f"other ({why[:40]})"
                if f.verdict == "hang":
                    stalled = float(why.split("no progress for ")[1].split(" s")[0])
                    f.delay = f"{stalled - HANG_TIMEOUT_S:+.1f} s after the timeout"
                f.lost = hit["lost_iterations"]
                f.bound = hit["lost_iterations"] if hit.get("restored_from_checkpoint") else 0
                back = next((c for c in changes if c["cause"] == "grow" and f.rank in c.get("joined_ranks", [])
                             and c["iteration"] >= hit["iteration"]), None)
                f.action = f"{hit['from']} -> {hit['to']}" + (f"; rejoined at {back['iteration']}" if back else
                                                             "; not rejoined")
                if back is None and f.verdict in ("stop", "hang"):
                    f.verdict += " (not rejoined)"
        elif kind in ("slow", "slow_link"):
            want = "fail_slow" if kind == "slow" else "slow_link"
            def names(v: dict) -> bool:
                d = v.get("detail", {})
                if kind == "slow":
                    return d.get("launch_rank", v["rank"]) == f.rank
                return sorted([d.get("launch_rank"), d.get("peer_launch_rank")]) == sorted([f.rank, f.peer])

            hit = next((v for v in found if v.get("kind") == want and v["iteration"] >= f.at and names(v)), None)
            if hit is not None:
                f.verdict = kind
                f.delay = f"{hit['iteration'] - f.at} iterations"
                f.action = "reported (--resihp-act off)"
                f.lost = 0
            else:
                f.action = missed_slow(f, rows(metrics, "train"))
        elif kind == "requeue":
            if "resumed from" in everything:
                f.verdict = "resumed"
                f.action = "saved, exit 0, relaunched with --load"
                f.lost = 0
        elif kind == "corrupt":
            if "loading the newest complete checkpoint before it" in everything:
                f.verdict = "fell_back"
                f.lost = None  # iterations redone: the interval between the two checkpoints
                f.action += "; the newest complete checkpoint before it loaded"


def missed_slow(f: Fault, train: list[dict]) -> str:
    """What the detector saw after a slow fault it did not name (the job logs its highest score and
    that rank each iteration), so that a miss on a noisy host can be told from a broken detector."""
    after = [r for r in train if r["iteration"] >= f.at and "resihp_max_score" in r]
    if not after:
        return "missed; the detector scored no iteration after it"
    top = sorted(r["resihp_max_score"] for r in after)
    ranks = collections.Counter(r["resihp_max_score_rank"] for r in after).most_common(1)[0]
    return (f"missed; highest score over {len(after)} iterations after it: median {top[len(top) // 2]:.2f}, "
            f"max {top[-1]:.2f}, most often rank {ranks[0]} ({ranks[1]} times)")


def table(result: dict) -> str:
    lines = [f"seed {result['seed']}: {len(result['faults'])} faults over {result['iterations']} iterations, "
             f"{len(result['launches'])} launch(es), {result['wall_s']} s",
             f"{'kind':<16}{'rank':>5}{'iter':>6}  {'expected':<10}{'verdict':<22}{'delay':<26}{'lost':>5}  action"]
    for f in result["faults"]:
        rank = f"{f['rank']}-{f['peer']}" if f["peer"] is not None else str(f["rank"])
        lines.append(f"{f['kind']:<16}{rank:>5}{f['at']:>6}  {f['expected']:<10}{str(f['verdict']):<22}"
                     f"{f['delay']:<26}{'' if f['lost'] is None else f['lost']:>5}  {f['action']}")
    e = result["ettr"]
    diff = result["loss_max_rel_diff"]
    floor = result["loss_floor"]
    lines.append(f"right verdicts {result['right_verdicts']}/{len(result['faults'])}; finished {result['finished']}; "
                 f"loss vs straight run max rel diff {'n/a' if diff is None else f'{diff:.1e}'} (the fault-free job's "
                 f"{'n/a' if floor is None else f'{floor:.1e}'}); "
                 + (f"ETTR {e['ettr']:.3f} over {e['wall_s']:.0f} s" if e else "no ETTR row")
                 + f"; {'PASSED' if result['passed'] else 'FAILED'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=None, help="one soak with this seed")
    p.add_argument("--seeds", default="1,2,3,4,5", help="the bench: one soak per seed (comma-separated)")
    p.add_argument("--faults", type=int, default=10)
    p.add_argument("--out", default=None, help="keep the soaks' files here (default: a temporary directory)")
    args = p.parse_args(argv)
    seeds = [args.seed] if args.seed is not None else [int(s) for s in args.seeds.split(",")]
    report = Report(bench="chaos")
    out = args.out or tempfile.mkdtemp(prefix="megatron-ext-chaos-")
    results = []
    try:
        for s in seeds:
            r = soak(s, args.faults, os.path.join(out, f"seed{s}"))
            print(table(r), flush=True)
            results.append(r)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    faults = [f for r in results for f in r["faults"]]
    hang_delays = [float(f["delay"].split()[0]) for f in faults if f["verdict"] == "hang" and f["delay"]]
    figures = {"seeds": seeds, "faults_per_seed": args.faults, "soaks": results,
               "right_verdict_share": round(sum(f["verdict"] == f["expected"] for f in faults) / max(len(faults), 1),
                                            4),
               "hang_delay_after_timeout_s": {"median": statistics.median(hang_delays) if hang_delays else None,
                                              "max": max(hang_delays, default=None)},
               "ettr": {r["seed"]: (r["ettr"] or {}).get("ettr") for r in results},
               "loss_max_rel_diff": max((r["loss_max_rel_diff"] or 0.0) for r in results) if results else None,
               "passed": all(r["passed"] for r in results)}
    report.emit(figures)
    return 0 if figures["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Start N ranks of a script directly, as srun does (no torchrun agent in between).

Used where the launcher must not react to a dying worker by itself — ``--resihp-on-stop
continue``, fail-stop tests and the live detector benchmark. This process hosts the rendezvous
store (``runtime/store.py``) and outlives every rank, so survivors of a lost rank, rank 0
included, can still meet there and form a new process group. A rank that dies does not stop the
others: each rank's exit code is its own.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

from megatron_ext.runtime.store import STORE_ENV, host


@dataclasses.dataclass
class RankResult:
    rank: int
    returncode: int
    output: str


def _rank_env(rank: int, nproc: int, addr: str, env: dict[str, str] | None) -> dict[str, str]:
    base = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **(env or {})}
    for key in ("MASTER_ADDR", "MASTER_PORT"):  # the store is ours; ranks must not host another
        base.pop(key, None)
    return {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), STORE_ENV: addr}


def launch_ranks(script_args: list[str], nproc: int, *, cwd: str | None = None, env: dict[str, str] | None = None,
                 timeout_s: float | None = 900.0, capture: bool = True) -> list[RankResult]:
    """Run ``python script_args...`` as ranks 0..nproc-1 and wait for all of them. With
    ``capture`` each rank's output (stdout and stderr) comes back in its result; without, it goes
    to this process's streams as it is written."""
    store, addr = host()
    out = subprocess.PIPE if capture else None
    procs = [subprocess.Popen([sys.executable, *script_args], cwd=cwd, env=_rank_env(r, nproc, addr, env),
                              stdout=out, stderr=subprocess.STDOUT if capture else None, text=True)
             for r in range(nproc)]
    texts = [""] * nproc

    def watch(rank: int, p: subprocess.Popen) -> None:
        from megatron_ext.runtime.failover import mark_exited

        if capture:
            texts[rank] = p.stdout.read()
        if p.wait() != 0:
            # Survivors learn of a dead rank from the store at once, not after the heartbeat timeout.
            try:
                mark_exited(store, rank, p.returncode)
            except Exception:  # the job is ending
                pass

    watchers = [threading.Thread(target=watch, args=(r, p), daemon=True) for r, p in enumerate(procs)]
    for w in watchers:
        w.start()
    try:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for w in watchers:
            w.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for w in watchers:
            w.join(5.0)
    # ``store`` lives until here, after every rank: the survivors of a lost rank meet through it.
    return [RankResult(r, p.returncode, texts[r] or "") for r, p in enumerate(procs)]


def job_exit_code(codes: list[int]) -> int:
    """0 when every rank either finished with 0 or was lost to a signal while the others went on
    (a job that continued past a fail-stop); else the first nonzero exit code of a rank that
    exited by itself (1 when every rank was killed)."""
    if any(c == 0 for c in codes) and all(c == 0 or c < 0 for c in codes):
        return 0
    own = [c for c in codes if c > 0]
    return own[0] if own else 1


def run_job(script_args: list[str], nproc: int) -> tuple[int, list[int]]:
    """``launch_ranks`` for a job on a terminal: output streamed, Ctrl-C stops every rank.
    Returns (the job's exit code, each rank's)."""
    def stop(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        results = launch_ranks(script_args, nproc, timeout_s=None, capture=False)
    finally:
        signal.signal(signal.SIGTERM, previous)
    codes = [r.returncode for r in results]
    return job_exit_code(codes), codes

"""Start N ranks of a script directly, as srun does (no torchrun agent in between).

Used where the launcher must not react to a dying worker by itself -- ``--resihp`` (the survivors
of a lost rank end the job themselves under ``abort``: exit 75, one line naming the rank; or go on
under ``continue``), fail-stop tests and the live detector benchmark. This process hosts the rendezvous
store (``ft/store.py``) and outlives every rank, so survivors of a lost rank, rank 0 included, can
still meet there and form a new process group. A rank that dies does not stop the others: each
rank's exit code is its own, and the moment one ends without finishing, its exit is reported in
the store (``membership.report_exit``), so the survivors know at once instead of after the
heartbeat timeout.

With ``respawn`` (``--ft-respawn N``) a rank that was lost is started again, up to N times per
rank, as a new incarnation (``MEGATRON_EXT_INCARNATION=k``): the new process waits as a spare until
the survivors take it in at an iteration boundary (``ft/core.py``, "grow"). Nothing is started
again once the job has ended (``job/end``) or finished training (``job/done``).

A rank of a script is a fork of a preloaded zygote (``ft/zygote.py``: torch and megatron-core
imported once per launcher, not once per rank); ``MEGATRON_EXT_LAUNCH_START=spawn`` starts each as
a new interpreter instead.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from megatron_ext.ft import membership as ms
from megatron_ext.ft import zygote as zg
from megatron_ext.ft.errors import FAILED_EXIT_CODE
from megatron_ext.ft.preflight import LAUNCHER_ENV
from megatron_ext.ft.store import STORE_ENV, host

INCARNATION_ENV = "MEGATRON_EXT_INCARNATION"
logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RankResult:
    rank: int
    returncode: int
    output: str
    incarnations: list[int] = dataclasses.field(default_factory=list)
    """Exit code of every process this rank had, the last one last (``returncode``)."""
    lost: bool = False
    """Its last process was lost while the job went on: killed, or ended on its own exception
    (it said so in the store)."""
    job_end: dict | None = None
    """How the job ended when it ended early (``membership.declare_end``: code, one line)."""
    spare: bool = False
    """Its last process ended as a spare (it had no place in the layout at the end)."""
    stopped: bool = False
    """The launcher stopped its last process (``stop_after_failure_s`` after another rank failed)."""


def _rank_env(rank: int, nproc: int, addr: str, env: dict[str, str] | None, incarnation: int) -> dict[str, str]:
    base = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **(env or {})}
    for key in ("MASTER_ADDR", "MASTER_PORT"):  # the store is ours; ranks must not host another
        base.pop(key, None)
    return {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), STORE_ENV: addr,
            LAUNCHER_ENV: "1", INCARNATION_ENV: str(incarnation)}


def _zygote_env(nproc: int, env: dict[str, str] | None) -> dict[str, str]:
    """The ranks' environment without what differs between ranks, launches and incarnations: the
    zygote's (``ft/zygote.py``), so that what a preloaded module computed at import matches a rank."""
    per_rank = {"RANK", "LOCAL_RANK", "WORLD_SIZE", STORE_ENV, LAUNCHER_ENV, INCARNATION_ENV}
    return {k: v for k, v in _rank_env(0, nproc, "", env, 0).items() if k not in per_rank}


def launch_ranks(script_args: list[str], nproc: int, *, cwd: str | None = None, env: dict[str, str] | None = None,
                 timeout_s: float | None = 900.0, capture: bool = True, respawn: int = 0,
                 respawn_delay_s: float = 0.0, report_exits: bool = True,
                 stop_after_failure_s: float | None = None, grace_s: float | None = None) -> list[RankResult]:
    """Run ``python script_args...`` as ranks 0..nproc-1 and wait for all of them (and their
    replacements). With ``capture`` each rank's output (stdout and stderr, of every incarnation)
    comes back in its result; without, it goes to this process's streams as it is written.
    ``respawn``: start a lost rank again, up to this many times per rank, after ``respawn_delay_s``.
    ``report_exits`` False: say nothing of a dead rank, as srun does (only the heartbeat then names
    it: what the detector's tests and benchmark measure). ``stop_after_failure_s``: once a rank has
    failed, the ranks still running this long after are stopped (a rank that died before the
    fault-tolerance core watched for losses leaves the others waiting in a collective). ``grace_s``:
    once the job has decided without a process -- the job ended (``job/end``), or the others named
    it lost while it still runs (hung, or silent) -- it is stopped this long after: SIGTERM once the
    job ended (then SIGKILL after as long again), SIGKILL when it was named lost."""
    store, addr = host()
    out = subprocess.PIPE if capture else None
    texts: list[list[str]] = [[] for _ in range(nproc)]
    codes: list[list[int]] = [[] for _ in range(nproc)]
    procs: list[subprocess.Popen | None] = [None] * nproc
    current = [0] * nproc  # the incarnation each rank's process now is
    lock = threading.Lock()
    watchers: list[threading.Thread] = []

    zygote = zg.zygote_for(_zygote_env(nproc, env)) if zg.forkable(script_args) else None
    outdir = tempfile.mkdtemp(prefix="megatron-ext-ranks-") if capture and zygote is not None else None

    def start(rank: int, incarnation: int) -> None:
        rank_env = _rank_env(rank, nproc, addr, env, incarnation)
        p = None
        if zygote is not None:
            log = os.path.join(outdir, f"rank{rank}.{incarnation}.log") if outdir else None
            try:
                p = zygote.start(list(script_args), rank_env, cwd, log)
            except RuntimeError as e:
                logger.warning("launch: rank %d started as a new interpreter: %s", rank, e)
        if p is None:
            p = subprocess.Popen([sys.executable, *script_args], cwd=cwd, env=rank_env,
                                 stdout=out, stderr=subprocess.STDOUT if capture else None, text=True)
        with lock:
            procs[rank] = p
            current[rank] = incarnation
        w = threading.Thread(target=watch, args=(rank, incarnation, p), daemon=True)
        watchers.append(w)
        w.start()

    def watch(rank: int, incarnation: int, p) -> None:
        text, _ = p.communicate()      # a forked rank's and a new interpreter's alike
        code = p.returncode
        if capture:
            texts[rank].append(text or "")
        codes[rank].append(code)
        if code == 0 or not report_exits:
            return
        # Survivors learn of a dead rank from the store at once, not after the heartbeat timeout.
        try:
            reason = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            ms.report_exit(store, rank, incarnation, code=code, reason=reason, by="launcher")
            ended = ms.job_end(store) is not None or ms.is_done(store)
        except Exception:  # the job is ending
            return
        if incarnation < respawn and not ended:
            if respawn_delay_s:
                time.sleep(respawn_delay_s)
            start(rank, incarnation + 1)

    for r in range(nproc):
        start(r, 0)
    stopped: set[int] = set()
    decided: dict[tuple[int, int], float] = {}   # (rank, incarnation) -> when the job decided without it

    def enforce() -> None:
        """``grace_s``: stop the processes that did not follow a decision."""
        now = time.monotonic()
        end = ms.job_end(store)
        with lock:
            live = [(r, current[r], p) for r, p in enumerate(procs) if p is not None and p.poll() is None]
        for r, inc, p in live:
            report = None if end is not None else ms.exit_report(store, r, inc)
            if end is None and (report is None or report["by"] not in ("heartbeat", "hang")):
                continue
            since = decided.setdefault((r, inc), now)
            if now - since <= grace_s:
                continue
            if end is not None and now - since <= 2 * grace_s:
                if r not in stopped:
                    logger.warning("launch: rank %d still runs %.0f s after the job ended: SIGTERM", r, grace_s)
                    stopped.add(r)
                    p.terminate()
                continue
            logger.warning("launch: rank %d still runs after the job decided without it: SIGKILL", r)
            if end is not None:
                stopped.add(r)
            p.kill()

    try:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failed_at = None
        while True:
            if grace_s is not None:
                try:
                    enforce()
                except Exception as exc:  # the store answers in this process; never let it stop the wait
                    logger.debug("launch: %s", exc)
            with lock:
                pending = [w for w in watchers if w.is_alive()]
                failed = any(c != 0 for cs in codes for c in cs)
            if not pending:
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            if stop_after_failure_s is not None and failed:
                failed_at = time.monotonic() if failed_at is None else failed_at
                if time.monotonic() - failed_at > stop_after_failure_s:
                    break
            pending[0].join(0.2)
    finally:
        with lock:
            live = [(r, p) for r, p in enumerate(procs) if p is not None and p.poll() is None]
        for r, p in live:
            stopped.add(r)
            p.kill()
            p.wait()
        for w in list(watchers):
            w.join(5.0)
        if outdir is not None:
            shutil.rmtree(outdir, ignore_errors=True)
    # ``store`` lives until here, after every rank: the survivors of a lost rank meet through it.
    end = ms.job_end(store)
    results = []
    for r in range(nproc):
        code = codes[r][-1] if codes[r] else -9
        report = ms.exit_report(store, r, len(codes[r]) - 1) if code != 0 else None
        results.append(RankResult(r, code, "".join(texts[r]), list(codes[r]), job_end=end,
                                  lost=(code < 0 and r not in stopped) or (report is not None and report["by"] == "self"),
                                  spare=code == 0 and ms.spare_state(store, r) == "waiting", stopped=r in stopped))
    return results


def job_exit_code(results: list[RankResult]) -> int:
    """The job's exit code: the code it ended with when it ended early (``job/end``: 1 for an
    error that ends every rank, 75 for a restart); else 0 when every rank either finished with 0
    or was lost while the others went on; else the first nonzero exit code of a rank that exited
    by itself (1 when every rank was killed)."""
    end = next((r.job_end for r in results if r.job_end is not None), None)
    if end is not None:
        return int(end["code"])
    if any(r.returncode == 0 for r in results) and all(r.returncode == 0 or r.lost for r in results):
        return 0
    own = [r.returncode for r in results if r.returncode > 0]
    return own[0] if own else FAILED_EXIT_CODE


def run_job(script_args: list[str], nproc: int, *, respawn: int = 0,
            stop_after_failure_s: float | None = None, grace_s: float | None = None) -> tuple[int, list[RankResult]]:
    """``launch_ranks`` for a job on a terminal: output streamed, Ctrl-C stops every rank.
    Returns (the job's exit code, each rank's result)."""
    def stop(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        results = launch_ranks(script_args, nproc, timeout_s=None, capture=False, respawn=respawn,
                               stop_after_failure_s=stop_after_failure_s, grace_s=grace_s)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return job_exit_code(results), results

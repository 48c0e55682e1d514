"""Where a run's wall time went, and its effective training time ratio: ETTR = productive / wall.

Every rank keeps the account of its own process (``WallAccount``); the logging rank prints it at the
end of the run in one line and writes it as one metrics row (``{"kind": "ettr", ...}``). The causes:

* ``productive``: the iterations the final model is made of (each iteration's own time, the one that
  counted: an iteration computed again after a rollback counts once, its earlier run is ``redone``);
* ``redone``: iterations computed and then thrown away (rolled back after a loss; redone from a
  checkpoint when a stage had no copy);
* ``detection``: from the start of an iteration a fault interrupted to the moment the training
  thread learnt of it (the fault to its verdict, with the part of the iteration done before it);
* ``pause``: from there to the first iteration after (the recovery, a planned re-layout);
* ``checkpoint`` saves, ``evaluation``, ``setup`` (the process's start to its first iteration:
  imports, model, data, a checkpoint's load);
* ``restarts``: across launches of the same run (a requeued Slurm job, a restart after exit 75):
  from the save of the checkpoint a launch resumed from to the start of that launch (the work lost
  after that save, the time in the queue, the launcher's start). The earlier launches' account
  travels in the checkpoint (``to_state`` / ``resume``), so the last launch reports the whole run;
* ``other``: the rest (logging, extension hooks, the gaps between iterations).

The figure large-scale training reports use (e.g. ByteDance's 97 % on a 9,600-GPU job).
"""
from __future__ import annotations

import time
from typing import Any, Callable

CAUSES = ("productive", "detection", "pause", "redone", "checkpoint", "evaluation", "setup", "restarts", "other")


RUN_START_S: float | None = None
"""Where the run's wall time starts: set by ``pretrain_gpt.py`` to its process's start; else (a trainer
made in a longer-lived process, a test) the trainer's creation."""


def run_start_s() -> float:
    return RUN_START_S if RUN_START_S is not None else time.time()


def process_start_s() -> float:
    """When this process started (wall clock, seconds since the epoch); now where it cannot be told."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # no psutil, or no /proc
        return time.time()


class WallAccount:
    def __init__(self, start_s: float | None = None, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.start_s = run_start_s() if start_s is None else float(start_s)
        self.iterations: dict[int, float] = {}
        self.spent = {c: 0.0 for c in CAUSES if c not in ("productive", "other")}
        self.carried: dict[str, float] = {}   # earlier launches, up to the save this one resumed from
        self.carried_wall_s = 0.0

    def charge(self, cause: str, seconds: float) -> None:
        if cause not in self.spent:
            raise ValueError(f"unknown cause {cause!r}; one of {', '.join(self.spent)}")
        self.spent[cause] += max(float(seconds), 0.0)

    def iteration(self, iteration: int, seconds: float) -> None:
        """``iteration`` took ``seconds``; an iteration computed before counts as redone."""
        if iteration in self.iterations:
            self.spent["redone"] += self.iterations[iteration]
        self.iterations[iteration] = float(seconds)

    def summary(self, now: float | None = None) -> dict[str, Any]:
        """``wall_s``, ``ettr`` and seconds per cause (earlier launches included)."""
        now = self.clock() if now is None else now
        seconds = {"productive": sum(self.iterations.values()), **self.spent}
        for c, s in self.carried.items():
            seconds[c] = seconds.get(c, 0.0) + s
        wall = max(now - self.start_s, 0.0) + self.carried_wall_s
        seconds["other"] = max(wall - sum(v for c, v in seconds.items() if c != "other"), 0.0)
        return {"wall_s": round(wall, 3), "ettr": round(seconds["productive"] / wall, 4) if wall > 0 else None,
                "seconds": {c: round(seconds[c], 3) for c in CAUSES}}

    def to_state(self, upto_iteration: int) -> dict[str, Any]:
        """For a checkpoint of ``upto_iteration``: the account up to now, the iterations after it left
        out (a resume redoes them)."""
        s = self.summary()
        later = sum(t for i, t in self.iterations.items() if i > upto_iteration)
        seconds = dict(s["seconds"])
        seconds["productive"] -= later
        seconds["redone"] += later
        return {"saved_at_s": self.clock(), "wall_s": s["wall_s"], "seconds": seconds}

    KEEP = 1000
    """Iterations an exported account names one by one (older ones count as one productive total)."""

    def export(self) -> dict[str, Any]:
        """The account for a process that joins the job (a replacement takes the job's account, not
        its own process's): JSON."""
        recent = sorted(self.iterations)[-self.KEEP:]
        older = sum(t for i, t in self.iterations.items() if i not in set(recent))
        return {"start_s": self.start_s, "spent": dict(self.spent), "carried": dict(self.carried),
                "carried_wall_s": self.carried_wall_s, "older_productive_s": older,
                "iterations": {str(i): self.iterations[i] for i in recent}}

    def adopt(self, account: dict[str, Any] | None) -> None:
        """Take the job's account (``export`` of a member) in place of this process's own."""
        if not account:
            return
        self.start_s = float(account["start_s"])
        self.spent = {c: float(account["spent"].get(c, 0.0)) for c in self.spent}
        self.carried = {c: float(v) for c, v in account.get("carried", {}).items()}
        self.carried_wall_s = float(account.get("carried_wall_s", 0.0))
        self.iterations = {int(i): float(t) for i, t in account["iterations"].items()}
        older = float(account.get("older_productive_s", 0.0))
        if older:
            self.carried["productive"] = self.carried.get("productive", 0.0) + older

    def resume(self, state: dict[str, Any] | None) -> None:
        """This launch resumes from a checkpoint whose account is ``state``: carry it, and count the
        time from that save to this process's start as a restart."""
        if not state:
            return
        try:
            carried = {c: float(v) for c, v in state["seconds"].items() if c in CAUSES}
            wall, saved_at = float(state["wall_s"]), float(state["saved_at_s"])
        except (KeyError, TypeError, ValueError, AttributeError):
            return  # an account this version cannot read: the run's own still holds
        gap = max(self.start_s - saved_at, 0.0)
        carried["restarts"] = carried.get("restarts", 0.0) + gap
        self.carried, self.carried_wall_s = carried, wall + gap


def describe(summary: dict[str, Any]) -> str:
    """The one line at the end of a run."""
    wall, sec = summary["wall_s"], summary["seconds"]
    ettr = summary["ettr"]
    parts = [f"{c} {sec[c]:.1f} s ({100 * sec[c] / wall:.1f} %)" if wall else f"{c} {sec[c]:.1f} s"
             for c in CAUSES if sec[c] > 0 or c == "productive"]
    head = f"ETTR {ettr:.3f}" if ettr is not None else "ETTR n/a"
    return f"{head} (effective training time / wall time) over {wall:.1f} s: " + ", ".join(parts)

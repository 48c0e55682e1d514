"""What a run tells its reader: the progress and validation lines, the metrics file (one JSON object
per line), TensorBoard scalars, and the rows kept in memory (``history``, what ``Trainer.run``
returns).

Only the logging rank (last stage, TP 0, DP 0) writes; the others keep nothing. A layout change may
make another process the logging rank: the outputs close before it and reopen after (the new
logging rank appends), and the rows in memory are handed over (``ft/transaction.py``). A resume,
or a rollback to a checkpoint, drops the train and validation rows after the checkpoint's
iteration (``rewind``) so the curves continue without duplicates.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

from megatron_ext.runtime import rundir
from megatron_ext.runtime.extension import IterationMetrics


def format_eta(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


# After a layout change: iterations left out while the new layout warms up, then the window whose
# median is "after"; "during" a fail-slow fault is the window before the change, "before" the one
# before that (the detector names a slow rank a few iterations after it slowed).
SETTLE_ITERS, AFTER_ITERS, DURING_ITERS, BEFORE_ITERS = 2, 10, 5, 10


def _median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None and math.isfinite(x))
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else 0.5 * (xs[mid - 1] + xs[mid])


def recovery_report(change: dict[str, Any], rows: list[dict[str, Any]], since: int = 0) -> dict[str, Any] | None:
    """Whether throughput recovered after the layout change ``change`` (its ``layout_change`` row),
    from the train rows kept so far; None until ``SETTLE_ITERS + AFTER_ITERS`` iterations ran
    after it. Medians of the measured iteration time (ms): before the fault, during it (a
    re-layout: the iterations before the change, while a rank was slow; a lost rank: the pause),
    and after the change once settled. ``since``: the iteration of the change before this one (the
    windows before the change stay in the layout it made)."""
    c = int(change["iteration"])
    times = {int(r["iteration"]): r.get("iter_time_s") for r in rows if r.get("kind") == "train"
             and int(r["iteration"]) > since}
    first, last = c + SETTLE_ITERS + 1, c + SETTLE_ITERS + AFTER_ITERS
    if last not in times:
        return None
    after = _median([times.get(i) for i in range(first, last + 1)])
    if change["cause"] == "relayout":
        during = _median([times.get(i) for i in range(c - DURING_ITERS + 1, c + 1)])
        before = _median([times.get(i) for i in range(c - DURING_ITERS - BEFORE_ITERS + 1, c - DURING_ITERS + 1)])
    else:  # a loss or a join: the change itself is the event; before it, the layout that ran
        during = None
        before = _median([times.get(i) for i in range(c - BEFORE_ITERS + 1, c + 1)])
    ms = lambda x: None if x is None else round(1e3 * x, 2)  # noqa: E731
    return {"iteration": last, "change_iteration": c, "cause": change["cause"], "from": change.get("from"), "to": change.get("to"),
            "before_ms": ms(before), "during_ms": ms(during), "pause_s": change.get("pause_s"),
            "after_ms": ms(after), "after_iterations": [first, last],
            "after_vs_before": round(before / after, 4) if before and after else None}


def describe_recovery(rep: dict[str, Any]) -> str:
    """The one line after a layout change has settled."""
    fmt = lambda x: "n/a" if x is None else f"{x:.1f} ms"  # noqa: E731
    what = {"relayout": "the re-layout", "fail_stop": "the loss", "grow": "the rejoin"}.get(rep["cause"], rep["cause"])
    before = "before the fault" if rep["cause"] != "grow" else "before it"
    during = f"{fmt(rep['during_ms'])} during it" if rep["cause"] == "relayout" else f"paused {rep['pause_s']:.2f} s"
    a, b = rep["after_iterations"]
    share = ("" if rep["after_vs_before"] is None else
             f": throughput {100 * rep['after_vs_before']:.0f} % of {'before the fault' if rep['cause'] != 'grow' else 'before it'}")
    shape = f"{rep['to']} kept" if rep["from"] == rep["to"] else f"{rep['from'] or 'new'} -> {rep['to']}"
    return (f"layout change at iteration {rep['change_iteration']} ({what}, {shape}): "
            f"iteration time {fmt(rep['before_ms'])} {before}, {during}, {fmt(rep['after_ms'])} after "
            f"(median of iterations {a}-{b}){share}")


class RunLog:
    """The run's outputs. ``logging``: the run's ``LoggingConfig``; ``train_iters`` for the ETA."""

    def __init__(self, logging: Any, train_iters: int) -> None:
        self.cfg = logging
        self.train_iters = train_iters
        self.history: list[dict[str, Any]] = []
        self.tensorboard = None     # a SummaryWriter on the logging rank while open
        self._metrics_fh = None
        self._unsettled: list[tuple[dict[str, Any], int]] = []   # a change not reported yet, the one before it
        self._last_change = 0

    # --- files ------------------------------------------------------------------------------
    def open(self, *, purge_step: int | None = None) -> None:
        """Open (appending) the metrics file and TensorBoard; call on the logging rank only.
        ``purge_step``: TensorBoard drops the events from this step on (a resume)."""
        lg = self.cfg
        if lg.tensorboard_dir and self.tensorboard is None:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=lg.tensorboard_dir, purge_step=purge_step)
        if lg.metrics_file and self._metrics_fh is None:
            os.makedirs(os.path.dirname(os.path.abspath(lg.metrics_file)), exist_ok=True)
            self._metrics_fh = open(lg.metrics_file, "a", encoding="utf-8")

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.flush()
            self.tensorboard.close()
            self.tensorboard = None
        if self._metrics_fh is not None:
            self._metrics_fh.close()
            self._metrics_fh = None

    def rewind(self, iteration: int) -> None:
        """The iterations after ``iteration`` are redone: their train and validation rows go, from
        memory and the metrics file (as on a resume); every other row stays."""
        redo = lambda row: row.get("kind") in ("train", "valid") and int(row.get("iteration", 0)) > iteration  # noqa: E731
        self.history = [row for row in self.history if not redo(row)]
        if self.cfg.metrics_file:
            rundir.truncate_metrics(self.cfg.metrics_file, iteration, kinds=("train", "valid"))

    # --- rows -------------------------------------------------------------------------------
    def record(self, kind: str, payload: dict[str, Any]) -> None:
        row = {"kind": kind, **payload}
        self.history.append(row)
        if kind == "layout_change":
            # Another change before this one settled: only the newest is reported.
            self._unsettled = [(row, self._last_change)]
            self._last_change = int(row["iteration"])
        if self._metrics_fh is not None:
            self._metrics_fh.write(json.dumps(row) + "\n")
            self._metrics_fh.flush()

    def train(self, m: IterationMetrics, avg_time: float) -> None:
        """One iteration: its row, its scalars, at every log interval its progress line, and once a
        layout change has settled, whether throughput recovered (a ``layout_recovery`` row)."""
        self.record("train", {"iteration": m.iteration, "loss": m.loss, "lr": m.lr, "grad_norm": m.grad_norm,
                              "iter_time_s": m.iter_time_s, "tokens_per_s": m.tokens_per_s,
                              "consumed_samples": m.consumed_samples, **m.extra})
        tb = self.tensorboard
        if tb is not None:
            tb.add_scalar("train/lm_loss", m.loss, m.iteration)
            tb.add_scalar("train/lr", m.lr, m.iteration)
            tb.add_scalar("train/tokens_per_s", m.tokens_per_s, m.iteration)
            if m.grad_norm is not None:
                tb.add_scalar("train/grad_norm", m.grad_norm, m.iteration)
            for k, v in m.extra.items():
                if isinstance(v, (int, float)):
                    tb.add_scalar(f"train/{k}", v, m.iteration)
        if self.cfg.progress and m.iteration % self.cfg.log_interval == 0:
            eta = format_eta(avg_time * (self.train_iters - m.iteration))
            gn = f"{m.grad_norm:.3f}" if m.grad_norm is not None else "n/a"
            extra = "".join(f" | {k}: {v:.3g}" if isinstance(v, float) else f" | {k}: {v}"
                            for k, v in m.extra.items())
            print(f" iteration {m.iteration:6d}/{self.train_iters:6d} | loss {m.loss:.4f} | lr {m.lr:.3e} | "
                  f"grad norm {gn} | {m.iter_time_s * 1000:7.1f} ms | {m.tokens_per_s:8.0f} tokens/s | "
                  f"ETA {eta}{' | skipped' if m.skipped else ''}{extra}", flush=True)
        self._report_recovery(m.iteration)

    def _report_recovery(self, iteration: int) -> None:
        while self._unsettled:
            change, since = self._unsettled[0]
            if iteration < change["iteration"] + SETTLE_ITERS + AFTER_ITERS:
                return
            self._unsettled.pop(0)
            rep = recovery_report(change, self.history, since)
            if rep is None:
                continue
            self.record("layout_recovery", rep)
            if self.cfg.progress:
                print(" " + describe_recovery(rep), flush=True)

    def validation(self, iteration: int, loss: float) -> None:
        ppl = math.exp(min(loss, 50.0))
        self.record("valid", {"iteration": iteration, "loss": loss, "ppl": ppl})
        if self.tensorboard is not None:
            self.tensorboard.add_scalar("valid/lm_loss", loss, iteration)
            self.tensorboard.add_scalar("valid/ppl", ppl, iteration)
        if self.cfg.progress:
            print(f" validation at iteration {iteration:6d} | loss {loss:.4f} | ppl {ppl:.2f}", flush=True)

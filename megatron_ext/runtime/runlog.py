"""What a run tells its reader: the progress and validation lines (ours, or Megatron-LM's with
``--log-format megatron``), the metrics file (one JSON object per line), the scalars of TensorBoard and
Weights & Biases under Megatron-LM's names (``runtime/scalars.py``), and the rows kept in memory
(``history``, what ``Trainer.run`` returns).

Only the logging rank (last stage, TP 0, DP 0) writes; the others keep nothing. A layout change may
make another process the logging rank: the outputs close before it and reopen after (the new
logging rank appends), and the rows in memory are handed over (``ft/transaction.py``). A resume,
or a rollback to a checkpoint, drops the train and validation rows after the checkpoint's
iteration (``rewind``) so the curves continue without duplicates.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
from typing import Any, Mapping

from megatron_ext.runtime import rundir
from megatron_ext.runtime.extension import IterationMetrics
from megatron_ext.runtime.moe_aux_loss import megatron_loss_name
from megatron_ext.runtime.scalars import Scalars, open_tensorboard, open_wandb, perplexity


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


LM_LOSS = "lm loss"
"""Megatron-LM's name of the language-model loss (its loss_dict key): TensorBoard tag and line field."""


@dataclasses.dataclass
class Interval:
    """What Megatron-LM's progress line sums between two lines: iterations, those that updated the
    model and those skipped (a skipped one with a non-finite loss is a nan iteration), the losses of
    the updated ones by name, the iteration time and the timers."""

    iterations: int = 0
    advanced: int = 0
    skipped: int = 0
    nan: int = 0
    time_s: float = 0.0
    losses: dict[str, float] = dataclasses.field(default_factory=dict)
    timers_s: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, m: IterationMetrics, losses: Mapping[str, float]) -> None:
        self.iterations += 1
        self.time_s += m.iter_time_s
        for name, t in m.timers_s.items():
            self.timers_s[name] = self.timers_s.get(name, 0.0) + t
        if m.skipped:
            self.skipped += 1
            self.nan += int(any(not math.isfinite(v) for v in losses.values()))
            return
        self.advanced += 1
        for name, v in losses.items():
            self.losses[name] = self.losses.get(name, 0.0) + v

    def mean_time_s(self) -> float:
        return self.time_s / max(self.iterations, 1)


class RunLog:
    """The run's outputs. ``logging``: the run's ``LoggingConfig``; ``train_iters`` for the ETA;
    ``config`` (the run's flat config) and ``save`` (``--save``) for Weights & Biases. The trainer
    sets ``first_iteration`` (the first this run trains: Megatron-LM's line is printed there too),
    and on the logging rank ``world_size`` and, with ``--log-throughput``, ``flops_per_sample`` (the
    model's forward and backward FLOPs of one sequence, ``models/flops.py``)."""

    def __init__(self, logging: Any, train_iters: int, *, config: Mapping[str, Any] | None = None,
                 save: str | None = None) -> None:
        self.cfg = logging
        self.train_iters = train_iters
        self.config = dict(config or {})
        self.save = save
        self.history: list[dict[str, Any]] = []
        self.first_iteration = 1
        self.world_size = 1
        self.flops_per_sample: float | None = None
        self.consumed_samples = 0          # at the last train row: validation's "vs samples" step
        self._tb = None                    # a SummaryWriter on the logging rank while open
        self._wandb = None                 # a wandb run, from the first open to the end of the run
        self._metrics_fh = None
        self._interval = Interval()
        self._unsettled: list[tuple[dict[str, Any], int]] = []   # a change not reported yet, the one before it
        self._last_change = 0

    @property
    def tensorboard(self) -> Scalars | None:
        """Where scalars go (TensorBoard and Weights & Biases; ``add_scalar(tag, value, step)``), or
        None when neither is open on this rank."""
        if self._tb is None and self._wandb is None:
            return None
        return Scalars(self._tb, self._wandb)

    # --- files ------------------------------------------------------------------------------
    def open(self, *, purge_step: int | None = None) -> None:
        """Open (appending) the metrics file, TensorBoard and Weights & Biases; call on the logging
        rank only. ``purge_step``: TensorBoard drops the events from this step on (a resume)."""
        lg = self.cfg
        if lg.tensorboard_dir and self._tb is None:
            self._tb = open_tensorboard(lg.tensorboard_dir, purge_step=purge_step, queue_size=lg.tensorboard_queue_size)
        if lg.wandb_project and self._wandb is None:
            self._wandb = open_wandb(lg, config=self.config, save=self.save)
        if lg.metrics_file and self._metrics_fh is None:
            os.makedirs(os.path.dirname(os.path.abspath(lg.metrics_file)), exist_ok=True)
            self._metrics_fh = open(lg.metrics_file, "a", encoding="utf-8")

    def close(self, *, finish: bool = False) -> None:
        """Close the files (a layout change reopens them, on whichever rank then logs). The Weights
        & Biases run stays open in this process until ``finish`` (the end of the run, or the process
        leaving the job): a layout change that keeps the logging rank here keeps one run."""
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        if self._metrics_fh is not None:
            self._metrics_fh.close()
            self._metrics_fh = None
        if finish and self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def rewind(self, iteration: int) -> None:
        """The iterations after ``iteration`` are redone: their train and validation rows go, from
        memory and the metrics file (as on a resume); every other row stays."""
        redo = lambda row: row.get("kind") in ("train", "valid") and int(row.get("iteration", 0)) > iteration  # noqa: E731
        self.history = [row for row in self.history if not redo(row)]
        if self.cfg.metrics_file:
            rundir.truncate_metrics(self.cfg.metrics_file, iteration, kinds=("train", "valid"))

    # --- rows -------------------------------------------------------------------------------
    def record(self, kind: str, payload: dict[str, Any], *, history: bool = True) -> None:
        """One metrics row; ``history`` False: the metrics file only (a summary after the last
        iteration, which a caller reading the returned history's last row as an iteration's must not
        meet)."""
        row = {"kind": kind, **payload}
        if history:
            self.history.append(row)
        if kind == "layout_change":
            # Another change before this one settled: only the newest is reported.
            self._unsettled = [(row, self._last_change)]
            self._last_change = int(row["iteration"])
        if self._metrics_fh is not None:
            self._metrics_fh.write(json.dumps(row) + "\n")
            self._metrics_fh.flush()

    def tflops_per_device(self, iter_time_s: float, batch: int) -> float | None:
        """Model TFLOP/s per device of an iteration of ``batch`` sequences that took ``iter_time_s``
        (Megatron-LM's throughput: the FLOPs over the time and the world size); None without
        ``--log-throughput``."""
        if self.flops_per_sample is None:
            return None
        return self.flops_per_sample * batch / (max(iter_time_s, 1e-12) * 1e12 * max(self.world_size, 1))

    def _line_due(self, iteration: int) -> bool:
        """Megatron-LM's rule: the run's first iteration and every ``--log-interval``; ours also the last."""
        due = iteration % self.cfg.log_interval == 0 or iteration == self.first_iteration
        return due or (self.cfg.log_format != "megatron" and iteration == self.train_iters)

    def train(self, m: IterationMetrics, avg_time: float) -> None:
        """One iteration: its row, its scalars, at a log interval its progress line, and once a
        layout change has settled, whether throughput recovered (a ``layout_recovery`` row)."""
        batch = m.global_batch_size
        tflops = self.tflops_per_device(m.iter_time_s, batch) if batch else None
        self.consumed_samples = m.consumed_samples
        self.record("train", {"iteration": m.iteration, "loss": m.loss, "lr": m.lr, "grad_norm": m.grad_norm,
                              "iter_time_s": m.iter_time_s, "tokens_per_s": m.tokens_per_s,
                              "consumed_samples": m.consumed_samples,
                              **({"tflops_per_device": tflops} if tflops is not None else {}),
                              **({"params_norm": m.params_norm} if m.params_norm is not None else {}),
                              **({"num_zeros_in_grad": m.num_zeros_in_grad} if m.num_zeros_in_grad is not None
                                 else {}), **m.extra})
        losses = {LM_LOSS: m.loss} if m.loss is not None else {}
        losses.update({name: v for k, v in m.extra.items() if (name := megatron_loss_name(k)) is not None})
        self._interval.add(m, losses)
        if m.iteration % self.cfg.tensorboard_log_interval == 0:
            self._write_train_scalars(m, losses)
        if self._line_due(m.iteration):
            self._log_point(m, avg_time, tflops)
        self._report_recovery(m.iteration)

    def _write_train_scalars(self, m: IterationMetrics, losses: Mapping[str, float]) -> None:
        out = self.tensorboard
        if out is None:
            return
        lg = self.cfg
        series = {"learning-rate": m.lr, "batch-size": m.global_batch_size, **losses}
        if lg.log_loss_scale_to_tensorboard:
            series["loss-scale"] = m.loss_scale
        if lg.log_world_size_to_tensorboard:
            series["world-size"] = self.world_size
        series["grad-norm"] = m.grad_norm
        if m.params_norm is not None:
            series["params-norm"] = m.params_norm
        if m.num_zeros_in_grad is not None:
            series["num-zeros"] = m.num_zeros_in_grad
        out.add_scalars(series, m.iteration, samples=m.consumed_samples,
                        wandb_extra={"samples vs steps": m.consumed_samples})
        ours = {"train/tokens_per_s": m.tokens_per_s}
        ours.update({f"train/{k}": v for k, v in m.extra.items()
                     if isinstance(v, (int, float)) and megatron_loss_name(k) is None})
        out.add_scalars(ours, m.iteration)

    def _log_point(self, m: IterationMetrics, avg_time: float, tflops: float | None) -> None:
        """A progress line is due: Megatron-LM's interval figures (timers to TensorBoard, its line
        with --log-format megatron), then the interval starts again (not after the first iteration,
        whose line only documents the start-up)."""
        lg, iv = self.cfg, self._interval
        first = m.iteration == self.first_iteration
        per_iter_s = iv.mean_time_s()
        interval_tflops = self.tflops_per_device(per_iter_s, m.global_batch_size) if m.global_batch_size else None
        out = self.tensorboard
        if out is not None and lg.log_timers_to_tensorboard and not first:
            timers = {"iteration-time": per_iter_s}
            if interval_tflops is not None:
                timers["throughput"] = interval_tflops
            if lg.timing_log_level >= 1:
                timers.update({f"{name}-time": t / iv.iterations for name, t in iv.timers_s.items()})
            out.add_scalars(timers, m.iteration)
        if lg.progress:
            if lg.log_format == "megatron":
                print(self._megatron_line(m, per_iter_s, interval_tflops), flush=True)
            else:
                print(self._line(m, avg_time, tflops), flush=True)
        if not first:
            self._interval = Interval()

    def _line(self, m: IterationMetrics, avg_time: float, tflops: float | None) -> str:
        eta = format_eta(avg_time * (self.train_iters - m.iteration))
        gn = f"{m.grad_norm:.3f}" if m.grad_norm is not None else "n/a"
        pn = f" | params norm {m.params_norm:.3f}" if m.params_norm is not None else ""
        pn += f" | num zeros {m.num_zeros_in_grad}" if m.num_zeros_in_grad is not None else ""
        flops = f" | {tflops:6.2f} TFLOP/s per device" if tflops is not None else ""
        extra = "".join(f" | {k}: {v:.3g}" if isinstance(v, float) else f" | {k}: {v}" for k, v in m.extra.items())
        return (f" iteration {m.iteration:6d}/{self.train_iters:6d} | loss {m.loss:.4f} | lr {m.lr:.3e} | "
                f"grad norm {gn}{pn} | {m.iter_time_s * 1000:7.1f} ms | {m.tokens_per_s:8.0f} tokens/s{flops} | "
                f"ETA {eta}{' | skipped' if m.skipped else ''}{extra}")

    def _megatron_line(self, m: IterationMetrics, per_iter_s: float, tflops: float | None) -> str:
        """Megatron-LM's progress line (``training_log``): its fields, order and formats; the losses
        are means over the interval's updated iterations, the time its mean per iteration. Our own
        fields (bubbles, ResiHP, the squeezer) follow its last field in the same form."""
        iv = self._interval
        now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")
        text = (f" [{now}] iteration {m.iteration:8d}/{self.train_iters:8d} |"
                f" consumed samples: {m.consumed_samples:12d} |"
                f" elapsed time per iteration (ms): {per_iter_s * 1000.0:.1f} |")
        if tflops is not None:
            text += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
        text += f" learning rate: {m.lr:.6E} | global batch size: {m.global_batch_size or 0:5d} |"
        for name, total in iv.losses.items():
            avg = total / max(1, iv.advanced)
            if avg > 0.0:
                text += f" {name}: {avg:.6E} |"
        text += f" loss scale: {m.loss_scale:.1f} |"
        if m.grad_norm is not None:
            text += f" grad norm: {m.grad_norm:.3f} |"
        if m.num_zeros_in_grad is not None:
            text += f" num zeros: {m.num_zeros_in_grad} |"
        if m.params_norm is not None:
            text += f" params norm: {m.params_norm:.3f} |"
        text += f" number of skipped iterations: {iv.skipped:3d} | number of nan iterations: {iv.nan:3d} |"
        for k, v in m.extra.items():
            if megatron_loss_name(k) is None:
                text += f" {k}: {v:.3g} |" if isinstance(v, float) else f" {k}: {v} |"
        return text

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

    def validation(self, iteration: int, loss: float, *, final: bool = False) -> None:
        """A validation loss: its row, Megatron-LM's scalars and the line (``final``: the one after
        training, which Megatron-LM's line says)."""
        ppl = perplexity(loss)
        self.record("valid", {"iteration": iteration, "loss": loss, "ppl": ppl})
        out = self.tensorboard
        if out is not None:
            tag = f"{LM_LOSS} validation"
            out.add_scalars({tag: loss}, iteration, samples=self.consumed_samples)
            if self.cfg.log_validation_ppl_to_tensorboard:   # TensorBoard only, as in Megatron-LM
                Scalars(self._tb).add_scalars({f"{tag} ppl": ppl}, iteration, samples=self.consumed_samples)
        if not self.cfg.progress:
            return
        if self.cfg.log_format == "megatron":
            where = f"iteration {iteration}" + (" on validation set" if final else "")
            text = f" validation loss at {where} | {LM_LOSS} value: {loss:.6E} | {LM_LOSS} PPL: {ppl:.6E} | "
            rule = "-" * (len(text) + 1)
            print(f"{rule}\n{text}\n{rule}", flush=True)
        else:
            print(f" validation at iteration {iteration:6d} | loss {loss:.4f} | ppl {ppl:.2f}", flush=True)

"""``pretrain_gpt.py --squeeze tune.yaml``: Hydro trials in this job's pipeline bubbles.

Each rank gets one guest process (``controller.GuestProcess``) that trains a fused bundle of the
YAML's Optuna study, only inside this rank's bubble windows (``pipeline/windows.py``, driven by the
pipeline events of either engine). Every ``--squeeze-control-every``-th iteration runs with the
guests parked; ``safety.SlowdownMonitor`` compares the two kinds of iterations block by block, and
all ranks back off together (a larger margin, fewer trials) and at last stop their guests when the
job is significantly slower than ``--squeeze-max-slowdown``. Guests never join the job's process
group; a guest that dies is restarted and its trials given back; the job never waits for one. At the
end each rank appends its run's figures to ``figures_rank<R>.json`` (``figures.py``) and rank 0
sums up the study, with the trials given back unfinished apart from failures. See docs/squeezer.md.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import resource
from typing import TYPE_CHECKING, Any

from megatron_ext.config.base import ConfigError, doc
from megatron_ext.config.run import section
from megatron_ext.runtime.extension import Extension, IterationMetrics, register_extension

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.hydro.config import HydroTuneConfig
    from megatron_ext.runtime.loop import Trainer

logger = logging.getLogger(__name__)

ACTIONS = ("keep", "back off", "stop")


@section("squeeze")
@dataclasses.dataclass(kw_only=True)
class SqueezeConfig:
    """Bubble Squeezer: a Hydro tuning study's trials run in this job's pipeline bubbles."""

    squeeze: str | None = doc("A Hydro tune YAML (e.g. configs/tune_tiny.yaml): run its study's trials in this "
                              "job's bubbles, one guest process beside each rank.", None)
    squeeze_max_slowdown: float = doc("Back off, and at last stop the guests, when iterations with guests are "
                                      "this much slower (a fraction) than the guest-off control iterations.", 0.01)
    squeeze_control_every: int = doc("Every N-th iteration runs with the guests parked: the control.", 4)
    squeeze_check_every: int = doc("Iterations per safety check (each compares its own guest-on and control "
                                   "iterations).", 40)
    squeeze_memory_budget_mb: float = doc("Memory of this rank's device; a guest gets what the rank leaves free at "
                                          "its peak. 0: the GPU's total memory, or on CPU half of MemAvailable "
                                          "shared by this host's ranks.", 0.0)
    squeeze_margin_ms: float = doc("Guests park this long before a window's forecast end.", 0.5)
    squeeze_forecast_quantile: float = doc("A window's forecast: this quantile of its recent lengths (low errs "
                                           "short).", 0.2)
    squeeze_start_iter: int = doc("Start the guests after this many iterations of the run (forecasts and the "
                                  "rank's memory peak need a few iterations; a resumed run counts from where it "
                                  "resumed).", 3)
    squeeze_max_restarts: int = doc("Restarts of a guest that died, per rank.", 3)
    squeeze_dir: str | None = doc("Guest logs, operation logs and figures; default <output_dir of the tune "
                                  "YAML>/squeeze.", None)

    def __post_init__(self) -> None:
        # The tune YAML, read once, here: the extension's setup takes it from this config.
        self.tune: HydroTuneConfig | None = None
        if self.squeeze is None:
            return
        if not os.path.isfile(self.squeeze):
            raise ConfigError(f"--squeeze: {self.squeeze} is not a file (a Hydro tune YAML, e.g. "
                              "configs/tune_tiny.yaml)")
        from megatron_ext.hydro.config import load_config

        self.tune = tune = load_config(self.squeeze)[0]   # a bad tune YAML is reported now, with its file and line
        if tune.resolved_storage() == "memory":
            raise ConfigError(f"--squeeze: {self.squeeze}: storage 'memory' cannot be shared by the guests of "
                              "several ranks; leave storage empty (SQLite in output_dir) or give a database URL")
        if not 0 <= self.squeeze_max_slowdown < 1:
            raise ConfigError(f"--squeeze-max-slowdown must be in [0, 1), got {self.squeeze_max_slowdown}")
        if self.squeeze_control_every < 2:
            raise ConfigError(f"--squeeze-control-every must be >= 2, got {self.squeeze_control_every}")
        if self.squeeze_check_every < 2 * self.squeeze_control_every:
            raise ConfigError(f"--squeeze-check-every ({self.squeeze_check_every}) must be at least twice "
                              f"--squeeze-control-every ({self.squeeze_control_every})")
        if not 0 <= self.squeeze_forecast_quantile <= 1:
            raise ConfigError(f"--squeeze-forecast-quantile must be in [0, 1], got {self.squeeze_forecast_quantile}")
        for key in ("squeeze_memory_budget_mb", "squeeze_margin_ms", "squeeze_start_iter", "squeeze_max_restarts"):
            if getattr(self, key) < 0:
                raise ConfigError(f"--{key.replace('_', '-')} must be >= 0, got {getattr(self, key)}")


def guest_budget_bytes(cfg: SqueezeConfig, device: Any, local_ranks: int) -> int:
    """What this rank leaves free at its peak, for its guest."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        total = cfg.squeeze_memory_budget_mb * 2 ** 20 or torch.cuda.get_device_properties(device).total_memory
        return max(0, int(total - torch.cuda.max_memory_reserved(device)))
    if cfg.squeeze_memory_budget_mb > 0:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB
        return max(0, int(cfg.squeeze_memory_budget_mb * 2 ** 20 - peak))
    from megatron_ext.hydro.memory import available_bytes

    return available_bytes(torch.device("cpu")) // max(1, local_ranks)   # half of MemAvailable, shared


class SqueezerExtension(Extension):
    name = "squeeze"
    requires = ("timeline",)       # its recorder drives the bubble windows

    def __init__(self, cfg: SqueezeConfig) -> None:
        self.cfg = cfg
        self.guest = None
        self.squeezer = None
        self.enabled = False
        self.blocks: list[dict[str, Any]] = []
        self.run_start: int | None = None      # this run's first iteration (> 1 when it resumed)

    # --- set-up ---------------------------------------------------------------------------------
    def setup(self, trainer: "Trainer") -> None:
        from megatron_ext.hydro.squeezer.safety import SlowdownMonitor
        from megatron_ext.pipeline.windows import BubbleWindows, WindowForecaster

        c = self.cfg
        self.tune_path = os.path.abspath(c.squeeze)
        tune = c.tune
        self.study_name, self.storage = tune.study_name, tune.resolved_storage()
        self.dir = os.path.abspath(c.squeeze_dir or os.path.join(tune.output_dir, "squeeze"))
        self.timeline = self.deps["timeline"]
        self.monitor = SlowdownMonitor(c.squeeze_max_slowdown, c.squeeze_control_every, c.squeeze_check_every)
        self.windows = BubbleWindows(WindowForecaster(c.squeeze_forecast_quantile))
        lay = trainer.ctx.layout
        self.enabled = lay.pp > 1 or lay.dp > 1
        self.measure_from = c.squeeze_start_iter + 1     # set from the run's first iteration
        if trainer.ctx.rank == 0:
            if self.enabled:
                logger.info("squeeze: study '%s' (%s) in the bubbles of %s; guests start after the run's first %d iterations; "
                            "every %d-th iteration is a guest-off control; logs in %s", self.study_name,
                            self.storage, trainer.layout_name(), c.squeeze_start_iter, c.squeeze_control_every,
                            self.dir)
            else:
                logger.warning("squeeze: %s has no pipeline stages or replicas to wait for (PP 1, DP 1): no "
                               "bubbles, no guests", trainer.layout_name())
        self.attach(trainer)

    def attach(self, trainer: "Trainer") -> None:
        """(Again after a re-layout: the schedule and so every window position changed.)"""
        self.windows.forecaster.reset()
        self.timeline.recorder.observer = self.windows if self.enabled else None
        self.timeline.guest_runs = self._guest_runs if self.enabled else None

    def detach(self, trainer: "Trainer") -> None:
        self.timeline.recorder.observer = None

    def _start(self, trainer: "Trainer") -> None:
        from megatron_ext.hydro.squeezer.controller import GuestProcess, Squeezer

        ctx = trainer.ctx
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        budget = guest_budget_bytes(self.cfg, ctx.device, local)
        device = str(ctx.device) if ctx.device.type == "cuda" else "cpu"
        self.guest = GuestProcess(tune_config=self.tune_path, rank=ctx.rank, device=device, log_dir=self.dir,
                                  budget_bytes=budget, max_restarts=self.cfg.squeeze_max_restarts,
                                  sampler_key=(self.run_start,))
        self.guest.start()
        self.squeezer = Squeezer(self.guest, margin_s=self.cfg.squeeze_margin_ms / 1e3, suspend=device == "cpu")
        self.windows.listeners.append(self.squeezer)
        logger.debug("squeeze: rank %d started guest pid %d with %.0f MiB free", ctx.rank, self.guest.proc.pid,
                     budget / 2 ** 20)

    # --- the loop -------------------------------------------------------------------------------
    def before_iteration(self, trainer: "Trainer", iteration: int) -> None:
        if not self.enabled:
            return
        if self.run_start is None:
            self.run_start = iteration
            self.measure_from = iteration + self.cfg.squeeze_start_iter
        if self.guest is None and iteration >= self.run_start + self.cfg.squeeze_start_iter:
            self._start(trainer)
        if self.guest is None:
            return
        self.squeezer.read_latencies()
        line = self.guest.check()
        if line:
            logger.warning("squeeze: %s", line)
        self.squeezer.active = (not self.monitor.stopped and not self.monitor.is_control(iteration)
                                and self.guest.ready)

    def after_iteration(self, trainer: "Trainer", metrics: IterationMetrics) -> None:
        if not self.enabled or self.guest is None:
            return
        it = metrics.iteration
        if it >= self.measure_from:
            res = self.monitor.observe(it, metrics.iter_time_s)
            if res is not None:
                self._agree(trainer, res)
        lg = trainer.cfg.logging
        if it % lg.log_interval == 0 or it == trainer.cfg.training.train_iters:
            self._progress(trainer, metrics)

    def _agree(self, trainer: "Trainer", res) -> None:
        """Collective: every rank acts on the most severe verdict of the block."""
        import torch
        import torch.distributed as dist

        from megatron_ext.hydro.squeezer.safety import level_settings
        from megatron_ext.runtime.distributed import collective_device

        # on the default group's collective device: NCCL on a GPU takes no CPU tensor
        mine = torch.tensor([float(ACTIONS.index(res.action)), res.slowdown, res.p_value, float(res.off)],
                            dtype=torch.float64, device=collective_device(trainer.ctx))
        rows = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, mine)
        # the most severe rank's verdict (then the largest slowdown), the same on every rank
        worst = max(range(len(rows)), key=lambda r: (float(rows[r][0]), float(rows[r][1])))
        action, slowdown, p_value, off = (ACTIONS[int(rows[worst][0])], float(rows[worst][1]),
                                          float(rows[worst][2]), int(rows[worst][3]))
        if action != res.action:
            self.monitor.force(action)
        keep_back, fusion_share = level_settings(self.monitor.level)
        self.squeezer.keep_back = keep_back
        if self.monitor.level:
            self.guest.ctl["max_trials"] = max(1, int(int(self.guest.ctl["fusion"]) * fusion_share))
        row = {"iterations": list(res.iterations), "rank": worst, "slowdown": slowdown, "p_value": p_value,
               "action": action, "level": self.monitor.level,
               "per_rank": [[float(r[1]), float(r[2])] for r in rows]}
        self.blocks.append(row)
        if trainer.ctx.rank == 0:
            msg = (f"squeeze: iterations {res.iterations[0]}-{res.iterations[1]}: slowdown {slowdown:+.2%} with "
                   f"guests vs {off} control iterations on rank {worst} (limit {self.cfg.squeeze_max_slowdown:.1%}, "
                   f"p={p_value:.3f})")
            if action == "back off":
                logger.warning("%s -> backing off to level %d: %.0f%% of each forecast kept back, fewer fused "
                               "trials", msg, self.monitor.level, keep_back * 100)
            elif action == "stop":
                logger.warning("%s -> guests stopped for the rest of the run (still slower after backing off %d "
                               "times)", msg, self.monitor.levels)
            else:
                logger.info("%s -> keep", msg)
        if action == "stop":
            from megatron_ext.hydro.squeezer.control import STOP_MONITOR

            self.squeezer.active = False
            self.squeezer.before_stop()
            self.guest.stop(wait=False, why=STOP_MONITOR)   # it gives its trials back and exits; check() sees it go

    def _progress(self, trainer: "Trainer", metrics: IterationMetrics) -> None:
        """Collective: the guests' share of bubble time and their trial-steps, for the log line."""
        import torch
        import torch.distributed as dist

        from megatron_ext.runtime.distributed import collective_device

        s = self.squeezer.stats()
        v = torch.tensor([s["busy_s"], s["window_s"], s["trial_steps"], s["trials_done"]],
                         dtype=torch.float64, device=collective_device(trainer.ctx))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(v)
        metrics.extra["squeeze_used"] = round(float(v[0] / v[1]), 3) if v[1] > 0 else 0.0
        metrics.extra["squeeze_trial_steps"] = int(v[2])
        metrics.extra["squeeze_trials"] = int(v[3])

    def _guest_runs(self) -> list[tuple[float, float]]:
        return self.guest.ctl.run_intervals() if self.guest is not None else []

    # --- the end ----------------------------------------------------------------------------------
    def teardown(self, trainer: "Trainer") -> None:
        # No collective here: teardown also runs when the job failed.
        if self.guest is None:
            return
        from megatron_ext.hydro.squeezer.figures import append_run, end_line

        self.squeezer.before_stop()
        self.guest.stop()
        s = self.squeezer.stats()
        path = os.path.join(self.dir, f"figures_rank{trainer.ctx.rank}.json")
        # appended: a resumed run keeps the figures of the runs before it
        fig = append_run(path, self.figures(trainer, s))
        logger.info("%s", end_line(trainer.ctx.rank, s, path, len(fig["runs"])))
        if trainer.ctx.rank == 0:
            self._study_line()
        self.guest.close()
        self.guest = None

    def figures(self, trainer: "Trainer", s: dict[str, Any]) -> dict[str, Any]:
        """This run's figures of this rank: one record of ``figures_rank<R>.json`` (``figures.py``)."""
        err = self.windows.forecaster.error_summary()
        busy = s["busy_s"]
        return {"rank": trainer.ctx.rank, "layout": trainer.layout_name(), "engine": trainer.cfg.parallel.engine,
                "first_iteration": self.run_start, "iterations": trainer.iteration,
                "window_s": s["window_s"], "guest_busy_s": busy,
                "guest_overrun_s": s["overrun_s"],
                "bubble_used": s["used"], "guest_steps": s["steps"], "guest_trial_steps": s["trial_steps"],
                "guest_steps_per_busy_s": s["steps"] / busy if busy > 0 else 0.0,
                "fusion": s["fusion"], "windows_offered": s["windows_offered"], "windows_used": s["windows_used"],
                "windows_skipped": s["windows_skipped"], "units": s["units"], "long_units": s["long_units"],
                "halts": s["halts"], "units_outlived": s["units_outlived"], "pause_latencies_s": s["latencies"],
                "pause_latencies_lost": s["latencies_lost"],
                "forecast": err, "blocks": self.blocks, "restarts": s["restarts"], "deaths": s["deaths"]}

    def _study_line(self) -> None:
        try:
            import optuna
            from optuna.trial import TrialState

            from megatron_ext.hydro.squeezer.guest import study_summary

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            study = optuna.load_study(study_name=self.study_name, storage=self.storage)
            trials = study.get_trials(deepcopy=False)
            best = min((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.value, default=None)
            logger.info("squeeze: study '%s': %s%s; finish or transfer it with python -m megatron_ext.hydro.tune "
                        "--config %s", self.study_name, study_summary(trials),
                        f"; best #{best.number} val {best.value:.4f} {best.params}" if best else "", self.cfg.squeeze)
        except Exception as exc:  # noqa: BLE001 - a summary line must not fail the job's end
            logger.warning("squeeze: could not read study '%s' (%s)", self.study_name, exc)


@register_extension("squeeze")
def _factory(cfg) -> SqueezerExtension | None:
    sq = cfg.ext("squeeze")
    if sq is None or not sq.squeeze:
        return None
    return SqueezerExtension(sq)

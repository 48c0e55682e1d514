"""Shared helpers of the Bubble Squeezer tests: a tiny study, and a stand-in rank that opens windows."""
from __future__ import annotations

import os
import time

TINY_STUDY = """\
study_name: {name}
output_dir: {out}
n_trials: {n_trials}
pruner: {pruner}
min_resource: 10
reduction_factor: 2
seed: 7
data_path: "synthetic:20000:64:1"
seq_length: 16
micro_batch_size: 4
num_layers: 1
hidden_size: 32
num_attention_heads: 4
shrink_ratio: 0.5
parametrization: mup
optimizer: adamw
trial_steps: {trial_steps}
eval_interval: 10
eval_iters: 2
target_steps: 50
max_fusion: 2
threads: 1
sampler: {sampler}
search_space:
{space}
"""
LR_SPACE = "  lr: {type: float, low: 1.0e-3, high: 3.0e-2, log: true}"


def tiny_study(tmp_path, name: str = "sq", n_trials: int = 4, trial_steps: int = 20, pruner: str = "none",
               space: str = LR_SPACE, sampler: str = "tpe") -> str:
    path = os.path.join(str(tmp_path), f"{name}.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(TINY_STUDY.format(name=name, out=os.path.join(str(tmp_path), "hydro"), n_trials=n_trials,
                                   pruner=pruner, trial_steps=trial_steps, space=space, sampler=sampler))
    return path


class WindowDriver:
    """Opens and closes windows on a control block the way a rank's squeezer does, and keeps them."""

    def __init__(self, squeezer, open_s: float = 0.03, closed_s: float = 0.02, early_every: int | None = None) -> None:
        """``early_every``: every that many windows the wait ends at half its forecast (a forecast
        errs long sometimes), so a guest is surely still running at some window's close."""
        from megatron_ext.pipeline.windows import Window

        self.sq, self.open_s, self.closed_s, self.early_every = squeezer, open_s, closed_s, early_every
        self.windows: list[tuple[float, float]] = []
        self._window = Window
        self.n = 0

    def one(self) -> None:
        t0 = time.perf_counter()
        w = self._window((self.n, 3, 1), t0, self.open_s)
        self.n += 1
        self.sq.window_open(w)
        early = self.early_every is not None and self.n % self.early_every == 0
        time.sleep(self.open_s / 2 if early else self.open_s)   # the rank waits for its peer: its core is idle
        t1 = time.perf_counter()
        self.sq.window_close(w, t1)
        self.windows.append((t0, t1))
        while time.perf_counter() - t1 < self.closed_s:
            pass                      # the rank computes: the guest must not

    def until(self, done, timeout_s: float = 120.0) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if done():
                return True
            self.one()
        return done()


def wait_for(pred, timeout_s: float = 60.0, poll_s: float = 0.05) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(poll_s)
    return pred()


def guest_tuner(path: str, rank: int, run_start: int = 1, restarts: int = 0):
    """A guest's tuner on the study of ``path``, its gate held open (a window without end)."""
    import math

    from megatron_ext.hydro.config import load_config
    from megatron_ext.hydro.squeezer.control import Control
    from megatron_ext.hydro.squeezer.guest import GuestTuner, WindowGate

    cfg, space, defaults, dropout = load_config(path, {"target_steps": 0})
    ctl = Control.create()
    ctl.open_window(time.perf_counter(), math.inf)
    tuner = GuestTuner(cfg, space, defaults, dropout, gate=WindowGate(ctl), budget_bytes=1 << 30,
                       owner={"rank": rank, "pid": 10_000 + rank, "host": "test"}, log=lambda s: None,
                       sampler_key=(run_start, restarts))
    study = tuner._open_study()
    return tuner, study, ctl


def ask_until_full(path: str, rank: int, barrier) -> None:
    """One guest of a race (a child process): asks, after the others are ready, until the study is full."""
    tuner, study, ctl = guest_tuner(path, rank)
    barrier.wait()
    while True:
        asked = []
        for _ in range(tuner._askable(2, 0, 0)):
            got = tuner._new_trial(study)
            if got is None:
                break
            asked.append(got[0])
        if not asked:
            break
        for trial in asked:
            study.tell(trial.number, float(trial.number))
    ctl.close(unlink=True)

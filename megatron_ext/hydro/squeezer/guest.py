"""A bubble guest: one process beside a training rank that trains a fused Hydro bundle of a shared
Optuna study, only inside the rank's bubble windows.

    python -m megatron_ext.hydro.squeezer.guest --control FILE --wake-fd N --config tune.yaml ...

(started by the rank's squeezer, not by hand). The guest is a ``HydroTuner`` whose bundles pass
every pause point (``PauseGate``: before each fused layer's forward, after its backward) through
``WindowGate``: it goes on only when a window is open and the window's deadline leaves room for
the unit that starts there (its own measured duration), and parks otherwise -- blocked in a
``select`` on the wake pipe, using no CPU -- until a window long enough opens. Parking is
cooperative because on a GPU a stopped process's queued kernels would still run; on CPU the OS
priority (nice 19, pinned to the rank's cores) is the second guard.

The study is shared by the guests of every rank: a guest draws with its own seed (derived from the
study's and its rank), asks one trial at a time and only while the study has fewer than
``n_trials`` trials finished or running, keeps its parameter sets apart from every other trial's
(``hydro.distinct``), tags its trials with its rank and pid, and on a stop gives its unfinished
trials back, saying why and after how many steps. A guest's results do not depend on when it ran:
``oplog`` records every bundle operation, and ``replay`` re-runs them alone for the parity check.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import signal
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import optuna
import torch
from optuna.trial import TrialState

from megatron_ext.hydro.bundle import TrialBundle, TrialSpec
from megatron_ext.hydro.config import load_config
from megatron_ext.hydro.distinct import COUNTED, duplicate_of, space_points
from megatron_ext.hydro.memory import fusion_count, probe_memory_model
from megatron_ext.hydro.optim import TrialHParams
from megatron_ext.hydro.schedule import LRSchedule
from megatron_ext.hydro.squeezer.control import (CLOSE_SIGNAL, FAILED, FINISHED, NO_ROOM, PARKED, RUNNING,
                                                STARTING, STOP_MONITOR, STOPPED, SUSPENDED, Control)
from megatron_ext.hydro.tuner import GIVEN_BACK_ATTR, HydroTuner, TuneResult, n_failed, n_given_back

logger = logging.getLogger(__name__)

OWNER_ATTR = "squeeze_guest"     # user attr of a trial a guest trains: {"rank", "pid", "host"}


class GuestStopped(BaseException):
    """The rank asked the guest to stop (or SIGTERM): unwinds the tuner from any pause point.
    ``why`` is a key of ``GIVEN_BACK``: what the trials it gives back will say."""

    def __init__(self, message: str, why: str = "end") -> None:
        super().__init__(message)
        self.why = why


def _stop_why(ctl: Control) -> str:
    return "monitor" if int(ctl["stop"]) == STOP_MONITOR else "end"


class NoRoom(RuntimeError):
    """Not even one trial fits the memory the rank leaves free."""


# --- pause points ---------------------------------------------------------------------------------

class WindowGate:
    """``PauseGate.on_checkpoint`` of a guest's bundles: run only inside open windows.

    A *unit* is the work from one pause point to the next; its cost is measured per starting point
    (the median of its recent units started in a window, in the guest's CPU time: ``unit_clock``;
    on a GPU the caller passes a wall clock). At each pause point the guest goes on only if
    ``deadline - now`` covers the next unit. ``cpu_clock``: the guest's CPU clock, the one the rank
    reads at a window's close (``control.cpu_clock_s``); None on a GPU, where pause latency is wall
    time (the guest's kernels are not its CPU time)."""

    def __init__(self, ctl: Control, *, clock: Callable[[], float] = time.perf_counter,
                 unit_clock: Callable[[], float] = time.process_time,
                 cpu_clock: Callable[[], float] | None = time.process_time,
                 sync: Callable[[], None] | None = None, parent_pid: int | None = None,
                 idle_poll_s: float = 1.0, history: int = 8) -> None:
        self.ctl, self.clock, self.sync = ctl, clock, sync
        self.unit_clock, self.cpu_clock = unit_clock, cpu_clock
        self.parent_pid = parent_pid
        self.idle_poll_s = idle_poll_s
        self._units: dict[str, collections.deque] = {}
        self._median: dict[str, float] = {}   # per pause point, the median of its recent units
        self._history = history
        self._key: str | None = None
        self._unit_t0 = 0.0
        self._run_t0: float | None = None
        self._run_seq = 0
        self._unit_seq = -1
        self._seq_used = self._seq_skipped = self._seq_seen = -1
        self._windows: collections.deque = collections.deque(maxlen=64)   # lengths of recent windows
        self._cap: float | None = None   # _cap_s of the windows seen, computed once per new window
        self._parked = False
        self._critical = 0
        self._suspend_pending = False

    # --- suspension when a window closes under a running unit (CPU) ------------------------------
    def install_suspend(self) -> None:
        """On CPU, a unit that outlives its window would crawl on at nice 19 until the rank's next
        wait. Instead the rank sends ``CLOSE_SIGNAL`` when it closes a window under a running guest;
        the handler (Python runs it between bytecodes, so after the torch op in flight) stops this
        process with SIGSTOP, and the rank's SIGCONT at a later window's open resumes the unit where
        it was. Inside a storage call (``critical``) the stop waits for the call's end: a guest never
        sits stopped holding a database lock other guests need."""
        signal.signal(getattr(signal, CLOSE_SIGNAL), self._on_close_signal)

    def _on_close_signal(self, signum: int, frame: Any) -> None:
        if self._parked or self.ctl["window_open"]:
            return                  # parked meanwhile, or a new window opened: nothing to stop
        if self._critical:
            self._suspend_pending = True
            return
        self._suspend()

    def _suspend(self) -> None:
        ctl = self.ctl
        now = self.clock()
        if self._run_t0 is not None:
            self._account(self._run_t0, now, self._cpu_now())
            self._run_t0 = None
        ctl["t_parked"] = now
        ctl["state"] = SUSPENDED
        os.kill(os.getpid(), signal.SIGSTOP)
        # resumed (SIGCONT) at a window's open, or to be told to stop
        ctl["state"] = RUNNING
        self._resumed()

    @contextlib.contextmanager
    def critical(self):
        """A section the rank must not stop in the middle of (storage calls)."""
        self._critical += 1
        self.ctl["critical"] = self._critical
        try:
            yield
        finally:
            self._critical -= 1
            self.ctl["critical"] = self._critical
            if not self._critical and self._suspend_pending:
                self._suspend_pending = False
                if not self._parked and not self.ctl["window_open"]:
                    self._suspend()

    def expected_s(self, where: str) -> float:
        return self._median.get(where, 0.0)

    def _need_s(self, where: str) -> float:
        """Room the unit starting at ``where`` needs. A unit longer than most windows (rebuilding a
        bundle between steps, say) would never fit and the guest would starve: it starts at the
        opening of a window of the longer quarter instead, and overruns it at nice 19."""
        need = self.expected_s(where)
        cap = self._cap_s()
        if cap is not None and need > cap:
            self.ctl["long_units"] += 1
            need = cap
        return need

    def _cap_s(self) -> float | None:
        """Half the length of a window of the longer quarter (room for the wake-up latency); None
        before 8 windows were seen. Asked at every pause point: kept from the last new window."""
        return self._cap

    def _publish_min_unit(self) -> None:
        """The shortest room any unit needs, for the rank to skip shorter windows. 0 (offer every
        window) until the guest has seen enough windows to know what a long unit is: a guest that
        had measured one long unit would otherwise be offered no window to learn from."""
        cap = self._cap_s()
        shortest = min(self._median.values())
        self.ctl["min_unit_s"] = 0.0 if cap is None else min(shortest, cap)

    def _saw_window(self) -> None:
        seq = int(self.ctl["window_seq"])
        if seq != self._seq_seen:
            self._seq_seen = seq
            self._windows.append(float(self.ctl["deadline"] - self.ctl["t_open"]))
            if len(self._windows) >= 8:
                self._cap = statistics.quantiles(self._windows, n=4)[2] / 2

    def checkpoint(self, where: str) -> None:
        ctl = self.ctl
        now = self.clock()
        ctl["heartbeat"] = now
        if self._key is not None:
            # A unit's cost is the guest's own CPU time (on CPU): what the rank or anything else on
            # the core took meanwhile does not count, so a unit that outlived its window is measured
            # as truly as one that fit.
            if self._unit_seq >= 0:
                past = self._units.setdefault(self._key, collections.deque(maxlen=self._history))
                past.append(self.unit_clock() - self._unit_t0)
                self._median[self._key] = statistics.median(past)
                self._publish_min_unit()
            ctl["units"] += 1
        if ctl["stop"]:
            raise GuestStopped("the rank asked the guest to stop", _stop_why(ctl))
        if ctl["window_open"]:
            self._saw_window()
        if not (ctl["window_open"] and ctl["deadline"] - now >= self._need_s(where)):
            self._park(now, where)
        self._key, self._unit_t0 = where, self.unit_clock()
        self._unit_seq = int(ctl["window_seq"]) if ctl["window_open"] else -1

    def _park(self, now: float, where: str) -> None:
        ctl = self.ctl
        if self.sync is not None:
            self.sync()          # nothing of ours may still be queued on the device
            now = self.clock()
        if self._run_t0 is not None:
            self._account(self._run_t0, now, self._cpu_now())
        ctl["t_parked"] = now
        self._parked = True
        ctl["state"] = PARKED
        while True:
            ctl.drain()
            if ctl["stop"]:
                self._parked = False
                ctl["state"] = RUNNING
                raise GuestStopped("the rank asked the guest to stop", _stop_why(ctl))
            t = self.clock()
            if ctl["window_open"]:
                self._saw_window()
                # asked again each window: what counts as a long unit follows the windows seen
                if ctl["deadline"] - t >= self._need_s(where):
                    break
                seq = int(ctl["window_seq"])
                if seq != self._seq_skipped:
                    self._seq_skipped = seq
                    ctl["windows_skipped"] += 1
            ctl["heartbeat"] = t
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                raise GuestStopped("the rank is gone", "rank gone")
            ctl.wait_wake(self.idle_poll_s)
        ctl["state"] = RUNNING
        self._parked = False
        self._resumed()

    def _resumed(self) -> None:
        ctl = self.ctl
        self._run_t0 = self.clock()
        seq = int(ctl["window_seq"])
        self._run_seq = seq
        if seq != self._seq_used:
            self._seq_used = seq
            ctl["windows_used"] += 1

    def _cpu_now(self) -> float | None:
        return None if self.cpu_clock is None else self.cpu_clock()

    def _account(self, t0: float, t1: float, cpu1: float | None = None) -> None:
        """Record the run [t0, t1) -- less the spans the rank held it stopped -- for the timeline,
        and the pause latency of each window the run saw close: measured by the guest, on its own
        CPU clock, from the window's close (the rank read the clock there) until it stopped running
        at ``t1`` (``cpu1``: it parked, or suspended itself after a storage call); 0 for a window it
        parked in before the close. A window at whose close the rank halted it (SIGSTOP) is the
        rank's to record: it reads the stopped guest's clock when it continues it. On a GPU
        (``cpu1`` None) the latency is wall time from the close to ``t1``. What the guest did inside
        windows is the rank's count (``Squeezer``: the guest's CPU clock at each open and close)."""
        ctl = self.ctl
        stops = ctl.stops_since(t0)
        start = t0
        for s0, s1 in stops:
            if s0 >= t1:
                break
            if s0 > start:
                ctl.add_run(start, s0)
            start = max(start, min(s1, t1))
        if t1 > start:
            ctl.add_run(start, t1)
        halted_at = {s0 for s0, _ in stops}
        for _, w1, c1 in ctl.closes_since(self._run_seq):
            if w1 < t0 or w1 in halted_at:
                continue
            if w1 >= t1:
                ctl.add_latency(0.0)                      # parked (or suspended) before the close
            elif cpu1 is not None and c1 == c1:           # c1 NaN: the rank could not read the clock
                ctl.add_latency(max(0.0, cpu1 - c1))
            else:
                ctl.add_latency(t1 - w1)

    def unit_table(self) -> str:
        return ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(self._median.items()))


# --- the operation log (for the parity check) -------------------------------------------------------

def spec_to_json(s: TrialSpec) -> dict[str, Any]:
    return {"trial_id": s.trial_id, "seed": s.seed, "dropout": s.dropout, "hparams": dataclasses.asdict(s.hparams)}


def spec_from_json(d: dict[str, Any]) -> TrialSpec:
    hp = dict(d["hparams"])
    hp["schedule"] = LRSchedule(**hp["schedule"])
    return TrialSpec(d["trial_id"], seed=d["seed"], hparams=TrialHParams(**hp), dropout=d["dropout"])


class OpLog:
    """Every bundle operation of a guest, in order, one JSON line each. A step names its batch by
    its draw number from the tuner's data stream (the stream is seeded: draw k is reproducible)."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.fh = open(path, "a", encoding="utf-8")
        self.draws = 0
        self._draw_of: collections.OrderedDict[int, int] = collections.OrderedDict()

    def drew(self, batch: tuple) -> None:
        self._draw_of[id(batch[0])] = self.draws
        self.draws += 1
        while len(self._draw_of) > 64:
            self._draw_of.popitem(last=False)

    def draw_of(self, x: Any) -> int:
        return self._draw_of.get(id(x), -1)

    def write(self, **row: Any) -> None:
        self.fh.write(json.dumps(row) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def instrument(bundle: TrialBundle, ctl: Control, log: OpLog | None, bid: int) -> TrialBundle:
    """Count ``bundle``'s steps into the control block and record its steps, evaluations and
    resizes in ``log`` (instance wrappers: the same bundle)."""
    step, evaluate, resize = bundle.train_step, bundle.evaluate, bundle.resize

    def train_step(x, y):
        losses = step(x, y)
        ctl["steps"] += 1
        ctl["trial_steps"] += bundle.num_trials
        if log is not None:
            log.write(op="step", bundle=bid, ids=list(bundle.trial_ids), batch=log.draw_of(x), losses=losses)
        return losses

    def evaluate_(batches):
        vals = evaluate(batches)
        if log is not None:
            log.write(op="eval", bundle=bid, ids=list(bundle.trial_ids), vals=vals)
        return vals

    def resize_(keep_ids, new_specs=()):
        bundle.gate.checkpoint("resize")
        if log is not None:
            log.write(op="resize", bundle=bid, keep=list(keep_ids), new=[spec_to_json(s) for s in new_specs])
        out = resize(keep_ids, new_specs)
        ctl["bundle_trials"] = bundle.num_trials
        return out

    bundle.train_step, bundle.evaluate, bundle.resize = train_step, evaluate_, resize_
    return bundle


# --- the tuner of a guest ------------------------------------------------------------------------

class GuestTuner(HydroTuner):
    """A ``HydroTuner`` sharing its study with other guests, gated by ``gate``."""

    def __init__(self, *args: Any, gate: WindowGate, budget_bytes: int, owner: dict[str, Any],
                 oplog: OpLog | None = None, sampler_key: tuple[int, ...] = (), **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.gate, self.budget_bytes, self.owner, self.oplog = gate, budget_bytes, owner, oplog
        # Its own draws: a guest's sampler seed comes from the study's seed and the guest's identity.
        self.sampler_key = (int(owner["rank"]), *sampler_key)
        self.fusion_used = 0
        self.bundles = 0
        self.live: TrialBundle | None = None     # the bundle in training (steps of its trials)
        self.withdrawn: list[int] = []           # its trials withdrawn as duplicates of another guest's
        self._finished_at_start: int | None = None
        self._next_query = 0.0          # storage polls are rate-limited while nothing is left to ask

    def _setup_data(self) -> None:
        super()._setup_data()
        if self.oplog is not None:
            draw, log = self.data.train_batch, self.oplog

            def train_batch():
                batch = draw()
                log.drew(batch)
                return batch

            self.data.train_batch = train_batch

    def _study(self):
        return self._open_study(), []    # running trials belong to other guests

    def _open_study(self) -> optuna.Study:
        # Storage calls (and the sampler behind ask) are units too: a pause point before each, so
        # the guest never starts one in a window without room for it.
        study = super()._open_study()
        self._tell_raw = study.tell
        study.ask = self._gated(study.ask, "study ask")
        study.tell = self._gated(study.tell, "study tell")
        return study

    def _gated(self, fn: Callable, where: str) -> Callable:
        checkpoint = self.gate.checkpoint

        critical = self.gate.critical

        def gated(*args: Any, **kwargs: Any) -> Any:
            checkpoint(where)
            with critical():
                return fn(*args, **kwargs)

        return gated

    def _askable(self, free: int, n_finished: int, n_open: int) -> int:
        """Free slots, up to what the shared study still lacks (finished + running, all guests)."""
        if self._finished_at_start is None:
            self._finished_at_start = n_finished
        self.gate.ctl["trials_done"] = n_finished - self._finished_at_start
        now = time.monotonic()
        if free <= 0 or now < self._next_query:
            return 0
        with self.gate.critical():
            taken = self._counted()
        n = max(0, min(free, self.cfg.n_trials - taken))
        # Nothing to ask now: look again in a while (another guest's trial may fail and free one).
        self._next_query = now + (5.0 if n == 0 and n_open > 0 else 0.0)
        return n

    def _counted(self) -> int:
        return self.study._storage.get_n_trials(self.study._study_id, state=COUNTED)

    def _ask_owned(self, study: optuna.Study) -> optuna.Trial:
        """A new running trial that names this guest as its owner from its first write: asked and
        then owned in two writes, a guest killed between them would leave a running trial no one
        can give back (seen once under load in CI). The study is never given waiting trials."""
        import datetime

        template = optuna.trial.FrozenTrial(
            number=-1, state=TrialState.RUNNING, value=None, datetime_start=datetime.datetime.now(),
            datetime_complete=None, params={}, distributions={}, user_attrs={OWNER_ATTR: dict(self.owner)},
            system_attrs={}, intermediate_values={}, trial_id=-1)
        local = getattr(study, "_thread_local", None)      # Study.ask drops its trial cache first
        if local is not None:
            local.cached_all_trials = None
        return optuna.Trial(study, study._storage.create_new_trial(study._study_id, template_trial=template))

    def _new_trial(self, study: optuna.Study) -> tuple[optuna.Trial, TrialSpec] | None:
        """One trial, asked only when the study still has fewer than ``n_trials`` trials finished or
        running, counted just before the ask. Trials are asked one at a time, so guests that count
        at the same moment overshoot by one each at most, never by a bundle's worth. Its values are
        drawn apart from every other trial's (``DistinctSampler``); should another guest have drawn
        the same set at the same moment, the later check sees it, and this guest withdraws its trial
        and asks again. One unit from its pause point: a storage transaction is never halted."""
        self.gate.checkpoint("study ask")
        names, room = list(self.space), space_points(self.space)
        with self.gate.critical():
            for attempt in range(4):
                if self._counted() >= self.cfg.n_trials:
                    return None
                trial = self._ask_owned(study)
                spec = self._spec(trial)
                # A repeat is withdrawn while the space has a free point (a full one must repeat).
                twin = duplicate_of(study, trial, names) if names and attempt < 3 else None
                if twin is None or room <= self._counted() - 1:
                    break
                mark_given_back(study, trial.number, "duplicate", steps=0, trial_steps=self.cfg.trial_steps,
                                reason=f"withdrawn: trial #{twin} has the same parameters (another guest drew them "
                                       "at the same moment)", tell=self._tell_raw)
                self.withdrawn.append(trial.number)
        trial.report = self._gated(trial.report, "trial report")
        trial.should_prune = self._gated(trial.should_prune, "trial prune")
        return trial, spec

    def trial_steps_now(self) -> dict[int, int]:
        """Steps each trial of the live bundle has trained."""
        if self.live is None:
            return {}
        return {int(t): self.live.steps_of(t) for t in self.live.trial_ids}

    def _fusion_now(self, fusion: int) -> int:
        return max(1, min(fusion, int(self.gate.ctl["max_trials"])))

    def _fusion(self) -> int:
        c = self.cfg
        if c.fusion:
            b = c.fusion
        else:
            specs = lambda n: [TrialSpec(i, seed=i, hparams=self.defaults) for i in range(n)]  # noqa: E731
            model = probe_memory_model(lambda n: self._bundle(self.proxy_factory, specs(n), self.proxy_multipliers,
                                                              check=False), self.data.train_batch())
            budget = self.budget_bytes if not c.memory_budget_mb else min(self.budget_bytes,
                                                                           int(c.memory_budget_mb * 2 ** 20))
            try:
                b = fusion_count(model, budget, c.max_fusion)
            except MemoryError:
                raise NoRoom(f"one trial needs {model(1) / 2**20:.1f} MiB, the rank leaves {budget / 2**20:.1f} MiB "
                             "free (--squeeze-memory-budget-mb is the device's memory; or shrink the study's "
                             "proxy)") from None
            self.log(f"fusion count {b}: {model(1) / 2**20:.2f} MiB for one trial, {model(b) / 2**20:.2f} MiB "
                     f"for {b}, {budget / 2**20:.0f} MiB free beside the rank")
        self.gate.ctl["fusion"] = b
        self.fusion_used = b
        self.live = None          # the probe's bundles hold no trial of the study
        return b

    def _bundle(self, factory, specs, multipliers, check: bool = True) -> TrialBundle:
        self.gate.checkpoint("build")
        bundle = super()._bundle(factory, specs, multipliers, check=check)
        bundle.gate.on_checkpoint = self.gate.checkpoint
        bid, self.bundles = self.bundles, self.bundles + 1
        self.live = bundle
        self.gate.ctl["bundle_trials"] = bundle.num_trials
        if self.oplog is not None:
            self.oplog.write(op="build", bundle=bid, check=check, specs=[spec_to_json(s) for s in specs])
        return instrument(bundle, self.gate.ctl, self.oplog, bid)

    def _finish(self, study, fusion, t0, tuning_s, history) -> TuneResult:
        # No results file and no transfer: other guests share the study (hydro.tune finishes it).
        trials = study.get_trials(deepcopy=False)
        return TuneResult(best_trial=None, best_params={}, best_proxy_loss=None, target_loss=None,
                          n_complete=sum(t.state == TrialState.COMPLETE for t in trials),
                          n_pruned=sum(t.state == TrialState.PRUNED for t in trials),
                          n_failed=n_failed(trials), n_given_back=n_given_back(trials), fusion=fusion,
                          wall_s=time.perf_counter() - t0, tuning_s=tuning_s, transfer_s=0.0, rows=[],
                          history=history)


def open_shared_study(tuner: HydroTuner, attempts: int = 20) -> optuna.Study:
    """The tuner's study (created if needed, settings checked) without the guest's pause points,
    retried: the guests of several ranks may create the storage at the same moment (SQLite: one of
    them fails on the schema's version row) or find it locked."""
    import sqlalchemy.exc

    for k in range(attempts):
        try:
            return HydroTuner._open_study(tuner)
        except sqlalchemy.exc.SQLAlchemyError:
            if k == attempts - 1:
                raise
            time.sleep(0.1 * (k + 1))
    raise AssertionError("unreachable")


# Why a guest gives a trial back unfinished: the reason a trial states (``GIVEN_BACK_ATTR``), and how
# the summary at the end of a run counts them.
GIVEN_BACK = {
    "end": ("the main job ended before the trial finished", "when the main job ended"),
    "monitor": ("the safety monitor stopped the guests before the trial finished",
                "when the safety monitor stopped the guests"),
    "rank gone": ("the rank's process ended before the trial finished", "when their rank's process ended"),
    "signal": ("the guest was terminated before the trial finished", "when their guest was terminated"),
    "died": ("its guest process died", "when their guest process died"),
    "duplicate": ("withdrawn: another guest drew the same parameters at the same moment",
                  "as duplicates of a trial another guest drew at the same moment"),
}


def mark_given_back(study: optuna.Study, number: int, why: str, *, steps: int | None, trial_steps: int,
                    reason: str | None = None, tell: Callable | None = None) -> None:
    """Give trial ``number`` back unfinished (FAIL in Optuna's terms) with why and after how many
    of its ``trial_steps`` steps (None: unknown)."""
    text = reason or GIVEN_BACK[why][0]
    if steps is not None and reason is None:
        text += f" ({steps} of {trial_steps} steps)"
    trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
    optuna.trial.Trial(study, trial_id).set_user_attr(
        GIVEN_BACK_ATTR, {"why": why, "reason": text, "steps": steps, "trial_steps": trial_steps})
    (tell or study.tell)(number, state=TrialState.FAIL)


def give_back(study: optuna.Study, pids: set[int], why: str, *, trial_steps: int,
              steps: dict[int, int] | None = None) -> list[int]:
    """Give back the running trials of guests ``pids`` (on this host), saying ``why`` (a key of
    ``GIVEN_BACK``) and, with ``steps`` (trial number -> steps trained; a trial not in it had not
    started), how far each got."""
    import socket

    host = socket.gethostname()
    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = t.user_attrs.get(OWNER_ATTR)
        if owner and owner.get("host") == host and int(owner.get("pid", -1)) in pids:
            mark_given_back(study, t.number, why, steps=None if steps is None else steps.get(t.number, 0),
                            trial_steps=trial_steps)
            out.append(t.number)
    return out


def study_summary(trials: list[optuna.trial.FrozenTrial]) -> str:
    """The study's trials by state, given-back trials apart by why and how far they got, e.g.
    ``0 complete, 0 pruned, 13 given back unfinished (13 when the main job ended, at 20-100 of 120
    steps), 0 failed, 0 running; no trial has finished yet: ...``."""
    count = {st: sum(t.state == st for t in trials) for st in (TrialState.COMPLETE, TrialState.PRUNED,
                                                                TrialState.RUNNING)}
    given: dict[str, list[dict[str, Any]]] = {}
    for t in trials:
        g = t.user_attrs.get(GIVEN_BACK_ATTR) if t.state == TrialState.FAIL else None
        if isinstance(g, dict):
            given.setdefault(g.get("why") if g.get("why") in GIVEN_BACK else "end", []).append(g)
    parts = [f"{count[TrialState.COMPLETE]} complete", f"{count[TrialState.PRUNED]} pruned"]
    furthest = trial_steps = None
    if given:
        clauses = []
        for why in GIVEN_BACK:
            if why not in given:
                continue
            clause = f"{len(given[why])} {GIVEN_BACK[why][1]}"
            steps = [g["steps"] for g in given[why] if isinstance(g.get("steps"), int)]
            if steps and why != "duplicate":
                trial_steps = given[why][0].get("trial_steps")
                lo, hi = min(steps), max(steps)
                clause += f", at {lo}{'' if lo == hi else f'-{hi}'} of {trial_steps} steps"
                furthest = hi if furthest is None else max(furthest, hi)
            clauses.append(clause)
        parts.append(f"{sum(map(len, given.values()))} given back unfinished ({'; '.join(clauses)})")
    parts += [f"{n_failed(trials)} failed", f"{count[TrialState.RUNNING]} running"]
    line = ", ".join(parts)
    if not count[TrialState.COMPLETE] and not count[TrialState.PRUNED] and furthest is not None:
        line += (f"; no trial has finished yet: a trial trains {trial_steps} steps (trial_steps) and the furthest "
                 f"given back reached {furthest}, so the run was too short for one; a longer run (--train-iters) "
                 "or shorter trials finish some")
    return line


def orphaned_pids(study: optuna.Study) -> set[int]:
    """Pids of this host's guests that own running trials but no longer exist."""
    import socket

    host = socket.gethostname()
    pids = set()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = t.user_attrs.get(OWNER_ATTR)
        if owner and owner.get("host") == host:
            pid = int(owner.get("pid", -1))
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                pids.add(pid)
            except PermissionError:
                pass
    return pids


# --- the process ----------------------------------------------------------------------------------

def _die_with_parent() -> None:
    """SIGKILL this process when its parent (the rank) dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise GuestStopped(f"signal {signum}", "signal")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_ext.hydro.squeezer.guest",
                                description="A bubble guest (started by the squeezer of a training rank).")
    p.add_argument("--control", required=True, help="control block file")
    p.add_argument("--wake-fd", type=int, required=True, help="read end of the wake pipe")
    p.add_argument("--config", required=True, help="the Hydro tune YAML of the study")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--budget-bytes", type=int, required=True, help="memory the rank leaves free")
    p.add_argument("--device", default="cpu")
    p.add_argument("--log-dir", required=True, help="where the guest's log and operation log go")
    p.add_argument("--reap", type=int, nargs="*", default=[], help="give back trials of these dead guests first")
    p.add_argument("--reap-only", action="store_true", help="only give back trials of dead guests, then exit")
    p.add_argument("--sampler-key", type=int, nargs="*", default=[],
                   help="with the study's seed and the rank, what this guest's sampler seed is derived from "
                        "(the run's first iteration, the restart count)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    parent = os.getppid()
    _die_with_parent()
    try:
        os.nice(19)
    except OSError:
        pass
    ctl = Control.attach(args.control, args.wake_fd)
    ctl["pid"] = os.getpid()
    ctl["state"] = STARTING
    ctl["heartbeat"] = time.perf_counter()
    os.makedirs(args.log_dir, exist_ok=True)
    log_fh = open(os.path.join(args.log_dir, f"guest_rank{args.rank}.log"), "a", encoding="utf-8")

    def log(line: str) -> None:
        log_fh.write(f"[pid {os.getpid()}] {line}\n")
        log_fh.flush()

    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.set_num_threads(1)
    tuner = study = None
    try:
        cfg, space, defaults, dropout = load_config(args.config, {"target_steps": 0, "threads": 1,
                                                                  "device": args.device.split(":")[0]})
        if args.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(args.device))
            torch.cuda.set_stream(torch.cuda.Stream(priority=0))   # 0 = the lowest priority
        import socket

        owner = {"rank": args.rank, "pid": os.getpid(), "host": socket.gethostname()}
        oplog = OpLog(os.path.join(args.log_dir, f"oplog_rank{args.rank}_pid{os.getpid()}.jsonl"))
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else None
        # On a GPU a unit's cost is its wall time (its kernels are not the process's CPU time).
        gate = WindowGate(ctl, sync=sync, parent_pid=parent,
                          unit_clock=time.perf_counter if sync is not None else time.process_time,
                          cpu_clock=None if sync is not None else time.process_time)
        if sync is None:       # on a GPU a stopped process's queued kernels would run on: park only
            gate.install_suspend()
        tuner = GuestTuner(cfg, space, defaults, dropout, gate=gate, budget_bytes=args.budget_bytes, owner=owner,
                           oplog=oplog, log=log, sampler_key=tuple(args.sampler_key))
        study = open_shared_study(tuner)          # ungated: for giving trials back
        tuner.study = None
        dead = set(args.reap) | orphaned_pids(study)
        if dead:
            lost = give_back(study, dead, "died", trial_steps=cfg.trial_steps)
            if lost:
                log(f"gave back trials {lost} of dead guests {sorted(dead)}")
        if args.reap_only:
            ctl["state"] = STOPPED
            return 0
        # Setting up (imports, data, models, the memory probe) runs at nice 19 outside the gate; the
        # first pause point is in the probe's first forward.
        tuner.run()
        ctl["state"] = FINISHED
        ctl.message = "study complete"
        log(f"no trial left to ask: the study is complete; units: {gate.unit_table()}")
        return 0
    except GuestStopped as exc:
        if study is not None:
            lost = give_back(study, {os.getpid()}, exc.why, trial_steps=cfg.trial_steps,
                             steps=tuner.trial_steps_now())
            log(f"stopped ({exc}); gave back trials {lost} ({GIVEN_BACK[exc.why][0]}); units: {gate.unit_table()}")
        ctl["state"] = STOPPED
        return 0
    except NoRoom as exc:
        ctl.message = str(exc)
        ctl["state"] = NO_ROOM
        log(f"no room: {exc}")
        return 0
    except Exception as exc:  # noqa: BLE001 - reported to the rank; the rank's job goes on
        ctl.message = f"{type(exc).__name__}: {exc}"
        ctl["state"] = FAILED
        log(traceback.format_exc())
        return 1
    finally:
        log_fh.close()


if __name__ == "__main__":
    sys.exit(main())

"""When to act on verdicts: the planner's hysteresis.

A re-layout pauses the job and moves state, so acting on every verdict is wrong twice over: a
device whose verdict flips (slow -> recovered -> slow, a thermal throttle that comes and goes)
would make the job re-lay out back and forth, paying the pause each time for nothing. The policy
keeps a *believed* speed per device and only re-plans when that belief changes:

* ``fail_slow`` sets the device's speed to ``1 / factor`` at once (detection already waited for
  persistence; a slow device costs every iteration);
* ``fail_stop`` sets it to 0 at once (the job cannot run with it);
* ``recovered`` changes nothing yet: the device must stay without a new ``fail_slow`` for
  ``recover_after`` iterations before it counts as healthy again and the planner may go back
  towards the healthy layout. A ``fail_slow`` in between cancels the recovery, and since the
  belief never changed, nothing is re-planned;
* ``slow_link`` (a pair of devices, ``links.py``) sets the link's extra seconds per message at
  once, and ``link_recovered`` clears it after the same ``recover_after`` iterations;
* ``slow_nic`` (a device, ``nic.py``) sets the bandwidth of its NIC (``detail["mbps"]``) at
  once, and ``nic_recovered`` clears it after ``recover_after`` iterations; the planner charges a
  slow NIC to the gradient all-reduce of every data-parallel ring the device is in;
* ``slow_path`` (a pair of devices, ``nic.py``'s ring probe) sets the path's bandwidth
  (``detail["mbps"]``) at once, and ``path_recovered`` clears it after ``recover_after``
  iterations; the planner charges it to a data-parallel ring that has the two devices as
  neighbours and to pipeline messages between them, and reorders the rings around it;
* a slow device the layout left out is no longer watched, so no ``recovered`` verdict can come for
  it; with ``readmit_after`` it counts as healthy again once it has been out that many iterations
  (the fault's expected duration is over): the planner may take it back, and if it is still slow
  the detector names it again once it computes;
* a changed belief re-plans from the layout in force, and the planner's own threshold
  (``PlannerConfig.min_gain``) drops plans that would not pay for their move (a factor re-estimated
  from x2.0 to x2.1 does not re-lay out the job);
* the measured iteration times (``record_time``): once the layout in force has run
  ``measure_after`` iterations with nothing in it believed slow, the median of those over the
  planner's prediction becomes its shape's factor (``Planner.shape_factors``), by which the
  planner scales what it predicts for layouts of that (tp, pp). Once the policy has re-laid out the
  job (a layout of its own choosing is in force), a new factor, or one changed by more than 1 %, is
  a changed belief and re-plans: a planner that misjudges one shape against another learns it from
  the shapes the job ran instead of staying on the one it is wrong about. The user's own starting
  layout is not re-planned on a factor alone (a healthy job is not re-laid out because its shape ran
  faster or slower than predicted).
"""
from __future__ import annotations

import logging
import math
from typing import Iterable

import numpy as np

from megatron_ext.resihp.planner import Planner, believed_healthy
from megatron_ext.resihp.planner_types import Plan, PlanLayout, PlanningError
from megatron_ext.resihp.verdicts import Verdict

logger = logging.getLogger(__name__)


def _bandwidth(v: Verdict, what: str) -> float:
    """The bytes/s a ``slow_nic`` or ``slow_path`` verdict carries (``detail["mbps"]``, decimal MB/s)."""
    mbps = v.detail.get("mbps")
    if not (isinstance(mbps, (int, float)) and math.isfinite(mbps) and mbps > 0):
        raise PlanningError(f"{v.kind} verdict for {what} at iteration {v.iteration} has no usable bandwidth "
                            f"(detail mbps {mbps!r})")
    return 1e6 * float(mbps)


class PlanPolicy:
    """Feeds verdicts to the planner with hysteresis; one instance per job, on the rank that
    decides (its plans are broadcast). ``observe`` once per iteration."""

    def __init__(self, planner: Planner, layout: PlanLayout, num_devices: int, *, recover_after: int = 50,
                 readmit_after: int = 0, measure_after: int = 20) -> None:
        if recover_after < 0:
            raise PlanningError(f"recover_after must be >= 0 iterations, got {recover_after}")
        if readmit_after < 0:
            raise PlanningError(f"readmit_after must be >= 0 iterations (0: never), got {readmit_after}")
        if measure_after < 0:
            raise PlanningError(f"measure_after must be >= 0 iterations (0: never), got {measure_after}")
        if num_devices <= max(layout.devices):
            raise PlanningError(f"num_devices ({num_devices}) must exceed the largest rank of the layout "
                                f"({max(layout.devices)})")
        self.planner = planner
        self.layout = layout
        self.recover_after = recover_after
        self.readmit_after = readmit_after
        self.speeds = np.ones(num_devices)
        self._outside: dict[int, int] = {}      # slow rank the layout left out -> iteration it was first seen out
        self._recovering: dict[int, int] = {}   # rank -> iteration of its 'recovered' verdict
        self.links: dict[tuple[int, int], float] = {}            # (device, device) -> extra s per message
        self._links_recovering: dict[tuple[int, int], int] = {}
        self.nics: dict[int, float] = {}                          # device -> its NIC's bytes/s
        self._nics_recovering: dict[int, int] = {}
        self.paths: dict[tuple[int, int], float] = {}            # (device, device) -> the path's bytes/s
        self._paths_recovering: dict[tuple[int, int], int] = {}
        self.plans: list[tuple[int, Plan]] = []
        self.measure_after = measure_after
        self._times: list[float] = []          # measured seconds of the layout in force since the last change
        self._measured = False                 # its shape's factor was taken in this period
        self._timed_layout = layout
        self._pending: list[str] = []          # factors to re-plan on at the next observe
        self._chosen = False                   # restored from a policy whose plan is in force (``chosen``)

    @property
    def chosen(self) -> bool:
        """The layout in force is a plan of this policy's, or of the policy it took over from, not
        the user's start."""
        return bool(self.plans) or self._chosen

    def believed(self, rank: int) -> float:
        return float(self.speeds[rank])

    def beliefs(self) -> dict[str, dict[str, float]]:
        """What this policy believes, JSON-able, for another process to plan on from
        (``restore``): the speed of every device that is not healthy, and the iteration since
        which each recovering device has had no new ``fail_slow``."""
        out = {"speeds": {str(d): float(s) for d, s in enumerate(self.speeds) if s != 1.0},
               "recovering": {str(d): int(it) for d, it in self._recovering.items()}}
        if self._outside:
            out["outside"] = {str(d): int(it) for d, it in self._outside.items()}
        if self.links or self._links_recovering:
            out["links"] = {f"{a}-{b}": float(x) for (a, b), x in self.links.items()}
            out["links_recovering"] = {f"{a}-{b}": int(it) for (a, b), it in self._links_recovering.items()}
        if self.nics or self._nics_recovering:
            out["nics"] = {str(d): float(x) for d, x in self.nics.items()}
            out["nics_recovering"] = {str(d): int(it) for d, it in self._nics_recovering.items()}
        if self.paths or self._paths_recovering:
            out["paths"] = {f"{a}-{b}": float(x) for (a, b), x in self.paths.items()}
            out["paths_recovering"] = {f"{a}-{b}": int(it) for (a, b), it in self._paths_recovering.items()}
        if self.chosen:
            out["chosen"] = True
        if self.planner.shape_factors:
            out["shape_factors"] = {f"{tp}x{pp}": float(f) for (tp, pp), f in self.planner.shape_factors.items()}
        return out

    def restore(self, beliefs: dict[str, dict[str, float]]) -> None:
        """Take over ``beliefs`` from another policy's ``beliefs()``: the hysteresis goes on where
        it was (a recovering device still needs the rest of its ``recover_after`` iterations)."""
        for d, speed in beliefs.get("speeds", {}).items():
            if not 0 <= int(d) < self.speeds.shape[0]:
                raise PlanningError(f"beliefs name device {d}; the policy knows {self.speeds.shape[0]} devices")
            self.speeds[int(d)] = float(speed)
        self._recovering.update({int(d): int(it) for d, it in beliefs.get("recovering", {}).items()})
        self._outside.update({int(d): int(it) for d, it in beliefs.get("outside", {}).items()})

        def pair(key: str) -> tuple[int, int]:
            a, b = (int(x) for x in key.split("-"))
            return (min(a, b), max(a, b))

        self.links.update({pair(k): float(x) for k, x in beliefs.get("links", {}).items()})
        self._links_recovering.update({pair(k): int(it) for k, it in beliefs.get("links_recovering", {}).items()})
        self.nics.update({int(d): float(x) for d, x in beliefs.get("nics", {}).items()})
        self._nics_recovering.update({int(d): int(it) for d, it in beliefs.get("nics_recovering", {}).items()})
        self.paths.update({pair(k): float(x) for k, x in beliefs.get("paths", {}).items()})
        self._paths_recovering.update({pair(k): int(it) for k, it in beliefs.get("paths_recovering", {}).items()})
        for key, f in beliefs.get("shape_factors", {}).items():
            tp, pp = (int(x) for x in key.split("x"))
            self.planner.shape_factors[(tp, pp)] = float(f)
        self._chosen = self._chosen or bool(beliefs.get("chosen", False))

    def observe(self, iteration: int, verdicts: Iterable[Verdict] = (), *, adopt: bool = True) -> Plan | None:
        """Take this iteration's verdicts; return a plan when the belief changed and the planner
        found one worth its move. With ``adopt`` the plan's layout becomes the one in force (the
        caller applies it); without, the policy keeps planning from the old one (log-only mode)."""
        changed = self.update_beliefs(iteration, verdicts) + self._pending
        self._pending = []
        if not changed:
            return None
        self._restart_timing()
        plan = self.planner.plan(self.layout, self.speeds, links=self.links, nics=self.nics, paths=self.paths)
        if plan is None:
            logger.info("resihp policy iteration %d: %s; no re-layout passes the threshold (%.0f %%, %.0f %% with "
                        "nothing believed slow)", iteration, "; ".join(changed), 100 * self.planner.config.min_gain,
                        100 * self.planner.config.min_gain_healthy)
            return None
        logger.info("resihp policy iteration %d: %s -> %s", iteration, "; ".join(changed), plan.describe())
        self.plans.append((iteration, plan))
        if adopt:
            self.layout = plan.new
        return plan

    def _restart_timing(self) -> None:
        self._times, self._measured = [], False

    def record_time(self, seconds: float) -> None:
        """One measured iteration of the layout in force (a re-layout's pause not included). Call
        after ``observe`` of the same iteration; the first call after a change is dropped (it may
        hold the move)."""
        if not (math.isfinite(seconds) and seconds > 0):
            raise PlanningError(f"a measured iteration must take a finite time > 0 seconds, got {seconds!r}")
        lay = self.layout
        if lay != self._timed_layout:   # set from outside (a live job's layout in force)
            self._restart_timing()
            self._timed_layout = lay
        if not self.measure_after or self._measured:
            return
        if not believed_healthy(set(lay.devices), self.speeds, self.links, self.nics, self.paths):
            return   # the prediction would rest on believed speeds; only healthy layouts teach the model
        self._times.append(float(seconds))
        if len(self._times) <= self.measure_after:
            return
        self._measured = True
        predicted = self.planner.iteration_s(lay, self.speeds)
        factor = float(np.median(self._times[1:])) / predicted
        key = (lay.tp, lay.pp)
        old = self.planner.shape_factors.get(key)
        self.planner.shape_factors[key] = factor
        logger.debug("resihp policy: tp%dpp%d measured at x%.3f of the prediction", lay.tp, lay.pp, factor)
        if self.chosen and (old is None or abs(factor / old - 1) > 0.01):
            self._pending.append(f"tp{lay.tp}pp{lay.pp} measured at x{factor:.3f} of the prediction")

    def update_beliefs(self, iteration: int, verdicts: Iterable[Verdict] = ()) -> list[str]:
        """Apply verdicts and the recovery clock to the believed speeds; returns what changed (one
        phrase per device), empty when nothing did."""
        changed = []
        for v in verdicts:
            r = v.rank
            if not 0 <= r < self.speeds.shape[0]:
                raise PlanningError(f"verdict at iteration {v.iteration} names rank {r}; the policy knows "
                                    f"{self.speeds.shape[0]} devices (0..{self.speeds.shape[0] - 1})")
            if v.kind == "fail_slow":
                if v.factor is None or not math.isfinite(v.factor) or v.factor <= 0:
                    raise PlanningError(f"fail_slow verdict for rank {r} at iteration {v.iteration} has no usable "
                                        f"factor ({v.factor!r})")
                self._recovering.pop(r, None)
                speed = min(1.0, 1.0 / v.factor)
                if self.speeds[r] > 0 and speed != self.speeds[r]:
                    self.speeds[r] = speed
                    changed.append(f"rank {r} x{v.factor:.2f}")
            elif v.kind in ("fail_stop", "hang"):  # a hung device is terminated: gone as a stopped one
                self._recovering.pop(r, None)
                if self.speeds[r] != 0:
                    self.speeds[r] = 0.0
                    changed.append(f"rank {r} dead")
            elif v.kind == "recovered" and 0 < self.speeds[r] < 1:
                self._recovering.setdefault(r, iteration)
            elif v.kind == "slow_link":
                link = v.link
                extra = float(v.detail.get("extra_s_per_message", 0.0))
                if not (math.isfinite(extra) and extra > 0):
                    raise PlanningError(f"slow_link verdict for devices {link} at iteration {v.iteration} has no usable "
                                        f"extra_s_per_message ({extra!r})")
                self._links_recovering.pop(link, None)
                if self.links.get(link) != extra:
                    self.links[link] = extra
                    changed.append(f"link {link[0]}-{link[1]} +{1e3 * extra:.1f} ms per message")
            elif v.kind == "link_recovered" and v.link in self.links:
                self._links_recovering.setdefault(v.link, iteration)
            elif v.kind == "slow_nic":
                bw = _bandwidth(v, f"device {r}")
                self._nics_recovering.pop(r, None)
                if self.nics.get(r) != bw:
                    self.nics[r] = bw
                    changed.append(f"NIC of {r} at {bw / 1e6:.4g} MB/s")
            elif v.kind == "nic_recovered" and r in self.nics:
                self._nics_recovering.setdefault(r, iteration)
            elif v.kind == "slow_path":
                path = v.link
                bw = _bandwidth(v, f"devices {path}")
                if path[0] == path[1] or path[1] >= self.speeds.shape[0]:
                    raise PlanningError(f"slow_path verdict at iteration {v.iteration} names devices {path}; need two "
                                        f"different devices of the {self.speeds.shape[0]} known")
                self._paths_recovering.pop(path, None)
                if self.paths.get(path) != bw:
                    self.paths[path] = bw
                    changed.append(f"path {path[0]}-{path[1]} at {bw / 1e6:.4g} MB/s")
            elif v.kind == "path_recovered" and v.link in self.paths:
                self._paths_recovering.setdefault(v.link, iteration)
        for r, since in sorted(self._recovering.items()):
            if iteration - since >= self.recover_after:
                del self._recovering[r]
                self.speeds[r] = 1.0
                changed.append(f"rank {r} healthy since iteration {since}")
        if self.readmit_after:
            changed += self._readmit(iteration)
        for link, since in sorted(self._links_recovering.items()):
            if iteration - since >= self.recover_after:
                del self._links_recovering[link]
                self.links.pop(link, None)
                changed.append(f"link {link[0]}-{link[1]} healthy since iteration {since}")
        for d, since in sorted(self._nics_recovering.items()):
            if iteration - since >= self.recover_after:
                del self._nics_recovering[d]
                self.nics.pop(d, None)
                changed.append(f"NIC of {d} healthy since iteration {since}")
        for path, since in sorted(self._paths_recovering.items()):
            if iteration - since >= self.recover_after:
                del self._paths_recovering[path]
                self.paths.pop(path, None)
                changed.append(f"path {path[0]}-{path[1]} healthy since iteration {since}")
        return changed

    def _readmit(self, iteration: int) -> list[str]:
        """Slow devices out of the layout for ``readmit_after`` iterations count as healthy again."""
        inside = set(self.layout.devices)
        for r in list(self._outside):
            if r in inside or not 0 < self.speeds[r] < 1:
                del self._outside[r]
        for r in np.flatnonzero((self.speeds > 0) & (self.speeds < 1)).tolist():
            if r not in inside:
                self._outside.setdefault(int(r), iteration)
        changed = []
        for r, since in sorted(self._outside.items()):
            if iteration - since >= self.readmit_after:
                del self._outside[r]
                self._recovering.pop(r, None)
                self.speeds[r] = 1.0
                changed.append(f"rank {r} readmitted after {iteration - since} iterations out of the job")
        return changed

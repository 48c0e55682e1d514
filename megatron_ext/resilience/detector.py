"""What the policies are told, and when: a model of the detectors.

* compute fail-slow (every policy): a device of the job that runs at least ``threshold`` times
  slower is named after ``delay`` iterations with its factor (ResiHP's detector: 6-7 iterations at
  its defaults, docs/resihp.md), and one more than ``severe_factor`` times slower after
  ``severe_delay`` (its severe rule, 2x in each of 4 iterations: measured, a 3x device is named
  after 3-4 iterations and a device at exactly 2x still after 6, its scores straddling 2);
  ``recovered`` after ``window`` iterations below the threshold.
  Devices outside the job (spares, dropped ones) are not observed; a convicted device that comes
  back into the job is watched afresh: named again if it is still slow, ``recovered`` if not.
* fail-stop (every policy): named when the loop notices the job hangs (after the heartbeat
  timeout, which ``run`` charges).
* slow links (given to every policy; used by those whose design can act on them: ADAPTRA's link
  detector, ResiHP's ring probe for NICs, torchft dropping the replica group behind the link): a
  NIC or a node-to-node path used by the job at ``1 / factor`` of its bandwidth, after ``delay``
  iterations, or ``severe_delay`` when ``factor`` is more than ``severe_factor`` (the live link,
  NIC and path watches' severe rule, ``--resihp-link-severe-factor``: the model assumes the probe
  is sized so that a link's excess scales with its factor); ``factor`` 1.0 when it is healthy again. A link outside the job (the NIC of a device
  the job left, a path between nodes it no longer spans) is not observed; a named one that comes
  back into the job is watched afresh, like a device. ResiHP's compute detector scores compute
  time only; a slow link shows up there as waiting, which it does not score.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from megatron_ext.resihp.verdicts import Verdict
from megatron_ext.resilience.faults import ClusterState
from megatron_ext.resilience.job import Job

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LinkVerdict:
    kind: str                       # "slow_nic" (target: device) or "slow_path" (target: (node, node))
    target: int | tuple[int, int]
    factor: float                   # bandwidth is 1 / factor of healthy; 1.0: recovered
    iteration: int


class DetectorModel:
    def __init__(self, num_devices: int, gpus_per_node: int, *, threshold: float = 1.25, delay: int = 7,
                 window: int = 8, severe_factor: float | None = None, severe_delay: int = 4) -> None:
        if threshold <= 1 or delay < 1 or window < 1 or severe_delay < 1:
            raise ValueError(f"DetectorModel: threshold must be > 1 and delay, window, severe_delay >= 1; got "
                             f"{threshold}, {delay}, {window}, {severe_delay}")
        if severe_factor is not None and severe_factor < threshold:
            raise ValueError(f"DetectorModel: severe_factor must be >= threshold ({threshold}), got {severe_factor}")
        self.threshold, self.delay, self.window, self.g = threshold, delay, window, gpus_per_node
        self.severe_factor, self.severe_delay = severe_factor, min(severe_delay, delay)
        self.slow_for = np.zeros(num_devices, dtype=np.int64)
        self.ok_for = np.zeros(num_devices, dtype=np.int64)
        self.convicted = np.zeros(num_devices, dtype=bool)
        self.dead = np.zeros(num_devices, dtype=bool)
        self.watched = np.zeros(num_devices, dtype=bool)
        self.rename = np.zeros(num_devices, dtype=bool)   # convicted, out of the job, back in it
        self.link_for: dict[tuple, int] = {}
        self.link_named: dict[tuple, float] = {}
        self.link_out: set[tuple] = set()   # named links outside the job (unobserved)

    def observe(self, it: int, job: Job, state: ClusterState) -> tuple[list[Verdict], list[LinkVerdict]]:
        devs = np.asarray(job.devices)
        watched = np.zeros(self.slow_for.shape[0], dtype=bool)
        watched[devs] = True
        entered = watched & ~self.watched
        self.watched = watched
        self.rename |= entered & self.convicted
        self.ok_for[entered] = 0
        sp = state.speed
        slow = watched & (sp > 0) & (sp <= 1.0 / self.threshold)
        self.slow_for = np.where(slow, self.slow_for + 1, 0)
        self.ok_for = np.where(watched & ~slow, self.ok_for + 1, np.where(slow, 0, self.ok_for))
        out = []
        delay = np.full(sp.shape, self.delay)
        if self.severe_factor is not None:
            # strictly slower than the severe factor: a device at exactly 2x scores around 2 and,
            # measured (tools/bench_detector.py), is named by the window rule (6 iterations)
            delay[(sp > 0) & (sp < 1.0 / self.severe_factor)] = self.severe_delay
        for r in np.flatnonzero((~self.convicted | self.rename) & (self.slow_for >= delay)):
            self.convicted[r] = True
            self.rename[r] = False
            out.append(Verdict(kind="fail_slow", rank=int(r), stage=None, iteration=it, factor=float(1 / sp[r]),
                               confidence=1.0, detector="model"))
        for r in np.flatnonzero(self.convicted & watched & (self.ok_for >= self.window) & (sp > 0)):
            self.convicted[r] = False
            self.rename[r] = False
            out.append(Verdict(kind="recovered", rank=int(r), stage=None, iteration=it, factor=None,
                               confidence=1.0, detector="model"))
        return out, self._links(it, job, state)

    def _links(self, it: int, job: Job, state: ClusterState) -> list[LinkVerdict]:
        seen: dict[tuple, float] = {}
        for d in job.devices:
            if state.nic[d] < 1.0 / self.threshold:
                seen[("slow_nic", d)] = 1.0 / state.nic[d]
        nodes = {d // self.g for d in job.devices}
        devs = set(job.devices)
        for (a, b), f in state.path.items():
            if a in nodes and b in nodes and f < 1.0 / self.threshold:
                seen[("slow_path", (a, b))] = 1.0 / f
        out = []
        for key in set(self.link_for) | set(seen):
            watched = (key[1] in devs) if key[0] == "slow_nic" else (key[1][0] in nodes and key[1][1] in nodes)
            if not watched:
                # Out of the job: not observed, so neither slow nor recovered (a dropped replica
                # group's NIC used to read as recovered the moment it left the job).
                if key in self.link_named:
                    self.link_out.add(key)
                continue
            if key in self.link_out:
                # A named link back in the job is watched afresh: named again if still slow,
                # recovered at once if not.
                self.link_out.discard(key)
                self.link_for[key] = 0
                del self.link_named[key]
                if key not in seen:
                    self.link_for.pop(key)
                    out.append(LinkVerdict(key[0], key[1], 1.0, it))
                    continue
            if key in seen:
                self.link_for[key] = self.link_for.get(key, 0) + 1
                # the live watches' severe rule (``links.ExcessWatch``): far past the margin, named sooner
                delay = self.severe_delay if self.severe_factor is not None and seen[key] > self.severe_factor \
                    else self.delay
                if self.link_for[key] >= delay and key not in self.link_named:
                    self.link_named[key] = seen[key]
                    out.append(LinkVerdict(key[0], key[1], seen[key], it))
            else:
                self.link_for.pop(key, None)
                if self.link_named.pop(key, None) is not None:
                    out.append(LinkVerdict(key[0], key[1], 1.0, it))
        return out

    def stops(self, it: int, job: Job, state: ClusterState) -> list[Verdict]:
        devs = np.asarray(job.devices)
        new = devs[(state.speed[devs] <= 0) & ~self.dead[devs]]
        self.dead[new] = True
        self.convicted[new] = False
        return [Verdict(kind="fail_stop", rank=int(r), stage=None, iteration=it, factor=None, confidence=1.0,
                        detector="model") for r in new]

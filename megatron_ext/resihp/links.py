"""Slow links: which pipeline link delivers its messages late, told apart from a slow device.

A slow device computes longer; a slow link leaves both of its ends waiting: the receiver for the
message, the sender for its link. The fail-slow detector scores compute time only, so it is blind
to a link, and the waits alone cannot tell one from the other (a stage behind a slow device waits
too). What can: the time a message takes *while its receiver is already waiting*. For each message of
the iteration (an activation downstream, a gradient upstream) the joined timeline has the sender's
p2p call and the receiver's. When the receiver posted first, everything from the sender's post to
the end of the receive, ``recv.t1 - send.t0``, is the message's transfer. A stage held up by a slow
device posts its sends late, which a waiting receiver does not count against the link; and a
message whose receiver came late (busy computing) says nothing about the link and is left out.

Per link (a pair of devices, by launch rank) and iteration the detector takes, for each direction,
the smallest transfer time of those messages (the one least disturbed by a host that stalls a
process), and adds the two directions: the link's *round trip*. The joined record is on one clock
(the timeline's clock offsets), and a constant offset left between two ranks would add to one
direction what it takes from the other. After ``warmup`` iterations the healthy round trip of all
links pooled is the baseline (median, with the MAD as its noise); a link is flagged in an iteration
when its round trip exceeds the baseline by ``max(floor_s, zscore x noise)``, named ``slow_link``
when all but one of its last ``window`` observed iterations are flagged (the fail-slow detector's
persistence rule), and ``link_recovered`` after ``window`` observed iterations unflagged. A link no
longer used (a re-layout moved its traffic away) is not observed: its verdict stands, so a planner
does not route traffic back onto it on no evidence.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import TYPE_CHECKING, Sequence

import numpy as np

from megatron_ext.resihp.verdicts import Verdict

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.pipeline.timeline import IterationRecord

Link = tuple[int, int]


def message_times(record: "IterationRecord") -> dict[tuple[int, int], list[float]]:
    """Transfer seconds of the pipeline messages of the iteration whose receiver was waiting first,
    keyed by (sender rank, receiver rank) of the record's world: ``recv.t1 - send.t0`` of the two
    p2p calls that carried it, when ``recv.t0 <= send.t0``."""
    sends, recvs = record.p2p_messages()
    ranks = record.ranks

    def key(direction, frm, to, mb, rank):
        e = ranks[rank]
        return direction, frm, to, mb, e.dp, e.tp

    posted = {key(d, frm, to, mb, r): (r, i) for d, frm, to, mb, r, i in sends}
    out: dict[tuple[int, int], list[float]] = collections.defaultdict(list)
    for d, frm, to, mb, r, i in recvs:
        hit = posted.get(key(d, frm, to, mb, r))
        if hit is None:
            continue
        s_rank, s_i = hit
        s_ev, r_ev = ranks[s_rank].events[s_i], ranks[r].events[i]
        if not float(r_ev["t0"]) <= float(s_ev["t0"]):
            continue
        t = float(r_ev["t1"]) - float(s_ev["t0"])
        if math.isfinite(t):
            out[(s_rank, r)].append(max(t, 0.0))
    return dict(out)


def round_trips(record: "IterationRecord", members: Sequence[int]) -> dict[Link, float]:
    """Per link with a timed message in both directions this iteration (devices by launch rank,
    smaller first): the smallest transfer time one way plus the smallest the other way."""
    best = {k: min(v) for k, v in message_times(record).items() if v}
    out = {}
    for (a, b), t in best.items():
        back = best.get((b, a))
        if back is not None and a < b:
            da, db = int(members[a]), int(members[b])
            out[(min(da, db), max(da, db))] = t + back
    return out


@dataclasses.dataclass
class _Watched:
    flags: collections.deque
    excess: collections.deque
    convicted: bool = False
    calm: int = 0
    severe: int = 0          # consecutive observations past the severe margin
    rule: str = ""           # the rule that convicted it: "window" or "severe"


class ExcessWatch:
    """What the link and NIC detectors share: a baseline pooled over the warm-up's values (median,
    MAD as noise), a flag at ``max(floor_s, zscore x noise)`` above it, and per watched thing (a
    link, a device) the persistence rule: convicted when all but one of its last ``window``
    observed values are flagged, released after ``window`` unflagged in a row. The severe rule (the
    fail-slow detector's, for links): with ``severe_factor`` > 0, a thing whose excess is at least
    ``severe_factor`` times the flag's margin in each of its last ``severe_window`` observations
    is convicted then, without waiting for the window (0: off)."""

    name = "ExcessWatch"

    def __init__(self, *, warmup: int, window: int, zscore: float, floor_s: float, severe_factor: float = 0.0,
                 severe_window: int = 4) -> None:
        if warmup < 1 or window < 2 or zscore <= 0 or floor_s <= 0:
            raise ValueError(f"{self.name}: need warmup >= 1, window >= 2, zscore > 0 and floor_s > 0; got "
                             f"{warmup}, {window}, {zscore}, {floor_s}")
        if severe_factor and not (severe_factor > 1 and 1 <= severe_window):
            raise ValueError(f"{self.name}: need severe_factor 0 (off) or > 1 and severe_window >= 1; got "
                             f"{severe_factor}, {severe_window}")
        self.warmup, self.window, self.zscore, self.floor_s = warmup, window, zscore, floor_s
        self.severe_factor, self.severe_window = float(severe_factor), int(severe_window)
        self.healthy: list[float] = []        # pooled values of the warm-up
        self.base_s: float | None = None
        self.noise_s = 0.0
        self.seen = 0                         # observations so far (iterations or probes)
        self.watched: dict = {}

    def threshold_s(self) -> float | None:
        """Value above which a watched thing is flagged (None before calibration)."""
        if self.base_s is None:
            return None
        return self.base_s + max(self.floor_s, self.zscore * self.noise_s)

    def suspect(self, key) -> bool:
        """Flagged on its last observation and not convicted (yet)."""
        st = self.watched.get(key)
        return st is not None and not st.convicted and bool(st.flags) and bool(st.flags[-1])

    def known_slow(self) -> dict:
        """Convicted things and their estimated extra seconds."""
        return {k: self._extra(st) for k, st in self.watched.items() if st.convicted}

    def _extra(self, st: _Watched) -> float:
        return float(np.median(st.excess)) / self.excess_divisor if st.excess else 0.0

    excess_divisor = 1.0

    def _calibrating(self, values) -> bool:
        """Count one observation; during the warm-up pool its values and return True."""
        self.seen += 1
        if self.base_s is not None:
            return False
        self.healthy.extend(values)
        if self.seen >= self.warmup and self.healthy:
            h = np.asarray(self.healthy)
            self.base_s = float(np.median(h))
            self.noise_s = float(1.4826 * np.median(np.abs(h - self.base_s)))
        return True

    def _step(self, key, value: float) -> str | None:
        """One observed value of ``key``: "slow" when it is convicted now, "recovered" when released."""
        st = self.watched.get(key)
        if st is None:
            st = self.watched[key] = _Watched(collections.deque(maxlen=self.window),
                                              collections.deque(maxlen=self.window))
        limit = self.threshold_s()
        flagged = value > limit
        st.flags.append(flagged)
        if flagged:
            st.excess.append(value - self.base_s)
            st.calm = 0
        else:
            st.calm += 1
        severe = bool(self.severe_factor) and value - self.base_s >= self.severe_factor * (limit - self.base_s)
        st.severe = st.severe + 1 if severe else 0
        if not st.convicted and len(st.flags) == self.window and sum(st.flags) >= self.window - 1:
            st.convicted, st.rule = True, "window"
            return "slow"
        if not st.convicted and self.severe_factor and st.severe >= self.severe_window:
            st.convicted, st.rule = True, "severe"
            return "slow"
        if st.convicted and st.calm >= self.window:
            st.convicted = False
            st.excess.clear()
            return "recovered"
        return None


class LinkDetector(ExcessWatch):
    """``observe(record, members, iteration)`` once per iteration on the detector's rank; returns the
    iteration's ``slow_link`` / ``link_recovered`` verdicts. Picklable (it travels with the detector
    when the logging rank moves)."""

    name = "LinkDetector"
    excess_divisor = 2.0        # a round trip's excess: both directions, one of them slow

    def __init__(self, *, warmup: int = 20, window: int = 8, zscore: float = 4.0, floor_s: float = 0.01,
                 severe_factor: float = 0.0, severe_window: int = 4) -> None:
        super().__init__(warmup=warmup, window=window, zscore=zscore, floor_s=floor_s, severe_factor=severe_factor,
                         severe_window=severe_window)
        self.last: dict[Link, float] = {}      # this iteration's round trips (for the log)
        self.held: list[Verdict] = []          # slow_link verdicts waiting on the NIC probe

    def observe(self, record: "IterationRecord", members: Sequence[int], iteration: int, *,
                nics: ExcessWatch | None = None) -> list[Verdict]:
        """With ``nics`` (the NIC detector, observed first in the iteration), a link verdict that
        a NIC under suspicion may explain waits for it (``_after_nics``)."""
        found = self._observe(record, members, iteration)
        return found if nics is None else self._after_nics(found, nics)

    def _after_nics(self, found: list[Verdict], nics: ExcessWatch) -> list[Verdict]:
        """A slow NIC slows every message of its device, so its pipeline link's too, and either
        watch may convict first (both need all but one of a window flagged; each can miss one). A
        planner told of the link alone re-lays the job out around it, and again when the NIC's
        verdict follows. So a ``slow_link`` verdict with an end whose NIC the last probe flagged,
        not yet convicted, waits here: released behind the NIC's verdict once the NIC is convicted
        (the planner then counts the NIC on the link: one plan), or as it is once the probe of both
        ends comes back clean. A ``link_recovered`` for a link still waiting drops both."""
        waiting = self.held + [v for v in found if v.kind == "slow_link"]
        back = {v.link for v in found if v.kind == "link_recovered"} & {v.link for v in waiting}
        self.held = [v for v in waiting if v.link not in back and any(nics.suspect(d) for d in v.link)]
        return ([v for v in found if v.kind != "slow_link" and v.link not in back]
                + [v for v in waiting if v.link not in back and v not in self.held])

    def _observe(self, record: "IterationRecord", members: Sequence[int], iteration: int) -> list[Verdict]:
        rt = round_trips(record, members)
        self.last = rt
        if self._calibrating(rt.values()):
            return []
        rank_of = {int(m): r for r, m in enumerate(members)}
        out = []
        for link, t in sorted(rt.items()):
            change = self._step(link, t)
            if change is not None:
                out.append(self._verdict("slow_link" if change == "slow" else "link_recovered", link, rank_of,
                                         iteration, t))
        return out

    def _verdict(self, kind: str, link: Link, rank_of: dict[int, int], iteration: int, t: float) -> Verdict:
        a, b = link
        detail = {"launch_rank": a, "peer_launch_rank": b, "round_trip_s": round(t, 6),
                  "baseline_s": round(self.base_s, 6)}
        if kind == "slow_link":
            detail["extra_s_per_message"] = round(self._extra(self.watched[link]), 6)
            detail["rule"] = self.watched[link].rule
        return Verdict(kind=kind, rank=rank_of.get(a, a), stage=None, iteration=iteration, factor=None,
                       confidence=1.0, detector="resihp-link", detail=detail)

"""Verdicts: what the detectors conclude, as structured events (JSON lines, log lines)."""
from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import os
from typing import Any, Sequence

from megatron_ext.resihp.jsonl import JsonLinesWriter

logger = logging.getLogger(__name__)

VERDICT_KINDS = ("fail_slow", "fail_stop", "hang", "recovered", "slow_link", "link_recovered", "slow_nic", "nic_recovered",
                 "slow_path", "path_recovered")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict:
    """A detector's conclusion about one rank.

    ``factor``: estimated slowdown (observed / expected time) for ``fail_slow``; None otherwise.
    ``confidence`` in [0, 1]: for ``fail_slow`` the probability, under the rank's measured healthy
    noise, that its true slowdown exceeds the threshold; 1 for a missed heartbeat.
    ``iteration``: the iteration at which the verdict was reached (for ``fail_stop``, the last
    iteration the detector had seen). ``time_s``: wall clock of the verdict when known.

    ``rank`` is the rank in the job's world *at* ``iteration``; a live rank permutation or a
    fail-stop regroup renumbers the ranks, so across a re-layout the same device can have another
    rank. The device itself is its launch rank (``DistContext.member``), which the fail-slow
    detector puts in ``detail["launch_rank"]`` (``launch_rank`` reads it; without it, no
    renumbering happened and the two are the same).

    ``slow_link`` / ``link_recovered`` (``links.py``) name a pipeline link, the pair of devices
    ``launch_rank`` and ``detail["peer_launch_rank"]``; ``rank`` is the first one's rank, ``factor``
    None, and ``detail["extra_s_per_message"]`` what the link adds to each message.
    ``slow_nic`` / ``nic_recovered`` (``nic.py``) name a device whose sends are slow, found by the
    ring probe; ``detail["mbps"]`` is its estimated bandwidth.
    ``slow_path`` / ``path_recovered`` (``nic.py``) name the network path between two devices,
    ``launch_rank`` and ``detail["peer_launch_rank"]``, found by the ring probe: both directions'
    messages are slow while neither device's sends to its other neighbour are;
    ``detail["mbps"]`` is the path's estimated bandwidth. The planner charges it to the
    data-parallel ring that has the two devices as neighbours, and to pipeline messages between them.
    """

    kind: str
    rank: int
    stage: int | None
    iteration: int
    factor: float | None
    confidence: float
    detector: str
    time_s: float | None = None
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in VERDICT_KINDS:
            raise ValueError(f"verdict kind must be one of {', '.join(VERDICT_KINDS)}, got {self.kind!r}")
        if not 0.0 <= self.confidence <= 1.0 or math.isnan(self.confidence):
            raise ValueError(f"verdict confidence must lie in [0, 1], got {self.confidence}")

    @property
    def link(self) -> tuple[int, int] | None:
        """The pair of devices (launch ranks, smaller first) a link or path verdict names; None otherwise."""
        if self.kind not in ("slow_link", "link_recovered", "slow_path", "path_recovered"):
            return None
        a, b = self.launch_rank, int(self.detail["peer_launch_rank"])
        return (min(a, b), max(a, b))

    @property
    def launch_rank(self) -> int:
        """The device the verdict names: its launch rank (``rank`` where the detail has none)."""
        return int(self.detail.get("launch_rank", self.rank))

    def on_devices(self, members: Sequence[int]) -> "Verdict":
        """This verdict with its device recorded: ``members[rank]`` (the launch rank of each rank
        of the world it was reached in) put in ``detail["launch_rank"]`` unless already there."""
        if "launch_rank" in self.detail or not 0 <= self.rank < len(members):
            return self
        return dataclasses.replace(self, detail={**self.detail, "launch_rank": int(members[self.rank])})

    @classmethod
    def fail_stop(cls, silence: Any, *, stage: int | None = None, detector: str = "heartbeat",
                  launch_rank: int | None = None) -> "Verdict":
        """The fail-stop verdict for a ``ft.liveness.Silence`` (a rank whose heartbeat stopped)."""
        detail = {"last_seen_s": silence.last_seen_s, "silent_s": silence.silent_s, "timeout_s": silence.timeout_s}
        if launch_rank is not None:
            detail["launch_rank"] = int(launch_rank)
        return cls(kind="fail_stop", rank=silence.rank, stage=stage, iteration=silence.iteration, factor=None,
                   confidence=1.0, detector=detector, time_s=silence.time_s, detail=detail)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Verdict":
        return cls(**data)

    def describe(self) -> str:
        """One log line."""
        about = ([f"launch rank {self.launch_rank}"] if self.launch_rank != self.rank else []) + (
            [f"stage {self.stage}"] if self.stage is not None else [])
        where = f"rank {self.rank}" + (f" ({', '.join(about)})" if about else "")
        if self.kind == "fail_slow":
            what = f"fail-slow x{self.factor:.2f}"
        elif self.kind in ("slow_link", "link_recovered"):
            d = self.detail
            what = (f"slow link to launch rank {d.get('peer_launch_rank')} (+{1e3 * d.get('extra_s_per_message', 0):.1f} "
                    f"ms per message; round trip {1e3 * d.get('round_trip_s', 0):.1f} ms against "
                    f"{1e3 * d.get('baseline_s', 0):.1f} ms healthy)" if self.kind == "slow_link"
                    else f"link to launch rank {d.get('peer_launch_rank')} recovered")
        elif self.kind == "slow_nic":
            d = self.detail
            mbps = f", about {d['mbps']:g} MB/s" if d.get("mbps") else ""
            what = (f"slow NIC (+{1e3 * d.get('extra_s_per_message', 0):.1f} ms per {d.get('probe_bytes', 0) // 1024} KB "
                    f"probe message{mbps}; egress {1e3 * d.get('egress_s', 0):.1f} ms against "
                    f"{1e3 * d.get('baseline_s', 0):.1f} ms healthy)")
        elif self.kind == "nic_recovered":
            what = "NIC recovered"
        elif self.kind == "slow_path":
            d = self.detail
            mbps = f", about {d['mbps']:g} MB/s" if d.get("mbps") else ""
            what = (f"slow path to launch rank {d.get('peer_launch_rank')} (+{1e3 * d.get('extra_s_per_message', 0):.1f} "
                    f"ms per {d.get('probe_bytes', 0) // 1024} KB probe message both ways{mbps})")
        elif self.kind == "path_recovered":
            what = f"path to launch rank {self.detail.get('peer_launch_rank')} recovered"
        elif self.kind == "fail_stop":
            what = "fail-stop (heartbeat lost)"
        elif self.kind == "hang":
            what = f"hung ({self.detail.get('why', 'no progress')})"
        else:
            what = "recovered"
        return (f"{detector_prefix(self.detector)} iteration {self.iteration}: {where} {what}, "
                f"confidence {self.confidence:.2f}")


def detector_prefix(detector: str) -> str:
    """How a detector's lines begin: ``resihp`` for ResiHP's own, ``resihp[raw]`` for another."""
    return "resihp" if detector == "resihp" else f"resihp[{detector}]"


class VerdictLog(JsonLinesWriter):
    """Appends verdicts to a JSON-lines file, one object per line, flushed at once."""

    def __init__(self, path: str | os.PathLike | io.TextIOBase):
        super().__init__(path, "a")


def read_verdicts(path: str | os.PathLike) -> list[Verdict]:
    """Read a verdict log (the plans logged beside verdicts are skipped); errors name the file and line."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                if isinstance(data, dict) and data.get("kind") == "plan":
                    continue  # a re-layout plan logged beside the verdicts (--resihp-act)
                out.append(Verdict.from_dict(data))
            except (json.JSONDecodeError, TypeError, ValueError) as exc:
                raise ValueError(f"{os.fspath(path)}:{lineno}: not a verdict: {exc}") from None
    return out

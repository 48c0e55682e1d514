"""Verdicts: what the detectors conclude, as structured events (JSON lines, log lines)."""
from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import os
from typing import Any

from megatron_ext.resihp.jsonl import JsonLinesWriter

logger = logging.getLogger(__name__)

VERDICT_KINDS = ("fail_slow", "fail_stop", "recovered")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict:
    """A detector's conclusion about one rank.

    ``factor``: estimated slowdown (observed / expected time) for ``fail_slow``; None otherwise.
    ``confidence`` in [0, 1]: for ``fail_slow`` the probability, under the rank's measured healthy
    noise, that its true slowdown exceeds the threshold; 1 for a missed heartbeat.
    ``iteration``: the iteration at which the verdict was reached (for ``fail_stop``, the last
    iteration the detector had seen). ``time_s``: wall clock of the verdict when known.
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Verdict":
        return cls(**data)

    def describe(self) -> str:
        """One log line."""
        where = f"rank {self.rank}" + (f" (stage {self.stage})" if self.stage is not None else "")
        if self.kind == "fail_slow":
            what = f"fail-slow x{self.factor:.2f}"
        elif self.kind == "fail_stop":
            what = "fail-stop (heartbeat lost)"
        else:
            what = "recovered"
        return (f"resihp[{self.detector}] iteration {self.iteration}: {where} {what}, "
                f"confidence {self.confidence:.2f}")


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

"""Runtime control of fail-slow detection: a small JSON file the job reads at iteration boundaries
(``--resihp-control-file PATH``), for the users of straggler detectors who asked to turn detection
off and on, change its thresholds and ask for its state while a job runs.

The detector's rank reads the file when it changed (its modification time or size) after each
iteration, applies what it says and logs each change in one line::

    {"detection": false}            # no fail-slow verdicts from here (the detector is not fed)
    {"detection": true, "threshold": 2.0, "window": 3}   # on again, named at 2x, over 3 iterations
    {"status": 7}                   # any new value: write PATH.status.json (state and verdicts)

``threshold`` is ``--resihp-threshold`` (the slowdown factor that names a rank), ``window`` is
``--resihp-window`` (the persistence: all but one of a rank's last N iterations). A file that does
not parse, or a value out of range, is one line naming the file and what is wrong, and changes
nothing: a typo never stops a job.
"""
from __future__ import annotations

import json
import os
from typing import Any

KEYS = ("detection", "threshold", "window", "status")


def status_path(path: str) -> str:
    return path + ".status.json"


class ControlFile:
    def __init__(self, path: str) -> None:
        self.path = path
        self.detection = True
        self._stamp: tuple[int, int] | None = None
        self._status: Any = None

    def _changed(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError:
            return False  # not written yet (or removed): nothing to apply
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        return True

    def poll(self, iteration: int, detector: Any, verdicts: list[Any]) -> list[str]:
        """Apply the file if it changed since the last poll; the lines to log."""
        if not self._changed():
            return []
        where = f"control file {self.path} at iteration {iteration}"
        try:
            with open(self.path, encoding="utf-8") as fh:
                data = json.load(fh)
            if not isinstance(data, dict):
                raise ValueError(f"expected a JSON object with keys {', '.join(KEYS)}")
            unknown = sorted(set(data) - set(KEYS))
            if unknown:
                raise ValueError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(KEYS)}")
            detection = data.get("detection", self.detection)
            if not isinstance(detection, bool):
                raise ValueError(f"detection must be true or false, got {detection!r}")
            cfg = detector.cfg
            threshold = float(data.get("threshold", cfg.resihp_threshold))
            if not threshold > 1.0:
                raise ValueError(f"threshold must be > 1 (a slowdown factor), got {threshold:g}")
            window = data.get("window", cfg.resihp_window)
            if not isinstance(window, int) or isinstance(window, bool) or window < 1:
                raise ValueError(f"window must be an integer >= 1, got {window!r}")
        except (OSError, ValueError, TypeError) as exc:
            return [f"{where}: ignored ({exc})"]
        lines = []
        if detection != self.detection:
            self.detection = detection
            lines.append(f"{where}: fail-slow detection {'on' if detection else 'off'}")
        if threshold != cfg.resihp_threshold or window != cfg.resihp_window:
            before = (cfg.resihp_threshold, cfg.resihp_window)
            cfg.resihp_threshold, cfg.resihp_window = threshold, window
            if hasattr(detector, "_persistence") and getattr(detector, "persist", None) is not None:
                detector.persist = detector._persistence()  # the new levels, each rank's history from here
            changed = ([f"threshold {before[0]:g} -> {threshold:g}"] if threshold != before[0] else []) + (
                [f"window {before[1]} -> {window}"] if window != before[1] else [])
            lines.append(f"{where}: {', '.join(changed)} (each rank's persistence starts again)")
        if "status" in data and data["status"] != self._status:
            self._status = data["status"]
            out = status_path(self.path)
            record = {"iteration": iteration, "detection": self.detection, "threshold": cfg.resihp_threshold,
                      "window": cfg.resihp_window, "request": data["status"],
                      "verdicts": [v.to_dict() for v in verdicts[-50:]]}
            tmp = f"{out}.tmp{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")
            os.replace(tmp, out)
            lines.append(f"{where}: status written to {out} ({len(record['verdicts'])} verdict(s))")
        return lines

"""Runtime control of fail-slow detection (resihp/control.py): a change of the file is applied at
the next iteration boundary and logged in one line; bad content is one line and changes nothing."""
from __future__ import annotations

import json
import os
import types

from megatron_ext.resihp.config import ResiHPConfig
from megatron_ext.resihp.control import ControlFile, status_path
from megatron_ext.resihp.verdicts import Verdict


def detector():
    d = types.SimpleNamespace(cfg=ResiHPConfig(), persist="old")
    d._persistence = lambda: ("new", d.cfg.resihp_threshold, d.cfg.resihp_window)
    return d


def write(path, data, bump: int) -> None:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    os.utime(path, ns=(bump * 10**9, bump * 10**9))  # a new modification time for each write


def test_the_file_turns_detection_off_and_on_changes_the_levels_and_writes_the_status(tmp_path):
    path = tmp_path / "control.json"
    c, d = ControlFile(str(path)), detector()
    assert c.poll(1, d, []) == [] and c.detection                        # no file yet: nothing to do
    write(path, {"detection": False}, 1)
    assert c.poll(5, d, []) == [f"control file {path} at iteration 5: fail-slow detection off"]
    assert not c.detection and c.poll(6, d, []) == []                   # unchanged: read once
    write(path, {"detection": True, "threshold": 2.0, "window": 3}, 2)
    assert c.poll(9, d, []) == [
        f"control file {path} at iteration 9: fail-slow detection on",
        f"control file {path} at iteration 9: threshold 1.25 -> 2, window 8 -> 3 (each rank's persistence starts again)"]
    assert (d.cfg.resihp_threshold, d.cfg.resihp_window, d.persist) == (2.0, 3, ("new", 2.0, 3))
    write(path, {"detection": True, "threshold": 2.5, "window": 3}, 4)
    assert c.poll(10, d, []) == [f"control file {path} at iteration 10: threshold 2 -> 2.5 (each rank's persistence "
                                 "starts again)"]                           # only what changed is named
    v = Verdict(kind="fail_slow", rank=2, stage=1, iteration=8, factor=2.5, confidence=0.9, detector="resihp",
                time_s=0.0)
    write(path, {"detection": True, "threshold": 2.0, "window": 3, "status": 1}, 5)
    changed, line = c.poll(12, d, [v])
    assert changed.endswith("threshold 2.5 -> 2 (each rank's persistence starts again)")
    assert line == f"control file {path} at iteration 12: status written to {status_path(str(path))} (1 verdict(s))"
    status = json.loads(open(status_path(str(path))).read())
    assert (status["iteration"], status["detection"], status["threshold"], status["window"], status["request"]) == (
        12, True, 2.0, 3, 1)
    assert status["verdicts"][0]["rank"] == 2 and status["verdicts"][0]["kind"] == "fail_slow"


def test_bad_content_is_one_line_and_changes_nothing(tmp_path):
    path = tmp_path / "control.json"
    c, d = ControlFile(str(path)), detector()
    for k, (data, why) in enumerate([
            ("{not json", "Expecting property name enclosed in double quotes"),
            ([1, 2], "expected a JSON object with keys detection, threshold, window, status"),
            ({"treshold": 2}, "unknown key(s) treshold; known: detection, threshold, window, status"),
            ({"threshold": 0.5}, "threshold must be > 1 (a slowdown factor), got 0.5"),
            ({"window": 0}, "window must be an integer >= 1, got 0"),
            ({"detection": "off"}, "detection must be true or false, got 'off'")]):
        write(path, data, k + 1)
        (line,) = c.poll(3, d, [])
        assert line.startswith(f"control file {path} at iteration 3: ignored (") and why in line, line
    assert c.detection and (d.cfg.resihp_threshold, d.cfg.resihp_window, d.persist) == (1.25, 8, "old")

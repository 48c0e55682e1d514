"""The short seeded chaos soak (tools/chaos.py): one 4-rank job meets a hang inside an all-reduce, a
preemption with a requeue whose newest checkpoint is corrupt, a SIGKILL and a fail-slow device; each
fault gets its kind of verdict, the lost ranks' replacements rejoin, nothing committed is lost beyond
the policy's bound, the job finishes on the straight run's curve, and its ETTR is reported."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.multirank
def test_a_short_seeded_soak_gets_every_verdict_right(tmp_path):
    proc = subprocess.run([sys.executable, "tools/chaos.py", "--seed", "1", "--faults", "4", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    (soak,) = result["soaks"]
    assert [(f["kind"], f["verdict"]) for f in soak["faults"]] == [
        ("hang:collective", "hang"), ("requeue", "resumed"), ("corrupt", "fell_back"), ("kill:start", "stop"),
        ("slow", "slow")], out[-3000:]
    assert soak["finished"] and soak["rows_complete"] and soak["loss_max_rel_diff"] <= 1e-5
    assert all(f["lost"] in (None, 0) for f in soak["faults"])
    assert "rejoined at" in soak["faults"][0]["action"] and "rejoined at" in soak["faults"][3]["action"]
    assert 0 < soak["ettr"]["ettr"] < 1 and soak["ettr"]["seconds"]["restarts"] > 0   # two launches, one account
    assert "right verdicts 5/5; finished True" in out and "PASSED" in out


def test_a_missed_slow_device_says_what_the_detector_saw():
    from tools import chaos
    f = chaos.Fault("slow", 0, 52)
    train = [{"iteration": 50, "resihp_max_score": 9.0, "resihp_max_score_rank": 3}] + [
        {"iteration": i, "resihp_max_score": s, "resihp_max_score_rank": r}
        for i, s, r in ((52, 1.9, 0), (53, 1.4, 1), (54, 1.7, 0), (55, 1.2, 0))]
    assert chaos.missed_slow(f, train) == ("missed; highest score over 4 iterations after it: median 1.70, max 1.90, "
                                           "most often rank 0 (3 times)")
    assert chaos.missed_slow(f, train[:1]) == "missed; the detector scored no iteration after it"
    assert chaos.Fault("slow", 2, 9).flags() == ["--inject-slow", f"2:9:{chaos.SLOW_FACTOR}"]

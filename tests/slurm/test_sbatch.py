"""The sbatch script trains for real on the local single-node Slurm that .ci/run starts."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slurm

if os.environ.get("MEGATRON_EXT_SLURM") != "1":
    pytest.skip("needs the local Slurm cluster: scripts/slurm/local_cluster.sh start, then "
                "MEGATRON_EXT_SLURM=1 and SLURM_CONF as it prints (.ci/run does this)", allow_module_level=True)


def job_state(job_id: str) -> tuple[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True).stdout
    state = re.search(r"JobState=(\S+)", out).group(1)
    code = re.search(r"ExitCode=(\S+)", out).group(1)
    return state, code


def test_sbatch_trains_and_exits_zero(tmp_path):
    assert shutil.which("sbatch"), "sbatch not on PATH"
    out = tmp_path / "job.out"
    ckpt = tmp_path / "ckpt"
    # Every output of the demo config goes under tmp_path: a test must not leave a run in the
    # repository's runs/demo (a later `make demo` would refuse to trample it), nor find one there.
    study = tmp_path / "study.yaml"
    study.write_text(re.sub(r"(?m)^output_dir:.*$", f"output_dir: {tmp_path / 'hydro'}",
                            open(os.path.join(ROOT, "configs", "demo_study.yaml"), encoding="utf-8").read()))
    env = {**os.environ, "PYTHON": os.path.join(ROOT, ".venv", "bin", "python")
           if os.path.exists(os.path.join(ROOT, ".venv", "bin", "python")) else "python3"}
    job_id = subprocess.run(
        ["sbatch", "--parsable", "--output", str(out), "scripts/slurm/pretrain_gpt.sbatch",
         "--config", "configs/demo.yaml", "--train-iters", "3", "--eval-iters", "1", "--log-interval", "1", "--save", str(ckpt),
         "--tensorboard-dir", str(tmp_path / "tb"), "--metrics-file", str(tmp_path / "metrics.jsonl"),
         "--squeeze", str(study), "--squeeze-dir", str(tmp_path / "squeeze")],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    deadline = time.time() + 600
    state, code = "PENDING", ""
    while time.time() < deadline:
        state, code = job_state(job_id)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(2)
    log = out.read_text() if out.exists() else "(no output file)"
    assert (state, code) == ("COMPLETED", "0:0"), f"job {job_id} ended {state} {code}:\n{log[-3000:]}"
    assert "1 node(s) x 4 processes" in log
    assert re.search(r"iteration\s+3/\s+3 \| loss \d", log), log[-2000:]
    assert "validation at iteration      3" in log
    assert (ckpt / "latest").read_text().strip() == "iter_0000003"

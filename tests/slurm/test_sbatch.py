"""The sbatch script trains for real on the local Slurm that .ci/run starts (two node names on this
host, each with its own slurmd)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
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


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def wait_for_job(job_id: str, out, timeout_s: float = 600) -> tuple[str, str, str]:
    """The job's final state and exit code (or its state at the timeout) and its output file."""
    deadline = time.time() + timeout_s
    state, code = "PENDING", ""
    while time.time() < deadline:
        state, code = job_state(job_id)
        if state in ENDED:
            break
        time.sleep(2)
    return state, code, out.read_text() if out.exists() else "(no output file)"


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
         "--squeeze", str(study), "--squeeze-dir", str(tmp_path / "squeeze"),
         # The demo's ResiHP off: this job takes the script's torchrun-per-node path (with --resihp
         # the ranks start under srun directly, as the fail-stop tests below do).
         "--no-resihp"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    state, code, log = wait_for_job(job_id, out)
    assert (state, code) == ("COMPLETED", "0:0"), f"job {job_id} ended {state} {code}:\n{log[-3000:]}"
    assert "1 node(s) x 4 processes" in log
    assert re.search(r"iteration\s+3/\s+3 \| loss \d", log), log[-2000:]
    assert "validation at iteration      3" in log
    assert (ckpt / "latest").read_text().strip() == "iter_0000003"


def _node_processes(job_id: str, node: str) -> list[int]:
    """Every process of ``job_id`` that runs on ``node`` (the local cluster's nodes share this host:
    Slurm puts the node's name in each task's environment)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in env and f"SLURMD_NODENAME={node}".encode() in env:
            pids.append(int(pid))
    return pids


def test_continue_across_two_nodes_survives_a_lost_node(tmp_path):
    # Two nodes of the local cluster, two ranks each (DP4): every process of node2 is SIGKILLed
    # mid-run, as a lost host would be; node1's ranks name them by heartbeat (no launcher reports
    # exits under srun), regroup through the store the batch script hosts, and train to the end.
    idle = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True).stdout.split()
    if len(set(idle)) < 2:
        pytest.skip("needs two nodes in the local cluster (scripts/slurm/local_cluster.sh starts node1 and node2)")
    out, metrics = tmp_path / "job.out", tmp_path / "metrics.jsonl"
    env = {**os.environ, "NPROC_PER_NODE": "2", "PYTHON": os.path.join(ROOT, ".venv", "bin", "python")
           if os.path.exists(os.path.join(ROOT, ".venv", "bin", "python")) else "python3"}
    job_id = subprocess.run(
        ["sbatch", "--parsable", "--nodes", "2", "--output", str(out), "scripts/slurm/pretrain_gpt.sbatch",
         "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
         "--global-batch-size", "8", "--micro-batch-size", "1", "--train-iters", "40", "--eval-iters", "0",
         "--log-interval", "5", "--metrics-file", str(metrics), "--save", str(tmp_path / "ckpt"),
         "--resihp", "--ft-on-stop", "continue", "--ft-heartbeat-interval-s", "0.5",
         "--ft-heartbeat-timeout-s", "4", "--ft-continue-timeout-s", "60"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    deadline = time.time() + 600
    killed: list[int] = []
    state, code = "PENDING", ""
    while time.time() < deadline:
        state, code = job_state(job_id)
        if state in ENDED:
            break
        done = [json.loads(line)["iteration"] for line in open(metrics)] if metrics.exists() else []
        if not killed and done and max(done) >= 8:
            killed = _node_processes(job_id, "node2")
            for pid in killed:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.5)
    log = out.read_text() if out.exists() else "(no output file)"
    assert killed, f"node2 had no process of job {job_id} to kill:\n{log[-3000:]}"
    assert (state, code) == ("COMPLETED", "0:0"), f"job {job_id} ended {state} {code}:\n{log[-3000:]}"
    assert "2 node(s) x 2 ranks, continue past lost ranks" in log
    rows = [json.loads(line) for line in open(metrics)]
    (change,) = [r for r in rows if r["kind"] == "layout_change"]
    assert change["cause"] == "fail_stop" and sorted(change["lost_ranks"]) == [2, 3], change
    assert sorted(change["members"]) == [0, 1] and change["lost_iterations"] == 0
    assert all(v.startswith("heartbeat silent") for v in change["lost_why"].values()), change["lost_why"]
    assert max(r["iteration"] for r in rows if r["kind"] == "train") == 40
    assert "job finished training" in log


def test_a_lost_rank_ends_the_job_with_exit_75_under_srun(tmp_path):
    # The default fail-stop action under the batch script: --resihp (abort) starts the ranks with
    # srun directly and the job's store on the first node; rank 1 is SIGKILLed in its optimizer
    # step of iteration 3, the survivor names it (same host: at once) in one line and the job
    # exits 75, the code a restart wrapper resumes with --load on.
    out, ckpt = tmp_path / "job.out", tmp_path / "ckpt"
    env = {**os.environ, "NPROC_PER_NODE": "2", "PYTHON": os.path.join(ROOT, ".venv", "bin", "python")
           if os.path.exists(os.path.join(ROOT, ".venv", "bin", "python")) else "python3"}
    job_id = subprocess.run(
        ["sbatch", "--parsable", "--output", str(out), "scripts/slurm/pretrain_gpt.sbatch",
         "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
         "--global-batch-size", "4", "--micro-batch-size", "1", "--train-iters", "8", "--eval-iters", "0",
         "--log-interval", "1", "--save", str(ckpt), "--save-interval", "2", "--resihp", "--inject-stop", "1:3:step"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    state, code, log = wait_for_job(job_id, out)
    assert (state, code) == ("FAILED", "75:0"), f"job {job_id} ended {state} {code}:\n{log[-3000:]}"
    assert "1 node(s) x 2 ranks, a lost rank ends the job with exit 75 (resume with --load)" in log
    lines = [line for line in log.splitlines() if line.startswith("resihp: aborting the job")]
    assert lines == [f"resihp: aborting the job: rank(s) 1 (process ended, seen by rank 0 on the same host) gone; "
                     f"resume from the last checkpoint (--load {ckpt})"], log[-3000:]
    assert "job ended (exit 75): rank(s) 1 (process ended, seen by rank 0 on the same host) gone" in log
    assert (ckpt / "latest").read_text().strip() == "iter_0000002"

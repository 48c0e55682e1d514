"""The srun lines the sbatch scripts build, without Slurm: ``srun``, ``scontrol`` and ``nvidia-smi`` are
stand-ins on PATH. The stand-in ``srun`` writes down its options and the environment its tasks would
get, and runs a Python step itself (as pyxis would run it inside the image) but no rank. What
Megatron-LM users put in their batch files: the ranks per node from ``--gpus-per-node``
(SLURM_GPUS_ON_NODE), ``CUDA_DEVICE_MAX_CONNECTIONS=1`` where the layers are split over ranks, and
every step in a container image (pyxis's ``--container-image``). tests/slurm/test_sbatch.py runs the
script for real on the local Slurm cluster."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SRUN = f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
i = next((k for k, a in enumerate(args) if not a.startswith("-")), len(args))
with open(os.environ["SRUN_LOG"], "a") as fh:
    fh.write(json.dumps({{"options": args[:i], "command": args[i:],
                         "env": {{k: os.environ.get(k) for k in ("NPROC_PER_NODE", "CUDA_DEVICE_MAX_CONNECTIONS")}}}}) + "\\n")
if args[i:] and args[i] != "bash":   # a Python step: run it here; a rank: no
    os.execvp(args[i], args[i:])
"""
SCONTROL = """#!/usr/bin/env bash
case "$1 $2" in
  "show hostnames") echo node1 ;;
  "show node") echo "NodeName=node1 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=localhost" ;;
esac
"""
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32"]
EXIT_SIGNAL = ["--exit-signal-handler", "--exit-signal", "SIGUSR1"]


def run_script(tmp_path, script: str, flags: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, list]:
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("nvidia-smi", "#!/bin/sh\nexit 9\n")):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    log = tmp_path / "srun.jsonl"
    log.unlink(missing_ok=True)
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM", "NPROC_PER_NODE", "CUDA_DEVICE_MAX", "CONTAINER_", "MEGATRON_EXT_STORE"))}
    full = {**base, "PATH": f"{stubs}:{os.environ['PATH']}", "SRUN_LOG": str(log), "PYTHON": sys.executable,
            "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_NUM_NODES": "1",
            "SLURMD_NODENAME": "node1", "SLURM_SUBMIT_DIR": ROOT, "MASTER_PORT": "29999", **env}
    proc = subprocess.run(["bash", script, *flags], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=300)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


@pytest.mark.parametrize("env, tp, nproc, connections", [
    ({"SLURM_GPUS_ON_NODE": "8"}, 2, "8", "1"),                  # --gpus-per-node 8; TP 2 wants it
    ({"SLURM_GPUS_PER_NODE": "h100:2"}, 1, "2", None),            # a typed count; TP 1: left alone
    ({}, 2, "4", "1"),                                            # no GPU: 4 CPU ranks
    ({"SLURM_GPUS_ON_NODE": "8", "NPROC_PER_NODE": "3", "CUDA_DEVICE_MAX_CONNECTIONS": "32"}, 2, "3", "32"),  # knobs win
])
def test_ranks_per_node_follow_the_gpus_and_connections_the_layer_split(tmp_path, env, tp, nproc, connections):
    proc, calls = run_script(tmp_path, "scripts/slurm/pretrain_gpt.sbatch",
                             [*TINY, "--tensor-model-parallel-size", str(tp)], env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"job 42: 1 node(s) x {nproc} processes, rendezvous 127.0.0.1:29999" in proc.stdout
    (rank_step,) = calls                       # one srun: a torchrun per node
    assert rank_step["options"] == ["--kill-on-bad-exit=1", "--ntasks-per-node=1"]
    assert rank_step["command"][:2] == ["bash", "-c"] and "torch.distributed.run" in rank_step["command"][2]
    # the ranks catch Slurm's warning signal (--signal=B:USR1@120), which torchrun's agent ignores
    assert rank_step["command"][3:] == ["pretrain_gpt", *TINY, "--tensor-model-parallel-size", str(tp), *EXIT_SIGNAL]
    assert rank_step["command"][2].lstrip().startswith('trap "" USR1')
    assert rank_step["env"] == {"NPROC_PER_NODE": nproc, "CUDA_DEVICE_MAX_CONNECTIONS": connections}


def test_the_container_example_runs_every_step_in_the_image(tmp_path):
    # The worked example on two 8-GPU nodes with ResiHP (the path that hosts the store): every
    # Python step and the ranks run in the image, the repository mounted at its own path.
    proc, calls = run_script(tmp_path, "scripts/slurm/pretrain_gpt_container.sbatch", [*TINY, "--resihp"],
                             {"SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_NUM_NODES": "2",
                              "CONTAINER_IMAGE": "/images/megatron-ext.sqsh"})
    container = ["--container-image=/images/megatron-ext.sqsh",
                 f"--container-mounts={ROOT}:{ROOT},/shared/data:/shared/data,/shared/runs:/shared/runs",
                 f"--container-workdir={ROOT}"]
    one = ["--overlap", "--nodes=1", "--ntasks=1", "--nodelist=node1", *container]
    assert [c["options"] for c in calls] == [
        one, one,                                               # the flags read; the store on the first node
        ["--kill-on-bad-exit=0", "--overcommit", "--nodes=2", "--ntasks=16", "--ntasks-per-node=8", *container],
        one]                                                    # how the job ended: the store's account
    py = sys.executable
    assert [c["command"][:2] for c in calls] == [[py, "-c"], [py, "-m"], ["bash", "-c"], [py, "-m"]]
    assert calls[1]["command"][2:] == ["megatron_ext.ft.store", "--host", "0.0.0.0"]
    assert calls[2]["command"][3:] == ["pretrain_gpt", *TINY, "--resihp", *EXIT_SIGNAL]
    assert calls[3]["command"][2:4] == ["megatron_ext.ft.store", "--exit-code"]
    assert calls[2]["env"] == {"NPROC_PER_NODE": "8", "CUDA_DEVICE_MAX_CONNECTIONS": None}   # TP 1
    assert "job 42: 2 node(s) x 8 ranks, a lost rank ends the job with exit 75" in proc.stdout
    # No rank ran here: the store says so, and the script exits with its code.
    assert proc.returncode == 1 and "job did not finish training and did not say why" in proc.stdout


@pytest.mark.parametrize("flags, restart, added", [
    (["--save", "ck"], "0", EXIT_SIGNAL),                                       # a first start
    (["--save", "ck"], "1", [*EXIT_SIGNAL, "--load", "ck"]),                    # a requeued job resumes
    (["--save", "ck", "--load", "ck"], "1", EXIT_SIGNAL),                       # its own --load stays
    (["--exit-signal-handler", "--exit-signal", "SIGTERM"], "0", []),          # its own signal stays
])
def test_the_ranks_catch_the_warning_signal_and_a_restart_resumes(tmp_path, flags, restart, added):
    proc, calls = run_script(tmp_path, "scripts/slurm/pretrain_gpt.sbatch", [*TINY, *flags],
                             {"SLURM_RESTART_COUNT": restart})
    assert proc.returncode == 0, proc.stderr[-2000:]
    (rank_step,) = calls
    assert rank_step["command"][3:] == ["pretrain_gpt", *TINY, *flags, *added]
    assert ("restart 1, resuming from --load ck" in proc.stdout) == ("--load" in added)

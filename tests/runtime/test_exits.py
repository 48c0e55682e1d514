"""Leaving a run early on purpose (Megatron-LM's --exit-signal-handler, --exit-duration-in-mins,
--exit-interval) and the first launch of a requeue-able job (--save X --load X on an empty X).

The decision is tested on its own (a stand-in agreement), then live: a 2-rank job is sent its exit
signal on one rank only, both ranks leave after the same iteration with a checkpoint, and the same
launch line run again resumes to the end on the straight run's curve, no iteration done twice or
skipped."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from megatron_ext.config.base import ConfigError
from megatron_ext.config.run import config_from_values
from megatron_ext.runtime import rundir
from megatron_ext.runtime.distributed import free_port
from megatron_ext.runtime.exits import ExitWatch
from tests.conftest import ROOT, run_python


def watch(**ck):
    values = {"exit_signal_handler": False, "exit_signal": "SIGTERM", "exit_duration_in_mins": None,
              "exit_interval": None, **ck}
    return types.SimpleNamespace(**values)


def test_the_exit_interval_needs_no_agreement():
    calls = []
    w = ExitWatch(watch(exit_interval=3), lambda flags: calls.append(flags) or flags)
    assert [w.decide(i) for i in (1, 2, 3, 4, 6)] == [None, None, "--exit-interval 3", None, "--exit-interval 3"]
    assert calls == [] and not w.collective


def test_every_rank_leaves_when_any_rank_got_the_signal():
    other_rank_got_it = lambda flags: [max(flags[0], 1), flags[1]]   # an all-reduce MAX where another rank has it
    w = ExitWatch(watch(exit_signal_handler=True, exit_signal="SIGUSR1"), other_rank_got_it)
    assert w.collective and not w.received
    assert w.decide(5) == "SIGUSR1 received"


def test_the_signal_only_sets_a_flag_and_the_old_handler_comes_back():
    before = signal.getsignal(signal.SIGUSR1)
    w = ExitWatch(watch(exit_signal_handler=True, exit_signal="SIGUSR1"), lambda flags: flags)
    w.install()
    try:
        assert w.decide(1) is None
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert w.received and w.decide(2) == "SIGUSR1 received"
    finally:
        w.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_the_duration_is_the_slowest_clocks_and_agreed():
    now = [0.0]
    seen = []
    w = ExitWatch(watch(exit_duration_in_mins=2), lambda flags: seen.append(list(flags)) or flags, clock=lambda: now[0])
    now[0] = 119.0
    assert w.decide(1) is None
    now[0] = 121.0
    assert w.decide(2) == "--exit-duration-in-mins 2 reached"
    assert seen == [[0, 0], [0, 1]]


@pytest.mark.parametrize("values, message", [
    ({"exit_signal_handler": True, "exit_signal": "SIGKILL"},
     "--exit-signal must name a signal a process can catch (SIGTERM, SIGUSR1, SIGUSR2, SIGINT, ...), got 'SIGKILL'"),
    ({"exit_signal_handler": True, "exit_signal": "USR1"},
     "--exit-signal must name a signal a process can catch (SIGTERM, SIGUSR1, SIGUSR2, SIGINT, ...), got 'USR1'"),
    ({"exit_interval": 0}, "--exit-interval must be >= 1, got 0"),
    ({"exit_duration_in_mins": 0}, "--exit-duration-in-mins must be >= 1, got 0"),
])
def test_bad_exit_flags_are_one_line(values, message):
    with pytest.raises(ConfigError) as err:
        config_from_values(values)
    assert str(err.value) == message


def test_save_and_load_of_one_empty_directory_is_a_fresh_start(tmp_path):
    run = tmp_path / "run"
    assert rundir.fresh_start(save=str(run), load=str(run))            # not there yet
    run.mkdir()
    assert rundir.fresh_start(save=str(run), load=str(run))            # there, empty
    (run / "iter_0000003").mkdir()
    assert not rundir.fresh_start(save=str(run), load=str(run))        # a checkpoint: resume
    assert not rundir.fresh_start(save=str(tmp_path / "other"), load=str(run))
    config_from_values({"save": str(tmp_path / "new"), "load": str(tmp_path / "new")}).validate(1)
    with pytest.raises(ConfigError, match="--load .*missing: no such directory"):
        config_from_values({"load": str(tmp_path / "missing")}).validate(1)


MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
         "--global-batch-size", "4", "--micro-batch-size", "1", "--eval-iters", "0", "--log-interval", "1",
         "--lr-decay-style", "constant", "--hidden-dropout", "0", "--attention-dropout", "0"]


ITERS = 300


def rows(path):
    return [r for r in map(json.loads, open(path)) if r.get("kind") == "train"]


def losses(path):
    return {r["iteration"]: r["loss"] for r in rows(path)}


def launch_two_ranks(argv, tmp_path, name):
    """Two ranks started as srun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT): their pids are
    this test's, so a signal can reach one rank alone."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONWARNINGS": "ignore"}
        out = open(tmp_path / f"{name}.rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "pretrain_gpt.py", *argv], cwd=ROOT, env=env, stdout=out,
                                       stderr=subprocess.STDOUT), out))
    return procs


def wait_all(procs, timeout=300):
    codes = []
    for p, out in procs:
        codes.append(p.wait(timeout))
        out.close()
    return codes


@pytest.mark.multirank
def test_a_signal_on_one_rank_saves_and_exits_every_rank_and_the_same_line_resumes_on_the_straight_curve(tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    # Enough iterations that the run is still going when the signal lands, however fast the host.
    line = [*MODEL, "--train-iters", str(ITERS), "--save", str(ck), "--load", str(ck), "--save-interval", "1000",
            "--exit-signal-handler", "--exit-signal", "SIGUSR1", "--metrics-file", str(metrics)]
    procs = launch_two_ranks(line, tmp_path, "first")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and (not metrics.exists() or len(rows(metrics)) < 4):
        time.sleep(0.2)
    procs[0][0].send_signal(signal.SIGUSR1)   # one rank only: the other learns it at the boundary
    assert wait_all(procs) == [0, 0], (tmp_path / "first.rank0.log").read_text()[-3000:]
    first = rows(metrics)
    left_at = first[-1]["iteration"]
    assert 4 <= left_at < ITERS and os.path.isdir(ck / f"iter_{left_at:07d}")
    log = (tmp_path / "first.rank0.log").read_text()
    assert "holds no checkpoint yet: starting from scratch" in log
    assert f"exiting after iteration {left_at} of {ITERS} (SIGUSR1 received); resume with --load {ck}" in log
    # The requeued job: the same line, again.
    assert wait_all(launch_two_ranks(line, tmp_path, "second")) == [0, 0], \
        (tmp_path / "second.rank0.log").read_text()[-3000:]
    assert [r["iteration"] for r in rows(metrics)] == list(range(1, ITERS + 1))   # none twice, none skipped
    straight = tmp_path / "straight.jsonl"
    run_python("pretrain_gpt.py", "--nproc-per-node", "2", *MODEL, "--train-iters", str(ITERS), "--metrics-file",
               str(straight))
    got, want = losses(metrics), losses(straight)
    assert max(abs(got[i] - want[i]) / abs(want[i]) for i in want) < 1e-6


@pytest.mark.multirank
def test_the_exit_interval_saves_and_leaves_and_the_next_launch_finishes(tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    line = ["pretrain_gpt.py", *MODEL, "--train-iters", "6", "--save", str(ck), "--load", str(ck),
            "--exit-interval", "4", "--metrics-file", str(metrics)]
    first = run_python(*line)
    assert "exiting after iteration 4 of 6 (--exit-interval 4)" in first.stdout + first.stderr
    saved = sorted(d for d in os.listdir(ck) if d.startswith("iter_"))
    assert saved == ["iter_0000004"], saved   # saved where it left, nothing after
    run_python(*line)
    assert [r["iteration"] for r in rows(metrics)] == list(range(1, 7))

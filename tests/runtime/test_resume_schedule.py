"""Continuing a finished run on a longer schedule: ``--override-opt-param-scheduler`` (Megatron-LM's
``--override-opt_param-scheduler``) puts the flags' learning-rate schedule in force at the
checkpoint's iteration; without it the checkpoint's schedule goes on (flat at its minimum after its
decay) and the warning names the flag. Single-process runs, as a user resumes one."""
from __future__ import annotations

import json

import pytest

from tests.conftest import run_python

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
         "--global-batch-size", "4", "--micro-batch-size", "2", "--eval-iters", "0", "--lr", "1e-3",
         "--min-lr", "1e-4"]


def lrs(path) -> dict[int, float]:
    return {r["iteration"]: r["lr"] for r in map(json.loads, open(path)) if r["kind"] == "train"}


def flag_schedule(argv: list[str], iterations: range) -> dict[int, float]:
    """The rate each iteration uses on the schedule of ``argv``'s flags (megatron-core's scheduler,
    as a straight run of those flags would step it: iteration i uses the rate after i - 1 steps)."""
    import torch

    from megatron_ext.config.run import parse_run_config
    from megatron_ext.runtime.optimizer import build_scheduler

    cfg = parse_run_config(argv)
    sched = build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.training.lr), cfg.training)
    sched.step(0)
    out = {}
    for it in range(1, iterations.stop):
        if it in iterations:
            out[it] = sched.optimizer.param_groups[0]["lr"]
        sched.step(1)
    return out


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume_schedule")
    run_python("pretrain_gpt.py", *MODEL, "--train-iters", "6", "--save", str(d / "ck"),
               "--metrics-file", str(d / "first.jsonl"))
    return d


def test_override_continues_on_the_flags_schedule(first_run):
    d = first_run
    longer = ["--train-iters", "12", "--lr-decay-iters", "12"]
    proc = run_python("pretrain_gpt.py", *MODEL, *longer, "--load", str(d / "ck"), "--override-opt-param-scheduler",
                      "--metrics-file", str(d / "override.jsonl"))
    got = lrs(d / "override.jsonl")
    assert sorted(got) == list(range(7, 13))
    want = flag_schedule([*MODEL, *longer], range(7, 13))
    assert got == pytest.approx(want, rel=1e-9)
    # Past the old end (iteration 6 decayed to the minimum), not the minimum: the cosine over 12
    # iterations is half-way down at iteration 7.
    assert lrs(d / "first.jsonl")[6] < got[7]
    assert got[7] == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))
    assert all(got[i] > got[i + 1] > 1e-4 for i in range(7, 11))
    assert "--override-opt-param-scheduler" in proc.stderr + proc.stdout  # the info line says which schedule


def test_without_the_flag_the_checkpoints_schedule_wins_and_the_warning_names_the_flag(first_run):
    d = first_run
    proc = run_python("pretrain_gpt.py", *MODEL, "--train-iters", "12", "--load", str(d / "ck"),
                      "--metrics-file", str(d / "kept.jsonl"))
    got = lrs(d / "kept.jsonl")
    assert sorted(got) == list(range(7, 13)) and set(got.values()) == {1e-4}
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if "resuming keeps" in line]
    assert len(warnings) == 1, proc.stderr[-2000:]
    assert warnings[0].endswith(
        "resuming keeps the checkpoint's learning-rate schedule: lr_decay_steps 6 (flags: 12); from iteration 6 "
        "to 12 the rate stays at its minimum 0.0001. To train on the flags' schedule from the checkpoint's "
        "iteration instead, add --override-opt-param-scheduler")

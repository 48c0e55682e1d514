"""User errors at the entry point: one line from one rank, exit code 2; one run per output directory."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from megatron_ext.config.base import ConfigError
from megatron_ext.runtime.rundir import check_outputs, truncate_metrics
from tests.conftest import launch_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **(env or {})}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        if env is None or var not in env:
            full_env.pop(var, None)
    return launch_python([os.path.join(ROOT, "pretrain_gpt.py"), *args], full_env, timeout, merge=False)


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error" in line.lower() or "Traceback" in line]


def test_layout_error_is_one_line_before_any_rank_starts():
    res = run(["--nproc-per-node", "4", "--pipeline-model-parallel-size", "3"])
    assert res.returncode == 2
    assert res.stdout == ""
    assert res.stderr.splitlines() == [
        "pretrain_gpt.py: error: world size 4 is not divisible by --tensor-model-parallel-size (1) x "
        "--pipeline-model-parallel-size (3) = 3"]


def test_a_fault_in_a_rank_the_world_lacks_is_refused_before_any_rank_starts():
    res = run(["--nproc-per-node", "4", "--inject-stop", "9:3:step"])
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr.splitlines() == [
        "pretrain_gpt.py: error: --inject-stop 9:3:step names rank 9, but the world has 4 ranks (0..3)"]


def test_megatron_cores_own_refusal_is_one_line_before_any_rank_starts(tmp_path):
    # TransformerConfig's check (top-1 routing needs the pre-softmax router) runs in the launcher,
    # not as a traceback from each of the four ranks.
    res = run(["--nproc-per-node", "4", "--config", "configs/qwen3_moe_tiny.yaml", "--moe-router-topk", "1",
               "--save", str(tmp_path / "ck"), "--metrics-file", str(tmp_path / "m.jsonl"),
               "--tensorboard-dir", str(tmp_path / "tb")])
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr.splitlines() == [
        "pretrain_gpt.py: error: --moe-router-topk 1: megatron-core refuses it (TransformerConfig): Please use "
        "--moe-router-pre-softmax when topk is 1."]


def test_misspelled_flag_is_one_line_with_a_suggestion():
    res = run(["--hiden-size", "8"])
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        "pretrain_gpt.py: error: unrecognized arguments: --hiden-size 8; did you mean --hidden-size?"]


def test_a_rank_other_than_0_stays_silent_and_exits_2():
    res = run(["--num-layers", "3", "--pipeline-model-parallel-size", "2"],
              env={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert res.returncode == 2
    assert res.stderr == "" and res.stdout == ""


def test_check_outputs_refuses_a_directory_that_holds_a_run(tmp_path):
    save = tmp_path / "ck"
    (save / "iter_0000010").mkdir(parents=True)
    (save / "latest").write_text("iter_0000010\n")
    with pytest.raises(ConfigError) as err:
        check_outputs(save=str(save), load=None, metrics_file=None, tensorboard_dir=None)
    assert str(err.value) == (f"--save {save} already holds a run (checkpoint iter_0000010): resume it with "
                              f"--load {save}, save elsewhere, or remove it")
    check_outputs(save=str(save), load=str(save), metrics_file=None, tensorboard_dir=None)  # a resume
    with pytest.raises(ConfigError, match="already holds a run"):  # resuming another run into this one
        check_outputs(save=str(save), load=str(tmp_path / "other"), metrics_file=None, tensorboard_dir=None)
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"iteration": 1}\n')
    with pytest.raises(ConfigError, match=r"--metrics-file .* already holds another run's metrics"):
        check_outputs(save=None, load=None, metrics_file=str(metrics), tensorboard_dir=None)
    tb = tmp_path / "tb"
    tb.mkdir()
    (tb / "events.out.tfevents.1.host").write_bytes(b"")
    with pytest.raises(ConfigError) as err:
        check_outputs(save=None, load=None, metrics_file=None, tensorboard_dir=str(tb), clean_hint=" (make x)")
    assert str(err.value) == (f"--tensorboard-dir {tb} already holds another run's events: resume that run with "
                              "--load, write elsewhere, or remove it (make x)")
    # empty or absent outputs are fine
    check_outputs(save=str(tmp_path / "new"), load=None, metrics_file=str(tmp_path / "n.jsonl"),
                  tensorboard_dir=str(tmp_path / "tb2"))


def test_truncate_metrics_keeps_rows_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "m.jsonl"
    rows = [{"kind": "train", "iteration": i} for i in range(1, 6)] + [{"kind": "valid", "iteration": 5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "train", "itera')
    assert truncate_metrics(str(path), 3) == 4  # iterations 4, 5, the valid row at 5, the torn line
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert truncate_metrics(str(path), 3) == 0


@pytest.mark.multirank  # four 2-rank launches
def test_runs_do_not_trample_and_a_bad_checkpoint_is_one_line(tmp_path):
    out = tmp_path / "run"
    common = ["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "2",
              "--hidden-size", "32", "--seq-length", "32", "--eval-iters", "0", "--lr-warmup-iters", "0",
              "--save", str(out / "ck"), "--metrics-file", str(out / "metrics.jsonl"),
              "--tensorboard-dir", str(out / "tb")]  # data cache: $MEGATRON_EXT_CACHE from conftest
    first = run([*common, "--train-iters", "3"])
    assert first.returncode == 0, first.stdout + first.stderr

    second = run([*common, "--train-iters", "3"])  # same outputs, no --load
    assert second.returncode == 2
    assert second.stderr.splitlines() == [
        f"pretrain_gpt.py: error: --save {out / 'ck'} already holds a run (checkpoint iter_0000003): resume it "
        f"with --load {out / 'ck'}, save elsewhere, or remove it"]

    shard = out / "ck" / "iter_0000003" / "__1_0.distcp"  # rank 1's tensors (torch_dist, the default)
    good = shard.read_bytes()
    shard.write_bytes(good[:1000])
    bad = run([*common, "--train-iters", "4", "--load", str(out / "ck")])
    assert bad.returncode == 2
    assert error_lines(bad.stderr + bad.stdout) == [
        f"pretrain_gpt.py: error: {out / 'ck' / 'iter_0000003'}: __1_0.distcp is truncated or altered "
        f"(1000 bytes, expected {len(good)}), and no complete checkpoint before it in {out / 'ck'}"]
    shard.write_bytes(good)

    # A run that crashed after the checkpoint left a row for iteration 4: the resume replaces it.
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"kind": "train", "iteration": 4, "loss": 99.0}) + "\n")
    resumed = run([*common, "--train-iters", "4", "--load", str(out / "ck")])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["loss"] != 99.0
    assert "resuming keeps the checkpoint's learning-rate schedule: lr_decay_steps 3 (flags: 4)" in resumed.stderr

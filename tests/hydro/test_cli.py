"""The CLI end to end: a real process killed mid-study resumes; bad search spaces are clear errors."""
import os
import signal
import subprocess
import sys
import textwrap

import optuna
from optuna.trial import TrialState

from megatron_ext.hydro.tune import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

YAML = """
study_name: cli
output_dir: {out}
n_trials: 6
fusion: 2
pruner: none
data_path: synthetic:20000:32
seq_length: 8
micro_batch_size: 4
hidden_size: 32
num_attention_heads: 4
num_layers: 1
shrink_ratio: 0.5
trial_steps: 48
eval_interval: 12
eval_iters: 2
target_steps: 4
threads: 1
search_space:
  lr: {{type: float, low: 1.0e-4, high: 1.0e-2, log: true}}
"""


def test_bad_search_space_exits_2_with_location(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("n_trials: 2\nsearch_space:\n  lr: {type: float, low: 1.0, high: 0.5}\n")
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: {path}:3: search_space.lr: 'low' (1.0) must be < 'high' (0.5)"


def _complete(storage):
    try:
        study = optuna.load_study(study_name="cli", storage=storage)
    except KeyError:
        return {}
    return {t.number: t.value for t in study.get_trials(states=(TrialState.COMPLETE,))}


def test_killed_cli_resumes_and_finishes(tmp_path):
    cfg = tmp_path / "tune.yaml"
    cfg.write_text(textwrap.dedent(YAML.format(out=tmp_path)))
    storage = f"sqlite:///{tmp_path}/cli.db"
    cmd = [sys.executable, "-m", "megatron_ext.hydro.tune", "--config", str(cfg)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # Kill the moment the first bundle reports its trials done (the next bundle is still running):
    # reacting to the tuner's own progress line, not polling the database, keeps the kill inside
    # the study however fast the machine is.
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if " done " in line:
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, "".join(seen)
    before = _complete(storage)
    assert 2 <= len(before) < 6, "the tuner finished before it could be killed"
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resuming study 'cli'" in out.stdout
    after = _complete(storage)
    assert len(after) == 6
    assert all(after[n] == v for n, v in before.items())
    assert "6 complete, 0 pruned" in out.stdout
    assert "full-width target val loss" in out.stdout

"""The CLI end to end: a real process killed mid-study resumes and ends with a best trial; a rerun of
a finished study reports it without retraining; no usable result and bad search spaces are errors."""
import json
import os
import re
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
pruner: successive_halving
min_resource: 12
reduction_factor: 2
data_path: synthetic:20000:32
seq_length: 8
micro_batch_size: 4
hidden_size: 32
num_attention_heads: 4
num_layers: 1
shrink_ratio: 0.5
trial_steps: 96
eval_interval: 12
eval_iters: 2
target_steps: 4
threads: 1
search_space:
  lr: {{type: float, low: 1.0e-4, high: 1.0e-2, log: true}}
"""


def test_misspelled_flag_is_one_line_with_a_suggestion(capsys):
    assert main(["--n-trails", "4"]) == 2
    assert capsys.readouterr().err.strip() == ("python -m megatron_ext.hydro.tune: error: unrecognized arguments: "
                                               "--n-trails 4; did you mean --n-trials?")


def test_bad_search_space_exits_2_with_location(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("n_trials: 2\nsearch_space:\n  lr: {type: float, low: 1.0, high: 0.5}\n")
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"python -m megatron_ext.hydro.tune: error: {path}:3: search_space.lr: 'low' (1.0) "
                           "must be < 'high' (0.5)")


def _study(storage):
    return optuna.load_study(study_name="cli", storage=storage)


def _finished(storage):
    """number -> (state, value or last reported value) of the finished trials."""
    return {t.number: (t.state.name, t.value if t.value is not None else t.intermediate_values[t.last_step])
            for t in _study(storage).get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))}


def test_killed_cli_resumes_and_ends_with_a_best_trial(tmp_path, capsys):
    cfg = tmp_path / "tune.yaml"
    cfg.write_text(textwrap.dedent(YAML.format(out=tmp_path)))
    storage = f"sqlite:///{tmp_path}/cli.db"
    cmd = [sys.executable, "-m", "megatron_ext.hydro.tune", "--config", str(cfg)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Stop it on the first progress line that shows a finished trial and a trial the pruner has judged
    # but that is still training: reacting to the tuner's own progress line, not polling the database,
    # keeps the stop inside the study however fast the machine is (that trial needs 48+ more steps).
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            m = re.search(r"\] ([1-5])/6 trials done, eta \S+ \| ([^|]*)(?:\| (.*))?$", line)
            if m and set(re.findall(r"#(\d+)@", m.group(2))) - set(re.findall(r"#(\d+) ", m.group(3) or "")):
                proc.send_signal(signal.SIGTERM)
                break
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, "".join(seen)
    assert re.fullmatch(r"interrupted \(SIGTERM\): study 'cli' at \S+: [1-5]/6 trials done \(\d+ complete, \d+ pruned\), "
                        r"\d+ in training(; best #\d+ val [\d.]+)?; run the same command to resume\n", err), err
    before = _finished(storage)
    assert 1 <= len(before) < 6, "the tuner finished before it could be stopped"
    interrupted = {t.number: t.intermediate_values for t in _study(storage).get_trials(states=(TrialState.RUNNING,))}
    assert interrupted, "".join(seen) + err

    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"resuming study 'cli': {len(before)} of 6 trials done, {len(interrupted)} interrupted trials resume" in out.stdout
    assert re.search(r"\] 6/6 trials done, eta \d+s \|", out.stdout), out.stdout
    after = _finished(storage)
    assert len(after) == 6 and all(after[n] == v for n, v in before.items())
    trials = {t.number: t for t in _study(storage).get_trials()}
    assert len(trials) == 6 and not any(t.state == TrialState.FAIL for t in trials.values())
    for n, values in interrupted.items():   # resumed under its own number, earlier reports kept
        assert trials[n].state != TrialState.RUNNING
        assert all(trials[n].intermediate_values[k] == v for k, v in values.items())
    result = json.loads((tmp_path / "cli.results.json").read_text())
    complete = {n: v for n, (state, v) in after.items() if state == "COMPLETE"}
    assert result["best_trial"] == min(complete, key=complete.get)
    assert re.search(r"full-width target val loss [\d.]+\n", out.stdout)

    # The same command once more: the finished study is reported, nothing is trained again.
    assert main(["--config", str(cfg)]) == 0
    again = capsys.readouterr().out
    assert "is finished (6/6 trials done): no trial to train" in again
    assert f"target: trial #{result['best_trial']}'s config was transferred by an earlier run" in again
    assert f"full-width target val loss {result['target_loss']:.4f} (from an earlier run)" in again
    assert "[transfer" not in again and " start #" not in again


def test_a_study_without_a_complete_trial_exits_1_and_says_why(tmp_path, capsys):
    path = tmp_path / "diverge.yaml"
    text = textwrap.dedent(YAML.format(out=tmp_path)).replace("n_trials: 6", "n_trials: 2").replace(
        "low: 1.0e-4, high: 1.0e-2", "low: 1.0e+30, high: 1.0e+31")    # every trial overflows to inf
    path.write_text(text)
    assert main(["--config", str(path)]) == 1
    cap = capsys.readouterr()
    assert cap.out.count("diverged") == 2
    assert cap.err.strip() == ("python -m megatron_ext.hydro.tune: error: study 'cli' has no complete trial "
                               "(0 complete, 2 pruned, 0 failed): there is "
                               "no best config and no target was trained. Every finished trial was pruned or "
                               "diverged; run more trials (--n-trials, the study continues), narrow the search "
                               "space, or use a milder pruner")
    assert json.loads((tmp_path / "cli.results.json").read_text())["best_trial"] is None

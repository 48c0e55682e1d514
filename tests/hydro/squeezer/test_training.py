"""``pretrain_gpt.py --squeeze``: the main job trains exactly as without guests, and a real Optuna
study finishes trials in its bubbles, on both engines (DeepSpeed's at ZeRO-1)."""
from __future__ import annotations

import json
import os

import optuna
import pytest
from optuna.trial import TrialState

from megatron_ext.config.defaults import former_default_flags
from megatron_ext.hydro.distinct import COUNTED, distinct_sets
from tests.conftest import run_torchrun
from tests.hydro.squeezer.squeezer_helpers import tiny_study

pytestmark = pytest.mark.multirank

# Constant learning rate: the first iterations of a long run equal those of a short one.
COMMON = [*former_default_flags(), "--pipeline-model-parallel-size", "2", "--num-layers", "2", "--log-interval", "100",
          "--eval-iters", "0", "--lr-decay-style", "constant", "--lr-warmup-iters", "0", "--seed", "5"]
ITERS = "500"  # the guests start (imports at nice 19) and finish the study by ~200 on a quiet 2-core host


def _losses(path: str) -> dict[int, float]:
    with open(path, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    return {r["iteration"]: r["loss"] for r in rows if r["kind"] == "train"}


# DeepSpeed's pipeline engine at ZeRO-1 (DeepSpeed's ZeRO optimizer steps; the bubbles are the engine's)
ENGINE = {"megatron": ["--engine", "megatron"], "deepspeed": ["--deepspeed", "--zero-stage", "1"]}


def _squeezed(tmp_path, engine: str):
    study = tiny_study(tmp_path, name=f"sq_{engine}", n_trials=4, trial_steps=20, pruner="successive_halving")
    metrics = os.path.join(str(tmp_path), f"{engine}_squeeze.jsonl")
    proc = run_torchrun("pretrain_gpt.py", *COMMON, *ENGINE[engine], "--train-iters", ITERS, "--squeeze", study,
                        "--squeeze-start-iter", "2", "--metrics-file", metrics, nproc=2)
    storage = f"sqlite:///{tmp_path}/hydro/sq_{engine}.db"
    trials = optuna.load_study(study_name=f"sq_{engine}", storage=storage).get_trials(deepcopy=False)
    figures = [json.load(open(os.path.join(str(tmp_path), "hydro", "squeeze", f"figures_rank{r}.json")))
               for r in (0, 1)]
    return proc.stdout + proc.stderr, trials, figures, metrics


def _plain(tmp_path, engine: str) -> str:
    """The same job without --squeeze, 60 iterations: the reference loss curve."""
    plain = os.path.join(str(tmp_path), f"{engine}_plain.jsonl")
    run_torchrun("pretrain_gpt.py", *COMMON, *ENGINE[engine], "--train-iters", "60", "--metrics-file", plain,
                 nproc=2)
    return plain


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("squeeze_megatron")
    return _squeezed(tmp, "megatron"), _plain(tmp, "megatron")


@pytest.fixture(scope="module")
def deepspeed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("squeeze_deepspeed")
    return _squeezed(tmp, "deepspeed"), _plain(tmp, "deepspeed")


def _check_trials_finished_in_bubbles(trials, figures, log):
    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert done, [(t.number, t.state) for t in trials]
    assert all("squeeze_guest" in t.user_attrs for t in trials)
    assert {t.user_attrs["squeeze_guest"]["rank"] for t in done} <= {0, 1}
    assert not [t for t in trials if t.state == TrialState.RUNNING]     # nothing left dangling
    assert sum(f["guest_trial_steps"] for f in figures) >= 20
    assert all(0 <= f["bubble_used"] <= 1 for f in figures) and any(f["bubble_used"] > 0 for f in figures)
    assert "squeeze: study " in log and "complete" in log
    # two guests, one study: no parameter set twice, at most one trial beyond n_trials (4) per other guest
    counted = [t for t in trials if t.state in COUNTED]
    assert len(counted) <= 5 and len(distinct_sets(counted, ["lr"])) == len(counted)
    # one run, one record; no figure printed as NaN
    assert all(len(f["runs"]) == 1 and f["runs"][0]["first_iteration"] == 1 for f in figures)
    assert "nan" not in " ".join(line for line in log.splitlines() if "squeeze: rank" in line).lower()


def test_megatron_trials_finish_in_the_bubbles(megatron):
    (log, trials, figures, _), _ = megatron
    _check_trials_finished_in_bubbles(trials, figures, log)


def _check_same_losses(metrics: str, plain: str) -> None:
    with_guests, alone = _losses(metrics), _losses(plain)
    common = sorted(set(alone) & set(with_guests))
    # the plain run's 60 iterations, each logged (a loss per iteration in the metrics file)
    assert len(common) == 60 and all(with_guests[i] == alone[i] for i in common), \
        [(i, with_guests[i], alone[i]) for i in common if with_guests[i] != alone[i]][:5] or len(common)


def test_megatron_main_job_trains_exactly_as_without_guests(megatron):
    (_, _, _, metrics), plain = megatron
    _check_same_losses(metrics, plain)


def test_deepspeed_trials_finish_in_the_bubbles(deepspeed):
    (log, trials, figures, _), _ = deepspeed
    _check_trials_finished_in_bubbles(trials, figures, log)


def test_deepspeed_main_job_trains_exactly_as_without_guests(deepspeed):
    (_, _, _, metrics), plain = deepspeed
    _check_same_losses(metrics, plain)

"""The tuner: fused trials, pruning with slot refill, resume after a crash, transfer to full width."""
import math

import optuna
import pytest
from optuna.trial import TrialState

from megatron_ext.hydro.bundle import TrialBundle
from megatron_ext.hydro.config import HydroTuneConfig, hparams_from
from megatron_ext.hydro.data import TokenBatches, synthetic_tokens
from megatron_ext.hydro.parametrization import mup_multipliers
from megatron_ext.hydro.search_space import parse_search_space
from megatron_ext.hydro.tuner import HydroTuner, SimulatedCrash, results_table

VOCAB = 32
SPACE = parse_search_space({"lr": {"type": "float", "low": 1e-4, "high": 3e-2, "log": True},
                            "warmup_steps": {"type": "int", "low": 0, "high": 4}})


def cfg_for(tmp_path, **kw):
    base = dict(study_name="t", output_dir=str(tmp_path), n_trials=6, fusion=2, trial_steps=12, eval_interval=4,
                min_resource=4, reduction_factor=2, hidden_size=32, num_attention_heads=4, num_layers=1,
                seq_length=8, micro_batch_size=4, eval_iters=2, shrink_ratio=0.5, target_steps=0, seed=3,
                data_path="synthetic", optimizer="adam")
    base.update(kw)
    return HydroTuneConfig(**base)


def data():
    return TokenBatches(synthetic_tokens(20_000, VOCAB, seed=1), 8, 4, seed=0)


def tuner(cfg, **kw):
    return HydroTuner(cfg, SPACE, hparams_from({}, cfg.trial_steps), data=data(), vocab_size=VOCAB,
                      log=lambda s: None, **kw)


def test_pruned_and_finished_trials_free_slots_for_new_ones(tmp_path, monkeypatch):
    sizes, ids_seen = [], []
    orig = TrialBundle.train_step

    def spy(self, x, y):
        sizes.append(self.num_trials)
        ids_seen.append(tuple(self.trial_ids))
        return orig(self, x, y)

    monkeypatch.setattr(TrialBundle, "train_step", spy)
    res = tuner(cfg_for(tmp_path)).run()
    assert res.n_complete + res.n_pruned == 6 and res.n_failed == 0
    assert res.n_pruned >= 1 and res.fusion == 2
    assert max(sizes) == 2
    # slot refill: some step ran a pair of trials that were not started together
    assert any(ids[1] - ids[0] > 1 for ids in ids_seen if len(ids) == 2)
    study = optuna.load_study(study_name="t", storage=cfg_for(tmp_path).resolved_storage())
    for t in study.get_trials(states=(TrialState.PRUNED,)):
        assert t.last_step < 12        # pruned trials stopped early ...
    for t in study.get_trials(states=(TrialState.COMPLETE,)):
        assert t.last_step == 12 and t.value == t.intermediate_values[12]
    assert res.best_proxy_loss == min(t.value for t in study.get_trials(states=(TrialState.COMPLETE,)))
    table = results_table(res, SPACE)
    assert table.splitlines()[0].split() == ["trial", "state", "steps", "val_loss", "lr", "warmup_steps"]


def _rung_values_at_rung_steps(study, min_resource, rf):
    """SHA's verdicts compare values at equal steps: each trial's rung-k value is its value at step
    min_resource * rf**k (eval_interval divides it here)."""
    for t in study.get_trials():
        for k in range(8):
            key = f"completed_rung_{k}"
            if key in t.system_attrs:
                assert t.system_attrs[key] == t.intermediate_values[min_resource * rf ** k], (t.number, k)


def test_killed_study_resumes_its_trials_with_their_verdicts(tmp_path):
    cfg = cfg_for(tmp_path, pruner="successive_halving", n_trials=10, fusion=4, trial_steps=16)
    with pytest.raises(SimulatedCrash):   # three trials pruned at step 4, three others killed at step 12
        tuner(cfg, crash_after=3).run()
    study = optuna.load_study(study_name="t", storage=cfg.resolved_storage())
    before = {t.number: (t.state, t.value) for t in study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))}
    running = {t.number: t for t in study.get_trials(states=(TrialState.RUNNING,))}
    assert len(before) == 3 and len(running) >= 1
    assert any(t.last_step for t in running.values()), "no interrupted trial had been judged yet"

    lines = []
    res = HydroTuner(cfg, SPACE, hparams_from({}, cfg.trial_steps), data=data(), vocab_size=VOCAB,
                     log=lines.append).run()
    assert any(f"resuming study 't': 3 of 10 trials done, {len(running)} interrupted trials resume" in s for s in lines)
    study = optuna.load_study(study_name="t", storage=cfg.resolved_storage())
    trials = {t.number: t for t in study.get_trials()}
    assert res.n_complete + res.n_pruned == 10 and res.n_failed == 0 and len(trials) == 10
    assert res.best_trial is not None and res.best_proxy_loss == min(
        t.value for t in trials.values() if t.state == TrialState.COMPLETE)
    for n, (state, value) in before.items():          # finished work is kept, not redone
        assert trials[n].state == state and trials[n].value == value
    for n, old in running.items():
        t = trials[n]                                   # resumed under its own number, same config
        assert t.state in (TrialState.COMPLETE, TrialState.PRUNED) and t.params == old.params
        for step, v in old.intermediate_values.items():
            assert t.intermediate_values[step] == v      # earlier verdicts' values are kept ...
        if t.state == TrialState.PRUNED:                 # ... and it is never pruned at a step it had passed
            assert t.last_step > (old.last_step or 0)
    _rung_values_at_rung_steps(study, cfg.min_resource, cfg.reduction_factor)


def test_a_finished_study_reports_its_result_without_retraining(tmp_path, monkeypatch):
    cfg = cfg_for(tmp_path, n_trials=2, trial_steps=4, pruner="none", target_steps=3)
    first = tuner(cfg).run()
    assert first.target_loss is not None and not first.target_reused

    def no_training(*a, **k):
        raise AssertionError("the finished study trained something again")
    monkeypatch.setattr(TrialBundle, "train_step", no_training)
    monkeypatch.setattr(HydroTuner, "transfer", no_training)
    lines = []
    again = HydroTuner(cfg, SPACE, hparams_from({}, cfg.trial_steps), data=data(), vocab_size=VOCAB,
                       log=lines.append).run()
    assert again.target_reused and again.target_loss == first.target_loss
    assert (again.best_trial, again.best_proxy_loss) == (first.best_trial, first.best_proxy_loss)
    assert f"target: trial #{first.best_trial}'s config was transferred by an earlier run" in "\n".join(lines)
    assert "full-width target val loss" in results_table(again, SPACE).splitlines()[-1]

    monkeypatch.undo()           # a longer target is trained again, and the reason is given
    lines.clear()
    longer = HydroTuner(cfg_for(tmp_path, n_trials=2, trial_steps=4, pruner="none", target_steps=5), SPACE,
                        hparams_from({}, 4), data=data(), vocab_size=VOCAB, log=lines.append).run()
    assert not longer.target_reused and longer.target_loss != first.target_loss
    assert "retraining the target: the earlier transfer does not apply (target_steps 3 -> 5)" in lines


def test_resume_with_a_different_search_space_is_refused(tmp_path):
    cfg = cfg_for(tmp_path, n_trials=1, trial_steps=4, pruner="none")
    tuner(cfg).run()
    other = HydroTuner(cfg, parse_search_space({"lr": {"type": "float", "low": 1e-3, "high": 1e-1}}),
                       data=data(), vocab_size=VOCAB, log=lambda s: None)
    with pytest.raises(RuntimeError, match="was created with different search_space"):
        other.run()


def test_best_config_transfers_to_the_full_width_target(tmp_path):
    cfg = cfg_for(tmp_path, n_trials=3, pruner="hyperband", target_steps=16, parametrization="mup",
                  optimizer="adamw")
    t = tuner(cfg)
    res = t.run()
    assert res.best_trial is not None and res.n_complete + res.n_pruned == 3
    assert res.target_loss is not None and math.isfinite(res.target_loss)
    assert res.target_loss < math.log(VOCAB) - 0.5           # the target learned with the transferred config
    target = t.target_factory(0)
    assert target.blocks[0].mlp.fc1.in_features == 32       # trained at full width ...
    assert t.proxy_template.get_submodule("blocks.0.mlp.fc1").in_features == 16   # ... tuned at half width
    mults = mup_multipliers(target, "adamw")
    assert mults["blocks.0.mlp.fc1.weight"][0] == 0.5        # muP: hidden LRs scale 1/width_mult
    assert mup_multipliers(t.proxy_factory(0), "adamw")["blocks.0.mlp.fc1.weight"][0] == 1.0


def test_python_api_takes_defaults_from_the_config(tmp_path):
    cfg = cfg_for(tmp_path, defaults={"schedule": "cosine", "beta2": 0.95, "grad_clip": 1.0})
    t = HydroTuner(cfg, SPACE, data=data(), vocab_size=VOCAB, log=lambda s: None)
    assert t.defaults.schedule.kind == "cosine" and t.defaults.beta2 == 0.95 and t.defaults.grad_clip == 1.0
    assert t.defaults.schedule.total_steps == cfg.trial_steps


def test_a_llama_study_tunes_a_shrunk_llama_proxy_and_transfers(tmp_path):
    cfg = cfg_for(tmp_path, model_family="llama", hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=64, rotary_base=500000, n_trials=3, pruner="none", trial_steps=8, target_steps=16,
                  parametrization="mup", optimizer="adamw")
    t = tuner(cfg)
    res = t.run()
    assert res.n_complete == 3 and res.target_loss is not None and res.target_loss < math.log(VOCAB) - 0.5
    attn = t.proxy_template.get_submodule("blocks.0.attn")
    assert (attn.n_heads, attn.kv_heads, attn.rotary_base) == (2, 1, 500000.0)      # shrunk 0.5: 4/2 -> 2/1
    assert t.proxy_template.get_submodule("blocks.0.mlp.gate").out_features == 32    # SwiGLU 64 -> 32
    target = t.target_factory(0)
    assert target.shape.family == "llama" and target.blocks[0].attn.kv_heads == 2
    assert mup_multipliers(target, "adamw")["blocks.0.mlp.gate.weight"][0] == 0.5    # muP on the SwiGLU widths
    study = optuna.load_study(study_name="t", storage=cfg.resolved_storage())
    assert study.user_attrs["hydro"]["model_family"] == "llama"
    with pytest.raises(RuntimeError, match="was created with different model_family, num_query_groups"):
        tuner(cfg_for(tmp_path, n_trials=3, pruner="none", trial_steps=8, optimizer="adamw")).run()   # gpt, same name

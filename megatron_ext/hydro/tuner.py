"""The Hydro tuner: an Optuna study whose trials run as fused bundles of shrunk models.

1. Shrink the target (a GPT- or LLaMA-style block, ``model_family``) with ``shrink_model`` and
   parametrize it with muP, so the proxy's best hyperparameters are the target's too.
2. Ask Optuna for as many configs as the bundle holds (fusion count from the memory model) and
   train them as one fused bundle; every ``eval_interval`` steps of a trial, report its validation
   loss. The pruner (successive halving / Hyperband / median) stops weak trials; finished and
   pruned trials leave the bundle and newly asked trials take their slots at once.
3. Train the full-width target with the best config and evaluate it.

The study lives in Optuna storage (SQLite by default), so a killed tuner resumes: finished trials
are kept, and trials that were running are picked up again under their own numbers (retrained from
step 0, since a bundle's weights live in memory only) with the pruner's earlier verdicts kept, so
they are judged at the same steps as every other trial and are never pruned for being late.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from typing import Any, Callable

import optuna
import torch
from optuna.trial import TrialState

from megatron_ext.compat.devices import resolve_device

from .bundle import TrialBundle, TrialSpec
from .config import HydroTuneConfig, default_hparams, hparams_dict, hparams_from
from .data import TokenBatches, load_tokens
from .distinct import DistinctSampler
from .fx_common import reinitialize
from .memory import MemoryModel, available_bytes, fusion_count, probe_memory_model
from .models import GPT, GPTShape
from .nn import fused_cross_entropy
from .optim import TrialHParams
from .parametrization import apply_mup, mup_multipliers, param_shapes
from .search_space import Param, space_signature
from .shrink import shrink_model

logger = logging.getLogger(__name__)

# User attribute of a trial that a worker sharing the study (a Bubble Squeezer guest) gave back
# unfinished: {"why", "reason", "steps", "trial_steps"}. The trial is FAIL in Optuna's terms; the
# tables and summaries name it apart from failures.
GIVEN_BACK_ATTR = "squeeze_given_back"


class SimulatedCrash(RuntimeError):
    """Raised by ``crash_after`` (tests): after that many trials finished, the tuner stops dead with
    its refilled bundle mid-training, leaving the study exactly as a killed process would."""


@dataclasses.dataclass
class TuneResult:
    best_trial: int | None
    best_params: dict[str, Any]
    best_proxy_loss: float | None
    target_loss: float | None
    n_complete: int
    n_pruned: int
    n_failed: int                             # failed, not counting the given-back trials
    fusion: int
    wall_s: float
    tuning_s: float
    transfer_s: float
    rows: list[dict[str, Any]]
    history: list[tuple[float, float]]        # (seconds since start, best proxy loss so far)
    target_reused: bool = False               # target_loss comes from an earlier run of this study
    n_given_back: int = 0                     # handed back unfinished by a guest (GIVEN_BACK_ATTR)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def sampler_seed(seed: int, key: tuple[int, ...] = ()) -> int:
    """The sampler's seed: the study's own, or for one of several workers sharing the study (``key``:
    its identity, e.g. a guest's rank) a seed derived from both, the same every time."""
    if not key:
        return seed
    digest = hashlib.sha256(",".join(str(int(k)) for k in (seed, *key)).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _make_sampler(cfg: HydroTuneConfig, space: dict[str, Param], key: tuple[int, ...] = ()) -> DistinctSampler:
    seed = sampler_seed(cfg.seed, key)
    if cfg.sampler == "random":
        base: optuna.samplers.BaseSampler = optuna.samplers.RandomSampler(seed=seed)
    else:
        # constant_liar: trials asked in one batch (one bundle) should not all land on one point.
        base = optuna.samplers.TPESampler(seed=seed, constant_liar=True, n_startup_trials=min(8, cfg.n_trials))
    return DistinctSampler(base, space, seed=seed)


def _make_pruner(cfg: HydroTuneConfig) -> optuna.pruners.BasePruner:
    if cfg.pruner == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=max(1, cfg.min_resource),
                                                      reduction_factor=cfg.reduction_factor)
    if cfg.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=max(1, cfg.min_resource), max_resource=cfg.trial_steps,
                                              reduction_factor=cfg.reduction_factor)
    if cfg.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=cfg.min_resource)
    return optuna.pruners.NopPruner()


@dataclasses.dataclass
class _Progress:
    """Where one run of the study stands: what the steps of ``HydroTuner.run`` read and update."""

    t0: float                   # the run's start (perf_counter): log lines and history count from it
    lengths: list[int]          # steps of the finished trials: the ETA's model of how long a trial runs
    n_finished: int             # counted locally: the storage is not queried on every step
    best: float                 # the best complete trial's value so far
    pending: list[optuna.trial.FrozenTrial] = dataclasses.field(default_factory=list)  # interrupted, to retrain
    judged: dict[int, int] = dataclasses.field(default_factory=dict)  # trial -> last step the pruner saw
    active: dict[int, optuna.Trial] = dataclasses.field(default_factory=dict)  # the bundle's trials
    bundle: TrialBundle | None = None
    leaving: list[int] = dataclasses.field(default_factory=list)  # told finished: leave at the next refill
    history: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # (s since t0, best so far)
    finished_here: int = 0      # trials this run finished (``crash_after`` counts these)
    t_loop: float = 0.0         # when training started: the ETA's rate is trial-steps since then
    trial_steps_here: int = 0


class HydroTuner:
    def __init__(self, cfg: HydroTuneConfig, space: dict[str, Param], defaults: TrialHParams | None = None,
                 default_dropout: float = 0.0, *, data: TokenBatches | None = None, vocab_size: int | None = None,
                 memory_model: MemoryModel | None = None, log: Callable[[str], None] | None = None,
                 crash_after: int | None = None) -> None:
        self.cfg, self.space = cfg, space
        if defaults is None:  # from cfg.defaults, validated like the YAML path does
            defaults, default_dropout = default_hparams(cfg, "HydroTuneConfig", {})
        self.defaults = defaults
        self.default_dropout = default_dropout
        self.data, self.vocab_size = data, vocab_size
        self.memory_model = memory_model
        self.log = log or (lambda s: logger.info("%s", s))
        self.crash_after = crash_after
        self.study: optuna.Study | None = None
        self.sampler_key: tuple[int, ...] = ()   # a worker's identity, when several share the study
        self._phase = "setup"     # setup, tuning, transfer, done: for status_line()
        self.device = torch.device(resolve_device(cfg.device))

    # ---- set-up ---------------------------------------------------------------------------------
    def _setup_data(self) -> None:
        if self.data is None:
            tokens, vocab, desc = load_tokens(self.cfg.data_path, self.cfg.data_cache_dir, self.cfg.max_tokens,
                                              self.cfg.seed)
            self.log(f"data: {desc}")
            self.data = TokenBatches(tokens, self.cfg.seq_length, self.cfg.micro_batch_size, seed=self.cfg.seed)
            self.vocab_size = self.vocab_size or vocab
        if self.cfg.vocab_size:
            self.vocab_size = self.cfg.vocab_size
        if not self.vocab_size:
            self.vocab_size = int(max(self.data.train.max(), self.data.val.max())) + 1

    def _target_shape(self) -> GPTShape:
        return self.cfg.target_shape(self.vocab_size)

    def _setup_models(self) -> None:
        c = self.cfg
        torch.manual_seed(c.seed)
        self.target_template = GPT(self._target_shape())
        example = (self.data.train_batch()[0][:2],)
        if c.shrink_ratio < 1:
            self.proxy_template = shrink_model(self.target_template, c.shrink_ratio, example_inputs=example,
                                               mode=c.shrink_mode)
            self.log(str(self.proxy_template.shrink_report))
            delta = self.target_template
        else:
            self.proxy_template = self.target_template
            delta = shrink_model(self.target_template, 2.0, example_inputs=example, mode=c.shrink_mode)
        self.base_shapes, self.delta_shapes = param_shapes(self.proxy_template), param_shapes(delta)
        self.mup = c.parametrization == "mup"
        self.proxy_multipliers = mup_multipliers(self.proxy_factory(0), c.optimizer) if self.mup else None

    def proxy_factory(self, seed: int) -> torch.nn.Module:
        m = reinitialize(copy.deepcopy(self.proxy_template), seed)
        if self.mup:
            apply_mup(m, self.base_shapes, self.delta_shapes)
        return m

    def target_factory(self, seed: int) -> torch.nn.Module:
        m = reinitialize(copy.deepcopy(self.target_template), seed)
        if self.mup:
            apply_mup(m, self.base_shapes, self.delta_shapes)
        return m

    def _bundle(self, factory, specs, multipliers, check: bool = True) -> TrialBundle:
        x, _ = self.data.train_batch()
        return TrialBundle(factory, specs, optimizer=self.cfg.optimizer, loss_fn=fused_cross_entropy,
                           example_inputs=(x[:2],), multipliers=multipliers, check=check, device=self.device)

    def _fusion(self) -> int:
        c = self.cfg
        if c.fusion:
            return c.fusion
        model = self.memory_model
        if model is None:
            specs = lambda b: [TrialSpec(i, seed=i, hparams=self.defaults) for i in range(b)]  # noqa: E731
            model = probe_memory_model(lambda b: self._bundle(self.proxy_factory, specs(b), self.proxy_multipliers,
                                                              check=False), self.data.train_batch())
        budget = available_bytes(self.device, c.memory_budget_mb)
        b = fusion_count(model, budget, c.max_fusion)
        self.log(f"fusion count {b}: {model(1) / 2**20:.2f} MiB for one trial, {model(b) / 2**20:.2f} MiB for "
                 f"{b}, budget {budget / 2**20:.0f} MiB")
        return b

    def _study(self) -> tuple[optuna.Study, list[optuna.trial.FrozenTrial]]:
        """Create or load the study; return it with the trials a killed tuner left running."""
        c = self.cfg
        study = self._open_study()
        stale = sorted(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)), key=lambda t: t.number)
        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        if done or stale:
            msg = f"resuming study '{c.study_name}': {len(done)} of {c.n_trials} trials done"
            if stale:
                # Marking them failed and re-running the configs as new trials (what this did before)
                # lost their pruner verdicts: the copies were judged again against a population that had
                # grown meanwhile (and against the failed originals' own rung values), and were pruned.
                msg += (f", {len(stale)} interrupted trials resume under their own numbers (" +
                        ", ".join(f"#{t.number}@{t.last_step or 0}" for t in stale) +
                        "): retrained from step 0, earlier pruner verdicts kept")
            self.log(msg)
        return study, stale

    def _open_study(self) -> optuna.Study:
        """Create or load the study; refuse one created with other settings."""
        c = self.cfg
        storage = c.resolved_storage()
        if storage == "memory":   # no persistence (benchmarks); cannot resume
            storage = None
        elif storage.startswith("sqlite:///"):
            os.makedirs(os.path.dirname(os.path.abspath(storage[len("sqlite:///"):])), exist_ok=True)
        study = optuna.create_study(study_name=c.study_name, storage=storage, sampler=_make_sampler(c, self.space, self.sampler_key),
                                    pruner=_make_pruner(c), direction="minimize", load_if_exists=True)
        self.study = study
        sig = {"search_space": space_signature(self.space), "trial_steps": c.trial_steps,
               "shrink_ratio": c.shrink_ratio, "hidden_size": c.hidden_size, "optimizer": c.optimizer}
        sig.update(_non_default(c, ("model_family", "num_query_groups")))   # keys of earlier studies unchanged
        old = study.user_attrs.get("hydro")
        if old is None:
            study.set_user_attr("hydro", sig)
        elif old != sig:
            diff = sorted(k for k in {**old, **sig} if old.get(k) != sig.get(k))
            raise RuntimeError(f"study '{c.study_name}' in {c.resolved_storage()} was created with different {', '.join(diff)}; "
                               "use another study_name or the original settings to resume")
        return study

    # Hooks for a tuner that shares its study with other workers (the Bubble Squeezer's guests).
    def _askable(self, free: int, n_finished: int, n_open: int) -> int:
        """How many new trials to ask now: the free slots, never beyond the trials still to finish
        (``n_open``: trials in training or waiting to resume)."""
        return max(0, min(free, self.cfg.n_trials - n_finished - n_open))

    def _new_trial(self, study: optuna.Study) -> tuple[optuna.Trial, TrialSpec] | None:
        """Ask one new trial and draw its parameters; None when the study wants no more."""
        trial = study.ask()
        return trial, self._spec(trial)

    def _fusion_now(self, fusion: int) -> int:
        """The fusion count for the next refill (a caller may lower it while the study runs)."""
        return fusion

    # ---- the study --------------------------------------------------------------------------------
    def _spec(self, trial: optuna.Trial) -> TrialSpec:
        values = {name: p.suggest(trial) for name, p in self.space.items()}
        hp = hparams_from(values, self.cfg.trial_steps, base=self.defaults)
        dropout = float(values.get("dropout", self.default_dropout))
        return TrialSpec(trial.number, seed=self.cfg.seed + trial.number, hparams=hp, dropout=dropout)

    def status_line(self) -> str:
        """One line of where the study stands (printed when the tuner is interrupted)."""
        c = self.cfg
        study = self.study
        if study is None:
            return f"study '{c.study_name}' not started yet (setting up data and models)"
        trials = study.get_trials(deepcopy=False)
        n_c = sum(t.state == TrialState.COMPLETE for t in trials)
        n_p = sum(t.state == TrialState.PRUNED for t in trials)
        running = [t for t in trials if t.state == TrialState.RUNNING]
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        line = (f"study '{c.study_name}' at {c.resolved_storage()}: {n_c + n_p}/{c.n_trials} trials done "
                f"({n_c} complete, {n_p} pruned), {len(running)} in training")
        if complete:
            b = min(complete, key=lambda t: t.value)
            line += f"; best #{b.number} val {b.value:.4f}"
        if self._phase == "transfer":
            line += "; the full-width target was being trained"
        if c.resolved_storage() == "memory":
            return line + "; storage 'memory': nothing to resume"
        return line + "; run the same command to resume"

    def run(self) -> TuneResult:
        """Run the study to ``n_trials`` finished trials and transfer its best config.

        The steps: set up data, models and the study (:meth:`_prepare`); settle the trials a killed
        run left running (:meth:`_settle_interrupted`); size the bundle (:meth:`_fusion`); train
        bundles until no trial is left (:meth:`_tune`); transfer and write the results
        (:meth:`_finish`). A study already finished goes straight to the last step.
        """
        c = self.cfg
        t0 = time.perf_counter()
        study, stale = self._prepare()
        val = self.data.val_batches(c.eval_iters)
        p = self._settle_interrupted(study, stale, t0)
        if p.n_finished >= c.n_trials and not p.pending:
            fusion = int(study.user_attrs.get("hydro_fusion", c.fusion))
            self.log(f"study '{c.study_name}' is finished ({p.n_finished}/{c.n_trials} trials done): no trial to train")
            return self._finish(study, fusion, t0, time.perf_counter() - t0, [])
        fusion = self._fusion()
        if c.resolved_storage() != "memory":
            study.set_user_attr("hydro_fusion", fusion)
        self._tune(study, fusion, val, p)
        tuning_s = time.perf_counter() - t0
        return self._finish(study, fusion, t0, tuning_s, p.history)

    def _prepare(self) -> tuple[optuna.Study, list[optuna.trial.FrozenTrial]]:
        """Data, proxy and target models, then the study (with the trials a killed run left
        running): the study last, so that a bad data path or model shape leaves no storage behind."""
        self._phase = "setup"
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        self._setup_data()
        self._setup_models()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study, stale = self._study()
        self._phase = "tuning"
        return study, stale

    def _settle_interrupted(self, study: optuna.Study, stale: list[optuna.trial.FrozenTrial],
                            t0: float) -> _Progress:
        """The study's progress before this run trains anything. Of the interrupted trials (``stale``),
        one whose last report was already final is told so, and one that had diverged is pruned:
        they count as finished. The others wait to be retrained under their own numbers, and
        ``judged[n]`` keeps the last step the pruner saw for trial n."""
        c = self.cfg
        prior = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        p = _Progress(t0=t0, lengths=[t.last_step for t in prior if t.last_step is not None],
                      n_finished=len(prior),
                      best=min((t.value for t in prior if t.state == TrialState.COMPLETE), default=math.inf))
        for t in stale:
            last = t.intermediate_values.get(t.last_step) if t.last_step is not None else None
            if last is not None and not math.isfinite(last):
                study.tell(t.number, state=TrialState.PRUNED)
            elif last is not None and t.last_step >= c.trial_steps:
                study.tell(t.number, last)
                p.best = min(p.best, last)
            else:
                p.pending.append(t)
                continue
            p.n_finished += 1
            p.lengths.append(t.last_step)
        p.judged = {t.number: t.last_step for t in p.pending if t.last_step is not None}
        return p

    def _tune(self, study: optuna.Study, fusion: int, val: list, p: _Progress) -> None:
        """Train the bundle a step at a time until no trial is left: refill its free slots, train,
        and at each trial's evaluation steps let the pruner judge it (finished and pruned trials
        leave at the next refill)."""
        c = self.cfg
        p.t_loop, p.trial_steps_here = time.perf_counter(), 0
        while True:
            self._refill(study, fusion, p)
            if not p.active:
                break
            if self.crash_after is not None and p.finished_here >= self.crash_after:
                raise SimulatedCrash(f"simulated crash after {p.finished_here} finished trials")
            bundle = p.bundle
            x, y = self.data.train_batch()
            losses = bundle.train_step(x, y)
            p.trial_steps_here += bundle.num_trials
            due = [tid for tid in bundle.trial_ids
                   if bundle.steps_of(tid) % c.eval_interval == 0 or bundle.steps_of(tid) >= c.trial_steps
                   or not math.isfinite(losses[bundle.trial_ids.index(tid)])]
            if not due:
                continue
            vals = dict(zip(bundle.trial_ids, bundle.evaluate(val)))
            notes = []
            for tid in due:
                note = self._judge(study, p, tid, vals[tid])
                if note is not None:
                    notes.append(note)
            self._retire(p)
            self._log_progress(p, vals, notes)

    def _refill(self, study: optuna.Study, fusion: int, p: _Progress) -> None:
        """Fill the bundle's free slots: interrupted trials first, then new ones, never more than
        the trials still to finish. Leavers and newcomers change the bundle in one resize (one copy
        of the survivors' state)."""
        free = self._fusion_now(fusion) - len(p.active)
        new_specs = []
        while p.pending and free > 0:
            trial = optuna.trial.Trial(study, p.pending.pop(0)._trial_id)   # params come back from storage
            p.active[trial.number] = trial
            new_specs.append(self._spec(trial))
            free -= 1
        for _ in range(self._askable(free, p.n_finished, len(p.active) + len(p.pending))):
            asked = self._new_trial(study)
            if asked is None:
                break
            trial, spec = asked
            p.active[trial.number] = trial
            new_specs.append(spec)
        if p.bundle is not None and (p.leaving or new_specs):
            keep = [t for t in p.bundle.trial_ids if t not in p.leaving]
            if keep or new_specs:
                p.bundle.resize(keep, new_specs)
            else:
                p.bundle = None  # every slot emptied and nothing left to ask: done
        elif new_specs:
            p.bundle = self._bundle(self.proxy_factory, new_specs, self.proxy_multipliers)
        p.leaving = []
        if new_specs:
            self.log(f"[{time.perf_counter() - p.t0:7.1f}s] start " + ", ".join(
                f"#{s.trial_id} " + _fmt_params(s, self.space) + (" resumed" if s.trial_id in p.judged else "")
                for s in new_specs))

    def _judge(self, study: optuna.Study, p: _Progress, tid: int, v: float) -> str | None:
        """Report trial ``tid``'s validation loss ``v`` at its current step and tell the study when
        it diverged, finished or is pruned (it then leaves the bundle); the progress note, if any."""
        trial, step = p.active[tid], p.bundle.steps_of(tid)
        if not math.isfinite(v):
            study.tell(trial, state=TrialState.PRUNED)
            p.leaving.append(tid)
            return f"#{tid} diverged"
        if step < p.judged.get(tid, 0):
            return None       # a resumed trial retraining steps the pruner has already judged
        if step != p.judged.get(tid):
            # At the last judged step the stored value is kept. Asking the pruner again there
            # repeats a verdict it gave, or gives the one a kill may have cut off.
            trial.report(v, step)
        if step >= self.cfg.trial_steps:
            study.tell(trial, v)
            p.leaving.append(tid)
            if v < p.best:
                p.best = v
                p.history.append((time.perf_counter() - p.t0, p.best))
            return f"#{tid} done {v:.4f}"
        if trial.should_prune():
            study.tell(trial, state=TrialState.PRUNED)
            p.leaving.append(tid)
            return f"#{tid} pruned at {step} ({v:.4f})"
        return None

    def _retire(self, p: _Progress) -> None:
        """Count the trials told finished this step; their lengths feed the ETA."""
        for tid in p.leaving:
            del p.active[tid]
            p.judged.pop(tid, None)
            p.lengths.append(p.bundle.steps_of(tid))
            p.finished_here += 1
            p.n_finished += 1

    def _log_progress(self, p: _Progress, vals: dict[int, float], notes: list[str]) -> None:
        """One line per evaluation step: trials done, the ETA, each trial's step and loss, verdicts."""
        c = self.cfg
        bundle = p.bundle
        per_step = (time.perf_counter() - p.t_loop) / max(1, p.trial_steps_here)
        eta = per_step * _remaining_trial_steps(
            [bundle.steps_of(t) for t in p.active], c.n_trials - p.n_finished - len(p.active), p.lengths, c.trial_steps)
        self.log(f"[{time.perf_counter() - p.t0:7.1f}s] {p.n_finished}/{c.n_trials} trials done, eta {_fmt_dur(eta)} | "
                 + " ".join(f"#{t}@{bundle.steps_of(t)}={vals[t]:.3f}" for t in bundle.trial_ids) +
                 (" | " + "; ".join(notes) if notes else ""))

    # ---- transfer and results -----------------------------------------------------------------------
    def _transfer_key(self, best_t: optuna.trial.FrozenTrial) -> dict[str, Any]:
        """What the target's validation loss depends on: a stored result with the same key is reused."""
        c = self.cfg
        fields = ("target_steps", "seed", "data_path", "max_tokens", "vocab_size", "seq_length", "micro_batch_size",
                  "eval_iters", "num_layers", "hidden_size", "num_attention_heads", "ffn_mult", "activation", "norm",
                  "shrink_ratio", "shrink_mode", "parametrization", "optimizer", "defaults", "device")
        return {"best_trial": best_t.number, "params": dict(best_t.params),
                **{f: getattr(c, f) for f in fields},
                # added with the llama block: only where set, so earlier studies' keys still match
                **_non_default(c, ("model_family", "num_query_groups", "rotary_base", "ffn_hidden_size"))}

    def _finish(self, study: optuna.Study, fusion: int, t0: float, tuning_s: float,
                history: list[tuple[float, float]]) -> TuneResult:
        c = self.cfg
        trials = study.get_trials(deepcopy=False)
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        rows = [{"trial": t.number, "state": t.state.name, "steps": t.last_step, "val_loss": t.value if t.value is not None
                 else (t.intermediate_values.get(t.last_step) if t.last_step is not None else None), "params": t.params,
                 "given_back": given_back_reason(t)}
                for t in trials]
        best_t = min(complete, key=lambda t: t.value) if complete else None
        target_loss, reused = None, False
        t1 = time.perf_counter()
        if best_t is not None and c.target_steps > 0:
            # json round trip: the key is compared with what the storage gives back (lists, not tuples)
            key = json.loads(json.dumps(self._transfer_key(best_t), default=str))
            stored = study.user_attrs.get("hydro_target")
            if stored is not None and stored.get("key") == key:
                target_loss, reused = stored["target_loss"], True
                self.log(f"target: trial #{best_t.number}'s config was transferred by an earlier run of this study: "
                         f"val loss {target_loss:.4f} (not retrained)")
            else:
                if stored is not None:
                    old = stored.get("key", {})
                    why = ", ".join(f"{k} {old.get(k)!r} -> {key[k]!r}" if k != "best_trial" else
                                    f"best trial #{old.get(k)} -> #{key[k]}" for k in key if old.get(k) != key[k])
                    self.log(f"retraining the target: the earlier transfer does not apply ({why})")
                self._phase = "transfer"
                target_loss = self.transfer(best_t.params)
                if c.resolved_storage() != "memory":
                    study.set_user_attr("hydro_target", {"key": key, "target_loss": target_loss})
        transfer_s = time.perf_counter() - t1
        res = TuneResult(best_trial=best_t.number if best_t else None, best_params=dict(best_t.params) if best_t else {},
                         best_proxy_loss=best_t.value if best_t else None, target_loss=target_loss,
                         n_complete=len(complete), n_pruned=sum(t.state == TrialState.PRUNED for t in trials),
                         n_failed=n_failed(trials), n_given_back=n_given_back(trials), fusion=fusion,
                         wall_s=time.perf_counter() - t0, tuning_s=tuning_s, transfer_s=transfer_s, rows=rows,
                         history=history, target_reused=reused)
        self._phase = "done"
        os.makedirs(c.output_dir, exist_ok=True)
        with open(os.path.join(c.output_dir, f"{c.study_name}.results.json"), "w", encoding="utf-8") as fh:
            json.dump(res.to_json(), fh, indent=1, default=str)
        return res

    def transfer(self, params: dict[str, Any], steps: int | None = None, seed: int | None = None) -> float:
        """Train the full-width target with ``params`` and return its validation loss.

        The target is trained the way the real job would be: a plain (unfused) model with
        ``mup.MuAdam`` / ``MuAdamW`` / ``MuSGD`` (torch optimizers for SP), the trial's LR schedule
        as ``LambdaLR`` and its gradient clipping, so the transferred config is used exactly as found.
        """
        c = self.cfg
        steps = steps or c.target_steps
        hp = hparams_from(params, steps, base=self.defaults)
        dropout = float(params.get("dropout", self.default_dropout))
        model = self.target_factory(c.seed if seed is None else seed).to(self.device)
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = dropout
        opt = _plain_optimizer(model, c.optimizer, hp, self.mup)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, hp.schedule.factor)
        val = self.data.val_batches(c.eval_iters)
        t0 = time.perf_counter()
        every = max(c.eval_interval, steps // 4)
        for k in range(1, steps + 1):
            x, y = (t.to(self.device) for t in self.data.train_batch())
            opt.zero_grad()
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            loss.backward()
            if hp.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), hp.grad_clip)
            opt.step()
            sched.step()
            if not math.isfinite(loss.item()):
                self.log(f"transfer: target diverged at step {k}")
                return math.inf
            if k % every == 0 and k < steps:
                self.log(f"[transfer {time.perf_counter() - t0:6.1f}s] target width {c.hidden_size} step {k}/{steps} "
                         f"val {_plain_eval(model, val, self.device):.4f}")
        v = _plain_eval(model, val, self.device)
        self.log(f"[transfer {time.perf_counter() - t0:6.1f}s] target width {c.hidden_size} step {steps}/{steps} val {v:.4f}")
        return v


def given_back_reason(t: optuna.trial.FrozenTrial) -> str | None:
    """Why a worker gave trial ``t`` back unfinished, or None when it did not."""
    given = t.user_attrs.get(GIVEN_BACK_ATTR) if t.state == TrialState.FAIL else None
    return given.get("reason", "given back") if isinstance(given, dict) else None


def n_given_back(trials: list[optuna.trial.FrozenTrial]) -> int:
    return sum(given_back_reason(t) is not None for t in trials)


def n_failed(trials: list[optuna.trial.FrozenTrial]) -> int:
    """Failed trials, not counting those given back unfinished."""
    return sum(t.state == TrialState.FAIL and given_back_reason(t) is None for t in trials)


def _non_default(cfg: HydroTuneConfig, names: tuple[str, ...]) -> dict[str, Any]:
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    return {n: getattr(cfg, n) for n in names if getattr(cfg, n) != defaults[n]}


def _plain_optimizer(model: torch.nn.Module, kind: str, hp: TrialHParams, mup_on: bool) -> torch.optim.Optimizer:
    if kind == "sgd":
        kw = dict(lr=hp.lr, momentum=hp.momentum, dampening=hp.dampening, weight_decay=hp.weight_decay)
    else:
        kw = dict(lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay)
    if mup_on:
        import mup
        cls = {"adam": mup.MuAdam, "adamw": mup.MuAdamW, "sgd": mup.MuSGD}[kind]
    else:
        cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[kind]
    return cls(model.parameters(), **kw)


@torch.no_grad()
def _plain_eval(model: torch.nn.Module, batches, device: torch.device) -> float:
    was = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        out = model(x.to(device))
        total += float(torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.to(device).reshape(-1)))
    model.train(was)
    return total / max(1, len(batches))


def _remaining_trial_steps(active_steps: list[int], unstarted: int, lengths: list[int], trial_steps: int) -> float:
    """Expected trial-steps left: an active trial at step s runs as long as the finished trials that
    got past s did (on average), and an unstarted one as long as the average finished trial. One
    pseudo-trial that ran to the end joins the average: early in a study only the short (pruned)
    trials have finished, and the estimate would otherwise forget that survivors run to the end."""
    def expected_from(s: int) -> float:
        past = [n for n in lengths if n > s] + [trial_steps]
        return sum(past) / len(past) - s
    return sum(max(0.0, expected_from(s)) for s in active_steps) + max(0, unstarted) * expected_from(0)


def _fmt_dur(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _fmt_params(spec: TrialSpec, space: dict[str, Param]) -> str:
    d = hparams_dict(spec.hparams)
    d["dropout"] = spec.dropout
    return "(" + ", ".join(f"{k}={_fmt(d[k])}" for k in space) + ")"


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def results_table(res: TuneResult, space: dict[str, Param]) -> str:
    """Trials sorted by validation loss (complete first), then the transfer line."""
    names = list(space)
    head = ["trial", "state", "steps", "val_loss"] + names
    order = sorted(res.rows, key=lambda r: (r["state"] != "COMPLETE", r["val_loss"] if r["val_loss"] is not None else math.inf))
    body = [[str(r["trial"]), "given back" if r.get("given_back") else r["state"].lower(), str(r["steps"] if r["steps"] is not None else "-"),
             f"{r['val_loss']:.4f}" if r["val_loss"] is not None else "-"] +
            [_fmt(r["params"].get(n, "-")) for n in names] for r in order]
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in body]
    given = f"{res.n_given_back} given back unfinished, " if res.n_given_back else ""
    lines.append(f"{res.n_complete} complete, {res.n_pruned} pruned, {given}{res.n_failed} failed; fusion {res.fusion}; "
                 f"tuning {res.tuning_s:.1f}s, transfer {res.transfer_s:.1f}s")
    if res.best_trial is not None:
        lines.append(f"best: trial {res.best_trial} proxy val loss {res.best_proxy_loss:.4f}" +
                     (f"; full-width target val loss {res.target_loss:.4f}" if res.target_loss is not None else "") +
                     (" (from an earlier run)" if res.target_reused else ""))
    return "\n".join(lines)

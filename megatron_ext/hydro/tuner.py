"""The Hydro tuner: an Optuna study whose trials run as fused bundles of shrunk models.

1. Shrink the target GPT (``shrink_model``) and parametrize it with muP, so the proxy's best
   hyperparameters are the target's too.
2. Ask Optuna for as many configs as the bundle holds (fusion count from the memory model) and
   train them as one fused bundle; every ``eval_interval`` steps of a trial, report its validation
   loss. The pruner (successive halving / Hyperband / median) stops weak trials; finished and
   pruned trials leave the bundle and newly asked trials take their slots at once.
3. Train the full-width target with the best config and evaluate it.

The study lives in Optuna storage (SQLite by default), so a killed tuner resumes: finished trials
are kept, trials that were running are marked failed and re-queued with the same parameters.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import time
from typing import Any, Callable

import optuna
import torch
from optuna.trial import TrialState

from .bundle import TrialBundle, TrialSpec
from .config import HydroTuneConfig, default_hparams, hparams_dict, hparams_from
from .data import TokenBatches, load_tokens
from .fx_common import reinitialize
from .memory import MemoryModel, available_bytes, fusion_count, probe_memory_model
from .models import GPT, GPTShape
from .nn import fused_cross_entropy
from .optim import TrialHParams
from .parametrization import apply_mup, mup_multipliers, param_shapes
from .search_space import Param, space_signature
from .shrink import shrink_model

logger = logging.getLogger(__name__)


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
    n_failed: int
    fusion: int
    wall_s: float
    tuning_s: float
    transfer_s: float
    rows: list[dict[str, Any]]
    history: list[tuple[float, float]]        # (seconds since start, best proxy loss so far)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _make_sampler(cfg: HydroTuneConfig) -> optuna.samplers.BaseSampler:
    if cfg.sampler == "random":
        return optuna.samplers.RandomSampler(seed=cfg.seed)
    # constant_liar: trials asked in one batch (one bundle) should not all land on one point.
    return optuna.samplers.TPESampler(seed=cfg.seed, constant_liar=True, n_startup_trials=min(8, cfg.n_trials))


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
        self.device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available()
                                   else ("cpu" if cfg.device == "auto" else cfg.device))

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
        c = self.cfg
        return GPTShape(vocab_size=self.vocab_size, seq_len=c.seq_length, d_model=c.hidden_size, n_layers=c.num_layers,
                        n_heads=c.num_attention_heads, ffn_mult=c.ffn_mult, activation=c.activation, norm=c.norm,
                        parametrization=c.parametrization)

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

    def _study(self) -> optuna.Study:
        c = self.cfg
        storage = c.resolved_storage()
        if storage == "memory":   # no persistence (benchmarks); cannot resume
            storage = None
        elif storage.startswith("sqlite:///"):
            os.makedirs(os.path.dirname(os.path.abspath(storage[len("sqlite:///"):])), exist_ok=True)
        study = optuna.create_study(study_name=c.study_name, storage=storage, sampler=_make_sampler(c),
                                    pruner=_make_pruner(c), direction="minimize", load_if_exists=True)
        sig = {"search_space": space_signature(self.space), "trial_steps": c.trial_steps,
               "shrink_ratio": c.shrink_ratio, "hidden_size": c.hidden_size, "optimizer": c.optimizer}
        old = study.user_attrs.get("hydro")
        if old is None:
            study.set_user_attr("hydro", sig)
        elif old != sig:
            diff = sorted(k for k in sig if old.get(k) != sig[k])
            raise RuntimeError(f"study '{c.study_name}' in {c.resolved_storage()} was created with different {', '.join(diff)}; "
                               "use another study_name or the original settings to resume")
        stale = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        for t in stale:
            # A previous tuner died with these in its bundle. Their progress was in memory only:
            # mark them failed and run the same configs again from scratch.
            study.tell(t.number, state=TrialState.FAIL)
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        if done or stale:
            self.log(f"resuming study '{c.study_name}': {len(done)} finished, {len(stale)} interrupted trials re-queued")
        return study

    # ---- the study --------------------------------------------------------------------------------
    def _spec(self, trial: optuna.Trial) -> TrialSpec:
        values = {name: p.suggest(trial) for name, p in self.space.items()}
        hp = hparams_from(values, self.cfg.trial_steps, base=self.defaults)
        dropout = float(values.get("dropout", self.default_dropout))
        return TrialSpec(trial.number, seed=self.cfg.seed + trial.number, hparams=hp, dropout=dropout)

    def run(self) -> TuneResult:
        c = self.cfg
        t0 = time.perf_counter()
        if c.threads:
            torch.set_num_threads(c.threads)
        self._setup_data()
        self._setup_models()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = self._study()
        fusion = self._fusion()
        val = self.data.val_batches(c.eval_iters)

        # Counted locally: querying the storage on every step would cost a database read per step.
        n_finished = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))
        active: dict[int, optuna.Trial] = {}
        bundle: TrialBundle | None = None
        history: list[tuple[float, float]] = []
        best = math.inf
        finished_here = 0
        leaving: list[int] = []
        while True:
            # Refill free slots: never ask for more than the trials still to finish. Leavers and
            # newcomers change the bundle in one resize (one copy of the survivors' state).
            want = min(fusion - len(active), c.n_trials - n_finished - len(active))
            new_specs = []
            for _ in range(max(0, want)):
                trial = study.ask()
                active[trial.number] = trial
                new_specs.append(self._spec(trial))
            if bundle is not None and (leaving or new_specs):
                keep = [t for t in bundle.trial_ids if t not in leaving]
                if keep or new_specs:
                    bundle.resize(keep, new_specs)
                else:
                    bundle = None  # every slot emptied and nothing left to ask: done
            elif new_specs:
                bundle = self._bundle(self.proxy_factory, new_specs, self.proxy_multipliers)
            leaving = []
            if new_specs:
                self.log(f"[{time.perf_counter() - t0:7.1f}s] start " + ", ".join(
                    f"#{s.trial_id} " + _fmt_params(s, self.space) for s in new_specs))
            if not active:
                break
            if self.crash_after is not None and finished_here >= self.crash_after:
                raise SimulatedCrash(f"simulated crash after {finished_here} finished trials")
            x, y = self.data.train_batch()
            losses = bundle.train_step(x, y)
            due = [tid for tid in bundle.trial_ids
                   if bundle.steps_of(tid) % c.eval_interval == 0 or bundle.steps_of(tid) >= c.trial_steps
                   or not math.isfinite(losses[bundle.trial_ids.index(tid)])]
            if not due:
                continue
            vals = dict(zip(bundle.trial_ids, bundle.evaluate(val)))
            notes = []
            for tid in due:
                trial, step, v = active[tid], bundle.steps_of(tid), vals[tid]
                if not math.isfinite(v):
                    study.tell(trial, state=TrialState.PRUNED)
                    notes.append(f"#{tid} diverged")
                    leaving.append(tid)
                    continue
                trial.report(v, step)
                if step >= c.trial_steps:
                    study.tell(trial, v)
                    notes.append(f"#{tid} done {v:.4f}")
                    leaving.append(tid)
                    if v < best:
                        best = v
                        history.append((time.perf_counter() - t0, best))
                elif trial.should_prune():
                    study.tell(trial, state=TrialState.PRUNED)
                    notes.append(f"#{tid} pruned at {step} ({v:.4f})")
                    leaving.append(tid)
            self.log(f"[{time.perf_counter() - t0:7.1f}s] " + " ".join(
                f"#{t}@{bundle.steps_of(t)}={vals[t]:.3f}" for t in bundle.trial_ids) +
                (" | " + "; ".join(notes) if notes else ""))
            for tid in leaving:
                del active[tid]
                finished_here += 1
                n_finished += 1
        tuning_s = time.perf_counter() - t0
        return self._finish(study, fusion, t0, tuning_s, history)

    # ---- transfer and results -----------------------------------------------------------------------
    def _finish(self, study: optuna.Study, fusion: int, t0: float, tuning_s: float,
                history: list[tuple[float, float]]) -> TuneResult:
        c = self.cfg
        trials = study.get_trials(deepcopy=False)
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        rows = [{"trial": t.number, "state": t.state.name, "steps": t.last_step, "val_loss": t.value if t.value is not None
                 else (t.intermediate_values.get(t.last_step) if t.last_step is not None else None), "params": t.params}
                for t in trials]
        best_t = min(complete, key=lambda t: t.value) if complete else None
        target_loss = None
        t1 = time.perf_counter()
        if best_t is not None and c.target_steps > 0:
            target_loss = self.transfer(best_t.params)
        transfer_s = time.perf_counter() - t1
        res = TuneResult(best_trial=best_t.number if best_t else None, best_params=dict(best_t.params) if best_t else {},
                         best_proxy_loss=best_t.value if best_t else None, target_loss=target_loss,
                         n_complete=len(complete), n_pruned=sum(t.state == TrialState.PRUNED for t in trials),
                         n_failed=sum(t.state == TrialState.FAIL for t in trials), fusion=fusion,
                         wall_s=time.perf_counter() - t0, tuning_s=tuning_s, transfer_s=transfer_s, rows=rows,
                         history=history)
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
    body = [[str(r["trial"]), r["state"].lower(), str(r["steps"] if r["steps"] is not None else "-"),
             f"{r['val_loss']:.4f}" if r["val_loss"] is not None else "-"] +
            [_fmt(r["params"].get(n, "-")) for n in names] for r in order]
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in body]
    lines.append(f"{res.n_complete} complete, {res.n_pruned} pruned, {res.n_failed} failed; fusion {res.fusion}; "
                 f"tuning {res.tuning_s:.1f}s, transfer {res.transfer_s:.1f}s")
    if res.best_trial is not None:
        lines.append(f"best: trial {res.best_trial} proxy val loss {res.best_proxy_loss:.4f}" +
                     (f"; full-width target val loss {res.target_loss:.4f}" if res.target_loss is not None else ""))
    return "\n".join(lines)

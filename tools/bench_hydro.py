"""Hydro benchmark: trial fusion throughput, muTransfer across width, and end-to-end tuning.

(a) samples/s of B fused trials against the same B trials trained one after another (plain
    modules, torch.optim.Adam), for a small GPT and a small CNN, with a parity check of the
    trained parameters; medians of rounds whose arms run in a rotated order, the speedup also as
    the median of paired per-round ratios with a 90 % bootstrap interval beside an A/A arm (a
    second, identical bundle) as the noise floor (``megatron_ext/bench/harness.py``).
(b) muTransfer: an LR sweep (one fused bundle per width and seed) at width w and 4w under muP and
    under standard parametrization, on an order-1 and an order-2 Markov stream; how many grid
    steps the best LR moves between the widths, per seed and for the mean over seeds.
(c) end to end: Hydro (shrink 4x + fuse + successive halving, then transfer to the full width)
    against plain sequential Optuna (full-width trials, no pruning) on the same target, data and
    search space, for a muP and for an SP target, over several seeds, interleaved. Both sides train
    full-width models with the same function (``HydroTuner.transfer``), so a target step costs the
    same on both; the figure is Hydro's total time over plain Optuna's time to its best.

Prints a table, then one JSON line. ``--quick`` shrinks every part (for a smoke run).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.bench.harness import aa_name, ratio_interval, rotated_order  # noqa: E402
from megatron_ext.hydro.bundle import TrialBundle, TrialSpec  # noqa: E402
from megatron_ext.hydro.config import HydroTuneConfig, hparams_from  # noqa: E402
from megatron_ext.hydro.data import TokenBatches, load_tokens  # noqa: E402
from megatron_ext.hydro.models import GPT, GPTShape, SmallCNN  # noqa: E402
from megatron_ext.hydro.nn import fused_cross_entropy  # noqa: E402
from megatron_ext.hydro.optim import TrialHParams  # noqa: E402
from megatron_ext.hydro.parametrization import apply_mup, mup_multipliers, param_shapes  # noqa: E402
from megatron_ext.hydro.search_space import parse_search_space  # noqa: E402
from megatron_ext.hydro.tuner import HydroTuner  # noqa: E402


# ---------------------------------------------------------------------------------------------
# (a) fusion throughput
def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def fusion_case(kind: str, sizes: list[int], rounds: int, batch: int
                ) -> tuple[dict[int, tuple[float, float, float]], float, float, dict[int, dict]]:
    """{B: (fused samples/s, sequential samples/s, one-model samples/s)}, the largest relative
    difference of a trial's parameter vector (L2, fused vs trained alone), the largest
    per-tensor max-abs relative one, and per B the fused/sequential speedup and an A/A ratio (a
    second, identical bundle stepped in its own slot) as medians of paired per-round ratios with
    90 % bootstrap intervals. Each round runs the arms in an order rotated by the round.

    "one model" trains a single plain model on the B batches stacked into one (B x the samples):
    the same FLOPs as B fused trials without any per-trial work, so on a CPU it bounds what fusion
    can gain (fusion removes per-op and Python overhead, not arithmetic)."""
    if kind == "gpt":
        # the size of a shrunk proxy trial (tune_tiny's proxy is 32 wide)
        shape = GPTShape(vocab_size=256, seq_len=32, d_model=32, n_layers=2, n_heads=2)
        factory = lambda s: (torch.manual_seed(s), GPT(shape))[1]  # noqa: E731
        gen = torch.Generator().manual_seed(0)

        def make_batch():
            t = torch.randint(0, 256, (batch, 33), generator=gen)
            return t[:, :-1], t[:, 1:]
    else:
        factory = lambda s: (torch.manual_seed(s), SmallCNN(3, 8, 10))[1]  # noqa: E731
        gen = torch.Generator().manual_seed(0)

        def make_batch():
            return torch.randn(batch, 3, 16, 16, generator=gen), torch.randint(0, 10, (batch,), generator=gen)
    results, worst, worst_t, ratios = {}, 0.0, 0.0, {}
    for B in sizes:
        specs = [TrialSpec(i, seed=i, hparams=TrialHParams(lr=1e-3 * (1 + i % 4))) for i in range(B)]
        batches = [make_batch() for _ in range(rounds + 2)]
        bundle = TrialBundle(factory, specs, optimizer="adam", loss_fn=fused_cross_entropy,
                             example_inputs=(batches[0][0][:2],))
        plains = [factory(s.seed) for s in specs]
        opts = [torch.optim.Adam(m.parameters(), lr=s.hparams.lr) for m, s in zip(plains, specs)]
        big = factory(0)
        big_opt = torch.optim.Adam(big.parameters(), lr=1e-3)
        # The A/A arm: a second bundle of the same trials, stepped in its own slot (stepping the
        # first one twice would change what the parity check compares).
        twin = TrialBundle(factory, specs, optimizer="adam", loss_fn=fused_cross_entropy,
                           example_inputs=(batches[0][0][:2],))

        def sequential(x, y):
            for m, o in zip(plains, opts):
                o.zero_grad()
                _ce(m(x), y).backward()
                o.step()

        def one_model(x, y):
            xb, yb = torch.cat([x] * B), torch.cat([y] * B)
            big_opt.zero_grad()
            _ce(big(xb), yb).backward()
            big_opt.step()

        arms = {"fused": bundle.train_step, "sequential": sequential, "one_model": one_model,
                aa_name("fused"): twin.train_step}
        times: dict[str, list[float]] = {name: [] for name in arms}
        for r, (x, y) in enumerate(batches):
            for name in rotated_order(list(arms), r):
                t0 = time.perf_counter()
                arms[name](x, y)
                if r >= 2:                       # two warm-up rounds
                    times[name].append(time.perf_counter() - t0)
        t_fused, t_seq, t_big = times["fused"], times["sequential"], times["one_model"]
        n = B * batch
        results[B] = (n / statistics.median(t_fused), n / statistics.median(t_seq), n / statistics.median(t_big))
        # speedup = sequential time / fused time per round; A/A = the twin's time / fused time
        spd, aa = ratio_interval(t_seq, t_fused), ratio_interval(times[aa_name("fused")], t_fused)
        ratios[B] = {"speedup": round(spd["median"], 3), "speedup_interval": [round(v, 3) for v in spd["interval"]],
                     "aa": round(aa["median"], 3), "aa_interval": [round(v, 3) for v in aa["interval"]]}
        for i, m in enumerate(plains):
            st = bundle.trial_state(i)
            ref = {k: v for k, v in m.state_dict().items() if v.is_floating_point()}
            num = sum(float((st[k] - v).double().pow(2).sum()) for k, v in ref.items())
            den = sum(float(v.double().pow(2).sum()) for v in ref.values())
            worst = max(worst, math.sqrt(num / den))
            for k, v in ref.items():
                worst_t = max(worst_t, float((st[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)))
    return results, worst, worst_t, ratios


# ---------------------------------------------------------------------------------------------
# (b) muTransfer
def lr_sweep(data: TokenBatches, vocab: int, width: int, base_width: int, parametrization: str, lrs: list[float],
             steps: int, seed: int) -> list[float]:
    """Validation loss after ``steps`` for each LR (all LRs as one fused bundle)."""
    def shape(d):
        return GPTShape(vocab_size=vocab, seq_len=data.seq_len, d_model=d, n_layers=2, n_heads=max(1, d // 16),
                        parametrization=parametrization)
    base, delta = param_shapes(GPT(shape(base_width))), param_shapes(GPT(shape(2 * base_width)))

    def factory(s):
        torch.manual_seed(s)
        m = GPT(shape(width))
        return apply_mup(m, base, delta) if parametrization == "mup" else m

    mults = mup_multipliers(factory(0), "adam") if parametrization == "mup" else None
    specs = [TrialSpec(i, seed=seed, hparams=TrialHParams(lr=lr, beta2=0.99)) for i, lr in enumerate(lrs)]
    bundle = TrialBundle(factory, specs, optimizer="adam", loss_fn=fused_cross_entropy,
                         example_inputs=(data.train_batch()[0][:2],), multipliers=mults, check=False)
    gen_state = data.gen.get_state()
    data.gen.manual_seed(seed)        # every width and parametrization sees the same batches
    for _ in range(steps):
        bundle.train_step(*data.train_batch())
    data.gen.set_state(gen_state)
    losses = bundle.evaluate(data.val_batches(4))
    return [v if math.isfinite(v) else float("inf") for v in losses]


# ---------------------------------------------------------------------------------------------
# (c) end to end
def plain_optuna(tuner: HydroTuner, space, n_trials: int) -> dict:
    """Sequential Optuna on the full-width target, every trial trained by ``tuner.transfer``: the
    code that trains Hydro's own target (same parametrization, model, optimizer class, schedule,
    clipping, data stream and evaluation), so both sides do the same work per target step.

    Returns the best-so-far curve as (wall s, cpu s, best val) after each trial, and the
    wall seconds per trained step (evaluation included, as in the transfer)."""
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    cfg = tuner.cfg
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=cfg.seed))
    w0, c0, best, curve, per_step = time.perf_counter(), time.process_time(), math.inf, [], []
    for _ in range(n_trials):
        trial = study.ask()
        values = {name: p.suggest(trial) for name, p in space.items()}
        t = time.perf_counter()
        v = tuner.transfer(values, steps=cfg.trial_steps, seed=cfg.seed + trial.number)
        if math.isfinite(v):      # a diverged trial stops early: its time per step is not comparable
            per_step.append((time.perf_counter() - t) / cfg.trial_steps)
        v = v if math.isfinite(v) else math.inf
        study.tell(trial, v)
        best = min(best, v)
        curve.append((time.perf_counter() - w0, time.process_time() - c0, best))
    return {"curve": curve, "s_per_step": statistics.median(per_step) if per_step else math.nan}


def tuning_case(tokens, vocab: int, parametrization: str, seed: int, quick: bool, space, side: str) -> dict:
    """One side ("plain" or "hydro") of one (parametrization, seed) cell of part (c)."""
    steps = 40 if quick else 150
    cfg = HydroTuneConfig(study_name="bench", storage="memory", output_dir=tempfile.mkdtemp(prefix="hydro-bench-"),
                          n_trials=8 if quick else 24, fusion=8, trial_steps=steps, eval_interval=max(5, steps // 6),
                          min_resource=max(5, steps // 6), reduction_factor=3, hidden_size=128,
                          num_attention_heads=8, num_layers=2, seq_length=32, micro_batch_size=16, eval_iters=4,
                          shrink_ratio=0.25, target_steps=steps, seed=seed, optimizer="adamw",
                          parametrization=parametrization, defaults={"schedule": "cosine", "grad_clip": 1.0})
    data = TokenBatches(tokens, 32, 16, seed=seed)
    tuner = HydroTuner(cfg, space, hparams_from({"schedule": "cosine", "grad_clip": 1.0}, steps),
                       data=data, vocab_size=vocab, log=lambda s: None)
    if side == "plain":
        tuner._setup_data()
        tuner._setup_models()     # the same target factory (and muP base shapes) as Hydro's transfer
        n = 4 if quick else 12
        out = plain_optuna(tuner, space, n)
        curve = out["curve"]
        best = curve[-1][2]
        k = next(i for i, (_, _, b) in enumerate(curve) if b == best)
        return {"best": best, "s_to_best": curve[k][0], "cpu_s_to_best": curve[k][1], "s_total": curve[-1][0],
                "trials": n, "s_per_step": out["s_per_step"]}
    c0 = time.process_time()
    res = tuner.run()
    return {"best": res.target_loss if res.target_loss is not None and math.isfinite(res.target_loss) else math.inf,
            "s": res.wall_s, "cpu_s": time.process_time() - c0, "tuning_s": res.tuning_s, "transfer_s": res.transfer_s,
            "trials": res.n_complete + res.n_pruned, "pruned": res.n_pruned, "fusion": res.fusion,
            "s_per_step": res.transfer_s / steps, "best_params": res.best_params}


def _ratio(hydro: dict, plain: dict, cpu: bool = False) -> float | None:
    """Hydro's total time over plain Optuna's time to its best; None if Hydro's target did not
    reach plain's best loss (the ratio would compare unequal results)."""
    if not hydro["best"] <= plain["best"]:
        return None
    return (hydro["cpu_s"] / plain["cpu_s_to_best"]) if cpu else (hydro["s"] / plain["s_to_best"])


def _median(values: list[float | None]) -> float | None:
    """Median with a missing value counted as worse than any (None if the median is missing)."""
    v = sorted(math.inf if x is None else x for x in values)
    m = statistics.median(v) if v else math.inf
    return None if not math.isfinite(m) else m


def _spread(values: list[float | None], nd: int = 3) -> list[float | None]:
    """[min, max]; a missing value counts as worse than any (null in the JSON)."""
    v = [math.inf if x is None else x for x in values]
    return [_json_num(min(v), nd), _json_num(max(v), nd)]


def _fmt_opt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _json_num(x: float | None, nd: int = 3) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, nd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (same for both sides)")
    ap.add_argument("--data-path", default="synthetic:300000:256",
                    help="token source for (c): '' = default corpus, a prefix, or synthetic")
    ap.add_argument("--mutransfer-data", default="synthetic:300000:32",
                    help="token source for (b) without its order: the sweep runs on the order-1 (bigram) and the "
                         "order-2 stream of this spec; order 2 needs attention to learn")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3],
                    help="seeds of (b) (init and batch order) and (c) (sampler, data order, init)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["fusion", "mutransfer", "tuning"])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = list(args.seeds)
    from megatron_ext.bench.harness import Report

    report = Report("bench_hydro")  # the load average before anything starts (also in the JSON line)
    load_start = [round(x, 2) for x in os.getloadavg()]
    q = args.quick
    out: dict = {}
    rows: list[str] = []

    if "fusion" not in args.skip:
        sizes = [1, 2, 4, 8] if q else [1, 2, 4, 8, 16]
        out["fusion"] = {}
        worst = worst_t = 0.0
        rows.append(f"(a) fusion: samples/s, medians of {'3' if q else '7'} rounds (arms in rotated order), {args.threads} thread(s); paired: median per-round speedup, 90 % interval; A/A: a twin bundle")
        rows.append(f"{'model':6} {'B':>3} {'fused':>10} {'sequential':>11} {'speedup':>8} {'one model':>10} {'bound':>7}")
        for kind, batch in (("gpt", 8), ("cnn", 16)):
            res, w, wt, rat = fusion_case(kind, sizes, 3 if q else 7, batch)
            worst, worst_t = max(worst, w), max(worst_t, wt)
            entry = {str(b): round(f, 1) for b, (f, s, _) in res.items()}
            entry.update({f"seq_{b}": round(s, 1) for b, (f, s, _) in res.items()})
            entry.update({f"one_model_{b}": round(o, 1) for b, (f, s, o) in res.items()})
            if 8 in res:
                entry["speedup_b8"] = round(rat[8]["speedup"], 2)   # median of paired per-round ratios
                entry["speedup_b8_interval"] = rat[8]["speedup_interval"]
                entry["aa_b8"], entry["aa_b8_interval"] = rat[8]["aa"], rat[8]["aa_interval"]
            out["fusion"][kind] = entry
            if 8 in res:
                entry["bound_b8"] = round(res[8][2] / res[8][1], 2)
            for b, (f, s, o) in res.items():
                rows.append(f"{kind:6} {b:>3} {f:>10.1f} {s:>11.1f} {f / s:>7.2f}x {o:>10.1f} {o / s:>6.2f}x   "
                            f"paired {rat[b]['speedup']:.2f}x [{rat[b]['speedup_interval'][0]:.2f}, "
                            f"{rat[b]['speedup_interval'][1]:.2f}]; A/A {rat[b]['aa']:.2f}x "
                            f"[{rat[b]['aa_interval'][0]:.2f}, {rat[b]['aa_interval'][1]:.2f}]")
        out["fusion"]["max_rel_diff"] = float(f"{worst:.3g}")
        out["fusion"]["max_rel_diff_per_tensor"] = float(f"{worst_t:.3g}")
        rows.append(f"parity after {'5' if q else '9'} steps, float32: max over trials of |theta_fused - theta_alone| / "
                    f"|theta_alone| = {worst:.2e} (worst single tensor, max-abs: {worst_t:.2e})")

    tokens, vocab, desc = load_tokens(args.data_path, max_tokens=400_000)

    if "mutransfer" not in args.skip:
        width = 32
        lrs = [2.0 ** e for e in range(-12, -3)] if not q else [2.0 ** e for e in range(-11, -4, 2)]
        steps = 60 if q else 400
        mt: dict = {"seeds": seeds, "steps": steps}
        for order in (1, 2):
            spec = f"{args.mutransfer_data}:{order}"
            mt_tokens, mt_vocab, mt_desc = load_tokens(spec, max_tokens=400_000)
            data = TokenBatches(mt_tokens, 32, 16, seed=0)
            rows.append(f"(b) muTransfer on {mt_desc}: Adam, {steps} steps, LR grid 2^{int(math.log2(lrs[0]))}.."
                        f"2^{int(math.log2(lrs[-1]))}, seeds {seeds}; val loss, mean over seeds")
            rows.append(f"{'param':5} {'width':>5} " + " ".join(f"{'2^' + str(int(math.log2(lr))):>7}" for lr in lrs)
                        + "   best (mean curve; per seed)")
            entry: dict = {}
            for p in ("mup", "sp"):
                best_seed = {w: [] for w in (width, 4 * width)}
                best_mean, mean_of = {}, {}
                for w in (width, 4 * width):
                    curves = [lr_sweep(data, mt_vocab, w, width, p, lrs, steps, seed=s) for s in seeds]
                    for c in curves:
                        best_seed[w].append(min(range(len(lrs)), key=lambda k: c[k]))
                    mean = [statistics.fmean(c[k] for c in curves) for k in range(len(lrs))]
                    best_mean[w] = min(range(len(lrs)), key=lambda k: mean[k])
                    mean_of[w] = mean
                    rows.append(f"{p:5} {w:>5} " + " ".join(f"{v:>7.3f}" for v in mean) +
                                f"   2^{int(math.log2(lrs[best_mean[w]]))}; " +
                                " ".join(f"2^{int(math.log2(lrs[i]))}" for i in best_seed[w]))
                shifts = [b - a for a, b in zip(best_seed[width], best_seed[4 * width])]
                entry[f"{p}_shift"] = best_mean[4 * width] - best_mean[width]
                entry[f"{p}_shifts"] = shifts
                entry[f"{p}_best_lr"] = [lrs[best_mean[width]], lrs[best_mean[4 * width]]]
                # What a shift costs where the curve is flat: the wide model's loss at the narrow
                # model's best LR, minus its best loss (mean curves).
                wide = mean_of[4 * width]
                entry[f"{p}_regret"] = round(wide[best_mean[width]] - wide[best_mean[4 * width]], 4)
            mt[f"order{order}"] = entry
            rows.append(f"order-{order}: best-LR shift from width {width} to {4 * width} (grid steps, mean curve; "
                        f"per seed): muP {entry['mup_shift']:+d} ({', '.join(f'{v:+d}' for v in entry['mup_shifts'])}), "
                        f"SP {entry['sp_shift']:+d} ({', '.join(f'{v:+d}' for v in entry['sp_shifts'])}); "
                        f"loss of width {4 * width} at width {width}'s best LR over its best: muP "
                        f"+{entry['mup_regret']:.4f}, SP +{entry['sp_regret']:.4f}")
        # the keys of the earlier single-order report: the order-2 stream
        mt.update({k: mt["order2"][k] for k in ("mup_shift", "sp_shift", "mup_best_lr", "sp_best_lr")})
        out["mutransfer"] = mt

    if "tuning" not in args.skip:
        space = parse_search_space({"lr": {"type": "float", "low": 1e-4, "high": 3e-2, "log": True},
                                    "beta2": {"type": "categorical", "choices": [0.95, 0.99]}})
        steps = 40 if q else 150
        cells: dict[str, list[tuple[dict, dict]]] = {"mup": [], "sp": []}
        # Interleaved: within a seed both parametrizations and both sides run back to back, and the
        # side that goes first alternates, so a load change on the shared host hits both sides.
        for i, seed in enumerate(seeds):
            for p in ("mup", "sp"):
                order = ("plain", "hydro") if (i + (p == "sp")) % 2 == 0 else ("hydro", "plain")
                got = {side: tuning_case(tokens, vocab, p, seed, q, space, side) for side in order}
                cells[p].append((got["plain"], got["hydro"]))
        rows.append(f"(c) end to end on {desc}: target GPT width 128, {steps} steps per full trial, seeds {seeds}, "
                    "both sides train the target with HydroTuner.transfer")
        rows.append(f"{'param':5} {'seed':>4} {'plain best':>10} {'at s':>7} {'total s':>8} {'ms/step':>8} "
                    f"{'hydro best':>10} {'hydro s':>8} {'ms/step':>8} {'pruned':>6} {'ratio':>6} {'cpu ratio':>9}")
        tuning: dict = {"seeds": seeds, "runs": []}
        for p in ("mup", "sp"):
            ratios, cpu_ratios = [], []
            for seed, (pl, hy) in zip(seeds, cells[p]):
                r, rc = _ratio(hy, pl), _ratio(hy, pl, cpu=True)
                ratios.append(r)
                cpu_ratios.append(rc)
                rows.append(f"{p:5} {seed:>4} {pl['best']:>10.4f} {pl['s_to_best']:>7.1f} {pl['s_total']:>8.1f} "
                            f"{1e3 * pl['s_per_step']:>8.1f} {hy['best']:>10.4f} {hy['s']:>8.1f} "
                            f"{1e3 * hy['s_per_step']:>8.1f} {hy['pruned']:>3}/{hy['trials']:<2} "
                            f"{(f'{r:.3f}' if r is not None else 'n/a'):>6} {(f'{rc:.3f}' if rc is not None else 'n/a'):>9}")
                tuning["runs"].append({"param": p, "seed": seed, "plain_best": _json_num(pl["best"], 4),
                                       "plain_s_to_best": round(pl["s_to_best"], 1), "plain_s_total": round(pl["s_total"], 1),
                                       "plain_ms_per_step": round(1e3 * pl["s_per_step"], 1),
                                       "hydro_best": _json_num(hy["best"], 4), "hydro_s": round(hy["s"], 1),
                                       "hydro_tuning_s": round(hy["tuning_s"], 1),
                                       "hydro_transfer_s": round(hy["transfer_s"], 1),
                                       "target_ms_per_step": round(1e3 * hy["s_per_step"], 1),
                                       "hydro_pruned": hy["pruned"], "hydro_trials": hy["trials"],
                                       "time_ratio": _json_num(r), "cpu_time_ratio": _json_num(rc)})
            tuning[f"time_ratio_{p}"] = _json_num(_median(ratios))
            tuning[f"cpu_time_ratio_{p}"] = _json_num(_median(cpu_ratios))
            tuning[f"reached_{p}"] = sum(r is not None for r in ratios)
            tuning.setdefault("spread", {})[f"time_ratio_{p}"] = _spread(ratios)
            tuning["spread"][f"cpu_time_ratio_{p}"] = _spread(cpu_ratios)
            for key, side, field in (("hydro_best", 1, "best"), ("plain_best", 0, "best")):
                tuning["spread"][f"{key}_{p}"] = _spread([c[side][field] for c in cells[p]], 4)
            gap = [c[1]["best"] - c[0]["best"] for c in cells[p]]
            tuning[f"loss_gap_{p}"] = _json_num(statistics.median(gap), 4)   # hydro - plain; < 0: Hydro better
            tuning["spread"][f"loss_gap_{p}"] = [_json_num(min(gap), 4), _json_num(max(gap), 4)]
            tuning[f"ms_per_step_{p}"] = {
                "plain": round(1e3 * statistics.median(c[0]["s_per_step"] for c in cells[p]), 1),
                "target": round(1e3 * statistics.median(c[1]["s_per_step"] for c in cells[p]), 1)}
            rows.append(f"{p}: time ratio (Hydro total / plain time to its best), median over seeds "
                        f"{_fmt_opt(tuning[f'time_ratio_{p}'])} [min {_fmt_opt(tuning['spread'][f'time_ratio_{p}'][0])}, "
                        f"max {_fmt_opt(tuning['spread'][f'time_ratio_{p}'][1])}]; by CPU time "
                        f"{_fmt_opt(tuning[f'cpu_time_ratio_{p}'])}; Hydro reached plain's best in "
                        f"{tuning[f'reached_{p}']}/{len(seeds)} seeds; loss gap (Hydro - plain) median "
                        f"{tuning[f'loss_gap_{p}']:+.4f}")
        # the keys of the earlier single-run report, now the medians of the muP cells
        mu = cells["mup"]
        tuning.update({"time_ratio": tuning["time_ratio_mup"],
                       "hydro_best": _json_num(statistics.median(c[1]["best"] for c in mu), 4),
                       "plain_best": _json_num(statistics.median(c[0]["best"] for c in mu), 4),
                       "hydro_s": round(statistics.median(c[1]["s"] for c in mu), 1),
                       "plain_s_to_best": round(statistics.median(c[0]["s_to_best"] for c in mu), 1),
                       "plain_s_total": round(statistics.median(c[0]["s_total"] for c in mu), 1),
                       "hydro_trials": mu[0][1]["trials"], "hydro_pruned": int(statistics.median(c[1]["pruned"] for c in mu)),
                       "plain_trials": mu[0][0]["trials"]})
        out["tuning"] = tuning

    out["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    out["load_avg_start"] = load_start
    rows.append(f"load average (1, 5, 15 min) at start {load_start}, at end {out['load_avg']}; "
                f"{os.cpu_count()} cores")
    print("\n".join(rows))
    report.emit(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

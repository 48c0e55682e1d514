"""Hydro benchmark: trial fusion throughput, muTransfer across width, and end-to-end tuning.

(a) samples/s of B fused trials against the same B trials trained one after another (plain
    modules, torch.optim.Adam), for a small GPT and a small CNN, with a parity check of the
    trained parameters; medians of interleaved rounds.
(b) muTransfer: an LR sweep (one fused bundle per width) at width w and 4w under muP and under
    standard parametrization; how many grid steps the best LR moves between the widths.
(c) end to end: Hydro (shrink 4x + fuse + successive halving, then transfer to the full width)
    against plain sequential Optuna (full-width trials, no pruning) on the same model, data and
    search space: best validation loss and wall time.

Prints a table, then one JSON line. ``--quick`` shrinks every part (for a smoke run).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
                ) -> tuple[dict[int, tuple[float, float]], float, float]:
    """{B: (fused samples/s, sequential samples/s)}, the largest relative difference of a trial's
    parameter vector (L2, fused vs trained alone), and the largest per-tensor max-abs relative one."""
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
    results, worst, worst_t = {}, 0.0, 0.0
    for B in sizes:
        specs = [TrialSpec(i, seed=i, hparams=TrialHParams(lr=1e-3 * (1 + i % 4))) for i in range(B)]
        batches = [make_batch() for _ in range(rounds + 2)]
        bundle = TrialBundle(factory, specs, optimizer="adam", loss_fn=fused_cross_entropy,
                             example_inputs=(batches[0][0][:2],))
        plains = [factory(s.seed) for s in specs]
        opts = [torch.optim.Adam(m.parameters(), lr=s.hparams.lr) for m, s in zip(plains, specs)]
        t_fused, t_seq = [], []
        for r, (x, y) in enumerate(batches):
            t0 = time.perf_counter()
            bundle.train_step(x, y)
            t1 = time.perf_counter()
            for m, o in zip(plains, opts):
                o.zero_grad()
                _ce(m(x), y).backward()
                o.step()
            t2 = time.perf_counter()
            if r >= 2:                       # two warm-up rounds
                t_fused.append(t1 - t0)
                t_seq.append(t2 - t1)
        n = B * batch
        results[B] = (n / statistics.median(t_fused), n / statistics.median(t_seq))
        for i, m in enumerate(plains):
            st = bundle.trial_state(i)
            ref = {k: v for k, v in m.state_dict().items() if v.is_floating_point()}
            num = sum(float((st[k] - v).double().pow(2).sum()) for k, v in ref.items())
            den = sum(float(v.double().pow(2).sum()) for v in ref.values())
            worst = max(worst, math.sqrt(num / den))
            for k, v in ref.items():
                worst_t = max(worst_t, float((st[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)))
    return results, worst, worst_t


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
def plain_optuna(data: TokenBatches, vocab: int, cfg: HydroTuneConfig, space, n_trials: int) -> list[tuple[float, float]]:
    """Sequential Optuna on the full-width SP target: (seconds, best val loss so far) per trial."""
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    shape = GPTShape(vocab_size=vocab, seq_len=cfg.seq_length, d_model=cfg.hidden_size, n_layers=cfg.num_layers,
                     n_heads=cfg.num_attention_heads, parametrization="sp")
    val = data.val_batches(cfg.eval_iters)
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=cfg.seed))
    t0, best, curve = time.perf_counter(), math.inf, []
    for _ in range(n_trials):
        trial = study.ask()
        values = {name: p.suggest(trial) for name, p in space.items()}
        hp = hparams_from(values, cfg.trial_steps, base=hparams_from({"schedule": "cosine"}, cfg.trial_steps))
        torch.manual_seed(cfg.seed + trial.number)
        model = GPT(shape)
        opt = torch.optim.AdamW(model.parameters(), lr=hp.lr, betas=(hp.beta1, hp.beta2), weight_decay=hp.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, hp.schedule.factor)
        for _ in range(cfg.trial_steps):
            x, y = data.train_batch()
            opt.zero_grad()
            _ce(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
        with torch.no_grad():
            v = statistics.fmean(float(_ce(model(x), y)) for x, y in val)
        v = v if math.isfinite(v) else math.inf
        study.tell(trial, v)
        best = min(best, v)
        curve.append((time.perf_counter() - t0, best))
    return curve


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (same for both sides)")
    ap.add_argument("--data-path", default="synthetic:300000:256",
                    help="token source for (b) and (c): '' = default corpus, a prefix, or synthetic")
    ap.add_argument("--mutransfer-data", default="synthetic:300000:32:2",
                    help="token source for (b): an order-2 Markov stream needs attention to learn, so the hidden "
                         "layers (where muP and SP differ) decide the best LR, and the optimum is sharp")
    ap.add_argument("--skip", nargs="*", default=[], choices=["fusion", "mutransfer", "tuning"])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    q = args.quick
    out: dict = {}
    rows: list[str] = []

    if "fusion" not in args.skip:
        sizes = [1, 2, 4, 8] if q else [1, 2, 4, 8, 16]
        out["fusion"] = {}
        worst = worst_t = 0.0
        rows.append(f"(a) fusion: samples/s, medians of {'3' if q else '7'} interleaved rounds, {args.threads} thread(s)")
        rows.append(f"{'model':6} {'B':>3} {'fused':>10} {'sequential':>11} {'speedup':>8}")
        for kind, batch in (("gpt", 8), ("cnn", 16)):
            res, w, wt = fusion_case(kind, sizes, 3 if q else 7, batch)
            worst, worst_t = max(worst, w), max(worst_t, wt)
            entry = {str(b): round(f, 1) for b, (f, s) in res.items()}
            entry.update({f"seq_{b}": round(s, 1) for b, (f, s) in res.items()})
            if 8 in res:
                entry["speedup_b8"] = round(res[8][0] / res[8][1], 2)
            out["fusion"][kind] = entry
            for b, (f, s) in res.items():
                rows.append(f"{kind:6} {b:>3} {f:>10.1f} {s:>11.1f} {f / s:>7.2f}x")
        out["fusion"]["max_rel_diff"] = float(f"{worst:.3g}")
        out["fusion"]["max_rel_diff_per_tensor"] = float(f"{worst_t:.3g}")
        rows.append(f"parity after {'5' if q else '9'} steps, float32: max over trials of |theta_fused - theta_alone| / "
                    f"|theta_alone| = {worst:.2e} (worst single tensor, max-abs: {worst_t:.2e})")

    tokens, vocab, desc = load_tokens(args.data_path, max_tokens=400_000)

    if "mutransfer" not in args.skip:
        width = 32
        lrs = [2.0 ** e for e in range(-12, -3)] if not q else [2.0 ** e for e in range(-11, -4, 2)]
        steps = 60 if q else 400
        mt_tokens, mt_vocab, mt_desc = load_tokens(args.mutransfer_data, max_tokens=400_000)
        data = TokenBatches(mt_tokens, 32, 16, seed=0)
        rows.append(f"(b) muTransfer on {mt_desc}: Adam, {steps} steps, LR grid 2^{int(math.log2(lrs[0]))}..2^{int(math.log2(lrs[-1]))}")
        rows.append(f"{'param':5} {'width':>5} " + " ".join(f"{'2^' + str(int(math.log2(lr))):>7}" for lr in lrs) + "   best")
        mt = {}
        for p in ("mup", "sp"):
            best_idx = []
            for w in (width, 4 * width):
                losses = lr_sweep(data, mt_vocab, w, width, p, lrs, steps, seed=1)
                i = min(range(len(lrs)), key=lambda k: losses[k])
                best_idx.append(i)
                rows.append(f"{p:5} {w:>5} " + " ".join(f"{v:>7.3f}" for v in losses) + f"   2^{int(math.log2(lrs[i]))}")
            mt[f"{p}_shift"] = best_idx[1] - best_idx[0]
            mt[f"{p}_best_lr"] = [lrs[i] for i in best_idx]
        out["mutransfer"] = mt
        rows.append(f"best-LR shift from width {width} to {4 * width} (grid steps): muP {mt['mup_shift']:+d}, "
                    f"SP {mt['sp_shift']:+d}")

    if "tuning" not in args.skip:
        space = parse_search_space({"lr": {"type": "float", "low": 1e-4, "high": 3e-2, "log": True},
                                    "beta2": {"type": "categorical", "choices": [0.95, 0.99]}})
        steps = 40 if q else 150
        cfg = HydroTuneConfig(study_name="bench", storage="memory", output_dir=tempfile.mkdtemp(prefix="hydro-bench-"),
                              n_trials=8 if q else 24, fusion=8, trial_steps=steps, eval_interval=max(5, steps // 6),
                              min_resource=max(5, steps // 6), reduction_factor=3, hidden_size=128,
                              num_attention_heads=8, num_layers=2, seq_length=32, micro_batch_size=16, eval_iters=4,
                              shrink_ratio=0.25, target_steps=steps, seed=5, optimizer="adamw",
                              defaults={"schedule": "cosine", "grad_clip": 1.0})
        plain_trials = 4 if q else 12
        data_p = TokenBatches(tokens, 32, 16, seed=0)
        curve = plain_optuna(data_p, vocab, cfg, space, plain_trials)
        plain_best = curve[-1][1]
        plain_time = next(t for t, b in curve if b == plain_best)
        data_h = TokenBatches(tokens, 32, 16, seed=0)
        tuner = HydroTuner(cfg, space, hparams_from({"schedule": "cosine", "grad_clip": 1.0}, steps),
                           data=data_h, vocab_size=vocab, log=lambda s: None)
        res = tuner.run()
        hydro_best = res.target_loss if res.target_loss is not None else math.inf
        reached = hydro_best <= plain_best
        ratio = res.wall_s / plain_time if reached else None
        out["tuning"] = {"time_ratio": round(ratio, 3) if ratio is not None else None,
                         "hydro_best": round(hydro_best, 4), "plain_best": round(plain_best, 4),
                         "hydro_s": round(res.wall_s, 1), "plain_s_to_best": round(plain_time, 1),
                         "plain_s_total": round(curve[-1][0], 1), "hydro_trials": res.n_complete + res.n_pruned,
                         "hydro_pruned": res.n_pruned, "plain_trials": plain_trials}
        rows.append(f"(c) end to end on {desc}: target GPT width 128, {steps} steps per full trial")
        rows.append(f"plain Optuna: {plain_trials} full-width trials, best val {plain_best:.4f} reached at "
                    f"{plain_time:.1f}s (total {curve[-1][0]:.1f}s)")
        rows.append(f"Hydro: {res.n_complete + res.n_pruned} proxy trials at width 32 ({res.n_pruned} pruned), "
                    f"fusion {res.fusion}, tuning {res.tuning_s:.1f}s + transfer {res.transfer_s:.1f}s; "
                    f"target val {hydro_best:.4f}")
        rows.append("time ratio (Hydro total / plain time to its best): " +
                    (f"{ratio:.3f}" if ratio is not None else "n/a (Hydro did not reach plain's best)"))

    print("\n".join(rows))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

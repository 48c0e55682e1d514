"""Coordinate check: activation scale against width, under muP and standard parametrization.

If a parametrization is right, the typical size of every activation coordinate stays constant as
width grows, also after some training steps (Tensor Programs V, section "coordinate check"). For
each width we train a few fused trials (different seeds, averaged) for ``steps`` steps with the
same LR and record mean |activation| of chosen layers at each step; SP's curves grow with width
(logits and attention blow up after a few steps), muP's stay flat.

``python -m megatron_ext.hydro.coord_check --out coord.png`` writes the plot and prints the table;
``--family llama`` checks the LLaMA-style block (RMSNorm, SwiGLU, rotary positions, grouped-query
attention with two query heads per key/value group, no biases) instead of the GPT block.
We use our own fused bundles (and ``FusedOptimizer`` with ``mup``'s multipliers) rather than
``mup.coord_check``: that checks our fused muP path end to end and avoids its pandas/seaborn stack.
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Sequence

import torch

from .bundle import TrialBundle, TrialSpec
from .data import TokenBatches, synthetic_tokens
from .models import GPT, GPTShape, llama_shape
from .nn import fused_cross_entropy
from .optim import TrialHParams
from .parametrization import apply_mup, mup_multipliers, param_shapes

LAYERS = ("tok", "blocks.0.attn", "blocks.0.mlp.fc2", "head")


def coord_data(widths: Sequence[int], parametrization: str, *, steps: int = 4, lr: float = 1e-2, seeds: int = 3,
               vocab: int = 64, seq_len: int = 16, batch: int = 8, head_dim: int = 8, optimizer: str = "adam",
               family: str = "gpt") -> dict[int, dict[str, list[float]]]:
    """{width: {layer: [mean |act| after 0..steps-1 updates]}}, averaged over ``seeds`` fused trials.

    ``family="llama"``: the LLaMA-style block, with half as many key/value groups as heads and a
    SwiGLU of 4 x width (Megatron-LM's 8h/3 rounding is not proportional at these widths)."""
    if family not in ("gpt", "llama"):
        raise ValueError(f"family must be gpt or llama, got {family!r}")
    data = TokenBatches(synthetic_tokens(20_000, vocab, seed=0), seq_len, batch, seed=0)
    batches = [data.train_batch() for _ in range(steps)]

    def shape(d: int) -> GPTShape:
        heads = max(1, d // head_dim)
        if family == "llama":
            return llama_shape(vocab_size=vocab, seq_len=seq_len, d_model=d, n_layers=1, n_heads=heads,
                               n_query_groups=max(1, heads // 2), ffn_hidden=4 * d, parametrization=parametrization)
        return GPTShape(vocab_size=vocab, seq_len=seq_len, d_model=d, n_layers=1, n_heads=heads,
                        parametrization=parametrization)

    base, delta = param_shapes(GPT(shape(widths[0]))), param_shapes(GPT(shape(2 * widths[0])))
    out: dict[int, dict[str, list[float]]] = {}
    for w in widths:
        def factory(seed: int, w=w) -> GPT:
            torch.manual_seed(seed)
            m = GPT(shape(w))
            return apply_mup(m, base, delta) if parametrization == "mup" else m

        mults = mup_multipliers(factory(0), optimizer) if parametrization == "mup" else None
        specs = [TrialSpec(s, seed=s, hparams=TrialHParams(lr=lr)) for s in range(seeds)]
        bundle = TrialBundle(factory, specs, optimizer=optimizer, loss_fn=fused_cross_entropy,
                             example_inputs=(batches[0][0][:2],), multipliers=mults, check=False)
        rec: dict[str, list[float]] = {k: [] for k in LAYERS}
        current: dict[str, float] = {}
        hooks = [bundle.model.get_submodule(name).register_forward_hook(
            lambda m, a, o, name=name: current.__setitem__(name, float(o.detach().abs().mean())))
            for name in LAYERS]
        for x, y in batches:
            bundle.train_step(x, y)      # records the activations this step's forward saw
            for k in LAYERS:
                rec[k].append(current[k])
        for h in hooks:
            h.remove()
        out[w] = rec
    return out


def growth(data: dict[int, dict[str, list[float]]], layer: str, step: int = -1) -> float:
    """Activation size at the widest width over that at the narrowest, at ``step``."""
    ws = sorted(data)
    return data[ws[-1]][layer][step] / max(data[ws[0]][layer][step], 1e-30)


def plot(results: dict[str, dict[int, dict[str, list[float]]]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = list(results)
    steps = len(next(iter(next(iter(results.values())).values()))[LAYERS[0]])
    fig, axes = plt.subplots(len(params), steps, figsize=(3.2 * steps, 3.0 * len(params)), squeeze=False,
                             sharey="row")
    for r, p in enumerate(params):
        ws = sorted(results[p])
        for t in range(steps):
            ax = axes[r][t]
            for layer in LAYERS:
                ax.plot(ws, [results[p][w][layer][t] for w in ws], marker="o", label=layer)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{p.upper()}  t={t}")
            ax.set_xlabel("width")
            if t == 0:
                ax.set_ylabel("mean |activation|")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_ext.hydro.coord_check", description=__doc__.split("\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--optimizer", default="adam", choices=("adam", "adamw", "sgd"))
    ap.add_argument("--family", default="gpt", choices=("gpt", "llama"), help="block of the model checked")
    ap.add_argument("--out", default="coord_check.png")
    args = ap.parse_args(argv)
    results = {p: coord_data(args.widths, p, steps=args.steps, lr=args.lr, optimizer=args.optimizer,
                             family=args.family) for p in ("sp", "mup")}
    print(f"{'param':5} {'layer':18} " + " ".join(f"w={w:<7}" for w in args.widths) + "  (last step)")
    for p, data in results.items():
        for layer in LAYERS:
            print(f"{p:5} {layer:18} " + " ".join(f"{data[w][layer][-1]:<9.3g}" for w in args.widths))
    plot(results, args.out)
    print(json.dumps({p: {layer: round(growth(d, layer), 3) for layer in LAYERS} for p, d in results.items()}))
    return 0 if all(math.isfinite(growth(d, "head")) for d in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

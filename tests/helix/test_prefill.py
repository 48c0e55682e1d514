"""Sequence tiling of forward-only graphs (prefill, evaluation): query tiles against every key,
the causal mask made per tile, tiles scheduled so each one's intermediates die before the next's
are made -- equal outputs, a lower peak the simulator predicts, and the memory budget kept."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_ext.helix.compiler import HelixBackend
from megatron_ext.helix.measure import peak_bytes_of
from tests.runtime import trainer_helpers


class CausalBlock(torch.nn.Module):
    """A pre-norm transformer layer written as megatron's unfused attention is: scores by matmul,
    the causal mask made from ``triu(ones)``, an in-place ``masked_fill_``, softmax, context."""

    def __init__(self, h: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(h)
        self.qkv = torch.nn.Linear(h, 3 * h)
        self.proj = torch.nn.Linear(h, h)
        self.fc1, self.fc2 = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [s, b, h]
        s, b, h = x.shape
        q, k, v = self.qkv(self.norm(x)).view(s, b * self.heads, 3, h // self.heads).unbind(2)
        scores = torch.bmm(q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2)) * (h // self.heads) ** -0.5
        mask = torch.triu(torch.ones(s, s), diagonal=1).bool()
        scores.masked_fill_(mask, -10000.0)
        ctx = torch.bmm(torch.softmax(scores, dim=-1), v.transpose(0, 1))  # [b*np, s, hn]
        x = x + self.proj(ctx.transpose(0, 1).reshape(s, b, h))
        return x + self.fc2(F.gelu(self.fc1(x)))


def _compiled(fn, backend, *args):
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(fn, backend=backend, dynamic=False)
        compiled(*args)
    return compiled


def test_query_tiles_against_every_key_equal_the_untiled_forward():
    torch.manual_seed(0)
    block = CausalBlock().eval()
    x = torch.randn(64, 1, 32)
    with torch.no_grad():
        ref = block(x)
    backend = HelixBackend(tiles=4, seq_tiling=True, mode="helix")
    out = _compiled(block, backend, x)(x)
    assert (out - ref).abs().max().item() <= 1e-6
    summary = backend.summaries[0]
    assert summary.tiled and not summary.tiling.joins, summary.refused
    fw = summary.graphs["fw"]
    # the mask is made per tile: a quarter of its rows each, the diagonal shifted by the tile's start
    made = [(tuple(n.args[0]), n) for n in fw.graph.nodes if n.target is torch.ops.aten.ones.default]
    assert [shape for shape, _ in made] == [(16, 64)] * 4
    diagonals = sorted(u.args[1] for _, n in made for u in n.users if u.target is torch.ops.aten.triu.default)
    assert diagonals == [1, 17, 33, 49]


def test_a_mask_split_along_its_columns_shifts_the_diagonal_the_other_way():
    def f(a, b):
        t = (a @ b.transpose(0, 1)).transpose(0, 1)  # tiled along its columns
        return t.masked_fill(torch.triu(torch.ones(a.shape[0], a.shape[0]), diagonal=1).bool(), 0.0)

    a, b = torch.randn(8, 4), torch.randn(8, 4)
    backend = HelixBackend(tiles=2, seq_tiling=True, mode="helix", input_dims={"l_a_": 0, "l_b_": 0})
    out = _compiled(f, backend, a, b)(a, b)
    assert torch.equal(out, f(a, b))
    assert backend.summaries[0].tiled
    triu = [n for n in backend.summaries[0].graphs["fw"].graph.nodes if n.target is torch.ops.aten.triu.default]
    assert sorted(n.args[1] for n in triu) == [-3, 1]


def test_training_graphs_are_not_tiled_for_memory():
    # with gradients the tiling is judged on the step's time as before: no collectives, nothing to do
    block = CausalBlock()
    x = torch.randn(64, 1, 32, requires_grad=True)
    backend = HelixBackend(seq_tiling=True, memory_budget_bytes=1)
    torch._dynamo.reset()
    torch.compile(block, backend=backend, dynamic=False)(x).sum().backward()
    assert not backend.summaries[0].tiled
    assert backend.summaries[0].refused == ["tiling: no collectives to overlap"]


# -- a GPT model of megatron-core, one rank ---------------------------------------------------------
S = 1024
VALUES = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "seq_length": S, "max_position_embeddings": S,
          "micro_batch_size": 1, "global_batch_size": 1, "train_iters": 1, "eval_iters": 0, "progress": False}


def test_gpt_prefill_peak_is_cut_as_predicted_and_kept_under_the_budget():
    from megatron_ext.config.defaults import FORMER_DEFAULTS
    from megatron_ext.config.run import config_from_values
    from megatron_ext.helix.adapter import make_traceable, prefill_first_call_state
    from megatron_ext.runtime.model import build_model, unwrap

    values = {**FORMER_DEFAULTS, **VALUES}
    for ctx in trainer_helpers.one_rank(values):
        model = unwrap(build_model(config_from_values(dict(values)), ctx, vocab_size=100, wrap_ddp=False).chunks[0])
        make_traceable(model)
        prefill_first_call_state(model, 1, S)
        model.eval()
        torch.manual_seed(1)
        ids, pos = torch.randint(0, 100, (1, S)), torch.arange(S).unsqueeze(0)
        with torch.no_grad():
            ref = model(ids, pos, None)

        def run(backend):
            f = _compiled(model.forward, backend, ids, pos, None)
            with torch.no_grad():
                out = f(ids, pos, None)
                peak = peak_bytes_of(lambda: f(ids, pos, None))
            return out, peak, backend.summaries[0]

        base_out, base_peak, base = run(HelixBackend(mode="baseline"))
        tiled_out, tiled_peak, tiled = run(HelixBackend(tiles=2, seq_tiling=True, mode="helix"))
        assert torch.equal(base_out, ref) and (tiled_out - ref).abs().max().item() <= 1e-6
        assert tiled.tiled and not tiled.tiling.joins, tiled.refused
        # the simulator's peaks are the allocator's (the profiler's running sum) to 5 %
        assert abs(base.baseline.peak_bytes - base_peak) <= 0.05 * base_peak
        assert abs(tiled.helix.peak_bytes - tiled_peak) <= 0.05 * tiled_peak
        assert tiled_peak <= 0.75 * base_peak  # the scores and the mask of one half at a time

        # auto, no budget: no time to gain, the untiled graph stays
        _, _, auto = run(HelixBackend(tiles=2, seq_tiling=True))
        assert not auto.tiled and auto.refused[0].startswith("tiled schedule: predicted gain")
        # a budget the untiled and the 2-tile schedules exceed: 4 tiles, and the measured peak fits
        budget = (tiled.helix.peak_bytes + base.baseline.peak_bytes // 4) // 2
        assert budget < tiled.helix.peak_bytes
        fit_out, fit_peak, fit = run(HelixBackend(tiles=2, seq_tiling=True, memory_budget_bytes=budget))
        assert fit.tiled and fit.tiling.tiles == 4, fit.refused
        assert fit.refused[0].startswith("2 tiles: predicted peak") and fit.helix.peak_bytes <= budget
        assert fit_peak <= budget * 1.05 and (fit_out - ref).abs().max().item() <= 1e-6


def test_skip_train_validates_once_with_sequence_tiles_and_the_same_loss():
    """``--skip-train`` (Megatron-LM's; also ``--eval-only``) runs the validation alone; with
    ``--helix --helix-seq-tiling`` its forward-only graph is tiled along the sequence, same loss."""
    from megatron_ext.config.defaults import FORMER_DEFAULTS
    from megatron_ext.config.run import config_from_values
    from megatron_ext.runtime.extension import build_extensions
    from megatron_ext.runtime.loop import Trainer

    values = {**FORMER_DEFAULTS, **VALUES, "seq_length": 256, "max_position_embeddings": 256, "train_iters": 5,
              "eval_iters": 2, "skip_train": True, "hidden_dropout": 0.0, "attention_dropout": 0.0}
    helix = {"helix": True, "helix_seq_tiling": True, "helix_mode": "tiled", "helix_cost_model": "analytical"}
    rows, graphs = {}, {}
    for ctx in trainer_helpers.one_rank(values):
        for name, extra in (("plain", {}), ("helix", helix)):
            torch._dynamo.reset()
            cfg = config_from_values({**values, **extra})
            trainer = Trainer(cfg, ctx, build_extensions(cfg)).setup()
            trainer.run()
            rows[name] = [(r["kind"], r["iteration"]) for r in trainer.history if r["kind"] in ("train", "valid")]
            rows[name + "_loss"] = [r["loss"] for r in trainer.history if r["kind"] == "valid"]
            ext = next((e for e in trainer.extensions if getattr(e, "name", "") == "helix"), None)
            graphs[name] = ext.backend.summaries if ext is not None else []
    assert rows["plain"] == rows["helix"] == [("valid", 0)]  # no training iteration, one validation
    assert abs(rows["plain_loss"][0] - rows["helix_loss"][0]) <= 1e-6
    assert [s.tiled for s in graphs["helix"]] == [True]
    assert graphs["helix"][0].tiling.tiled_inputs and set(graphs["helix"][0].tiling.tiled_inputs.values()) == {1}


def test_skip_train_without_validation_is_refused():
    from megatron_ext.config.base import ConfigError
    from megatron_ext.config.run import parse_run_config

    cfg = parse_run_config(["--eval-only", "--eval-iters", "0"])
    assert cfg.training.skip_train
    try:
        cfg.validate(1)
    except ConfigError as exc:
        assert str(exc) == ("--skip-train runs only the validation, and --eval-iters 0 turns it off: give "
                            "--eval-iters N (N > 0)")
    else:
        raise AssertionError("--skip-train with --eval-iters 0 was accepted")

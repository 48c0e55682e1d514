"""One prepared GPU check: the GPU path's figures in one run (under 8 minutes on one H100/H200).

Sections (each reports its own error and the others go on):

  env          torch / CUDA / cuDNN / NCCL / Transformer Engine / apex / megatron-core / DeepSpeed
  gpt          the runtime's GPT (Transformer Engine spec, bf16, megatron's optimizer) trains 30
               iterations: first and last loss, tokens/s, MFU; then resumes from the checkpoint of
               iteration 15 and must reproduce iterations 16..30 (losses and fp32 master weights)
  llama        the same with a LLaMA-3-style model (RMSNorm, SwiGLU, rotary positions, GQA, no
               biases, untied output layer): the runtime's llama family
  packed       packed variable-length documents through TE's THD (varlen) attention: each
               document's token losses equal those of the document run alone
  flops_model  ResiHP's FLOPs model: per-micro-batch forward/backward times of packed THD batches
               predicted from linear and attention FLOPs (the detector's Huber fit, calibrated on
               half the batches) against the measured CUDA-event times of the other half
  hydro        Hydro's fused bundle of B=8 trials against the same 8 trials one after another
  helix        pretrain's --helix path compiles the runtime's GPT through Helix's backend on CUDA
               (aot_autograd, Helix's passes, the FX graphs run as scheduled; cost model calibrated
               from CUDA micro-benchmarks) and reproduces the loss curve of its untransformed graphs
  deepspeed    ``--engine deepspeed`` (with ``--timeline``) against the runtime's megatron engine:
               the same model, data and seed under the project's launcher, on NCCL (PP2 on two
               GPUs, else one rank); loss curves side by side, tokens/s of each
  ft_nccl      --ft-on-stop continue on NCCL: 2 ranks (one GPU each) under the project's
               launcher, rank 1 SIGKILLed at iteration 6; the survivor is freed by the process
               group's abort and trains to the end alone. Needs at least 2 CUDA devices; skipped
               with the reason otherwise (on --cpu-smoke it runs the same job on gloo)

Prints a table, then one JSON line. Each section's figures also go to stderr, flushed, the
moment it ends (``gpu-check: NAME done (N s so far): {json}``), so a run killed from outside keeps
what it measured. ``--hard-limit-s`` interrupts a section still running at that time (recorded as
its error; the rest are skipped) so the table and JSON are still printed. Without CUDA it prints
why and exits 0 (a skip, not a failure) -- unless the machine shows an NVIDIA device
(``/dev/nvidia0`` or ``nvidia-smi``) that torch cannot use (a CPU build of torch, a driver too old
for its CUDA), which exits 1: a GPU window must not pass as a skip. ``--cpu-smoke`` runs every
section on CPU with tiny sizes to exercise this script's code (those figures are not GPU figures;
``--record`` refuses them). ``--record`` writes the table and the JSON under docs/figures/gpu/.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_ext.config.defaults import FORMER_DEFAULTS, former_default_flags  # noqa: E402

logger = logging.getLogger(__name__)

SECTIONS = ("env", "gpt", "llama", "packed", "flops_model", "hydro", "helix", "deepspeed", "ft_nccl")
# Keys every report carries (None when a section failed or was skipped): the JSON shape.
REQUIRED: dict[str, tuple[str, ...]] = {
    "env": ("torch", "cuda", "nccl", "transformer_engine", "apex", "device"),
    "gpt": ("tokens_per_s", "mfu", "loss_first", "loss_last", "resume_max_rel_diff"),
    "flops_model": ("median_abs_err", "p95_abs_err"),
    "hydro": ("fused_b8_speedup",),
    "helix": ("compiled", "loss_max_rel_diff"),
    "deepspeed": ("trained", "loss_max_rel_diff"),
    "ft_nccl": ("continued", "exit_codes", "pause_s"),
}
# Dense bf16 tensor-core peak FLOP/s by device-name fragment (vendor data sheets, SXM parts).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12,
                   "A10G": 70e12, "L4": 121e12}
SKIP_EXIT = 0
UNUSABLE_GPU_EXIT = 1
RECORD_DIR = os.path.join(ROOT, "docs", "figures", "gpu")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Workload sizes: the GPU ones, or tiny ones for ``--cpu-smoke``."""

    layers: int
    hidden: int
    heads: int
    seq: int
    micro_batch: int
    global_batch: int
    iters: int
    packed_tokens: tuple[int, ...]
    flops_batches: int
    hydro_width: int
    hydro_seq: int
    hydro_rounds: int
    helix_iters: int

    @classmethod
    def gpu(cls, iters: int) -> "Sizes":
        return cls(layers=12, hidden=768, heads=12, seq=1024, micro_batch=4, global_batch=16, iters=iters,
                   packed_tokens=(2048, 4096, 8192), flops_batches=36, hydro_width=128, hydro_seq=128,
                   hydro_rounds=20, helix_iters=5)

    @classmethod
    def cpu_smoke(cls, iters: int) -> "Sizes":
        return cls(layers=2, hidden=32, heads=2, seq=32, micro_batch=2, global_batch=4, iters=min(iters, 6),
                   packed_tokens=(32, 64), flops_batches=8, hydro_width=16, hydro_seq=16, hydro_rounds=3,
                   helix_iters=2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--record", action="store_true", help="also write the table and JSON under docs/figures/gpu/")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    p.add_argument("--iters", type=int, default=30, help="training iterations of the gpt section (default 30)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="device peak bf16 TFLOP/s for MFU (default: looked up from the device name)")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="start no section after this many seconds (default 450: the run stays under 8 "
                        "minutes; the rest are reported as skipped)")
    p.add_argument("--hard-limit-s", type=float, default=540.0,
                   help="interrupt a section still running this many seconds after the start, so the "
                        "report is printed before the machine is taken back (default 540)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run every section on CPU with tiny sizes (exercises the code; not GPU figures)")
    args = p.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown or not chosen:
        p.error(f"--sections: unknown section(s) {', '.join(unknown) or '(none given)'}; "
                f"choose from {', '.join(SECTIONS)}")
    if args.iters < 4 or args.iters % 2:
        p.error(f"--iters must be an even number >= 4 (the resume check restarts at half), got {args.iters}")
    if args.budget_s <= 0:
        p.error(f"--budget-s must be > 0, got {args.budget_s}")
    if args.hard_limit_s <= 0:
        p.error(f"--hard-limit-s must be > 0, got {args.hard_limit_s}")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        p.error(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    if args.record and args.cpu_smoke:
        p.error("--record keeps GPU figures only: drop --cpu-smoke")
    args.sections = chosen
    return args


# --- timing -------------------------------------------------------------------------------------

class Stopwatch:
    """Elapsed seconds of a region: CUDA events on a GPU (the kernels the region queued, not the
    host's launch time), the host clock on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    @contextlib.contextmanager
    def __call__(self, out: list[float]):
        import torch

        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            yield
            out.append(time.perf_counter() - t0)


# --- sections -----------------------------------------------------------------------------------

def _version(*dists: str) -> str | None:
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _nccl_version() -> str | None:
    import torch

    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a torch built without NCCL
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def section_env(ctx: dict[str, Any]) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    env: dict[str, Any] = {
        "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": _nccl_version() if cuda else None,
        "transformer_engine": _version("transformer_engine", "transformer-engine"),
        "apex": _version("apex"),
        "megatron_core": _version("megatron-core", "megatron_core"),
        "deepspeed": _version("deepspeed"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
    }
    if env["transformer_engine"] is not None:
        try:  # installed is not importable (a TE built for another CUDA): say which
            importlib.import_module("transformer_engine.pytorch")
        except Exception as exc:  # noqa: BLE001 - any import failure is the figure
            env["transformer_engine_import_error"] = f"{type(exc).__name__}: {exc}"[:300]
    # megatron's local layer spec (what the runtime builds without TE) fuses the masked softmax
    # only where apex's compiled kernels import (compat/kernels.py): say which case this is.
    from megatron_ext.compat.kernels import apex_fused_softmax_available

    env["apex_fused_softmax"] = apex_fused_softmax_available()
    if cuda:
        env["torch_compile_cuda"] = _compile_preflight()
    return env


def te_usable(env: dict[str, Any]) -> bool:
    """Transformer Engine installed and ``transformer_engine.pytorch`` importable."""
    return env.get("transformer_engine") is not None and not env.get("transformer_engine_import_error")


def _compile_preflight() -> str:
    """``ok``, or why torch.compile cannot build and run a CUDA kernel here (Triton, a C compiler):
    megatron's fused bias kernels and Helix compile through it on a GPU and would fail later, after
    minutes of the window, for the same reason."""
    import torch

    try:
        fn = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2.0)
        fn(torch.ones(64, device="cuda"))
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - the reason is the figure
        return f"{type(exc).__name__}: {exc}"[:300]


def peak_flops(device_name: str, override_tflops: float | None) -> float | None:
    if override_tflops is not None:
        return override_tflops * 1e12
    for frag, peak in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if frag in device_name:
            return peak
    return None


def gpt_iteration_flops(layers: int, hidden: int, heads: int, vocab: int, seq: int, global_batch: int, *,
                        ffn_hidden_size: int | None = None, num_query_groups: int | None = None,
                        gated_linear_unit: bool = False) -> float:
    """The FLOPs model's ``iteration_flops`` (``models/flops.py``) of a dense model given by its sizes."""
    from megatron_ext.models.flops import ModelSpec, iteration_flops

    return iteration_flops(ModelSpec(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                     vocab_size=vocab, ffn_hidden_size=ffn_hidden_size,
                                     num_query_groups=num_query_groups, gated_linear_unit=gated_linear_unit),
                           seq, global_batch)


def _trainer(values: dict[str, Any], dctx: Any):
    """A Trainer as pretrain_gpt.py builds it, extensions (--helix) included."""
    from megatron_ext.config.run import config_from_values
    from megatron_ext.runtime.extension import build_extensions
    from megatron_ext.runtime.loop import Trainer

    cfg = config_from_values(values)
    cfg.validate(dctx.world_size)
    return Trainer(cfg, dctx, build_extensions(cfg)).setup()


def _dist_context(seed: int):
    from megatron_ext.config.run import config_from_values
    from megatron_ext.runtime import distributed

    return distributed.setup(config_from_values({"train_iters": 1}).parallel, seed=seed)


def _train_losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.history if h["kind"] == "train"]


def _masters(trainer: Any) -> list[Any]:
    from megatron_ext.runtime.optimizer import collect_param_states

    params = list(trainer.model.parameters())
    return [s.get("main", p.detach().float().cpu()) for s, p in
            zip(collect_param_states(trainer.optimizer, params), params)]


def max_rel_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        raise ValueError(f"curves of different length: {len(a)} vs {len(b)}")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


# LLaMA-3-style flags (Megatron-LM's names; the runtime's llama family).
LLAMA_FLAGS = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
               "rotary_base": 500000, "group_query_attention": True, "disable_bias_linear": True,
               "untie_embeddings_and_output_weights": True}


def section_gpt(ctx: dict[str, Any]) -> dict[str, Any]:
    return train_and_resume(ctx, {})


def section_llama(ctx: dict[str, Any]) -> dict[str, Any]:
    heads = ctx["sizes"].heads
    return train_and_resume(ctx, {**LLAMA_FLAGS, "num_query_groups": max(heads // 4, 1)})


@contextlib.contextmanager
def deterministic(cuda: bool):
    """Reproducible kernels where torch and TE offer a choice, for the resume check (a resumed run
    against a straight one) only: elsewhere they would slow the timed sections' kernels."""
    import torch

    if not cuda:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    te_before = os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO")
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        if te_before is None:
            os.environ.pop("NVTE_ALLOW_NONDETERMINISTIC_ALGO", None)
        else:
            os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = te_before


def train_and_resume(ctx: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Train ``iters`` iterations (bf16, megatron's optimizer; the TE spec where TE imports),
    saving at half; then resume from that checkpoint and compare the second half."""
    with deterministic(ctx["cuda"]):
        return _train_and_resume(ctx, extra)


def _train_and_resume(ctx: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    import torch

    from megatron_ext.models.families import family_of
    from megatron_ext.models.flops import model_iteration_flops
    from megatron_ext.runtime.model import unwrap

    sz: Sizes = ctx["sizes"]
    half = sz.iters // 2
    values = {**FORMER_DEFAULTS, "num_layers": sz.layers, "hidden_size": sz.hidden, "num_attention_heads": sz.heads,
              "seq_length": sz.seq, "micro_batch_size": sz.micro_batch, "global_batch_size": sz.global_batch,
              "train_iters": sz.iters, "bf16": True, "lr": 3e-4, "lr_decay_style": "constant",
              "eval_iters": 0, "progress": False, "log_interval": 1000, **extra}
    cuda = ctx["cuda"]
    with tempfile.TemporaryDirectory() as tmp:
        save = os.path.join(tmp, "ckpt")
        if cuda:  # the straight run's own peak, not an earlier section's
            torch.cuda.reset_peak_memory_stats()
        straight = _trainer({**values, "save": save, "save_interval": half}, ctx["dist"])
        spec_name = type(unwrap(straight.model.chunks[0]).decoder.layers[0].self_attention.linear_qkv).__name__
        straight.run()
        peak_mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        losses = _train_losses(straight)
        times = [h["iter_time_s"] for h in straight.history if h["kind"] == "train"][2:]  # 2 warm-up its
        masters = _masters(straight)
        about = {"family": family_of(straight.cfg.model).name, "layer_impl": spec_name,
                 "params": sum(p.numel() for p in straight.model.parameters()),
                 "optimizer": type(getattr(straight.optimizer, "megatron_optimizer", straight.optimizer)).__name__,
                 "dtype": str(next(straight.model.parameters()).dtype).replace("torch.", "")}
        flops = model_iteration_flops(straight.cfg, straight.model.vocab_size)
        del straight  # its model and optimizer state leave the device before the resumed run's arrive
        resumed = _trainer({**values, "load": os.path.join(save, f"iter_{half:07d}")}, ctx["dist"])
        resumed.run()
        r_losses = _train_losses(resumed)
        r_masters = _masters(resumed)
    iter_s = statistics.median(times)
    peak = peak_flops(ctx["env"].get("device", ""), ctx["peak_tflops"])
    master_diff = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
                      for a, b in zip(r_masters, masters))
    return {
        **about, "iters": sz.iters, "tokens_per_iter": sz.global_batch * sz.seq, "iter_s": iter_s,
        "tokens_per_s": sz.global_batch * sz.seq / iter_s,
        "model_tflops_per_s": flops / iter_s / 1e12, "mfu": None if peak is None else flops / iter_s / peak,
        "loss_first": losses[0], "loss_last": losses[-1], "loss_falls": losses[-1] < losses[0],
        "resume_loss_max_rel_diff": max_rel_diff(r_losses, losses[half:]),
        "resume_max_rel_diff": master_diff, "peak_mem_gib": peak_mem,
    }


def _doc_mixes(token_counts: tuple[int, ...], n: int, seed: int) -> list[list[int]]:
    """``n`` micro-batches of packed documents: token counts cycle through ``token_counts``; each
    batch draws its documents from one of three shapes (many short, few long, mixed), so the
    attention work varies several-fold at equal token count."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        total = token_counts[i % len(token_counts)]
        shape = (i // len(token_counts)) % 3
        docs: list[int] = []
        while sum(docs) < total:
            if shape == 0:
                d = int(rng.integers(max(total // 64, 1), max(total // 16, 2)))
            elif shape == 1:
                d = int(rng.integers(total // 3, total + 1))
            else:
                d = int(rng.integers(max(total // 32, 1), total // 2 + 1))
            docs.append(min(d, total - sum(docs)))
        out.append(docs)
    return out


class PackedGPT:
    """A GPTModel fed one packed micro-batch of documents.

    CUDA with Transformer Engine: the TE layer spec with ``PackedSeqParams(qkv_format="thd")``
    (cumulative sequence lengths; TE's varlen flash/cuDNN attention keeps each document to itself).
    CPU smoke: the local spec with a block-causal mask (same semantics, full-matrix cost)."""

    def __init__(self, sz: Sizes, vocab: int, cuda: bool) -> None:
        import torch
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        from megatron_ext.compat.kernels import apex_fused_softmax_available
        from megatron_ext.runtime.model import layer_spec

        self.cuda, self.vocab = cuda, vocab
        self.device = torch.device("cuda" if cuda else "cpu")
        dtype = torch.bfloat16 if cuda else torch.float32
        cfg = TransformerConfig(num_layers=sz.layers, hidden_size=sz.hidden, num_attention_heads=sz.heads,
                                params_dtype=dtype, bf16=cuda, hidden_dropout=0.0, attention_dropout=0.0,
                                use_cpu_initialization=not cuda, batch_p2p_sync=cuda,
                                gradient_accumulation_fusion=False, bias_activation_fusion=cuda,
                                masked_softmax_fusion=cuda and apex_fused_softmax_available(), bias_dropout_fusion=cuda, persist_layer_norm=False,
                                apply_rope_fusion=False)
        self.max_len = max(sz.packed_tokens)
        self.model = GPTModel(config=cfg, transformer_layer_spec=layer_spec(cuda), vocab_size=vocab,
                              max_sequence_length=self.max_len).to(self.device)
        if cuda:
            from megatron.core.transformer.module import Float16Module

            self.model = Float16Module(cfg, self.model)

    def batch(self, docs: list[int], seed: int) -> dict[str, Any]:
        import torch

        from megatron_ext.data.packing import block_causal_mask, reset_positions

        g = torch.Generator().manual_seed(seed)
        total = sum(docs)
        tokens = torch.randint(0, self.vocab, (1, total + 1), generator=g)
        b = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": reset_positions([docs])}
        if self.cuda:
            from megatron.core.packed_seq_params import PackedSeqParams

            cu = torch.tensor([0] + np.cumsum(docs).tolist(), dtype=torch.int32, device=self.device)
            b["packed"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                          max_seqlen_q=max(docs), max_seqlen_kv=max(docs))
            b["mask"] = None
        else:
            b["packed"], b["mask"] = None, block_causal_mask([docs], total)
        return {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in b.items()}

    def token_losses(self, b: dict[str, Any]):
        return self.model(b["tokens"], b["position_ids"], b["mask"], labels=b["labels"],
                          packed_seq_params=b["packed"]).float()


def section_packed(ctx: dict[str, Any]) -> dict[str, Any]:
    import torch

    sz: Sizes = ctx["sizes"]
    if ctx["cuda"] and not te_usable(ctx["env"]):
        return {"skipped": "Transformer Engine is not installed or does not import: no THD attention"}
    torch.manual_seed(0)
    m = PackedGPT(sz, vocab=4096, cuda=ctx["cuda"])
    docs = [max(sz.packed_tokens) // 8, max(sz.packed_tokens) // 4, max(sz.packed_tokens) // 2]
    docs.append(max(sz.packed_tokens) - sum(docs))
    with torch.no_grad():
        packed = m.token_losses(m.batch(docs, seed=1)).view(-1)
        alone, start = [], 0
        full = m.batch(docs, seed=1)
        for d in docs:
            one = {"tokens": full["tokens"][:, start:start + d], "labels": full["labels"][:, start:start + d],
                   "position_ids": torch.arange(d, device=m.device).unsqueeze(0)}
            if m.cuda:
                from megatron.core.packed_seq_params import PackedSeqParams

                cu = torch.tensor([0, d], dtype=torch.int32, device=m.device)
                one.update(packed=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                  max_seqlen_q=d, max_seqlen_kv=d), mask=None)
            else:
                from megatron_ext.data.packing import block_causal_mask

                one.update(packed=None, mask=block_causal_mask([[d]], d).to(m.device))
            alone.append(m.token_losses(one).view(-1))
            start += d
        alone_t = torch.cat(alone)
        # Control: the same pack under plain causal attention, where later documents see earlier ones.
        leaky = m.token_losses({**full, "packed": None, "mask": None}).view(-1)
    diff = float((packed - alone_t).abs().max())
    leak = float((leaky - alone_t).abs().max())
    # Isolation holds when packing moves the losses far less than a leak between documents does
    # (bf16 kernels differ between the packed and the one-document shapes, so not bit-equal).
    return {"attention": "TE THD (PackedSeqParams)" if m.cuda else "block-causal mask (CPU smoke)",
            "docs": docs, "max_abs_loss_diff": diff, "leaky_max_abs_loss_diff": leak,
            "mean_loss": float(alone_t.mean()), "documents_isolated": diff < 0.1 * leak}


def fit_flops_model(lin: np.ndarray, att: np.ndarray, seconds: np.ndarray, calib: np.ndarray) -> np.ndarray:
    """Relative errors |predicted / measured - 1| on the held-out points (``~calib``) of
    ``time = a * linear + b * attention + c``, fitted on ``calib`` with the detector's Huber fit."""
    from megatron_ext.resihp.stats import huber_fit

    if lin.shape != att.shape or lin.shape != seconds.shape or calib.shape != lin.shape:
        raise ValueError("lin, att, seconds and calib must have the same shape")
    if calib.sum() < 3 or (~calib).sum() < 1:
        raise ValueError(f"need >= 3 calibration points and >= 1 held-out point, got {int(calib.sum())} "
                         f"and {int((~calib).sum())}")
    x = np.stack([lin, att, np.ones_like(lin)], axis=-1)
    coef = huber_fit(x, seconds, calib)
    pred = x[~calib] @ coef
    return np.abs(pred / seconds[~calib] - 1.0)


def error_summary(err: np.ndarray) -> dict[str, float]:
    return {"median_abs_err": float(np.median(err)), "p95_abs_err": float(np.percentile(err, 95)),
            "max_abs_err": float(err.max()), "points": int(err.size)}


def section_flops_model(ctx: dict[str, Any]) -> dict[str, Any]:
    import torch

    from megatron_ext.models.flops import ModelSpec, microbatch_flops

    sz: Sizes = ctx["sizes"]
    if ctx["cuda"] and not te_usable(ctx["env"]):
        return {"skipped": "Transformer Engine is not installed or does not import: no THD attention"}
    torch.manual_seed(0)
    m = PackedGPT(sz, vocab=4096, cuda=ctx["cuda"])
    spec = ModelSpec(num_layers=sz.layers, hidden_size=sz.hidden, num_attention_heads=sz.heads, vocab_size=4096,
                     flash_attention=ctx["cuda"])
    watch = Stopwatch(ctx["cuda"])
    mixes = _doc_mixes(sz.packed_tokens, sz.flops_batches, seed=3)
    rows = []
    for i, docs in enumerate(mixes):
        b = m.batch(docs, seed=100 + i)
        fwd_t: list[float] = []
        bwd_t: list[float] = []
        for rep in range(2 + 5):  # two warm-ups, median of five
            f: list[float] = []
            bw: list[float] = []
            with watch(f):
                loss = m.token_losses(b).mean()
            with watch(bw):
                loss.backward()
            m.model.zero_grad(set_to_none=True)
            if rep >= 2:
                fwd_t.append(f[0])
                bwd_t.append(bw[0])
        fwd, bwd = microbatch_flops(spec, docs, sz.layers, first_stage=True, last_stage=True)
        rows.append((fwd.linear, fwd.attention, statistics.median(fwd_t), bwd.linear, bwd.attention,
                     statistics.median(bwd_t)))
    a = np.array(rows)
    calib = np.arange(len(rows)) % 2 == 0
    err_f = fit_flops_model(a[:, 0], a[:, 1], a[:, 2], calib)
    err_b = fit_flops_model(a[:, 3], a[:, 4], a[:, 5], calib)
    out = error_summary(np.concatenate([err_f, err_b]))
    out.update(fwd_median_abs_err=float(np.median(err_f)), bwd_median_abs_err=float(np.median(err_b)),
               micro_batches=len(rows), timer="cuda events" if ctx["cuda"] else "host clock",
               attention_share_range=[float((a[:, 1] / (a[:, 0] + a[:, 1])).min()),
                                      float((a[:, 1] / (a[:, 0] + a[:, 1])).max())])
    return out


def section_hydro(ctx: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from megatron_ext.hydro.bundle import TrialBundle, TrialSpec
    from megatron_ext.hydro.models import GPT, GPTShape
    from megatron_ext.hydro.nn import fused_cross_entropy
    from megatron_ext.hydro.optim import TrialHParams

    sz: Sizes = ctx["sizes"]
    dev = torch.device("cuda" if ctx["cuda"] else "cpu")
    B, batch = 8, 8
    shape = GPTShape(vocab_size=256, seq_len=sz.hydro_seq, d_model=sz.hydro_width, n_layers=2, n_heads=4)

    def factory(seed: int):
        torch.manual_seed(seed)
        return GPT(shape)

    specs = [TrialSpec(i, seed=i, hparams=TrialHParams(lr=1e-3 * (1 + i % 4))) for i in range(B)]
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(sz.hydro_rounds + 2):
        t = torch.randint(0, 256, (batch, sz.hydro_seq + 1), generator=gen)
        batches.append((t[:, :-1].to(dev), t[:, 1:].to(dev)))
    bundle = TrialBundle(factory, specs, optimizer="adam", loss_fn=fused_cross_entropy,
                         example_inputs=(batches[0][0][:2],), device=dev)
    plains = [factory(s.seed).to(dev) for s in specs]
    opts = [torch.optim.Adam(p.parameters(), lr=s.hparams.lr) for p, s in zip(plains, specs)]
    watch = Stopwatch(ctx["cuda"])
    fused_t: list[float] = []
    seq_t: list[float] = []
    for r, (x, y) in enumerate(batches):
        f: list[float] = []
        s: list[float] = []
        with watch(f):
            bundle.train_step(x, y)
        with watch(s):
            for mdl, opt in zip(plains, opts):
                opt.zero_grad()
                F.cross_entropy(mdl(x).reshape(-1, shape.vocab_size), y.reshape(-1)).backward()
                opt.step()
        if r >= 2:
            fused_t.append(f[0])
            seq_t.append(s[0])
    worst = 0.0
    for i, mdl in enumerate(plains):
        st = bundle.trial_state(i)
        for k, v in mdl.state_dict().items():
            if v.is_floating_point():
                worst = max(worst, float((st[k].to(v.device) - v).abs().max() / v.abs().max().clamp_min(1e-12)))
    return {"trials": B, "shape": dataclasses.asdict(shape), "fused_step_s": statistics.median(fused_t),
            "sequential_step_s": statistics.median(seq_t),
            "fused_b8_speedup": statistics.median(seq_t) / statistics.median(fused_t),
            "param_max_rel_diff": worst}


def section_helix(ctx: dict[str, Any]) -> dict[str, Any]:
    sz: Sizes = ctx["sizes"]
    values = {**FORMER_DEFAULTS, "num_layers": 2, "hidden_size": max(sz.hidden // 3, 32), "num_attention_heads": 2,
              "seq_length": min(sz.seq, 256), "micro_batch_size": 2, "global_batch_size": 4,
              "train_iters": sz.helix_iters, "lr": 1e-3, "lr_decay_style": "constant", "eval_iters": 0,
              "progress": False, "log_interval": 1000}
    # References: the eager model, and the same local-spec model through Helix's backend without
    # its passes (--helix-mode baseline); on a GPU the eager run uses the TE spec, --helix the
    # local spec, so only the baseline compares like with like.
    eager = _trainer(dict(values), ctx["dist"])
    eager.run()
    curves = {}
    out: dict[str, Any] = {}
    for mode in ("baseline", "tiled"):
        t0 = time.perf_counter()
        t = _trainer({**values, "helix": True, "helix_mode": mode}, ctx["dist"])
        t.run()
        curves[mode] = _train_losses(t)
        if mode == "tiled":
            ext = next(e for e in t.extensions if getattr(e, "name", "") == "helix")
            summaries = list(ext.backend.summaries) if ext.backend is not None else []
            out.update(compiled=bool(summaries), graphs=len(summaries),
                       tiled_graphs=sum(s.tiled for s in summaries), cost_model=ext.cfg.helix_cost_model,
                       compile_and_train_s=time.perf_counter() - t0)
        for e in t.extensions:
            e.teardown(t)
    out["loss_max_rel_diff"] = max_rel_diff(curves["tiled"], curves["baseline"])
    out["eager_loss_max_rel_diff"] = max_rel_diff(curves["tiled"], _train_losses(eager))
    return out


def _metric_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a run's ``--metrics-file`` (none when the run never wrote it)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _last_lines(ranks: list[Any]) -> str:
    """Each rank's last line of output (its error, where it failed), joined."""
    return " | ".join(r.output.strip().splitlines()[-1][:200] for r in ranks if r.output.strip())


def section_deepspeed(ctx: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed engine on the GPU path (its own layers, its pipeline engine, the project's
    patches, ``--timeline``'s recorder) against the megatron engine on the same model and data."""
    import torch

    from megatron_ext.ft.launch import job_exit_code, launch_ranks

    sz: Sizes = ctx["sizes"]
    gpus = torch.cuda.device_count() if ctx["cuda"] else 0
    nproc = 2 if gpus >= 2 else 1
    backend = ["--device", "cuda", "--distributed-backend", "nccl"] if ctx["cuda"] else ["--device", "cpu"]
    iters = 10 if ctx["cuda"] else 4
    model = [*former_default_flags(), "--num-layers", "4", "--hidden-size", str(min(sz.hidden, 256)),
             "--num-attention-heads",
             str(min(sz.heads, 4)), "--seq-length", str(min(sz.seq, 256)), "--micro-batch-size", "2",
             "--global-batch-size", "8", "--pipeline-model-parallel-size", str(nproc), "--train-iters", str(iters),
             "--eval-iters", "0", "--lr-decay-style", "constant", "--progress", "false"]
    out: dict[str, Any] = {"ranks": nproc, "backend": "nccl" if ctx["cuda"] else "gloo"}
    curves: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for eng, extra in (("megatron", []), ("deepspeed", ["--timeline"])):
            metrics = os.path.join(tmp, f"{eng}.jsonl")
            argv = [os.path.join(ROOT, "pretrain_gpt.py"), *backend, *model, "--engine", eng, *extra,
                    "--metrics-file", metrics]
            ranks = launch_ranks(argv, nproc, cwd=ROOT, timeout_s=300)
            train = [r for r in _metric_rows(metrics) if r["kind"] == "train"]
            curves[eng] = [r["loss"] for r in train]
            out[f"{eng}_exit_codes"] = [r.returncode for r in ranks]
            out[f"{eng}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in train[1:]) if len(train) > 1 \
                else None
            if job_exit_code(ranks) != 0 or len(train) != iters:  # the other engine still runs
                errors[eng] = f"--engine {eng} trained {len(train)} of {iters} iterations: " + _last_lines(ranks)
    out["trained"] = "deepspeed" not in errors
    if errors:
        out["error"] = "; ".join(errors.values())
        return out
    out["loss_first"], out["loss_last"] = curves["deepspeed"][0], curves["deepspeed"][-1]
    out["loss_max_rel_diff"] = max_rel_diff(curves["deepspeed"], curves["megatron"])
    return out


def section_ft_nccl(ctx: dict[str, Any]) -> dict[str, Any]:
    """A lost rank on NCCL: the survivor continues (what lifts the refusal of continue on NCCL)."""
    import torch

    from megatron_ext.ft.launch import job_exit_code, launch_ranks

    gpus = torch.cuda.device_count() if ctx["cuda"] else 0
    if ctx["cuda"] and gpus < 2:
        return {"skipped": f"needs at least 2 CUDA devices (one per NCCL rank), found {gpus}: continue on NCCL stays "
                           "behind --ft-continue-experimental-nccl"}
    backend = ["--device", "cuda", "--distributed-backend", "nccl"] if ctx["cuda"] else ["--device", "cpu"]
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        argv = [os.path.join(ROOT, "pretrain_gpt.py"), *backend, "--num-layers", "2", "--hidden-size", "64",
                "--num-attention-heads", "4", "--seq-length", "64", "--global-batch-size", "8", "--micro-batch-size",
                "2", "--train-iters", "20", "--eval-iters", "0", "--log-interval", "5", "--resihp",
                "--ft-on-stop", "continue", "--ft-continue-experimental-nccl", "--ft-heartbeat-interval-s",
                "0.5", "--ft-heartbeat-timeout-s", "4", "--ft-continue-timeout-s", "60", "--inject-stop",
                "1:6", "--metrics-file", metrics]
        ranks = launch_ranks(argv, 2, cwd=ROOT, timeout_s=300)
        rows = _metric_rows(metrics)
    change = next((r for r in rows if r["kind"] == "layout_change"), None)
    trained = max((r["iteration"] for r in rows if r["kind"] == "train"), default=0)
    out = {"backend": "nccl" if ctx["cuda"] else "gloo", "exit_codes": [r.returncode for r in ranks],
           "job_exit_code": job_exit_code(ranks), "continued": change is not None and trained == 20,
           "pause_s": round(change["pause_s"], 3) if change else None, "to": change["to"] if change else None}
    if not out["continued"]:
        out["error"] = "the survivor did not train to the end: " + _last_lines(ranks)
    return out


SECTION_FUNCS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "env": section_env, "gpt": section_gpt, "llama": section_llama, "packed": section_packed,
    "flops_model": section_flops_model, "hydro": section_hydro, "helix": section_helix, "deepspeed": section_deepspeed,
    "ft_nccl": section_ft_nccl,
}


# --- reporting (pure: tested on CPU) --------------------------------------------------------------

class SectionTimeout(BaseException):
    """Raised inside a section still running at ``--hard-limit-s``. Not an ``Exception``: a section's
    own ``except Exception`` (a preflight, a retried step) must not swallow it and run on."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise SectionTimeout("interrupted at --hard-limit-s")


def run_section(name: str, fn: Callable[[dict[str, Any]], dict[str, Any]], ctx: dict[str, Any],
                limit_s: float | None = None) -> dict[str, Any]:
    """The section's figures, or ``{"error": ...}``: one broken section never loses the others.
    With ``limit_s``, a section still running after that many seconds is interrupted (SIGALRM,
    main thread only) and reports so as its error."""
    t0 = time.perf_counter()
    armed = False
    if limit_s is not None:
        try:
            previous = signal.signal(signal.SIGALRM, _on_alarm)
            signal.setitimer(signal.ITIMER_REAL, max(limit_s, 1e-3))
            armed = True
        except ValueError:  # not the main thread: no limit
            pass
    try:
        out = dict(fn(ctx))
    except (Exception, SectionTimeout) as exc:  # noqa: BLE001 - reported in the JSON, the next section runs
        logger.error("section %s failed:\n%s", name, traceback.format_exc())
        out = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        if armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
    out["section_s"] = round(time.perf_counter() - t0, 2)
    return out


def gpu_visible() -> bool:
    """An NVIDIA device on the machine, whether or not torch can use it."""
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


def announce(name: str, result: dict[str, Any], so_far_s: float) -> None:
    """One section's figures on stderr the moment it ends (flushed): kept if the run is killed."""
    print(f"gpu-check: {name} done ({so_far_s:.0f} s so far): {json.dumps(result, default=str)}",
          file=sys.stderr, flush=True)


def complete(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every required key present (None where a section failed, was skipped or not run)."""
    out = {k: dict(v) for k, v in results.items()}
    for section, keys in REQUIRED.items():
        d = out.setdefault(section, {"skipped": "not run (--sections)"})
        for k in keys:
            d.setdefault(k, None)
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, dict)):
        s = json.dumps(v)
        return s if len(s) <= 60 else s[:57] + "..."
    return str(v)


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = [("section", "figure", "value")]
    for section, figs in results.items():
        for k, v in figs.items():
            rows.append((section, k, _fmt(v)))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


def record(text: str, line: str, device: str, when: datetime.datetime) -> tuple[str, str]:
    os.makedirs(RECORD_DIR, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower() or "device"
    base = os.path.join(RECORD_DIR, f"gpu_check_{when:%Y%m%d_%H%M%S}_{slug}")
    with open(base + ".txt", "w", encoding="utf-8") as fh:
        fh.write(text + "\n")
    with open(base + ".json", "w", encoding="utf-8") as fh:
        fh.write(line + "\n")
    return base + ".txt", base + ".json"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import torch

    from megatron_ext.bench.harness import Report

    report = Report("gpu_check")  # provenance on the JSON line: a recorded figure names its commit
    cuda = torch.cuda.is_available()
    started = time.perf_counter()
    if cuda:  # before the first cuBLAS handle: the resume check's deterministic GEMMs need it
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env = section_env({})
    if not cuda and not args.cpu_smoke:
        where = f"torch {torch.__version__}, CUDA build {torch.version.cuda}"
        if gpu_visible():
            print(f"gpu-check failed: an NVIDIA device is present but torch cannot use it ({where}): a CPU "
                  "build of torch, or a driver older than its CUDA. Run it with a CUDA build (the Docker "
                  "image, or GPU_PY=python-with-cuda make gpu-check)", file=sys.stderr)
            print(json.dumps({"error": f"NVIDIA device present, CUDA unusable ({where})", "env": env}))
            return UNUSABLE_GPU_EXIT
        reason = f"no CUDA device ({where}): the GPU check needs one GPU; --cpu-smoke runs its code on CPU"
        print(f"gpu-check skipped: {reason}")
        print(json.dumps({"skipped": reason, "env": env}))
        return SKIP_EXIT
    os.environ.setdefault("MEGATRON_EXT_CACHE", os.path.join(tempfile.gettempdir(), "megatron_ext_gpu_check"))
    if cuda:
        # Deterministic algorithms hold for the resume check only (``deterministic``); and they
        # would fill every new tensor with NaN first, which no figure here needs.
        torch.utils.deterministic.fill_uninitialized_memory = False
    sizes = Sizes.gpu(args.iters) if cuda else Sizes.cpu_smoke(args.iters)
    ctx: dict[str, Any] = {"cuda": cuda, "env": env, "sizes": sizes, "peak_tflops": args.peak_tflops}
    results: dict[str, dict[str, Any]] = {}
    # Megatron models need megatron's parallel state (one rank: TP = PP = DP = 1). If it cannot be
    # set up, the sections that need it say so and the others run.
    needs_dist = {"gpt", "llama", "packed", "flops_model", "helix"} & set(args.sections)
    dist_error = None
    if needs_dist:
        try:
            ctx["dist"] = _dist_context(seed=1234)
        except Exception as exc:  # noqa: BLE001 - reported per section
            logger.error("distributed setup failed:\n%s", traceback.format_exc())
            dist_error = f"distributed setup failed: {type(exc).__name__}: {exc}"[:500]
    for name in args.sections:
        spent = time.perf_counter() - started
        if name == "env":
            results[name] = env
        elif spent > args.budget_s:
            results[name] = {"skipped": f"time budget spent ({spent:.0f} s > --budget-s {args.budget_s:g})"}
        elif spent >= args.hard_limit_s:
            results[name] = {"skipped": f"hard limit reached ({spent:.0f} s >= --hard-limit-s {args.hard_limit_s:g})"}
        elif dist_error is not None and name in needs_dist:
            results[name] = {"error": dist_error}
        else:
            results[name] = run_section(name, SECTION_FUNCS[name], ctx, limit_s=args.hard_limit_s - spent)
        announce(name, results[name], time.perf_counter() - started)
    if needs_dist and dist_error is None:
        from megatron_ext.runtime import distributed

        distributed.teardown()
    results = complete(results)
    results["meta"] = {"wall_s": round(time.perf_counter() - started, 1), "cpu_smoke": not cuda,
                       "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    text = table(results)
    line = json.dumps(report.line(results), default=str)
    print(text)
    print(line)
    if args.record:
        paths = record(text, line, env["device"], datetime.datetime.now(datetime.timezone.utc))
        print(f"recorded {paths[0]} and {paths[1]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

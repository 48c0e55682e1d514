"""DeepSpeed-engine scenarios for tests/deepspeed_patches, run under ``torchrun --nproc_per_node 4``.

One launch (imports cost 10-20 s per rank on 2 cores) runs, in the same 4 processes:
timelines (PP2xDP2 m4, PP4 m4, PP4 m8: the joined IterationRecord of the last iteration, pickled),
loss curves for parity with the megatron engine (PP2xDP2, PP4), resume (20 straight against 10 + 10),
live re-layout (PP2xDP2 -> 3+1 layers -> PP4 in the same processes against the straight 20),
checkpoints moved between engines (DeepSpeed PP2xDP2 -> megatron PP2xDP2 and back), and TP2 x PP2 on
both engines (the LLaMA-style family; checkpoints continued across engines and layouts).
Rank 0 writes ``results.json`` and the pickles into the output directory.
"""
from __future__ import annotations

import json
import os
import pickle
import sys
import warnings

warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch.distributed as dist  # noqa: E402

from deepspeed_patches import trainer as ds  # noqa: E402
from megatron_ext.config.run import config_from_values  # noqa: E402
from megatron_ext.runtime import distributed  # noqa: E402
from megatron_ext.runtime.extension import build_extensions  # noqa: E402
from megatron_ext.runtime.loop import Trainer  # noqa: E402
from tests.scenario_helpers import CURVE, LLAMA_STYLE, TIMELINE, TINY, curve, from_logging_rank  # noqa: E402

TIMELINES = {
    "pp2dp2_m4": {"pipeline_model_parallel_size": 2, "global_batch_size": 8},
    "pp4_m4": {"pipeline_model_parallel_size": 4, "global_batch_size": 4},
    "pp4_m8": {"pipeline_model_parallel_size": 4, "global_batch_size": 8},
}
PP2DP2 = {"pipeline_model_parallel_size": 2}
# ResiHP live on this engine: rank 2 (stage 1, dp 0) computes 3x slower from iteration 20 (a clear fault:
# the delay and small-factor recall are benchmark figures, tools/bench_detector.py).
RESIHP = {**TINY, "train_iters": 60, "seq_length": 128, "micro_batch_size": 1, "lr_decay_style": "constant",
          "pipeline_model_parallel_size": 2, "resihp": True, "resihp_warmup": 12, "inject_slow": ["2:20:3.0"]}
PP4 = {"pipeline_model_parallel_size": 4}
# TP x PP x DP: the LLaMA-style family (RMSNorm, SwiGLU, rotary, grouped-query attention, no biases,
# untied head), fp32, no dropout, so that the engines must agree to rounding.
LLAMA = {**CURVE, **LLAMA_STYLE, "untie_embeddings_and_output_weights": True, "save_interval": 5}
TP2PP2 = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}


def run_deepspeed(base: dict, values: dict, *, load: str | None = None) -> tuple[Trainer, list]:
    cfg = config_from_values({**base, **values, "engine": "deepspeed", **({"load": load} if load else {})})
    cfg.validate(int(os.environ["WORLD_SIZE"]))
    ds.check_config(cfg)
    ctx = ds.setup_distributed(cfg.parallel, seed=cfg.training.seed)
    exts = build_extensions(cfg)
    trainer = ds.DeepSpeedTrainer(cfg, ctx, exts).setup()
    trainer.run()
    return trainer, exts


def megatron_curve(base: dict, values: dict, *, load: str | None = None) -> list[float]:
    """A megatron-engine run's loss curve; its parallel state is destroyed after (the default group stays)."""
    cfg = config_from_values({**base, **values, **({"load": load} if load else {})})
    cfg.validate(int(os.environ["WORLD_SIZE"]))
    trainer = Trainer(cfg, distributed.setup(cfg.parallel, seed=cfg.training.seed), build_extensions(cfg)).setup()
    trainer.run()
    losses = curve(trainer)
    distributed.destroy_parallel_state(trainer.ctx.pgs)
    return losses


def checkpoint_at(save_dir: str, iteration: int, out_dir: str) -> str:
    """A directory whose latest checkpoint is ``save_dir``'s of ``iteration`` (rank 0 links it)."""
    name = f"iter_{iteration:07d}"
    path = os.path.join(out_dir, f"{os.path.basename(save_dir)}_at{iteration}")
    if int(os.environ["RANK"]) == 0:
        os.makedirs(path, exist_ok=True)
        os.symlink(os.path.join(save_dir, name), os.path.join(path, name))
        with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w", encoding="ascii") as fh:
            fh.write(str(iteration))  # Megatron-LM's tracker (the default format)
    dist.barrier()
    return path


def three_d(out_dir: str) -> dict:
    """The LLaMA-style family in TP2 x PP2 on both engines (DeepSpeed's with sequence parallelism and
    the timeline on), and each engine's checkpoint of iteration 5 continued by the other engine in
    another layout (megatron TP1 x PP2 x DP2 from DeepSpeed's; DeepSpeed TP2 x DP2 from megatron's)."""
    ds_save, mg_save = os.path.join(out_dir, "ckpt_ds_tp2pp2"), os.path.join(out_dir, "ckpt_megatron_tp2pp2")
    res: dict = {"megatron_tp2pp2": megatron_curve(LLAMA, {**TP2PP2, "save": mg_save})}
    trainer, exts = run_deepspeed(LLAMA, {**TP2PP2, "sequence_parallel": True, "save": ds_save, "timeline": True,
                                          "timeline_out": os.path.join(out_dir, "ds_tp2pp2")})
    res["deepspeed_tp2pp2_sp"] = curve(trainer)
    res["layout"] = trainer.layout_name()
    record = exts[0].record(trainer, trainer.iteration, dst=0)
    if record is not None:
        with open(os.path.join(out_dir, "ds_tp2pp2.pkl"), "wb") as fh:
            pickle.dump(record, fh)
    res["megatron_tp1pp2dp2_from_ds5"] = megatron_curve(LLAMA, {"pipeline_model_parallel_size": 2},
                                                        load=checkpoint_at(ds_save, 5, out_dir))
    res["deepspeed_tp2dp2_from_megatron5"] = curve(run_deepspeed(
        LLAMA, {"tensor_model_parallel_size": 2}, load=checkpoint_at(mg_save, 5, out_dir))[0])
    return res


def same_initial_weights(cfg, ctx, vocab_size: int) -> list[int]:
    """[tensors compared, tensors that differ] over all ranks: the fresh DeepSpeed stage against the
    fresh megatron chunk of the same stage (PP2 x DP2), matched by megatron key and global layer."""
    import torch

    from deepspeed_patches.gpt import build_gpt_pipeline
    from megatron_ext.runtime.model import build_model, iter_sharded_tensors, padded_vocab_size, shard_slices, unwrap

    chunk = unwrap(build_model(cfg, ctx, vocab_size, wrap_ddp=False).chunks[0])
    megatron = {(st.key, shard_slices(st)[0]): st.data for st in iter_sharded_tensors(chunk.sharded_state_dict())}
    pipe = build_gpt_pipeline(cfg.model, vocab_size=padded_vocab_size(vocab_size, 1), num_stages=2,
                              seed=cfg.training.seed, std=cfg.model.init_method_std)
    entries = pipe.shard_entries()
    differ = sum(not torch.equal(megatron[(e.key, e.index)], e.param.data) for e in entries)
    counts = torch.tensor([len(entries) if len(entries) == len(megatron) else -1, differ])
    dist.all_reduce(counts)
    return counts.tolist()


def live_relayout() -> dict:
    """Trainer.relayout on this engine: PP2 x DP2 (2+2 layers) -> 3+1 at iteration 7 -> PP4 with the
    ranks reversed at 14 -> TP2 x PP2 at 17, with the timeline on (it re-attaches to each new engine);
    then the targets it refuses."""
    from megatron_ext.config.base import ConfigError

    cfg = config_from_values({**CURVE, **PP2DP2, "train_iters": 20, "engine": "deepspeed", "timeline": True})
    trainer = ds.DeepSpeedTrainer(cfg, ds.setup_distributed(cfg.parallel, seed=cfg.training.seed),
                                  build_extensions(cfg)).setup()
    losses, layouts = [], []

    def train(n: int) -> None:
        losses.extend(from_logging_rank(trainer.ctx, [trainer.train_step().loss for _ in range(n)]))
        layouts.append(trainer.layout_name())

    train(7)
    trainer.relayout(tp=1, pp=2, stage_layers=[3, 1])
    train(7)
    # With the ranks in reverse order: the processes renumbered on a new default group.
    members = trainer.relayout(tp=1, pp=4, rank_order=[3, 2, 1, 0])["members"]
    train(3)
    trainer.relayout(tp=2, pp=2)     # the TP size changed live: the PipelineModule rebuilt with TP layers
    train(3)
    refusals = []
    for kw in ({"tp": 1, "pp": 2, "vpp": 2}, {"tp": 1, "pp": 2, "replica_microbatches": [3, 1]}):
        try:
            trainer.relayout(**kw)
        except ConfigError as exc:
            refusals.append(str(exc))
    generation = trainer.ctx.generation
    # Back to launch order: the scenarios after this one set up from RANK again.
    trainer.relayout(tp=1, pp=2, rank_order=[3, 2, 1, 0])
    assert list(trainer.ctx.members) == [0, 1, 2, 3] and dist.get_rank() == int(os.environ["RANK"])
    return {"losses": losses, "layouts": layouts, "refusals": refusals, "stage_layers": [3, 1], "members": members,
            "generation": generation}


def main() -> None:
    out_dir = sys.argv[1]
    results: dict[str, list[float]] = {}
    rank = int(os.environ["RANK"])

    for name, values in TIMELINES.items():
        trainer, exts = run_deepspeed(TIMELINE, {**values, "timeline_out": os.path.join(out_dir, name)})
        record = exts[0].record(trainer, trainer.iteration, dst=0)
        if trainer.ctx.is_logging_rank:  # what the progress line and TensorBoard got
            extra = [k for k in trainer.history[-1] if k.startswith("bubble_s")]
            with open(os.path.join(out_dir, f"{name}_logged.json"), "w", encoding="utf-8") as fh:
                json.dump(extra, fh)
        if record is not None:
            with open(os.path.join(out_dir, f"{name}.pkl"), "wb") as fh:
                pickle.dump(record, fh)

    results["pp2dp2"] = curve(run_deepspeed(CURVE, PP2DP2)[0])
    results["pp4"] = curve(run_deepspeed(CURVE, PP4)[0])

    ckpt = os.path.join(out_dir, "ckpt_ds_pp2dp2")
    results["straight20"] = curve(run_deepspeed(CURVE, {**PP2DP2, "train_iters": 20})[0])
    results["first10"] = curve(run_deepspeed(CURVE, {**PP2DP2, "train_iters": 10, "save": ckpt})[0])
    results["resumed10"] = curve(run_deepspeed(CURVE, {**PP2DP2, "train_iters": 20}, load=ckpt)[0])
    results["relayout"] = live_relayout()

    # Checkpoints move between engines (same layout, PP2 x DP2): DeepSpeed's continued by megatron,
    # and megatron's continued by DeepSpeed.
    cfg = config_from_values({**CURVE, **PP2DP2, "train_iters": 20, "load": ckpt})
    cfg.validate(int(os.environ["WORLD_SIZE"]))
    ctx = distributed.setup(cfg.parallel, seed=cfg.training.seed)
    trainer = Trainer(cfg, ctx).setup()
    trainer.run()
    results["megatron_from_ds10"] = curve(trainer)
    results["init"] = same_initial_weights(cfg, ctx, trainer.splits.tokenizer.vocab_size)
    megatron_ckpt = os.path.join(out_dir, "ckpt_megatron_pp2dp2")
    cfg = config_from_values({**CURVE, **PP2DP2, "train_iters": 10, "save": megatron_ckpt})
    trainer = Trainer(cfg, ctx).setup()
    trainer.run()
    results["megatron_first10"] = curve(trainer)
    results["ds_from_megatron10"] = curve(run_deepspeed(CURVE, {**PP2DP2, "train_iters": 20}, load=megatron_ckpt)[0])

    distributed.destroy_parallel_state(ctx.pgs)   # megatron's PP2 x DP2 state: three_d sets up its own
    results["three_d"] = three_d(out_dir)

    verdicts = os.path.join(out_dir, "resihp.verdicts.jsonl")
    run_deepspeed(RESIHP, {"resihp_verdicts_out": verdicts,
                           "resihp_trace_out": os.path.join(out_dir, "resihp.trace.jsonl")})
    dist.barrier()
    if rank == 0:
        results["resihp_verdicts"] = ([json.loads(line) for line in open(verdicts, encoding="utf-8")]
                                      if os.path.exists(verdicts) else [])

    if rank == 0:
        with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as fh:
            json.dump(results, fh)
    distributed.teardown()


if __name__ == "__main__":
    main()

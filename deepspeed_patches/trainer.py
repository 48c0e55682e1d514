"""``pretrain_gpt.py --engine deepspeed``: the runtime Trainer over DeepSpeed's PipelineEngine.

``DeepSpeedTrainer`` subclasses ``megatron_ext.runtime.loop.Trainer`` and replaces only the engine
hooks: the model is the GPT ``PipelineModule`` of ``deepspeed_patches/gpt.py`` inside
``deepspeed.initialize`` (our ``EventPipelineEngine``), and an iteration is ``engine.train_batch``.
Data (``MicroBatchStream``), the LR schedule (megatron-core's ``OptimizerParamScheduler``), progress
lines, TensorBoard, the metrics file, checkpoints and extensions are the base Trainer's.

The optimizer is ``torch.optim.AdamW`` (fp32) with megatron's clipping: DeepSpeed's own
``gradient_clipping`` sums the norm over the tensor-parallel group only and counts the tied embedding
on two stages, so it is switched off and ``ClippedAdamW`` clips by the global norm over the pipeline,
each parameter counted once, as the megatron engine does.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.config.base import ConfigError
from megatron_ext.config.run import ParallelConfig, RunConfig
from megatron_ext.engines import engine
from megatron_ext.runtime import distributed
from megatron_ext.ft import store as store_lib
from megatron_ext.ft.target import LayoutTarget
from megatron_ext.runtime.distributed import DistContext
from megatron_ext.layout import Layout
from megatron_ext.runtime.loop import RecorderHooks, Trainer
from megatron_ext.runtime import checkpoint as ckpt
from megatron_ext.runtime.model import model_vocab_size
from megatron_ext.runtime.optimizer import _param_groups, build_scheduler

logger = logging.getLogger(__name__)


def check_config(cfg: RunConfig) -> None:
    """What ``--engine deepspeed`` does not support beyond RunConfig's own checks (TP = 1, no vpp;
    the lines are the engine spec's, ``megatron_ext/engines.py``)."""
    # Model families the PipelineModule does not build are refused by RunConfig.validate
    # (models/families.py: mixture of experts).
    spec = engine("deepspeed")
    t = cfg.training
    for feature, on in (("bf16", t.bf16), ("fp16", t.fp16), ("per_token_loss", t.calculate_per_token_loss),
                        ("decoupled_lr", t.decoupled_lr is not None), ("num_zeros_in_grad", t.log_num_zeros_in_grad)):
        if on:
            spec.refuse(feature)
    if cfg.data.doc_length_dist:
        # Packed documents need their block-causal mask on every stage and per-document attention;
        # the PipelineModule passes hidden states only.
        spec.refuse("packed_documents")
    if cfg.parallel.data_parallel_microbatches is not None:
        # Its engine scales every replica's loss by one accumulation count.
        spec.refuse("data_parallel_microbatches")
    if cfg.parallel.overlap_grad_reduce:
        spec.refuse("overlap_grad_reduce")


def _tensor_parallel_on_cpu(tp: int, device: torch.device) -> None:
    """The TP layers call megatron-core's region functions, which allocate on the CUDA device: on
    CPU they need the project's megatron-core shim (``compat/megatron_cpu.py``)."""
    if tp > 1 and device.type == "cpu":
        from megatron_ext.compat import megatron_cpu

        megatron_cpu.apply()


def setup_distributed(parallel: ParallelConfig, *, seed: int, timeout_s: float = 600.0,
                      join: bool = False) -> DistContext:
    """Process group, DeepSpeed's comm backend (patched) and this rank's place in the TP x PP x DP grid.

    DeepSpeed's grid (``PipeModelDataParallelTopology``) orders ranks as megatron does (TP fastest,
    then DP, then PP), so ``Layout(tp, pp, dp)`` describes it; ``DeepSpeedTrainer`` checks that
    against the engine's grid.
    May be called again in the same processes for another pipeline size. ``join``: a replacement
    process (no group until a layout change takes it in; ``layout_context`` then initialises
    DeepSpeed's comm on the new group).
    """
    os.environ.setdefault("LOCAL_RANK", "0")  # PipelineModule reads it; a lone process has no launcher
    if join:
        ctx = distributed.joining_context(parallel, timeout_s=timeout_s)
        if ctx.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed_patches

        deepspeed_patches.apply()
        torch.manual_seed(seed)
        return ctx
    rank, world, local_rank, device, backend = distributed.init_process_group(parallel, timeout_s=timeout_s)
    if device.type == "cpu":
        # Name the accelerator: DeepSpeed's auto-detection warns on every rank when it falls back to CPU.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed_patches

    deepspeed_patches.apply()
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    # DeepSpeed logs every engine's configuration at INFO through its own "DeepSpeed" logger.
    ds_logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    torch.manual_seed(seed)
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend,
                       layout=parallel.launch_layout(world), store_addr=store_lib.address_from_env(),
                       timeout_s=timeout_s)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class ClippedAdamW(torch.optim.AdamW):
    """AdamW that clips by the global gradient norm over the pipeline and skips non-finite updates.

    DeepSpeed calls ``step()`` at ``OptimizerStep``, after the tied and data-parallel reduces, reads
    ``overflow`` (a skipped step) and ``_global_grad_norm``, and zeroes the gradients itself.
    """

    def __init__(self, params: list[torch.nn.Parameter], *, norm_params: list[torch.nn.Parameter],
                 norm_group: Any, clip_grad: float, before_update: Any = None, after_update: Any = None,
                 sequence_parallel: tuple[list[torch.nn.Parameter], Any] | None = None,
                 norm_device: torch.device | str = "cpu", **adamw: Any) -> None:
        super().__init__(_param_groups(params), **adamw)
        # (parameters, TP group): gradients of what sees only a sequence shard, summed before the norm
        self.sequence_parallel = sequence_parallel
        # The trainer's commit vote (--ft-on-stop continue) sits between the norm and the update.
        self.before_update, self.after_update = before_update, after_update
        self.norm_params = norm_params
        self.norm_group = norm_group
        # where the norm's sum is accumulated and all-reduced: the job's device (NCCL, the GPU
        # job's backend, cannot reduce a CPU tensor)
        self.norm_device = torch.device(norm_device)
        self.clip_grad = clip_grad
        self.overflow = False
        self.last_grad_norm: float | None = None
        self._global_grad_norm: float | None = None

    def grad_norm(self) -> float:
        sq = torch.zeros((), dtype=torch.float64, device=self.norm_device)
        for p in self.norm_params:
            if p.grad is not None:
                sq += p.grad.double().pow(2).sum().to(self.norm_device)
        if dist.is_initialized() and self.norm_group is not None:
            dist.all_reduce(sq, group=self.norm_group)
        return float(sq.sqrt())

    @torch.no_grad()
    def step(self, closure=None):
        if self.sequence_parallel is not None:   # megatron's _allreduce_layernorm_grads
            params, group = self.sequence_parallel
            for p in params:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=group)
        norm = self.grad_norm()
        self.last_grad_norm = self._global_grad_norm = norm
        self.overflow = not torch.isfinite(torch.tensor(norm))
        if self.before_update is not None:
            self.before_update()
        if self.overflow:
            logger.warning("non-finite gradient norm %s: skipping this update", norm)
        else:
            if self.clip_grad > 0 and norm > self.clip_grad:
                coef = self.clip_grad / (norm + 1e-6)
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.mul_(coef)
            super().step(closure)
        if self.after_update is not None:
            self.after_update()
        return None


def deepspeed_config(cfg: RunConfig, layout: Layout) -> dict[str, Any]:
    t = cfg.training
    return {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.global_batch_size // (t.micro_batch_size * layout.dp),
        "gradient_clipping": 0.0,  # ClippedAdamW clips (see the module docstring)
        "steps_per_print": 2**62,  # progress lines are the Trainer's
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": 0},
        # Stages send whole activations to the same TP rank of the next stage: DeepSpeed's
        # partitioning assumes TP ranks hold equal activations, which sequence parallelism breaks.
        "pipeline": {"pipe_partitioned": False, "grad_partitioned": False},
    }


def pipe_items(batches: list[dict[str, Any]]) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """Micro-batches as DeepSpeed's (inputs for the first stage, labels for the last stage)."""
    return [((b["tokens"], b["position_ids"]), (b["labels"], b["loss_mask"])) for b in batches]


class DeepSpeedTrainer(Trainer):
    """The runtime Trainer with DeepSpeed's PipelineEngine running each iteration."""

    engine: Any = None
    # TP and PP sizes, layers per stage and the rank order: the PipelineModule is rebuilt for the new
    # layout and the state moves by shard entries
    relayout_knobs = frozenset({"shape", "layers", "permute"})
    _engine_groups: list = []

    def check_target(self, target: LayoutTarget) -> None:
        if target.vp > 1:
            raise ConfigError("--engine deepspeed runs one stage per rank: use --engine megatron for a target with "
                              "virtual (interleaved) stages")
        mbs = target.replica_microbatches
        if mbs is not None and len(set(mbs)) > 1:
            raise ConfigError("--engine deepspeed cannot move micro-batches between replicas (its engine scales "
                              "every replica's loss by one accumulation count): use --engine megatron for DP "
                              "work migration")

    def _drop_engine(self) -> None:
        # The engine's grid built its own groups (pipe, data, slice and p2p pairs): destroy exactly
        # those; the new PipelineModule builds the new layout's. DeepSpeed has no group collection:
        # PipelineParallelGrid calls dist.new_group for every group of every rank (new_group is
        # collective) but keeps only this rank's, so the ones it made are known only as the process
        # groups that appeared while it was built (build_model) -- the one place this engine reads
        # torch's group registry, _world.pg_map.
        self.engine = self.model = self.optimizer = None
        gc.collect()
        live = dist.distributed_c10d._world.pg_map
        for group in self._engine_groups:
            if group in live:
                try:
                    dist.destroy_process_group(group)
                except Exception as exc:  # a group with a lost member (fail-stop): it goes with the world
                    logger.debug("destroying an engine group: %s", exc)
        self._engine_groups = []

    def drop_gradients(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def drop_model(self) -> None:
        if self.engine is not None and self.extensions_set_up:
            for ext in self.extensions:
                ext.detach(self)
        self.close_outputs(finish=True)
        self._drop_engine()
        self.scheduler = None
        distributed.leave(self.ctx)

    def layout_context(self, target: LayoutTarget, *, generation: int | None, store_addr: str | None) -> DistContext:
        """The new layout's place in DeepSpeed's grid, which the engine builds over the default group:
        the same one (``generation`` None), or a new world (after a fail-stop, a rejoin, or for a
        rank permutation)."""
        self.check_target(target)
        self._drop_engine()
        if generation is None:
            return dataclasses.replace(self.ctx, layout=target)
        ctx = distributed.new_world(self.ctx, layout=target, store_addr=store_addr, generation=generation)
        import deepspeed

        deepspeed.init_distributed(dist_backend=ctx.backend, verbose=False)
        return ctx

    def build_model(self) -> None:
        import deepspeed

        from deepspeed_patches.engine import EventPipelineEngine
        from deepspeed_patches.gpt import build_gpt_pipeline, norm_params, sequence_parallel_params

        cfg, ctx, t = self.cfg, self.ctx, self.cfg.training
        tp = ctx.layout.tp
        _tensor_parallel_on_cpu(tp, ctx.device)
        vocab = model_vocab_size(cfg, self.splits.tokenizer.vocab_size, tp, ckpt.embedding_rows(cfg.checkpoint.load))
        before = set(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else set()
        self.model = build_gpt_pipeline(cfg.model, vocab_size=vocab, num_stages=ctx.layout.pp, seed=t.seed,
                                        std=cfg.model.init_method_std, stage_layers=ctx.layout.stage_layers,
                                        tensor_parallel=tp, sequence_parallel=cfg.parallel.sequence_parallel)
        grid = self.model._grid
        got = (grid.get_stage_id(), grid.get_data_parallel_rank(), grid.get_slice_parallel_rank())
        if got != (ctx.coord.pp, ctx.coord.dp, ctx.coord.tp):  # grid and Layout disagree: groups would be wrong
            raise RuntimeError(f"rank {ctx.rank}: DeepSpeed grid (stage, dp, tp) {got} != layout {ctx.coord}")
        sp = sequence_parallel_params(self.model)
        # the norm sums over one replica (every stage and TP rank: DeepSpeed's model-parallel group)
        self.optimizer = ClippedAdamW(list(self.model.parameters()), norm_params=norm_params(self.model),
                                      norm_group=grid.get_model_parallel_group() if tp > 1 else
                                      grid.get_pipe_parallel_group(),
                                      sequence_parallel=(sp, grid.get_slice_parallel_group()) if sp else None,
                                      norm_device=distributed.collective_device(ctx), clip_grad=t.clip_grad,
                                      before_update=self.commit_update, after_update=self.update_applied, lr=t.lr,
                                      betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                      weight_decay=t.weight_decay)
        self.engine, _, _, _ = deepspeed.initialize(model=self.model, optimizer=self.optimizer,
                                                    config=deepspeed_config(cfg, ctx.layout))
        if not isinstance(self.engine, EventPipelineEngine):
            raise RuntimeError(f"deepspeed.initialize built {type(self.engine).__name__}, not EventPipelineEngine: "
                               "call deepspeed_patches.apply() first")
        if dist.is_initialized():
            self._engine_groups = [g for g in dist.distributed_c10d._world.pg_map if g not in before]
        self.scheduler = build_scheduler(self.optimizer, t)

    def prepare_schedule(self) -> None:
        pass  # the engine builds its TrainSchedule every iteration

    @property
    def schedule_name(self) -> str:
        return "deepspeed"

    def install_recorder(self, recorder: Any) -> RecorderHooks:
        """The engine records its own instructions (``EventPipelineEngine``): attach the recorder."""
        self.engine.attach_recorder(recorder)

        def uninstall() -> None:
            # The recorder keeps the last iteration's events: record() still works after the run.
            if self.engine is not None:
                self.engine.attach_recorder(None)

        return RecorderHooks(new_iteration=lambda: None, uninstall=uninstall)

    def _num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def layout_name(self) -> str:
        lay = self.ctx.layout
        return f"deepspeed {f'tp{lay.tp}' if lay.tp > 1 else ''}pp{lay.pp}dp{lay.dp}"

    def _train_batches(self, batches: list[dict[str, Any]]) -> tuple[Any, bool, float | None]:
        loss = self.engine.train_batch(data_iter=iter(pipe_items(batches)))
        return loss, not self.optimizer.overflow, self.optimizer.last_grad_norm

    def _eval_batches(self, batches: list[dict[str, Any]]) -> Any:
        return self.engine.eval_batch(iter(pipe_items(batches)), compute_loss=True, reduce_output="avg",
                                      bcast_loss=False, num_micro_batches=len(batches))

    def _reduce_loss(self, loss: Any) -> float | None:
        """The engine already averaged over micro-batches and data-parallel ranks; None off the last stage."""
        if not self.ctx.is_last_stage or loss is None:
            return None
        return float(loss)

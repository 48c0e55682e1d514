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
import shutil
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

from deepspeed_patches import ds_config

logger = logging.getLogger(__name__)


def check_config(cfg: RunConfig, world: int | None = None) -> None:
    """What ``--engine deepspeed`` does not support beyond RunConfig's own checks (no vpp; the lines
    are the engine spec's, ``megatron_ext/engines.py``), and the user's DeepSpeed config against the
    flags (``ds_config.plan``: one line per disagreement) when the world size is known."""
    # Model families the PipelineModule does not build are refused by RunConfig.validate
    # (models/families.py: mixture of experts).
    spec = engine("deepspeed")
    t = cfg.training
    for feature, on in (("fp16", t.fp16), ("per_token_loss", t.calculate_per_token_loss),
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
    par = cfg.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    dp = world // (tp * pp) if world and world % (tp * pp) == 0 else 1
    device = "cuda" if par.device == "cuda" or (par.device == "auto" and torch.cuda.is_available()) else "cpu"
    plan = ds_config.plan(cfg, dp, device_type=device)
    check_plan(cfg, plan)


def check_plan(cfg: RunConfig, plan: "ds_config.DeepSpeedPlan") -> None:
    """What runs on DeepSpeed's optimizers and its plain engine, and what does not yet (by name)."""
    ext = cfg.extensions
    if plan.engine == "plain":
        where = f"DeepSpeed's plain engine (ZeRO-{plan.zero_stage}, one pipeline stage)"
        for on, what in ((ext["squeeze"].squeeze, "--squeeze (it fills pipeline bubbles; this engine has none)"),
                         (ext["timeline"].timeline or ext["timeline"].timeline_out is not None,
                          "--timeline (it records the pipeline engine's instructions)"),
                         (ext["resihp"].resihp, "--resihp (its detector reads pipeline timelines)")):
            if on:
                raise ConfigError(f"{what} is not run on {where}: use --pipeline-model-parallel-size > 1 with "
                                  "ZeRO-0 or ZeRO-1")
    if plan.deepspeed_optimizer and ext["ft"].ft_on_stop == "continue":
        raise ConfigError(f"--ft-on-stop continue is not run on DeepSpeed's ZeRO-{plan.zero_stage}"
                          f"{' bf16' if plan.bf16 else ''} optimizer yet: a lost rank's optimizer partition is held "
                          "nowhere else, and the live re-layout moves a plain optimizer's per-parameter state; use "
                          "--ft-on-stop abort (resume from the checkpoint) or ZeRO-0 in fp32")
    if plan.writes_deepspeed_checkpoints and cfg.checkpoint.ckpt_format == "megatron_ext":
        raise ConfigError(f"--ckpt-format megatron_ext cannot hold DeepSpeed's ZeRO-{plan.zero_stage} optimizer "
                          "state: drop it (this run writes DeepSpeed's checkpoints)")


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
        cfg, ctx = self.cfg, self.ctx
        self.plan = ds_config.plan(cfg, ctx.layout.dp, device_type=ctx.device.type)
        check_plan(cfg, self.plan)
        if ctx.rank == 0 and not getattr(self, "_plan_said", False):
            self._plan_said = True
            for note in self.plan.notes:
                logger.info("%s", note)
            if self.plan.writes_deepspeed_checkpoints and cfg.checkpoint.save and cfg.checkpoint.ckpt_format != "deepspeed":
                logger.info("--save writes DeepSpeed checkpoints (global_stepN/, latest): the ZeRO-%d optimizer's "
                            "state is DeepSpeed's", self.plan.zero_stage)
        _tensor_parallel_on_cpu(ctx.layout.tp, ctx.device)
        self._voted = False
        before = set(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else set()
        if self.plan.engine == "plain":
            self._build_plain()
        else:
            self._build_pipeline()
        if dist.is_initialized():
            self._engine_groups = [g for g in dist.distributed_c10d._world.pg_map if g not in before]
        if self.plan.scheduler_from_config:
            self.scheduler = EngineScheduler(self.engine)
        else:
            self.scheduler = build_scheduler(self.optimizer, self.cfg.training)

    def _vocab(self) -> int:
        cfg = self.cfg
        return model_vocab_size(cfg, self.splits.tokenizer.vocab_size, self.ctx.layout.tp,
                                ckpt.embedding_rows(cfg.checkpoint.load))

    def _flags_adamw(self) -> dict[str, Any]:
        t = self.cfg.training
        return dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay)

    def _config_adamw(self) -> dict[str, Any]:
        """The config optimizer's Adam settings, as torch's AdamW takes them (ClippedAdamW)."""
        params = self.plan.config["optimizer"].get("params", {})
        out = self._flags_adamw()
        for key in ("lr", "eps", "weight_decay"):
            if key in params:
                out[key] = float(params[key])
        if "betas" in params:
            out["betas"] = tuple(float(b) for b in params["betas"])
        return out

    def _initialize(self, model: Any, **kwargs: Any) -> None:
        """``deepspeed.initialize`` with the plan's config: DeepSpeed's optimizer (ZeRO, bf16, or the
        plain engine) built from the config's section, or the Megatron flags' AdamW handed over."""
        import deepspeed

        plan = self.plan
        if not plan.deepspeed_optimizer:
            self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=plan.config,
                                                        **kwargs)
            return
        groups = _param_groups(list(model.parameters()))
        client = None if plan.optimizer_from_config else torch.optim.AdamW(groups, **self._flags_adamw())
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=client, model_parameters=groups if client is None else None, config=plan.config,
            **kwargs)
        # The commit vote (--ft-on-stop) sits between the norm and the first update of the iteration:
        # the wrapped optimizer's step runs once per parameter group after ZeRO's norm and clipping.
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        inner.register_step_pre_hook(lambda *_: self._vote_once())
        inner.register_step_post_hook(lambda *_: self.update_applied())

    def _vote_once(self) -> None:
        if not self._voted:
            self._voted = True
            self.commit_update()
            self.mark_progress("the optimizer step")

    def _build_pipeline(self) -> None:
        from deepspeed_patches.engine import EventPipelineEngine
        from deepspeed_patches.gpt import build_gpt_pipeline, norm_params, sequence_parallel_params

        cfg, ctx, t = self.cfg, self.ctx, self.cfg.training
        tp = ctx.layout.tp
        self.model = build_gpt_pipeline(cfg.model, vocab_size=self._vocab(), num_stages=ctx.layout.pp, seed=t.seed,
                                        std=cfg.model.init_method_std, stage_layers=ctx.layout.stage_layers,
                                        tensor_parallel=tp, sequence_parallel=cfg.parallel.sequence_parallel)
        grid = self.model._grid
        got = (grid.get_stage_id(), grid.get_data_parallel_rank(), grid.get_slice_parallel_rank())
        if got != (ctx.coord.pp, ctx.coord.dp, ctx.coord.tp):  # grid and Layout disagree: groups would be wrong
            raise RuntimeError(f"rank {ctx.rank}: DeepSpeed grid (stage, dp, tp) {got} != layout {ctx.coord}")
        if not self.plan.deepspeed_optimizer:
            sp = sequence_parallel_params(self.model)
            adamw = self._config_adamw() if self.plan.optimizer_from_config else self._flags_adamw()
            # the norm sums over one replica (every stage and TP rank: DeepSpeed's model-parallel group)
            self.optimizer = ClippedAdamW(list(self.model.parameters()), norm_params=norm_params(self.model),
                                          norm_group=grid.get_model_parallel_group() if tp > 1 else
                                          grid.get_pipe_parallel_group(),
                                          sequence_parallel=(sp, grid.get_slice_parallel_group()) if sp else None,
                                          norm_device=distributed.collective_device(ctx), clip_grad=self.plan.clip,
                                          before_update=self.commit_update, after_update=self.update_applied,
                                          **adamw)
        self._initialize(self.model)
        if not isinstance(self.engine, EventPipelineEngine):
            raise RuntimeError(f"deepspeed.initialize built {type(self.engine).__name__}, not EventPipelineEngine: "
                               "call deepspeed_patches.apply() first")

    def _build_plain(self) -> None:
        from deepspeed.utils import set_z3_leaf_modules

        from deepspeed_patches.gpt import build_gpt_model, z3_leaf_classes

        cfg, ctx, t = self.cfg, self.ctx, self.cfg.training
        self.model = build_gpt_model(cfg.model, vocab_size=self._vocab(), seed=t.seed, std=cfg.model.init_method_std,
                                     tensor_parallel=ctx.layout.tp)
        grid = self.model._grid
        got = (grid.get_data_parallel_rank(), grid.get_slice_parallel_rank())
        if got != (ctx.coord.dp, ctx.coord.tp):
            raise RuntimeError(f"rank {ctx.rank}: DeepSpeed grid (dp, tp) {got} != layout {ctx.coord}")
        if self.plan.zero_stage == 3:
            ds_config.check_zero3_buckets(self.plan, sum(p.numel() for p in self.model.parameters()), ctx.device.type)
            set_z3_leaf_modules(self.model, z3_leaf_classes())
        self.model.to(ctx.device)
        self._initialize(self.model, mpu=grid)

    def prepare_schedule(self) -> None:
        pass  # the engine builds its TrainSchedule every iteration

    @property
    def schedule_name(self) -> str:
        return "deepspeed"

    def install_recorder(self, recorder: Any) -> RecorderHooks:
        """The engine records its own instructions (``EventPipelineEngine``): attach the recorder."""
        if self.plan.engine == "plain":
            raise ConfigError("DeepSpeed's plain engine records no pipeline events: the extensions that read them "
                              "need --pipeline-model-parallel-size > 1 (ZeRO-0 or ZeRO-1)")
        self.engine.attach_recorder(recorder)

        def uninstall() -> None:
            # The recorder keeps the last iteration's events: record() still works after the run.
            if self.engine is not None:
                self.engine.attach_recorder(None)

        return RecorderHooks(new_iteration=lambda: None, uninstall=uninstall)

    def _num_parameters(self) -> int:
        # ZeRO-3 partitions every parameter: ds_numel is its whole size
        return sum(getattr(p, "ds_numel", p.numel()) for p in self.model.parameters())

    def layout_name(self) -> str:
        lay = self.ctx.layout
        zero = f" zero{self.plan.zero_stage}" if self.plan.zero_stage else ""
        kind = " plain" if self.plan.engine == "plain" else ""
        return f"deepspeed{kind}{zero}{' bf16' if self.plan.bf16 else ''} " \
               f"{f'tp{lay.tp}' if lay.tp > 1 else ''}pp{lay.pp}dp{lay.dp}"

    # --- checkpoints: DeepSpeed's own format (global_stepN/, latest) ---------------------------
    def writes_deepspeed_checkpoints(self) -> bool:
        return self.plan.writes_deepspeed_checkpoints or self.cfg.checkpoint.ckpt_format == "deepspeed"

    def _save_checkpoint(self) -> str:
        if not self.writes_deepspeed_checkpoints():
            return super()._save_checkpoint()
        save_dir, it = self.cfg.checkpoint.save, self.iteration
        account = [self.wall.to_state(it)]
        if dist.is_initialized() and self.ctx.world_size > 1:
            dist.broadcast_object_list(account, src=0)
        # Megatron-DeepSpeed's client state keeps the iteration at the top; the rest is this run's.
        client = {"iteration": it, "megatron_ext": {
            "consumed_samples": self.train_stream.consumed_samples, "layout": self.layout_dict(),
            "scheduler": None if self.plan.scheduler_from_config else self.scheduler.state_dict(),
            "ettr": account[0], "config": self.cfg.flat()}}
        client["universal_checkpoint_info"] = self._universal_info()
        self.saving = True
        self.mark_progress("a checkpoint save", long=True)
        tag = f"global_step{it}"
        # DeepSpeed writes every rank's files, then (after a barrier) rank 0 writes ``latest``.
        self.engine.save_checkpoint(save_dir, tag=tag, client_state=client)
        self.fault_point("save")
        keep = self.cfg.checkpoint.keep_last
        if keep and self.ctx.rank == 0:
            steps = sorted((int(d[len("global_step"):]), d) for d in os.listdir(save_dir)
                           if d.startswith("global_step") and d[len("global_step"):].isdigit())
            for _, old in steps[:-keep]:
                shutil.rmtree(os.path.join(save_dir, old), ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()
        self.saving = False
        self.mark_progress("the checkpoint saved")
        return os.path.join(save_dir, tag)

    def _check_universal(self, where: str) -> None:
        """Every parameter of this rank has its state in the universal checkpoint (``zero/<name>/``),
        on every rank, before DeepSpeed reads any: the names are the engine's (the pipeline engine's
        ``3.linear_qkv.weight`` is the plain engine's ``layer002.linear_qkv.weight``)."""
        missing = [n for n, _ in self.model.named_parameters() if not os.path.isdir(os.path.join(where, "zero", n))]
        problem = None
        if missing:
            have = sorted(os.listdir(os.path.join(where, "zero")))[:3]
            problem = (f"{where}: no state for {missing[0]} ({len(missing)} parameters of rank {self.ctx.rank} "
                       f"missing; it holds {', '.join(have)}, ...): a universal checkpoint loads into the engine "
                       "that wrote it (the pipeline engine's and the plain engine's parameter names differ)")
        problems = [problem]
        if dist.is_initialized() and self.ctx.world_size > 1:
            problems = [None] * self.ctx.world_size
            dist.all_gather_object(problems, problem)
        first = next((p for p in problems if p), None)
        if first:
            raise ckpt.CheckpointError(first)

    def _universal_info(self) -> dict[str, Any]:
        """DeepSpeed's ``universal_checkpoint_info`` of the whole model (collective: every rank's
        parameters, by exact name), so that ``ds_to_universal`` merges TP slices and pipeline copies
        (``gpt.universal_patterns``)."""
        import re

        from deepspeed_patches.gpt import universal_patterns

        mine = universal_patterns(self.model)
        everyone = [mine]
        if dist.is_initialized() and self.ctx.world_size > 1:
            everyone = [None] * self.ctx.world_size
            dist.all_gather_object(everyone, mine)
        merged = {k: sorted({n for part in everyone for n in part[k]}) for k in mine}
        return {k: [f"^{re.escape(n)}$" for n in v] for k, v in merged.items() if v}

    def load_checkpoint(self, path: str, *, finetune: bool = False, load_optim: bool = True,
                        load_rng: bool = True) -> None:
        tag = ckpt.deepspeed_tag(path)
        if self.plan.universal:
            tag = _universal_tag(path, self.cfg.checkpoint.ckpt_step if path == self.cfg.checkpoint.load else None)
        if tag is None:
            if self.plan.deepspeed_optimizer:
                self._load_weights_into_deepspeed(path, finetune=finetune)
                return
            super().load_checkpoint(path, finetune=finetune, load_optim=load_optim, load_rng=load_rng)
            return
        load_dir = path if self.plan.universal or os.path.isfile(os.path.join(path, ckpt.LATEST)) \
            else os.path.dirname(os.path.normpath(path))
        step = self.cfg.checkpoint.ckpt_step if path == self.cfg.checkpoint.load else None
        if step is not None and not self.plan.universal:
            tag = f"global_step{step}"
        if not os.path.isdir(os.path.join(load_dir, tag)):
            raise ckpt.CheckpointError(f"{load_dir}: no DeepSpeed checkpoint {tag}/ (its latest names "
                                       f"{ckpt.deepspeed_tag(load_dir)})")
        if self.plan.universal:
            self._check_universal(os.path.join(load_dir, tag))
        load_optim = load_optim and not finetune
        _, client = self.engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=load_optim,
                                                load_lr_scheduler_states=load_optim,
                                                load_module_only=not load_optim)
        if client is None:
            raise ckpt.CheckpointError(f"{os.path.join(load_dir, tag)}: DeepSpeed found no checkpoint to load")
        ours = client.get("megatron_ext") or {}
        if finetune:
            self.scheduler.step(0)
            if self.ctx.rank == 0:
                logger.info("fine-tuning from the weights of %s: iteration 0, a fresh optimizer and schedule",
                            os.path.join(load_dir, tag))
            return
        iteration = client.get("iteration")
        self.iteration = int(iteration if iteration is not None else tag[len("global_step"):].split("_")[0])
        # Megatron-DeepSpeed keeps the consumed samples in its args; a plain DeepSpeed save has neither
        args = client.get("args")
        consumed = ours.get("consumed_samples", getattr(args, "consumed_train_samples", None))
        self.train_stream.consumed_samples = int(consumed if consumed is not None
                                                 else self.iteration * self.cfg.training.global_batch_size)
        if path == self.cfg.checkpoint.load:
            self.wall.resume(ours.get("ettr"))
        if load_optim and ours.get("scheduler") and not self.plan.scheduler_from_config:
            self._warn_schedule_change(ours["scheduler"])
            self.scheduler.load_state_dict(ours["scheduler"])
        self.scheduler.step(0)
        if self.ctx.rank == 0:
            logger.info("resumed from DeepSpeed checkpoint %s at iteration %d (%d samples consumed)%s",
                        os.path.join(load_dir, tag), self.iteration, self.train_stream.consumed_samples,
                        "" if load_optim else " with a fresh optimizer and schedule")

    def _load_weights_into_deepspeed(self, path: str, *, finetune: bool) -> None:
        """A checkpoint of the project's formats (or Megatron-LM's) under DeepSpeed's ZeRO optimizer:
        the weights and the position, with a fresh optimizer (its state there is a plain optimizer's,
        per parameter). ZeRO-1/2 and bf16 keep fp32 copies of the weights: they are refreshed."""
        if self.plan.zero_stage == 3:
            raise ckpt.CheckpointError(f"{path}: ZeRO-3 partitions the weights this checkpoint would be loaded into; "
                                       "load it at ZeRO-0/1/2 and save a DeepSpeed checkpoint first")
        if self.ctx.rank == 0 and not finetune:
            logger.warning("%s is not a DeepSpeed checkpoint: its weights and position are loaded, the ZeRO-%d "
                           "optimizer starts fresh", path, self.plan.zero_stage)
        super().load_checkpoint(path, finetune=finetune, load_optim=False, load_rng=True)
        refresh = getattr(self.optimizer, "refresh_fp32_params", None)
        if refresh is not None:
            refresh()

    def _train_batches(self, batches: list[dict[str, Any]]) -> tuple[Any, bool, float | None]:
        self._voted = False
        if self.plan.engine == "plain":
            return self._plain_train(batches)
        loss = self.engine.train_batch(data_iter=iter(pipe_items(batches)))
        if self.plan.deepspeed_optimizer:
            return loss, self.engine.was_step_applied(), _as_float(self.engine.get_global_grad_norm())
        return loss, not self.optimizer.overflow, self.optimizer.last_grad_norm

    def _plain_train(self, batches: list[dict[str, Any]]) -> tuple[Any, bool, float | None]:
        """One iteration on DeepSpeed's plain engine: forward and backward per micro-batch; the engine
        accumulates (its gradient_accumulation_steps is the micro-batch count) and steps at the last."""
        engine, device = self.engine, self.ctx.device
        total = torch.zeros((), dtype=torch.float64)
        for i, b in enumerate(batches):
            self.microbatch = i
            self.mark_progress("a micro-batch's forward")
            loss = engine(*(b[k].to(device) for k in ("tokens", "position_ids", "labels", "loss_mask")))
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        return self._dp_mean(total / len(batches)), engine.was_step_applied(), \
            _as_float(engine.get_global_grad_norm())

    def _dp_mean(self, value: torch.Tensor) -> float:
        """The mean over data-parallel replicas (the loss the log line shows, as the pipeline engine's)."""
        group = self.model._grid.get_data_parallel_group()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            t = value.to(distributed.collective_device(self.ctx), torch.float64)
            dist.all_reduce(t, group=group)
            value = t.cpu() / dist.get_world_size(group)
        return float(value)

    def _eval_batches(self, batches: list[dict[str, Any]]) -> Any:
        if self.plan.engine == "plain":
            device = self.ctx.device
            total = sum(float(self.engine(*(b[k].to(device) for k in ("tokens", "position_ids", "labels",
                                                                       "loss_mask"))))
                        for b in batches)
            return self._dp_mean(torch.tensor(total / len(batches), dtype=torch.float64))
        return self.engine.eval_batch(iter(pipe_items(batches)), compute_loss=True, reduce_output="avg",
                                      bcast_loss=False, num_micro_batches=len(batches))

    def _reduce_loss(self, loss: Any) -> float | None:
        """The engine already averaged over micro-batches and data-parallel ranks; None off the last stage."""
        if self.plan.engine == "plain":
            return None if loss is None else float(loss)
        if not self.ctx.is_last_stage or loss is None:
            return None
        return float(loss)


def _universal_tag(path: str, step: int | None) -> str:
    """The universal checkpoint of save directory ``path``: ``global_step{step}_universal`` for
    ``--ckpt-step``, else what its ``latest_universal`` names (ds_to_universal writes it)."""
    if step is not None:
        tag = f"global_step{step}_universal"
    else:
        latest = os.path.join(path, "latest_universal")
        if not os.path.isfile(latest):
            raise ckpt.CheckpointError(f"{path}: --universal-checkpoint, but no latest_universal there: convert a "
                                       "checkpoint first (python -m deepspeed.checkpoint.ds_to_universal "
                                       f"--input_folder {path}/global_stepN --output_folder "
                                       f"{path}/global_stepN_universal)")
        with open(latest, encoding="utf-8") as fh:
            tag = fh.read().strip()
    if not os.path.isdir(os.path.join(path, tag, "zero")):
        raise ckpt.CheckpointError(f"{os.path.join(path, tag)}: not a universal checkpoint (no zero/ directory)")
    return tag


def _as_float(value: Any) -> float | None:
    if value is None:
        return None
    return float(value.item() if isinstance(value, torch.Tensor) else value)


class EngineScheduler:
    """The config's DeepSpeed schedule (its ``scheduler`` section) behind the Trainer's scheduler calls:
    the engine steps it after every applied update, so ``step`` here does nothing."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def step(self, increment: int = 1) -> None:
        del increment

    def state_dict(self) -> dict[str, Any]:
        return self.engine.lr_scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sched = self.engine.lr_scheduler
        sched.load_state_dict(state)
        # DeepSpeed's schedules set the groups' rate only when stepped: re-apply the restored step's
        # (a resume from the project's formats restores no optimizer param groups).
        sched.step(sched.last_batch_iteration)

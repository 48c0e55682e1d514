"""The training loop: megatron-core's pipeline schedule over this rank's micro-batches.

``Trainer`` owns the runtime objects (model, optimizer, scheduler, data streams) as attributes, so
extensions reach them through the trainer and a layout change can replace them. It implements the
fault-tolerance core's protocol (``ft/protocol.py``): the engine hooks a subclass for another engine
overrides, and the parts a layout change carries over. With a core (``ft``) the loop meets it at
three points: the start of a step, the commit vote before the update, and a failure.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from megatron_ext.config.run import RunConfig
from megatron_ext.config.samples import schedule_steps
from megatron_ext.data.dataset import MicroBatchStream, build_splits, split_sizes
from megatron_ext.errors import UserError
from megatron_ext.ft import transaction
from megatron_ext.ft.core import FaultTolerance, StepRecord
from megatron_ext.ft.errors import JobFailed, RankEnded, RestartNeeded
from megatron_ext.ft.target import KNOBS, LayoutTarget, check
from megatron_ext.runtime import checkpoint as ckpt
from megatron_ext.runtime import distributed, rundir
from megatron_ext.runtime import ettr
from megatron_ext.runtime.distributed import DistContext
from megatron_ext.runtime.exits import ExitWatch
from megatron_ext.runtime.extension import Extension, IterationMetrics
from megatron_ext.runtime.housekeeping import Housekeeping
from megatron_ext.runtime.model import ModelBundle, build_model, count_parameters, padded_vocab_size, stage_loss_func
from megatron_ext.runtime.runlog import RunLog
from megatron_ext.runtime.optimizer import build_optimizer, build_scheduler, scheduler_settings

logger = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: RunConfig, ctx: DistContext, extensions: Iterable[Extension] = (),
                 ft: FaultTolerance | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.extensions = list(extensions)
        self.ft = ft
        """The fault-tolerance core (``ft/core.py``), or None (nothing survives a lost rank)."""
        self.iteration = 0
        self.log = RunLog(cfg.logging, cfg.training.train_iters, config=cfg.flat(), save=cfg.checkpoint.save)
        self.forward_backward_func = None
        self.last_batches: list[dict[str, Any]] = []
        self.model: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.train_stream: MicroBatchStream | None = None
        self.layout_changes: list[dict[str, Any]] = []   # the ``layout_change`` rows of this process
        self.layout_change: transaction.Change | None = None   # the one being applied
        self._pending_layout: tuple[LayoutTarget, str] | None = None
        self.step_record = StepRecord(iteration=0, consumed_samples=0)   # the iteration in flight
        self.step_timers: dict[str, float] = {}   # --timing-log-level 1: the phases of the iteration in flight
        self.saving = False
        self.extensions_set_up = False
        self.exit_watch = ExitWatch(cfg.checkpoint, self._agree_max)
        self.housekeeping = Housekeeping(cfg.training, ctx.device)
        """--manual-gc and --empty-unused-memory-level: the same collection points on every rank."""
        """Why the ranks leave early (``--exit-signal-handler``, ``--exit-duration-in-mins``,
        ``--exit-interval``): asked after each iteration, the same answer on every rank."""
        # Fault injection points inside an iteration: callables (point, iteration) -> None.
        self.fault_points: list[Callable[[str, int], None]] = []
        self.microbatch = 0  # the forward's micro-batch within the iteration (progress marks)
        self.wall = ettr.WallAccount()  # where this process's wall time goes (runtime/ettr.py)
        self._accounted_s = time.time()  # the wall clock up to which ``wall`` has charged the time

    @property
    def relayouts(self) -> list[dict[str, Any]]:
        """The planned re-layouts applied in this process (fail-slow plans, permutations)."""
        return [c for c in self.layout_changes if c["cause"] == "relayout"]

    # --- setup -----------------------------------------------------------------------------
    def _build_splits(self) -> None:
        cfg = self.cfg
        t, lg = cfg.training, cfg.logging
        self.splits = build_splits(
            cfg.data, cfg.tokenizer, seq_length=cfg.model.seq_length, seed=t.seed,
            sizes=split_sizes(t.train_iters, t.global_batch_size, lg.eval_interval, lg.eval_iters))

    def setup_spare(self) -> "Trainer":
        """A process the launcher started again in place of a lost one: the data, no model yet.
        ``run`` first waits for a round that takes it in; the layout change that does builds the
        model, receives its state from the holders and sets the extensions up."""
        self._build_splits()
        self.exit_watch.install()
        return self

    def setup(self) -> "Trainer":
        cfg, ctx = self.cfg, self.ctx
        t, lg = cfg.training, cfg.logging
        self._build_splits()
        self.build_model()
        self.build_streams()
        ck = cfg.checkpoint
        fresh = rundir.fresh_start(save=ck.save, load=ck.load)
        source, finetune = self.checkpoint_to_load()
        if fresh and source is None and ctx.rank == 0:
            logger.info("--load %s holds no checkpoint yet: starting from scratch (it is also --save: the next "
                        "launch of this line resumes from what this one saves)", ck.load)
        if source is not None:
            self.load_checkpoint(source, finetune=finetune, load_optim=ck.load_optim and not cfg.training.skip_train,
                                 load_rng=ck.load_rng)
        else:
            self.scheduler.step(0)
        self.prepare_schedule()
        if ctx.rank == 0:
            logger.info("layout %s (world %d) on %s/%s; %d parameters on rank 0; data %s; %d micro-batches "
                        "of %d per iteration", self.layout_name(), ctx.world_size, ctx.device, ctx.backend,
                        self._num_parameters(), self.splits.source, self.train_stream.num_microbatches,
                        t.micro_batch_size)
        if ctx.is_logging_rank and lg.metrics_file and cfg.checkpoint.load:
            rundir.truncate_metrics(lg.metrics_file, self.iteration)
        self.exit_watch.install()
        self.log.first_iteration = self.iteration + 1
        if lg.log_throughput:
            from megatron_ext.models.flops import model_iteration_flops

            vocab = padded_vocab_size(self.splits.tokenizer.vocab_size, ctx.layout.tp)
            self.log.flops_per_sample = model_iteration_flops(cfg, vocab, global_batch=1)
        # On a resume, TensorBoard drops the events a crashed run wrote after the checkpoint.
        self.open_outputs(purge_step=self.iteration + 1 if cfg.checkpoint.load else None)
        for ext in self.extensions:
            ext.setup(self)
        self.extensions_set_up = True
        if self.ft is not None:
            self.ft.arm(self)
        return self

    def build_streams(self, consumed_samples: int = 0) -> None:
        """This rank's share of each global batch (its data-parallel index), from ``consumed_samples``."""
        cfg, ctx = self.cfg, self.ctx
        t, d, lg = cfg.training, cfg.data, cfg.logging
        packing = None
        if d.doc_length_dist:
            from megatron_ext.data.packing import LengthDistribution

            packing = LengthDistribution.parse(d.doc_length_dist)
        stream = dict(global_batch=t.global_batch_size, micro_batch=t.micro_batch_size, dp_rank=ctx.coord.dp,
                      dp_size=ctx.layout.dp, eod=self.splits.tokenizer.eod, packing=packing, seed=t.seed)
        self.train_stream = MicroBatchStream(self.splits.train, **stream,
                                             replica_microbatches=ctx.layout.replica_microbatches)
        self.train_stream.consumed_samples = consumed_samples
        self.train_stream.global_batch = t.global_batch_at(consumed_samples)   # where a ramp stands
        self.valid_stream = None
        if self.splits.valid is not None and len(self.splits.valid) > 0 and lg.eval_iters > 0:
            self.valid_stream = MicroBatchStream(self.splits.valid, **stream,
                                                 replica_microbatches=ctx.layout.replica_microbatches)

    # --- the run's outputs (runtime/runlog.py) -------------------------------------------------
    @property
    def history(self) -> list[dict[str, Any]]:
        """The rows this process kept (the logging rank's: train, valid, layout changes, ...)."""
        return self.log.history

    @history.setter
    def history(self, rows: list[dict[str, Any]]) -> None:
        self.log.history = rows

    @property
    def tensorboard(self) -> Any:
        """Where an extension writes scalars on the logging rank (``add_scalar(tag, value, step)``: to
        TensorBoard and Weights & Biases, ``runtime/scalars.py``); None elsewhere, or without either."""
        return self.log.tensorboard

    def open_outputs(self, purge_step: int | None = None) -> None:
        if self.ctx.is_logging_rank:
            self.log.world_size = self.ctx.world_size   # TFLOP/s per device: the devices of this layout
            self.log.open(purge_step=purge_step)

    def close_outputs(self, finish: bool = False) -> None:
        """Close the output files (``finish``: the run ends in this process, Weights & Biases too)."""
        self.log.close(finish=finish)

    def rewind_outputs(self, iteration: int) -> None:
        self.log.rewind(iteration)

    def record(self, kind: str, payload: dict[str, Any]) -> None:
        if kind == "layout_change":
            self.layout_changes.append(payload)
        self.log.record(kind, payload)

    # --- layout changes ---------------------------------------------------------------------
    def request_layout(self, target: LayoutTarget, *, reason: str = "") -> None:
        """Ask for a re-layout after the current iteration (extensions call this from
        ``after_iteration``, on every rank with the same target: it is collective)."""
        self._pending_layout = (target, reason)

    def _apply_pending_layout(self) -> dict[str, Any] | None:
        pending, self._pending_layout = self._pending_layout, None
        if pending is None:
            return None
        target, reason = pending
        with self._charged("pause"):
            return self.change_layout(target, reason=reason)

    @contextlib.contextmanager
    def _charged(self, cause: str):
        """Charge the wall time of the block to ``cause`` (``runtime/ettr.py``)."""
        start = time.time()
        try:
            yield
        finally:
            self._accounted_s = time.time()
            self.wall.charge(cause, self._accounted_s - start)

    def relayout(self, *, tp: int, pp: int, vpp: int | None = None, stage_layers: list[int] | None = None,
                 replica_microbatches: list[int] | None = None, rank_order: list[int] | None = None) -> dict[str, Any]:
        """Collective, at an iteration boundary: continue this run under another TP x PP (x DP) layout,
        and with ``rank_order`` the ranks in another order (rank ``i`` of the new layout is the
        process that is rank ``rank_order[i]`` now), in the same processes without a restart. Model
        and optimizer state move to their new owners point to point; bad input raises
        ``UserError`` before anything changes. Returns the ``layout_change`` row (layouts, members,
        this rank's bytes, seconds)."""
        members = list(self.ctx.members)
        if rank_order is not None:
            order = [int(r) for r in rank_order]
            if sorted(order) != list(range(len(members))):
                raise UserError(f"relayout rank_order {order}: expected each rank 0..{len(members) - 1} once (every "
                                "rank of the job keeps a place; only a fail-stop leaves ranks out)")
            members = [members[r] for r in order]
        try:
            target = LayoutTarget(tp=tp, pp=pp, members=tuple(members), vp=vpp or 1,
                                  stage_layers=tuple(stage_layers) if stage_layers else None,
                                  replica_microbatches=tuple(replica_microbatches) if replica_microbatches else None)
        except ValueError as exc:  # the layout value refuses a shape the ranks cannot form
            raise UserError(f"relayout: {exc}") from None
        return self.change_layout(target, reason="")

    def change_layout(self, target: LayoutTarget, *, reason: str = "") -> dict[str, Any]:
        """Collective: apply ``target`` with every rank kept (``ft/transaction.py``), through the
        fault-tolerance core where there is one, so that a loss in the middle is recovered."""
        self.check_target(target)
        check(target, cfg=self.cfg, members=self.ctx.members, knobs=self.relayout_knobs, membership_may_change=False)
        new_world = tuple(target.members) != tuple(self.ctx.members)
        if self.ft is not None:
            info = self.ft.change_layout(self, target, reason=reason)
        else:
            store_addr = distributed.rendezvous_address(self.ctx) if new_world else None
            if new_world and store_addr is None:
                raise UserError(NO_STORE)
            held = transaction.HeldState.capture(self)
            from megatron_ext.ft.core import planned_change

            change = planned_change(self, target, reason=reason, held=held,
                                    generation=self.ctx.generation + 1 if new_world else None, store_addr=store_addr)
            info = transaction.apply(self, change, held)
        self.layout_change = None
        return info

    # Engine hooks: a subclass for another engine (deepspeed_patches/trainer.py) overrides these and
    # keeps data, LR schedule, checkpoints, logging and extensions.
    relayout_knobs = KNOBS
    """What ``relayout`` can change live on this engine (``ft.target.KNOBS``): TP/PP sizes, layers
    per stage, micro-batches per replica, the rank order (the ResiHP planner searches only these)."""

    def check_target(self, target: LayoutTarget) -> None:
        """Raise ``UserError`` for a target this engine cannot re-lay out to (before anything changes)."""

    def layout_context(self, target: LayoutTarget, *, generation: int | None, store_addr: str | None) -> DistContext:
        """Process groups of ``target``, the old ones destroyed: on the same default group, or (a
        ``generation``) a new default group over ``target.members`` meeting at ``store_addr``."""
        ep = self.cfg.parallel.expert_model_parallel_size
        if generation is None:
            return distributed.relayout(self.ctx, tp=target.tp, pp=target.pp, vpp=self.ctx.vpp, layout=target,
                                        seed=self.cfg.training.seed, ep=ep)
        return distributed.regroup(self.ctx, layout=target, seed=self.cfg.training.seed, ep=ep, store_addr=store_addr,
                                   generation=generation)

    def drop_gradients(self) -> None:
        """Forget the gradients of an iteration that is rolled back."""
        self.model.zero_grad_buffer()

    def drop_model(self) -> None:
        """A rank that becomes a spare lets go of its model and its process groups."""
        if self.model is not None and self.extensions_set_up:
            for ext in self.extensions:
                ext.detach(self)
        self.close_outputs(finish=True)
        self.model = self.optimizer = self.scheduler = None
        distributed.leave(self.ctx)

    def build_model(self) -> None:
        """Set ``self.model``, ``self.optimizer`` and ``self.scheduler``."""
        self.model: ModelBundle = build_model(self.cfg, self.ctx, self.splits.tokenizer.vocab_size,
                                              saved_vocab_rows=ckpt.embedding_rows(self.checkpoint_to_load()[0]))
        params = list(self.model.parameters())
        self.optimizer = build_optimizer(params, self.cfg.training, self.ctx.device.type == "cuda", self.model.chunks,
                                         pgs=self.ctx.pgs)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.training)

    def prepare_schedule(self) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.forward_backward_func = get_forward_backward_func()

    @property
    def schedule_name(self) -> str:
        """The pipeline schedule this engine runs (``pipeline/schedule_orders.py``)."""
        return "interleaved" if self.ctx.vpp else "1f1b"

    def install_recorder(self, recorder: Any) -> "RecorderHooks":
        """Record this layout's pipeline events into ``recorder`` (an ``EventRecorder``): megatron's
        schedule and p2p calls wrapped from outside, and the optimizer step and the gradient
        finalisation timed. The handle's ``new_iteration()`` runs before each iteration and
        ``uninstall()`` undoes it all (before a layout change, at the end)."""
        from megatron_ext.pipeline.events import Phase
        from megatron_ext.pipeline.megatron_hooks import MegatronPipelineHooks, wrap_phase

        hooks = MegatronPipelineHooks(recorder, self.model.chunks).install()
        self.optimizer.step = wrap_phase(recorder, self.optimizer.step, Phase.OPTIMIZER)
        tconf = self.model.config
        finalize = tconf.finalize_model_grads_func
        tconf.finalize_model_grads_func = wrap_phase(recorder, finalize, Phase.GRAD_REDUCE)

        def uninstall() -> None:
            hooks.uninstall()
            if self.optimizer is not None:
                self.optimizer.__dict__.pop("step", None)
            tconf.finalize_model_grads_func = finalize  # installed again, it would wrap its own wrapper

        return RecorderHooks(new_iteration=hooks.new_iteration, uninstall=uninstall)

    def _num_parameters(self) -> int:
        return count_parameters(self.model.chunks)

    def layout_name(self) -> str:
        return self.ctx.layout.name

    # --- one iteration ---------------------------------------------------------------------
    def mark_progress(self, point: str, iteration: int | None = None, *, long: bool = False) -> None:
        """The training thread got to ``point``: the fault-tolerance core's hang watch
        (``ft/liveness.py``, ``Progress``) names a rank without progress as hung. A clock read."""
        if self.ft is not None:
            self.ft.progress.mark(point, iteration, long=long)

    def _forward_step(self, data_iterator, model):
        self.microbatch += 1
        self.mark_progress(f"the forward of micro-batch {self.microbatch}")
        batch = next(data_iterator)
        dev = self.ctx.device
        tokens = batch["tokens"].to(dev, non_blocking=True)
        labels = batch["labels"].to(dev, non_blocking=True)
        position_ids = batch["position_ids"].to(dev, non_blocking=True)
        mask = batch.get("attention_mask")
        output = model(tokens, position_ids, None if mask is None else mask.to(dev), labels=labels)
        per_token = self.per_token_loss
        return output, stage_loss_func(batch["loss_mask"].to(dev), per_token=per_token)

    def _run_schedule(self, batches: list[dict[str, Any]], *, forward_only: bool) -> list[dict[str, Any]]:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        chunks = self.model.chunks
        iters = [iter(batches) for _ in chunks]
        pgs = self.ctx.pgs
        return self.forward_backward_func(
            forward_step_func=self._forward_step,
            data_iterator=iters if len(chunks) > 1 else iters[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(batches),
            seq_length=self.cfg.model.seq_length,
            micro_batch_size=self.cfg.training.micro_batch_size,
            forward_only=forward_only,
            # The layout's groups, explicitly: the schedule takes both or neither.
            pg_collection=pgs,
            p2p_communicator=P2PCommunicator(pp_group=pgs.pp, config=self.model.config),
        )

    @property
    def per_token_loss(self) -> bool:
        """The loss is averaged over the global batch's tokens (megatron's calculate_per_token_loss):
        --calculate-per-token-loss, or uneven micro-batches per replica, whose tokens must weigh alike."""
        return self.ctx.layout.replica_microbatches is not None or self.cfg.training.calculate_per_token_loss

    def _reduce_loss(self, losses: list[dict[str, Any]]) -> float | None:
        """Mean lm loss over micro-batches and data-parallel ranks; None off the last stage."""
        if not self.ctx.is_last_stage:
            return None
        if self.per_token_loss:  # [sum, count] per micro-batch
            sums = torch.stack([d["lm loss"].float().cpu() for d in losses]).sum(0) if losses else torch.zeros(2)
            if self.ctx.layout.dp > 1:
                sums = sums.to(distributed.collective_device(self.ctx))
                dist.all_reduce(sums, group=self.ctx.pgs.dp)
            return float(sums[0] / sums[1].clamp(min=1.0))
        value = torch.stack([d["lm loss"].float().cpu() for d in losses]).mean() if losses else torch.tensor(0.0)
        if self.ctx.layout.dp > 1:
            value = value.to(distributed.collective_device(self.ctx))
            dist.all_reduce(value, group=self.ctx.pgs.dp)
            value = value / self.ctx.layout.dp
        return float(value)

    def _sync(self) -> None:
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize()

    def _train_batches(self, batches: list[dict[str, Any]]) -> tuple[Any, bool, float | None]:
        """Forward/backward over the micro-batches and the optimizer step: (losses for
        ``_reduce_loss``, update applied, gradient norm)."""
        timed = self.cfg.logging.timing_log_level >= 1
        self.model.train()
        self.model.zero_grad_buffer()
        start = time.perf_counter()
        losses = self._run_schedule(batches, forward_only=False)
        if timed:  # Megatron-LM's level-1 timers: the phases, the device synchronised at their ends
            self._sync()
            self.step_timers["forward-backward"] = time.perf_counter() - start
        start = time.perf_counter()
        applied, grad_norm = self._optimizer_step()
        if timed:
            self._sync()
            self.step_timers["optimizer"] = time.perf_counter() - start
        return losses, applied, grad_norm

    def _eval_batches(self, batches: list[dict[str, Any]]) -> Any:
        return self._run_schedule(batches, forward_only=True)

    def train_step(self) -> IterationMetrics:
        it = self.iteration + 1
        self._accounted_s = time.time()  # what came before (logging, hooks) is the account's "other"
        # What a failure in the middle needs to settle this iteration (``FaultTolerance.settle``).
        self.step_record = (self.ft.start_step(self) if self.ft is not None
                            else StepRecord(iteration=it, consumed_samples=self.train_stream.consumed_samples))
        self.mark_progress("the iteration's start", it)
        for ext in self.extensions:
            ext.before_iteration(self, it)
        self.step_timers = {}
        start = time.perf_counter()
        # --rampup-batch-size: this iteration's global batch, from the data position it starts at.
        batch = self.train_stream.global_batch = self.cfg.training.global_batch_at(self.train_stream.consumed_samples)
        self.mark_progress("the data fetch")
        self.fault_point("data")
        batches = self.train_stream.next_iteration()
        self.microbatch = 0
        self.last_batches = batches
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this update uses
        losses, applied, grad_norm = self._train_batches(batches)
        self.scheduler.step(1)
        self.step_record.scheduled = True
        self._sync()
        elapsed = time.perf_counter() - start
        self.iteration = it
        t = self.cfg.training
        metrics = IterationMetrics(
            iteration=it, loss=self._reduce_loss(losses), lr=lr,
            grad_norm=grad_norm, iter_time_s=elapsed,
            tokens_per_s=batch * self.cfg.model.seq_length / max(elapsed, 1e-9),
            consumed_samples=self.train_stream.consumed_samples, skipped=not applied,
            global_batch_size=batch, loss_scale=self._loss_scale(), timers_s=self.step_timers,
            params_norm=self.params_norm() if self.cfg.logging.log_params_norm else None,
            num_zeros_in_grad=getattr(self, "num_zeros_in_grad", None))
        for ext in self.extensions:
            ext.after_iteration(self, metrics)
        if self.ft is not None:
            self.ft.progress.iteration_done(elapsed)
        return metrics

    def params_norm(self) -> float:
        """Collective: the L2 norm of the whole model's parameters (Megatron-LM's --log-params-norm), each
        counted once: every rank sums the squares of the slices it holds as the main replica (the
        checkpoint's view, so TP shards, stages and experts add up and replicas do not), one all-reduce."""
        from megatron_ext.runtime.reshard import local_entries

        squares = torch.zeros((), dtype=torch.float64)
        for e in local_entries(self.model, main_only=True):
            squares += e.param.detach().double().pow(2).sum().cpu()
        if dist.is_initialized() and self.ctx.world_size > 1:
            t = squares.to(distributed.collective_device(self.ctx))
            dist.all_reduce(t)
            squares = t.cpu()
        return float(squares.sqrt())

    def _loss_scale(self) -> float:
        """The optimizer's loss scale (megatron's optimizers have one: 1.0 but in fp16)."""
        scale = getattr(self.optimizer, "get_loss_scale", None)
        return float(scale()) if callable(scale) else 1.0

    def fault_point(self, point: str, iteration: int | None = None) -> None:
        """Test-only fault injection (``--inject-stop RANK:ITER:POINT``): the registered hooks."""
        it = iteration if iteration is not None else self.step_record.iteration
        for hook in self.fault_points:
            hook(point, it)

    def commit_update(self) -> None:
        """Right before this rank's optimizer update: no rank updates before every rank is ready
        to (``ft/ledger.py``); raises ``RankLost`` when the iteration is abandoned."""
        self.mark_progress("the commit vote")
        self.fault_point("step")
        if self.ft is not None:
            self.ft.vote(self.step_record.iteration)

    def update_applied(self) -> None:
        self.step_record.applied = True

    def _optimizer_step(self) -> tuple[bool, float | None]:
        self.commit_update()
        self.mark_progress("the optimizer step")
        out = self.optimizer.step()
        self.update_applied()
        # megatron's optimizers (and CPUOptimizer) return (applied, grad norm, zeros in the gradient)
        self.num_zeros_in_grad = None
        if isinstance(out, tuple):
            if len(out) > 2 and self.cfg.training.log_num_zeros_in_grad and out[2] is not None:
                self.num_zeros_in_grad = int(out[2])
            return bool(out[0]), (None if out[1] is None else float(out[1]))
        return bool(out), None

    def evaluate(self) -> float | None:
        if self.valid_stream is None:
            return None
        with self._charged("evaluation"):
            return self._evaluate()

    def _evaluate(self) -> float | None:
        self.model.eval()
        losses = []
        with torch.no_grad(), self.housekeeping.validation():
            for i in range(self.cfg.logging.eval_iters):
                batches = self.valid_stream.iteration(start=i * self.cfg.training.global_batch_size)
                loss = self._reduce_loss(self._eval_batches(batches))
                if loss is not None:
                    losses.append(loss)
        self.model.train()
        return sum(losses) / len(losses) if losses else None

    # --- checkpoints -----------------------------------------------------------------------
    def layout_dict(self) -> dict[str, int]:
        lay = self.ctx.layout
        return {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "vpp": self.ctx.vpp or 1}

    def save_checkpoint(self) -> str:
        with self._charged("checkpoint"):
            return self._save_checkpoint()

    def _save_checkpoint(self) -> str:
        # The run's time account so far travels with it: a later launch resumed from it reports the
        # whole run. Rank 0's, on every rank: the checkpoint's common state is the same everywhere.
        account = [self.wall.to_state(self.iteration)]
        if dist.is_initialized() and self.ctx.world_size > 1:
            dist.broadcast_object_list(account, src=0)
        state = ckpt.TrainState(iteration=self.iteration, consumed_samples=self.train_stream.consumed_samples,
                                scheduler=self.scheduler.state_dict(), extra={"ettr": account[0]})
        self.saving = True  # a fail-stop during the save saves again after the survivors regroup
        self.mark_progress("a checkpoint save", long=True)  # as long as a collective may take
        path = ckpt.save(self.cfg.checkpoint.save, model=self.model, optimizer=self.optimizer, state=state,
                         config=self.cfg.flat(), layout=self.layout_dict(), keep_last=self.cfg.checkpoint.keep_last,
                         on_written=lambda: self.fault_point("save"), ckpt_format=self.cfg.checkpoint.ckpt_format,
                         samples_per_step=self.samples_per_scheduler_step())
        self.saving = False
        self.mark_progress("the checkpoint saved")
        return path

    def samples_per_scheduler_step(self) -> int:
        """Samples per step of this run's scheduler: the global batch where it counts iterations (a
        torch_dist checkpoint holds Megatron-LM's schedule, in samples), 1 where it counts samples."""
        from megatron_ext.config.samples import schedule_steps

        t = self.cfg.training
        return t.global_batch_size if schedule_steps(t).unit == "iterations" else 1

    def checkpoint_to_load(self) -> tuple[str | None, bool]:
        """(the checkpoint directory the run starts from, fine-tune?): --load's, or where --load holds
        none, --pretrained-checkpoint's weights (Megatron-LM's fine-tuning start); (None, False) for
        a fresh start."""
        ck = self.cfg.checkpoint
        fresh = rundir.fresh_start(save=ck.save, load=ck.load)
        if ck.pretrained_checkpoint and (ck.load is None or fresh or not ckpt.exists(ck.load)):
            return ck.pretrained_checkpoint, True
        if ck.load and not fresh:
            return ck.load, ck.finetune
        return None, False

    def load_checkpoint(self, path: str, *, finetune: bool = False, load_optim: bool = True,
                        load_rng: bool = True) -> None:
        """Resume from ``path``; ``finetune``: its weights only (iteration 0, a fresh optimizer, schedule and
        RNG); ``load_optim`` False: a fresh optimizer and schedule at the checkpoint's iteration, as
        Megatron-LM's --no-load-optim. A recovery (ft/transaction.py) loads everything."""
        load_optim, load_rng = load_optim and not finetune, load_rng and not finetune
        # Each rank verifies only the files it reads: a rank whose shard is bad must not leave the
        # others waiting in the first collective. Every rank learns the first failure and raises it.
        error = None
        try:
            step = self.cfg.checkpoint.ckpt_step if path == self.cfg.checkpoint.load else None
            state = ckpt.load(path, model=self.model, optimizer=self.optimizer, layout=self.layout_dict(),
                              load_optim=load_optim, load_rng=load_rng, step=step,
                              samples_per_step=self.samples_per_scheduler_step())
        except ckpt.CheckpointError as exc:
            error = str(exc)
        errors = [error]
        if dist.is_initialized() and dist.get_world_size() > 1:
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise ckpt.CheckpointError(first)
        if finetune:
            self.scheduler.step(0)
            if self.ctx.rank == 0:
                logger.info("fine-tuning from the weights of %s (iteration %d there): iteration 0, a fresh optimizer "
                            "and schedule", path, state.iteration)
            return
        self.iteration = state.iteration
        self.train_stream.consumed_samples = state.consumed_samples
        if path == self.cfg.checkpoint.load:  # a later launch of the same run (not a fail-stop rollback)
            self.wall.resume(state.extra.get("ettr"))
        if load_optim and state.scheduler:
            self._warn_schedule_change(state.scheduler)
            self.scheduler.load_state_dict(state.scheduler)
        elif load_optim and self.ctx.rank == 0:  # Megatron-LM's --no-save-optim saves no schedule either
            logger.warning("%s holds no learning-rate schedule: the schedule starts from its beginning", path)
        self.scheduler.step(0)  # re-applies lr/wd of the restored step to the param groups
        if self.ctx.rank == 0:
            logger.info("resumed from %s at iteration %d (%d samples consumed)%s", path, state.iteration,
                        state.consumed_samples, "" if load_optim else " with a fresh optimizer and schedule")

    def _warn_schedule_change(self, saved: dict[str, Any]) -> None:
        """On resume the checkpoint's LR schedule wins over the flags (megatron's
        use_checkpoint_opt_param_scheduler), unless ``--override-opt-param-scheduler`` (megatron's
        override_opt_param_scheduler) makes the flags' win: say which one runs when they differ."""
        t = self.cfg.training
        want = {k: v for k, v in scheduler_settings(t).items()
                if k in ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "start_wd")}
        changed = {k: (saved[k], v) for k, v in want.items() if k in saved and saved[k] != v}
        if not changed or self.ctx.rank != 0:
            return
        if t.override_opt_param_scheduler:
            logger.info("resuming at iteration %s on the flags' learning-rate schedule "
                        "(--override-opt-param-scheduler): %s", saved.get("num_steps"),
                        "; ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()))
            return
        decay_end = saved.get("lr_decay_steps")
        flat = (f"; from iteration {decay_end} to {t.train_iters} the rate stays at its minimum "
                f"{saved.get('min_lr')}" if decay_end is not None and t.train_iters > decay_end
                and schedule_steps(t).unit == "iterations" else "")
        logger.warning("resuming keeps the checkpoint's learning-rate schedule: %s%s. To train on the flags' "
                       "schedule from the checkpoint's iteration instead, add --override-opt-param-scheduler",
                       "; ".join(f"{k} {old} (flags: {new})" for k, (old, new) in changed.items()), flat)

    def _log(self, m: IterationMetrics, avg_time: float) -> None:
        if self.ctx.is_logging_rank:
            self.log.train(m, avg_time)

    def _log_eval(self, loss: float | None, *, final: bool = False) -> None:
        if self.ctx.is_logging_rank and loss is not None:
            self.log.validation(self.iteration, loss, final=final)

    # --- the run ---------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        t, lg, ck = cfg.training, cfg.logging, cfg.checkpoint
        times: list[float] = []
        finished = ending = False
        self._accounted_s = time.time()
        self.wall.charge("setup", self._accounted_s - self.wall.start_s)
        self.housekeeping.start()
        try:
            if self.ft is not None and self.ft.is_spare and not self.ft.wait_as_spare(self):
                return self.history  # the job finished while this process waited for a place
            leave = None
            if t.skip_train and self.ctx.rank == 0:
                logger.info("skipping training (--skip-train is on): validation at iteration %d", self.iteration)
            while not t.skip_train and self.iteration < t.train_iters and leave is None:
                try:
                    self._iterate(times)
                    leave = self._exit_reason()
                except Exception as exc:
                    if self.ft is None:
                        raise
                    failed = time.time()
                    self.wall.charge("detection", failed - self._accounted_s)
                    try:
                        if not self.ft.on_failure(self, exc):
                            return self.history  # left out, then the job finished while this rank waited
                    finally:
                        self._accounted_s = time.time()
                        self.wall.charge("pause", self._accounted_s - failed)
                    times.clear()
            if leave is None and lg.eval_iters > 0:
                self._log_eval(self.evaluate(), final=True)
            if ck.save and not t.skip_train and not (ck.save_interval and self.iteration % ck.save_interval == 0):
                self.save_checkpoint()
            if leave is not None and self.ctx.rank == 0:
                logger.info("exiting after iteration %d of %d (%s)%s", self.iteration, t.train_iters, leave,
                            f"; resume with --load {ck.save}" if ck.save else " without a checkpoint (no --save)")
            finished = True
            self._report_wall_time()
        except (RankEnded, JobFailed, RestartNeeded):
            # This process ends at once (the entry point exits without teardown): no extension may
            # wait on a collective with the others or report a run this rank no longer takes part in.
            ending = True
            raise
        finally:
            self.housekeeping.stop()
            self.exit_watch.uninstall()
            if self.ft is not None and finished:
                self.ft.finish()
            if not ending:
                for ext in self.extensions:
                    ext.teardown(self)
            self.close_outputs(finish=True)
        return self.history

    def _report_wall_time(self) -> None:
        """The run's time account (``runtime/ettr.py``): one line and one metrics row, by the logging rank."""
        if not self.ctx.is_logging_rank:
            return
        summary = self.wall.summary()
        print(f" {ettr.describe(summary)}", flush=True)
        self.log.record("ettr", {"iteration": self.iteration, **summary}, history=False)

    def _exit_reason(self) -> str | None:
        """Why every rank leaves after this iteration (``runtime/exits.py``), or None."""
        if self.iteration >= self.cfg.training.train_iters:
            return None  # the run ends here anyway
        return self.exit_watch.decide(self.iteration)

    def _agree_max(self, flags: list[int]) -> list[int]:
        """The element-wise maximum of ``flags`` over every rank of the job."""
        if self.ctx.world_size == 1 or not dist.is_initialized():
            return list(flags)
        t = torch.tensor(flags, dtype=torch.int32, device=distributed.collective_device(self.ctx))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(x) for x in t.tolist()]

    def _iterate(self, times: list[float]) -> None:
        """One iteration and what follows it (progress line, a requested re-layout, validation,
        checkpoint)."""
        t, lg, ck = self.cfg.training, self.cfg.logging, self.cfg.checkpoint
        m = self.train_step()
        self.wall.iteration(m.iteration, m.iter_time_s)
        self._accounted_s = time.time()
        self.housekeeping.after_iteration(self.iteration)
        times.append(m.iter_time_s)
        recent = times[-20:]
        self._log(m, sum(recent) / len(recent))
        if self._pending_layout is not None:
            self._apply_pending_layout()
            times.clear()  # the ETA follows the new layout's speed
        if lg.eval_interval and self.iteration % lg.eval_interval == 0 and self.iteration < t.train_iters:
            self._log_eval(self.evaluate())
        if ck.save and ck.save_interval and self.iteration % ck.save_interval == 0:
            self.save_checkpoint()


@dataclasses.dataclass(frozen=True)
class RecorderHooks:
    """What ``Trainer.install_recorder`` returns: called before each iteration, and to undo."""

    new_iteration: Callable[[], None]
    uninstall: Callable[[], None]


NO_STORE = ("a live rank permutation (relayout rank_order) renumbers the ranks through a new process group, "
            "which needs a store outside the old one: start the job with `python pretrain_gpt.py "
            "--nproc-per-node N` or torchrun, or export the MEGATRON_EXT_STORE=host:port line of "
            "`python -m megatron_ext.ft.store` to every rank")

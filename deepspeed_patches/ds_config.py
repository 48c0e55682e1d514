"""A DeepSpeed user's ``ds_config.json`` merged with the Megatron flags of the run (``--deepspeed_config``).

Megatron-DeepSpeed users launch ``pretrain_gpt.py --deepspeed --deepspeed_config ds.json --zero-stage N``
plus Megatron flags. ``plan`` reads their config (a file, or the JSON itself on the command line) and
decides, before any rank starts, what runs:

* **What the run owns** -- the batch sizes (``train_batch_size``, ``train_micro_batch_size_per_gpu``,
  ``gradient_accumulation_steps``) come from ``--global-batch-size`` / ``--micro-batch-size`` and the
  layout. A config that gives one must agree; a disagreement is one line naming both values.
  ``--zero-stage`` and ``zero_optimization.stage``, ``--bf16`` and ``bf16.enabled``, and ``--lr`` /
  ``--weight-decay`` against the config optimizer's (when the Megatron flags' schedule drives them)
  are checked the same way.
* **What the config owns** -- the optimizer (``optimizer``), the schedule (``scheduler``), the
  gradient clipping (``gradient_clipping``), the precision (``bf16``) and ZeRO (``zero_optimization``).
  Where a section is absent the Megatron flags give it, as in Megatron-DeepSpeed.
* **Which engine** -- DeepSpeed's ``PipelineEngine`` (ZeRO stages 0 and 1: DeepSpeed asserts it) when
  the pipeline has more than one stage, or at one stage with ZeRO-0 and no ``--no-pipeline-parallel``
  (the project's DeepSpeed engine as it was); DeepSpeed's plain engine otherwise (ZeRO 1-3).
* **Who clips** -- DeepSpeed's ZeRO optimizers and its plain engine clip by the global norm, each
  parameter counted once (``ds_pipe_replicated``, the tensor-parallel marks). The pipeline engine at
  ZeRO-0 does not (``runtime.utils.clip_grad_norm_`` counts non-tensor-parallel parameters only on
  the first stage and the tied embedding on two), so there the trainer's ``ClippedAdamW`` clips, with
  the config's Adam / AdamW settings and clipping value.

Nothing here imports DeepSpeed: the plan is made where the config is checked.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from megatron_ext.config.base import ConfigError

# DeepSpeed 0.19.8's optimizer types (runtime/config.py DEEPSPEED_OPTIMIZERS, lower case) and schedules
# (runtime/lr_schedules.py VALID_LR_SCHEDULES): checked here so a typo is one line before any rank starts.
DS_OPTIMIZERS = ("adam", "adamw", "lamb", "onebitadam", "onebitlamb", "zerooneadam", "adagrad", "lion", "muadam",
                 "muadamw", "musgd", "muon")
DS_SCHEDULERS = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
# Optimizer types ClippedAdamW runs under the pipeline engine at ZeRO-0 (it is torch's AdamW).
ADAM_TYPES = ("adam", "adamw")


@dataclasses.dataclass
class DeepSpeedPlan:
    config: dict[str, Any]
    """What ``deepspeed.initialize`` gets."""
    source: str
    """Where the user's config came from (a path, or 'inline JSON'), for messages; '' without one."""
    zero_stage: int
    engine: str
    """'pipeline' (DeepSpeed's PipelineEngine) or 'plain' (DeepSpeedEngine)."""
    optimizer_from_config: bool
    scheduler_from_config: bool
    clip: float
    bf16: bool
    notes: list[str] = dataclasses.field(default_factory=list)
    universal: bool = False
    """--load holds a universal checkpoint (DeepSpeed's checkpoint.load_universal)."""

    @property
    def deepspeed_optimizer(self) -> bool:
        """DeepSpeed's optimizer wrapper steps (ZeRO, bf16, or the plain engine), not ClippedAdamW."""
        return self.engine == "plain" or self.zero_stage >= 1 or self.bf16

    @property
    def writes_deepspeed_checkpoints(self) -> bool:
        """Where the optimizer's state is DeepSpeed's (partitioned or wrapped), --save writes
        DeepSpeed's format: the project's formats hold a plain optimizer's per-parameter state."""
        return self.deepspeed_optimizer


def load_user_config(spec: str) -> tuple[dict[str, Any], str]:
    """``--deepspeed_config``'s value: a JSON object inline (starts with '{') or a file holding one."""
    text = spec.strip()
    if text.startswith("{"):
        source, where = "--deepspeed_config (inline JSON)", "--deepspeed_config"
    else:
        source = where = spec
        if not os.path.isfile(spec):
            raise ConfigError(f"--deepspeed_config {spec}: no such file (give a ds_config.json path or the JSON itself)")
        with open(spec, encoding="utf-8") as fh:
            text = fh.read()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: a DeepSpeed config is a JSON object, got {type(value).__name__}")
    return value, source


def _enabled(section: Any, where: str) -> bool | None:
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: expected an object such as {{\"enabled\": true}}, got {section!r}")
    return bool(section.get("enabled", False))


def _agree(source: str, key: str, theirs: Any, flag: str, ours: Any) -> None:
    if theirs is None or theirs == "auto":
        return
    if theirs != ours:
        raise ConfigError(f"{source}: {key} {theirs} disagrees with {flag} {ours}: the run owns it, so give the same "
                          "value or drop the key")


def plan(cfg: Any, dp: int, *, device_type: str = "cpu") -> DeepSpeedPlan:
    """The DeepSpeed config and choices of run ``cfg`` (a RunConfig) with ``dp`` data-parallel replicas.
    Raises ConfigError with one line for any disagreement or any section that cannot run."""
    par, t = cfg.parallel, cfg.training
    user, source = load_user_config(par.deepspeed_config) if par.deepspeed_config else ({}, "")
    where = source or "the DeepSpeed config"
    notes: list[str] = []
    gas = t.global_batch_size // (t.micro_batch_size * dp)
    _agree(where, "train_batch_size", user.get("train_batch_size"), "--global-batch-size", t.global_batch_size)
    _agree(where, "train_micro_batch_size_per_gpu", user.get("train_micro_batch_size_per_gpu"), "--micro-batch-size",
           t.micro_batch_size)
    _agree(where, "gradient_accumulation_steps", user.get("gradient_accumulation_steps"),
           f"--global-batch-size / (--micro-batch-size x data-parallel size {dp}) =", gas)

    zero = user.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise ConfigError(f"{where}: zero_optimization must be an object, got {zero!r}")
    stage = zero.get("stage")
    if stage is not None:
        if stage not in (0, 1, 2, 3):
            raise ConfigError(f"{where}: zero_optimization.stage {stage!r}: DeepSpeed's stages are 0, 1, 2 and 3")
        if par.zero_stage is not None and par.zero_stage != stage:
            raise ConfigError(f"{where}: zero_optimization.stage {stage} disagrees with --zero-stage {par.zero_stage}")
    else:
        stage = par.zero_stage or 0
    if zero.get("offload_optimizer") or zero.get("offload_param"):
        raise ConfigError(f"{where}: zero_optimization offload (offload_optimizer / offload_param) is not supported "
                          "here yet: drop it")
    pp = par.pipeline_model_parallel_size
    if pp > 1 and stage >= 2:
        raise ConfigError(f"ZeRO-{stage} with --pipeline-model-parallel-size {pp}: DeepSpeed's pipeline engine runs "
                          "ZeRO stages 0 and 1 only; use ZeRO-1, or one pipeline stage (DeepSpeed's plain engine)")
    engine = "plain" if pp == 1 and (stage >= 1 or par.no_pipeline_parallel) else "pipeline"

    if _enabled(user.get("fp16"), f"{where}: fp16") or t.fp16:
        raise ConfigError(f"{where}: fp16 (loss-scaled half precision) is not run by --engine deepspeed here: use its "
                          "bf16 section, or fp32")
    bf16_section = user.get("bf16", user.get("bfloat16"))
    bf16 = _enabled(bf16_section, f"{where}: bf16")
    if t.bf16 and bf16 is False:
        raise ConfigError(f"{where}: bf16.enabled false disagrees with --bf16: give the same precision in both")
    if bf16 is None:
        bf16 = t.bf16
    elif bf16 and not t.bf16:
        notes.append(f"{where}: its bf16 section trains in bf16 (the Megatron flags say fp32; the config's "
                     "precision is what runs)")
    if bf16 and engine == "pipeline" and stage == 0:
        # DeepSpeed's BF16_Optimizer at ZeRO-0 under a pipeline: its own fp32 masters, as ZeRO-1's.
        notes.append("bf16 under the pipeline engine at ZeRO-0: DeepSpeed runs its BF16_Optimizer (fp32 master "
                     "weights and accumulation)")
    if bf16 and par.sequence_parallel:
        raise ConfigError("--sequence-parallel with bf16 on --engine deepspeed is not supported yet: drop one")

    optimizer = user.get("optimizer")
    if optimizer is not None:
        if not isinstance(optimizer, dict) or not isinstance(optimizer.get("type"), str):
            raise ConfigError(f"{where}: optimizer needs a \"type\" (one of DeepSpeed's: {', '.join(DS_OPTIMIZERS)})")
        kind = optimizer["type"].lower()
        if kind not in DS_OPTIMIZERS:
            raise ConfigError(f"{where}: optimizer type {optimizer['type']!r} is not one of DeepSpeed's "
                              f"({', '.join(DS_OPTIMIZERS)})")
        params = optimizer.setdefault("params", {})
        if not isinstance(params, dict):
            raise ConfigError(f"{where}: optimizer.params must be an object, got {params!r}")
        if "max_grad_norm" in params:
            raise ConfigError(f"{where}: optimizer.params.max_grad_norm: DeepSpeed clips by gradient_clipping; move it "
                              "there")
        adam_w = kind == "adamw" or params.get("adam_w_mode", True)
        if kind in ADAM_TYPES and device_type == "cpu" and "torch_adam" not in params:
            params["torch_adam"] = True
            notes.append(f"{where}: on CPU the config's {optimizer['type']} runs as torch's "
                         f"{'AdamW' if adam_w else 'Adam'} (torch_adam: DeepSpeed's FusedAdam is a GPU kernel)")
        if engine == "pipeline" and not (bf16 or stage >= 1) and (kind not in ADAM_TYPES or not adam_w):
            raise ConfigError(f"{where}: optimizer {optimizer['type']} with DeepSpeed's pipeline engine at ZeRO-0 runs "
                              "only as AdamW here (the engine's own clipping miscounts the pipeline's gradient "
                              "norm): use Adam/AdamW, or ZeRO-1")
    if par.sequence_parallel and (engine == "plain" or stage >= 1):
        raise ConfigError("--sequence-parallel on --engine deepspeed runs at ZeRO-0 under the pipeline engine only "
                          "(DeepSpeed's ZeRO does not sum the sequence-parallel norms' gradients): drop one")
    scheduler = user.get("scheduler")
    if scheduler is not None:
        if not isinstance(scheduler, dict) or scheduler.get("type") not in DS_SCHEDULERS:
            raise ConfigError(f"{where}: scheduler type {scheduler.get('type') if isinstance(scheduler, dict) else scheduler!r} "
                              f"is not one of DeepSpeed's ({', '.join(DS_SCHEDULERS)})")
    elif optimizer is not None:
        # The Megatron flags' schedule sets every group's lr and weight decay at each step.
        params = optimizer["params"]
        if "lr" in params and float(params["lr"]) != t.lr:
            raise ConfigError(f"{where}: optimizer lr {params['lr']} disagrees with --lr {t.lr}, whose schedule "
                              "(--lr-decay-style, warm-up) drives the rate without a scheduler section: give the "
                              "same value, or a scheduler section")
        if "weight_decay" in params and float(params["weight_decay"]) != t.weight_decay:
            raise ConfigError(f"{where}: optimizer weight_decay {params['weight_decay']} disagrees with --weight-decay "
                              f"{t.weight_decay} (the Megatron flags' schedule sets it without a scheduler section)")
    clip = user.get("gradient_clipping")
    clip = t.clip_grad if clip is None else float(clip)

    config = {k: v for k, v in user.items() if k not in ("bfloat16",)}
    config.update(train_batch_size=t.global_batch_size, train_micro_batch_size_per_gpu=t.micro_batch_size,
                  gradient_accumulation_steps=gas)
    config["zero_optimization"] = {**zero, "stage": stage}
    config["bf16"] = {**(bf16_section if isinstance(bf16_section, dict) else {}), "enabled": bool(bf16)}
    deepspeed_optimizer = engine == "plain" or stage >= 1 or bf16
    # ClippedAdamW clips under the pipeline engine at ZeRO-0 (see the module docstring).
    config["gradient_clipping"] = clip if deepspeed_optimizer else 0.0
    section = config.get("checkpoint") or {}
    if par.universal_checkpoint:
        section = {**section, "load_universal": True}
    if section:
        config["checkpoint"] = section
    universal = bool(section.get("load_universal"))
    if universal and stage == 3:
        raise ConfigError("--universal-checkpoint at ZeRO-3: DeepSpeed loads universal checkpoints at ZeRO 1 and 2 "
                          "(and bf16); use one of those")
    config.setdefault("steps_per_print", 2**62)  # progress lines are the Trainer's
    config.setdefault("wall_clock_breakdown", False)
    if engine == "pipeline":
        pipe = dict(config.get("pipeline") or {})
        if pipe.get("pipe_partitioned") or pipe.get("grad_partitioned"):
            notes.append(f"{where}: pipeline.pipe_partitioned / grad_partitioned are off here (stages send whole "
                         "activations, which sequence parallelism needs)")
        # Stages send whole activations to the same TP rank of the next stage: DeepSpeed's
        # partitioning assumes TP ranks hold equal activations, which sequence parallelism breaks.
        config["pipeline"] = {**pipe, "pipe_partitioned": False, "grad_partitioned": False}
    if deepspeed_optimizer and optimizer is None and stage >= 1:
        # The Megatron flags' AdamW is handed to DeepSpeed (a client optimizer), as Megatron-DeepSpeed does.
        config.setdefault("zero_allow_untested_optimizer", True)
    if universal and not deepspeed_optimizer:
        raise ConfigError("--universal-checkpoint needs DeepSpeed's optimizer (ZeRO 1 or 2, or bf16): at ZeRO-0 in "
                          "fp32 under the pipeline engine this run's optimizer is ClippedAdamW")
    return DeepSpeedPlan(config=config, source=source, zero_stage=stage, engine=engine,
                         optimizer_from_config=optimizer is not None, scheduler_from_config=scheduler is not None,
                         clip=clip, bf16=bool(bf16), notes=notes, universal=universal)


# DeepSpeed's ZeRO-3 default (runtime/zero/config.py: reduce_bucket_size)
ZERO3_DEFAULT_REDUCE_BUCKET = 500_000_000


def check_zero3_buckets(plan: DeepSpeedPlan, num_parameters: int, device_type: str) -> None:
    """On CPU, DeepSpeed 0.19.8's ZeRO-3 fails once a reduce bucket fills in the middle of a backward: it
    calls ``Tensor.record_stream`` with the CPU accelerator's stream, which is None (``stage3.py``'s
    gradient bucketing). One line naming the setting, before the engine is built."""
    if device_type != "cpu" or plan.zero_stage != 3:
        return
    bucket = int((plan.config.get("zero_optimization") or {}).get("reduce_bucket_size", ZERO3_DEFAULT_REDUCE_BUCKET))
    if bucket < num_parameters:
        raise ConfigError(f"{plan.source or 'the DeepSpeed config'}: zero_optimization.reduce_bucket_size {bucket} is "
                          f"below this rank's {num_parameters} parameters: on CPU DeepSpeed's ZeRO-3 fails when a "
                          "reduce bucket fills during the backward (record_stream on the CPU accelerator); give "
                          f"reduce_bucket_size >= {num_parameters}")

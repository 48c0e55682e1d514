"""Training engines, registered: megatron-core's schedules and DeepSpeed's PipelineEngine.

Each engine is one ``EngineSpec``: where its parts live (the trainer class, how the process group
is set up and torn down, its extra checks before any rank starts) and what it refuses, feature by
feature, with the message a user reads. Nothing outside this registry asks which engine runs: the
config, the model families and the extensions ask the spec (``engine(name).refuse(feature)``), and
the entry point loads the parts (``spec.load("trainer")``). The parts are named by import path, not
imported here, so this module -- which the config reads at parse time -- pulls in no engine.

The built-in specs are below; another engine registers its own with ``register_engine`` from a
module named in the ``megatron_ext.engines`` entry-point group (loaded on first lookup).
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from megatron_ext.errors import ConfigError

FEATURES = ("tensor_parallel", "virtual_pipeline", "distributed_optimizer", "data_parallel_microbatches",
            "mixture_of_experts", "bf16", "packed_documents", "overlap_grad_reduce", "helix", "slow_link_injection",
            "slow_nic_injection", "slow_path_injection", "transformer_config_flags", "batch_size_rampup", "fp16", "per_token_loss",
            "decoupled_lr", "num_zeros_in_grad")
"""What an engine may refuse (each engine's ``refusals`` names the ones it does, with why)."""


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    name: str
    summary: str
    trainer: str
    """``module:attribute`` of its trainer class (``runtime.loop.Trainer`` or a subclass)."""
    setup_distributed: str
    """``module:function``: ``(parallel, *, seed, timeout_s, join) -> DistContext``."""
    teardown: str
    """``module:function``: ``() -> None``, after the run."""
    check: str | None = None
    """``module:function``: ``(RunConfig, world size or None) -> None``, checks that need the engine's
    code, run before any rank starts."""
    refusals: dict[str, str] = dataclasses.field(default_factory=dict)
    """Feature (``FEATURES``) -> the one line that refuses it."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.refusals) - set(FEATURES))
        if unknown:
            raise ValueError(f"engine {self.name!r} refuses unknown feature(s) {unknown}; known: {FEATURES}")

    def supports(self, feature: str) -> bool:
        return feature not in self.refusals

    def refuse(self, feature: str, detail: str = "") -> None:
        """Raise ``ConfigError`` with the engine's line for ``feature`` when it does not run it."""
        if feature in self.refusals:
            raise ConfigError(self.refusals[feature] + (f" ({detail})" if detail else ""))

    def load(self, part: str) -> Any:
        """The part named by ``trainer``, ``setup_distributed``, ``teardown`` or ``check``."""
        target = getattr(self, part)
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)


_ENGINES: dict[str, EngineSpec] = {}
_PLUGINS_LOADED = False


def register_engine(spec: EngineSpec) -> EngineSpec:
    if spec.name in _ENGINES and _ENGINES[spec.name] != spec:
        raise ValueError(f"engine {spec.name!r} registered twice")
    _ENGINES[spec.name] = spec
    return spec


def engines() -> dict[str, EngineSpec]:
    """Every registered engine (the built-in ones and those of installed entry points)."""
    global _PLUGINS_LOADED
    if not _PLUGINS_LOADED:
        _PLUGINS_LOADED = True
        from importlib.metadata import entry_points

        for ep in entry_points(group="megatron_ext.engines"):
            importlib.import_module(ep.value)
    return dict(_ENGINES)


def engine(name: str) -> EngineSpec:
    known = engines()
    if name not in known:
        raise ConfigError(f"--engine {name!r}: no such engine; registered: {', '.join(sorted(known))}")
    return known[name]


MEGATRON = register_engine(EngineSpec(
    name="megatron", summary="megatron-core: GPTModel, DDP, the 1F1B and interleaved schedules (TP x PP x DP, EP)",
    trainer="megatron_ext.runtime.loop:Trainer", setup_distributed="megatron_ext.runtime.distributed:setup",
    teardown="megatron_ext.runtime.distributed:teardown", check="megatron_ext.runtime.model:check_config"))

DEEPSPEED = register_engine(EngineSpec(
    name="deepspeed", summary="DeepSpeed's PipelineEngine over the GPT as a PipelineModule (TP x PP x DP)",
    trainer="deepspeed_patches.trainer:DeepSpeedTrainer", setup_distributed="deepspeed_patches.trainer:setup_distributed",
    teardown="deepspeed_patches.trainer:teardown", check="deepspeed_patches.trainer:check_config",
    refusals={
        "virtual_pipeline": "--engine deepspeed runs one stage per rank (DeepSpeed's TrainSchedule): drop "
                            "--virtual-pipeline-model-parallel-size or use --engine megatron",
        "distributed_optimizer": "--use-distributed-optimizer is megatron's optimizer: it needs --engine megatron",
        "data_parallel_microbatches": "--data-parallel-microbatches needs --engine megatron and plain 1F1B "
                                      "(no --virtual-pipeline-model-parallel-size)",
        "mixture_of_experts": "--engine deepspeed does not train mixture-of-experts models (--num-experts): "
                              "DeepSpeed's PipelineModule here is a dense GPT; use --engine megatron",
        "fp16": "--engine deepspeed trains in fp32 or bf16 (the config's bf16 section, or --bf16): drop --fp16 "
                "or use --engine megatron",
        "per_token_loss": "--calculate-per-token-loss needs --engine megatron (DeepSpeed's engine averages over "
                          "micro-batches)",
        "num_zeros_in_grad": "--log-num-zeros-in-grad needs --engine megatron (DeepSpeed's engine steps its own "
                             "optimizer without counting)",
        "decoupled_lr": "--decoupled-lr needs --engine megatron (it finds the input and output layers by "
                        "megatron-core's marks)",
        "packed_documents": "--doc-length-dist (packed documents) is not supported by --engine deepspeed yet: "
                            "use --engine megatron",
        "overlap_grad_reduce": "--overlap-grad-reduce is a megatron DDP option; DeepSpeed's pipeline engine "
                               "reduces gradients after the schedule: drop it with --engine deepspeed",
        "helix": "--helix compiles megatron-core's GPTModel: use it with --engine megatron",
        "slow_link_injection": "--inject-slow-link throttles megatron-core's p2p calls: use it with --engine megatron",
        "slow_nic_injection": "--inject-slow-nic throttles megatron-core's p2p calls: use it with --engine megatron",
        "slow_path_injection": "--inject-slow-path throttles megatron-core's p2p calls and gradient finalisation: "
                               "use it with --engine megatron",
        "transformer_config_flags": "--engine deepspeed builds its own GPT block, which megatron-core's "
                                    "TransformerConfig and GPTModel flags do not reach: use --engine megatron",
        "batch_size_rampup": "--rampup-batch-size needs --engine megatron: DeepSpeed's engine fixes its batch "
                             "(train_batch_size) when it is built",
    }))

"""``HydroTuneConfig``: one tuning study, read from strict YAML (``--config tune.yaml``) plus flags.

Flat keys as everywhere in the project, with two mappings: ``search_space`` (what Optuna samples,
see ``search_space.py``) and ``defaults`` (values of the same hyperparameters when not searched).
Errors name the file, the line and the key.
"""
from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, Mapping

import yaml

from megatron_ext.config.base import ConfigError, build, check_unknown, doc, field_names, load_yaml_node

from .optim import OPTIMIZERS, TrialHParams
from .schedule import LRSchedule
from .search_space import SEARCHABLE, Param, parse_search_space

if TYPE_CHECKING:  # pragma: no cover
    from .models import GPTShape

PRUNERS = ("none", "median", "successive_halving", "hyperband")
FAMILIES = ("gpt", "llama")
# What the llama block is made of, and the gpt-family keys that would contradict it.
LLAMA_BLOCK = {"norm": "rmsnorm", "activation": "silu"}


@dataclasses.dataclass(kw_only=True)
class HydroTuneConfig:
    """Hydro tuning study: shrink the target GPT, tune fused trials with Optuna, transfer the best."""
    # study
    study_name: str = doc("Optuna study name (resuming uses the same name and storage).", "hydro")
    storage: str = doc("Optuna storage URL; empty = sqlite:///<output-dir>/<study-name>.db; 'memory' = "
                       "not persisted (cannot resume).", "")
    output_dir: str = doc("Where the study database and results.json go.", "runs/hydro")
    n_trials: int = doc("Trials to finish (complete or pruned), counting those of earlier runs.", 16)
    sampler: str = doc("Optuna sampler.", "tpe", choices=("tpe", "random"))
    pruner: str = doc("Early stopping of weak trials.", "successive_halving", choices=PRUNERS)
    min_resource: int = doc("Steps before a trial can first be pruned (pruner rung 0).", 20)
    reduction_factor: int = doc("Keep 1 of this many trials per rung (successive halving / Hyperband).", 3)
    seed: int = doc("Seed of the sampler, the data order and trial initializations.", 1234)
    # target model
    model_family: str = doc("Block of the target, as the runtime's model families: gpt (LayerNorm, GELU MLP, "
                            "learned positions, biases) or llama (RMSNorm, SwiGLU, rotary positions, grouped-query "
                            "attention, no biases).", "gpt", choices=FAMILIES)
    num_layers: int = doc("Target GPT layers.", 2)
    hidden_size: int = doc("Target GPT hidden size (the full width that the best config is transferred to).", 256)
    num_attention_heads: int = doc("Target GPT attention heads.", 8)
    num_query_groups: int = doc("llama: key/value head groups (grouped-query attention, as --num-query-groups); "
                                "0 = one per attention head.", 0)
    rotary_base: int = doc("llama: base period of the rotary position embeddings (--rotary-base).", 10000)
    ffn_mult: int = doc("gpt: MLP hidden size as a multiple of hidden-size (unless ffn-hidden-size is set).", 4)
    ffn_hidden_size: int = doc("MLP hidden size; 0 = ffn-mult x hidden-size (gpt), or Megatron-LM's --swiglu "
                               "default int(8h/3/64)*64 (llama).", 0)
    activation: str = doc("gpt: MLP activation (llama: SiLU in the SwiGLU).", "gelu", choices=("gelu", "silu"))
    norm: str = doc("gpt: normalization layer (llama: RMSNorm).", "layernorm", choices=("layernorm", "rmsnorm"))
    seq_length: int = doc("Tokens per training sequence.", 64)
    vocab_size: int = doc("Vocabulary size; 0 = from the tokenizer or the data.", 0)
    # shrinking and parametrization
    shrink_ratio: float = doc("Width of the tuned proxy relative to the target (1 = tune the target itself).", 0.25)
    shrink_mode: str = doc("How attention shrinks: fewer heads or a smaller head dim.", "heads",
                           choices=("heads", "head_dim"))
    parametrization: str = doc("mup transfers LRs across width; sp is standard parametrization.", "mup",
                               choices=("mup", "sp"))
    # data
    data_path: str = doc("Indexed dataset prefix; empty = the default corpus; 'synthetic[:tokens[:vocab[:order]]]' "
                         "= a generated bigram stream.", "")
    data_cache_dir: str | None = doc("Cache directory of the default corpus.", None)
    max_tokens: int = doc("Read at most this many tokens (0 = all).", 2_000_000)
    micro_batch_size: int = doc("Sequences per step, the same for every trial of a bundle.", 16)
    # training
    optimizer: str = doc("Optimizer of every trial.", "adamw", choices=OPTIMIZERS)
    trial_steps: int = doc("Training steps of a trial that is never pruned.", 200)
    eval_interval: int = doc("Validate (and report to the pruner) every N steps of a trial.", 20)
    eval_iters: int = doc("Validation batches per evaluation.", 4)
    target_steps: int = doc("Steps to train the full-width target with the best config; 0 skips transfer.", 400)
    search_space: dict[str, Any] = doc("Hyperparameters to search: name: {type, low, high, log, step, choices}.",
                                       default_factory=dict)
    defaults: dict[str, Any] = doc("Values of hyperparameters that are not searched.", default_factory=dict)
    # resources
    fusion: int = doc("Trials per fused bundle; 0 = as many as the memory budget allows (<= max-fusion).", 0)
    max_fusion: int = doc("Upper bound of the fusion count.", 8)
    memory_budget_mb: float = doc("Memory for the bundle; 0 = free device memory (half the free RAM on CPU).", 0.0)
    device: str = doc("Where trials run; auto = cuda when available.", "auto", choices=("auto", "cpu", "cuda"))
    threads: int = doc("torch intra-op threads on CPU; 0 = torch's default.", 0)

    def __post_init__(self) -> None:
        def bad(key: str, msg: str) -> None:
            raise ConfigError(f"key '{key}' {msg}")
        for key in ("n_trials", "trial_steps", "eval_interval", "eval_iters", "micro_batch_size", "max_fusion",
                    "num_layers", "hidden_size", "num_attention_heads", "ffn_mult", "seq_length",
                    "reduction_factor"):
            if getattr(self, key) < 1:
                bad(key, f"must be >= 1, got {getattr(self, key)}")
        for key in ("fusion", "target_steps", "min_resource", "vocab_size", "max_tokens", "threads"):
            if getattr(self, key) < 0:
                bad(key, f"must be >= 0, got {getattr(self, key)}")
        if self.memory_budget_mb < 0:
            bad("memory_budget_mb", f"must be >= 0, got {self.memory_budget_mb}")
        if self.reduction_factor < 2 and self.pruner in ("successive_halving", "hyperband"):
            bad("reduction_factor", f"must be >= 2 for the {self.pruner} pruner")
        if not 0 < self.shrink_ratio <= 1:
            bad("shrink_ratio", f"must be in (0, 1], got {self.shrink_ratio}")
        if self.hidden_size % self.num_attention_heads:
            bad("hidden_size", f"{self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}")
        for key in ("num_query_groups", "ffn_hidden_size"):
            if getattr(self, key) < 0:
                bad(key, f"must be >= 0, got {getattr(self, key)}")
        if self.model_family == "llama":
            for key, want in LLAMA_BLOCK.items():
                # The gpt-family defaults stand for "not set"; anything else would contradict the block.
                if getattr(self, key) not in (want, dataclasses.fields(self)[_FIELD_INDEX[key]].default):
                    bad(key, f"is {getattr(self, key)!r}, but the llama block uses {want!r}")
                setattr(self, key, want)
            g = self.num_query_groups
            if g and self.num_attention_heads % g:
                bad("num_query_groups", f"{g} does not divide num_attention_heads {self.num_attention_heads}")
            if self.rotary_base < 1:
                bad("rotary_base", f"must be >= 1, got {self.rotary_base}")
            if (self.hidden_size // self.num_attention_heads) % 2:
                bad("num_attention_heads", f"gives head dim {self.hidden_size // self.num_attention_heads}; rotary "
                                           "embeddings need an even head dim")
            if not self.ffn_hidden_size and self.ffn_hidden() < 1:
                bad("ffn_hidden_size", f"is 0 and Megatron-LM's --swiglu default for hidden_size {self.hidden_size} "
                                       "is 0: set ffn_hidden_size")
        else:
            if self.num_query_groups:
                bad("num_query_groups", "needs model_family llama (the gpt block has multi-head attention)")
            if self.rotary_base != 10000:
                bad("rotary_base", "needs model_family llama (the gpt block has learned positions)")

    def ffn_hidden(self) -> int:
        """The MLP hidden size of the target (``ffn_hidden_size``, else the family's default)."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.model_family == "llama":
            from megatron_ext.models.families import swiglu_ffn_hidden_size

            return swiglu_ffn_hidden_size(self.hidden_size)
        return self.ffn_mult * self.hidden_size

    def target_shape(self, vocab_size: int) -> "GPTShape":
        """The target model's shape: the family's block at full width."""
        from .models import GPTShape
        llama = self.model_family == "llama"
        return GPTShape(vocab_size=vocab_size, seq_len=self.seq_length, d_model=self.hidden_size,
                        n_layers=self.num_layers, n_heads=self.num_attention_heads, ffn_mult=self.ffn_mult,
                        ffn_hidden=self.ffn_hidden(), activation=self.activation, norm=self.norm,
                        parametrization=self.parametrization, swiglu=llama,
                        n_query_groups=self.num_query_groups if llama else 0,
                        position="rope" if llama else "learned", rotary_base=float(self.rotary_base), bias=not llama)

    def resolved_storage(self) -> str:
        import os
        return self.storage or f"sqlite:///{os.path.join(self.output_dir, self.study_name + '.db')}"


_FIELD_INDEX = {f.name: i for i, f in enumerate(dataclasses.fields(HydroTuneConfig))}


def key_lines(root: yaml.Node | None) -> dict[str, int]:
    """Line of each top-level key, and of each ``search_space`` / ``defaults`` entry (``name``), in
    the node tree of the tune YAML (read once, by ``load_yaml_node``)."""
    out: dict[str, int] = {}
    if isinstance(root, yaml.MappingNode):
        for k, v in root.value:
            key = str(k.value).replace("-", "_")
            out[key] = k.start_mark.line + 1
            if key in ("search_space", "defaults") and isinstance(v, yaml.MappingNode):
                for kk, _ in v.value:
                    out[f"{key}.{kk.value}"] = kk.start_mark.line + 1
    return out


def _with_line(exc: ConfigError, lines: Mapping[str, int], path: str) -> ConfigError:
    m = re.search(r"key '(\w+)'", str(exc))
    if m and m.group(1) in lines and str(exc).startswith(f"{path}: "):
        msg = str(exc)[len(path) + 2:]
        return ConfigError(f"{path}:{lines[m.group(1)]}: {msg}")
    return exc


def load_config(path: str | None, overrides: Mapping[str, Any] | None = None
                ) -> tuple[HydroTuneConfig, dict[str, Param], TrialHParams, float]:
    """(config, search space, default hyperparameters, default dropout) from YAML + flag overrides."""
    values, root = load_yaml_node(path) if path else ({}, None)
    where = path or "flags"
    lines = key_lines(root)
    check_unknown(values, field_names(HydroTuneConfig), where)
    for k, v in (overrides or {}).items():
        if v is not None:
            values[k] = yaml.safe_load(v) if k in ("search_space", "defaults") and isinstance(v, str) else v
    if values.get("model_family") == "llama":
        for key, want in LLAMA_BLOCK.items():
            if key in values and values[key] != want:
                loc = f"{where}:{lines[key]}" if key in lines else where
                raise ConfigError(f"{loc}: key '{key}' is {values[key]!r}, but model_family llama uses {want!r} "
                                  "(remove the key)")
    try:
        cfg = build(HydroTuneConfig, values, where)
    except ConfigError as exc:
        msg = str(exc)
        if not msg.startswith(where):
            exc = ConfigError(f"{where}: {msg}")
        raise _with_line(exc, lines, where) from None
    for key in ("search_space", "defaults"):
        if not isinstance(getattr(cfg, key), Mapping):
            loc = f"{where}:{lines[key]}" if key in lines else where
            raise ConfigError(f"{loc}: key '{key}' must be a mapping, got {getattr(cfg, key)!r}")
    space = parse_search_space(cfg.search_space, where, {k.split(".", 1)[1]: v for k, v in lines.items()
                                                          if k.startswith("search_space.")})
    hp, dropout = default_hparams(cfg, where, {k.split(".", 1)[1]: v for k, v in lines.items()
                                               if k.startswith("defaults.")})
    return cfg, space, hp, dropout


def default_hparams(cfg: HydroTuneConfig, where: str, lines: Mapping[str, int]) -> tuple[TrialHParams, float]:
    """Validate ``defaults`` with the search-space rules (a default is a one-point range)."""
    vals: dict[str, Any] = {}
    for name, v in cfg.defaults.items():
        name = str(name)
        loc = f"{where}:{lines[name]}" if name in lines else where
        if name not in SEARCHABLE:
            import difflib
            close = difflib.get_close_matches(name, SEARCHABLE, n=1)
            raise ConfigError(f"{loc}: defaults.{name}: unknown hyperparameter" +
                              (f" (did you mean '{close[0]}'?)" if close else ""))
        kind, valid = SEARCHABLE[name]
        spec = {"type": "categorical", "choices": [v]}
        parsed = parse_search_space({name: spec}, where, {name: lines[name]} if name in lines else {}, section="defaults")
        value = parsed[name].choices[0]
        if kind != "categorical" and not valid[0] <= value <= valid[1]:
            raise ConfigError(f"{loc}: defaults.{name}: {value} is outside [{valid[0]}, {valid[1]}]")
        vals[name] = value
    return hparams_from(vals, cfg.trial_steps), float(vals.get("dropout", 0.0))


def hparams_from(values: Mapping[str, Any], total_steps: int, base: TrialHParams | None = None) -> TrialHParams:
    """TrialHParams from searched/default values; the schedule decays over ``total_steps``."""
    base = base or TrialHParams()
    kw = {f.name: values.get(f.name, getattr(base, f.name)) for f in dataclasses.fields(TrialHParams)
          if f.name != "schedule"}
    sched = LRSchedule(kind=str(values.get("schedule", base.schedule.kind)),
                       warmup_steps=int(values.get("warmup_steps", base.schedule.warmup_steps)),
                       total_steps=total_steps,
                       min_ratio=float(values.get("min_lr_ratio", base.schedule.min_ratio)))
    return TrialHParams(**kw, schedule=sched)


def hparams_dict(h: TrialHParams) -> dict[str, Any]:
    """The flat, searchable-name view of a TrialHParams (for tables and results.json)."""
    d = {f.name: getattr(h, f.name) for f in dataclasses.fields(h) if f.name != "schedule"}
    d.update(schedule=h.schedule.kind, warmup_steps=h.schedule.warmup_steps, min_lr_ratio=h.schedule.min_ratio)
    return d


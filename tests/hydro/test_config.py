"""Strict YAML for tuning studies: the example config loads; bad input is named with file:line."""
import os
import textwrap

import pytest

from megatron_ext.config.base import ConfigError
from megatron_ext.hydro.config import load_config
from megatron_ext.hydro.search_space import parse_search_space

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write(tmp_path, text):
    p = tmp_path / "tune.yaml"
    p.write_text(textwrap.dedent(text))
    return str(p)


def test_example_config_loads():
    cfg, space, hp, dropout = load_config(os.path.join(ROOT, "configs", "tune_tiny.yaml"))
    assert cfg.hidden_size == 128 and cfg.shrink_ratio == 0.25 and cfg.parametrization == "mup"
    assert set(space) == {"lr", "beta2", "warmup_steps"}
    assert space["lr"].log and space["lr"].low == 1e-4
    assert hp.schedule.kind == "cosine" and hp.weight_decay == 0.01 and hp.grad_clip == 1.0
    assert hp.schedule.total_steps == cfg.trial_steps and dropout == 0.0
    assert cfg.resolved_storage() == "sqlite:///runs/hydro/tune_tiny.db"


def test_flags_override_yaml(tmp_path):
    path = write(tmp_path, """
        hidden_size: 64
        num_attention_heads: 4
        search_space:
          lr: {type: float, low: 1e-4, high: 1e-2, log: true}
    """)
    cfg, space, _, _ = load_config(path, {"hidden_size": 32, "search_space": "{momentum: {type: float, low: 0, high: 0.9}}"})
    assert cfg.hidden_size == 32 and set(space) == {"momentum"}
    assert space["momentum"].high == 0.9


@pytest.mark.parametrize("body,message", [
    ("hiden_size: 64\n", "tune.yaml: unknown key 'hiden_size' (did you mean 'hidden_size'?)"),
    ("n_trials: 0\n", "tune.yaml:1: key 'n_trials' must be >= 1, got 0"),
    ("seed: 1\nn_trials: many\n", "tune.yaml:2: key 'n_trials' expects int, got 'many'"),
    ("search_space: [lr]\n", "tune.yaml:1: key 'search_space' must be a mapping"),
    ("seed: 1\nsearch_space:\n  lr: {type: float, low: 0.1, high: 0.01}\n",
     "tune.yaml:3: search_space.lr: 'low' (0.1) must be < 'high' (0.01)"),
    ("search_space:\n  lr: {type: float, low: 0, high: 0.1, log: true}\n",
     "tune.yaml:2: search_space.lr: log scale needs low > 0, got 0.0"),
    ("search_space:\n  learning_rate: {type: float, low: 0.1, high: 1}\n",
     "search_space.learning_rate: unknown hyperparameter"),
    ("search_space:\n  lr: {type: float, low: 0.001}\n", "search_space.lr: missing 'high'"),
    ("search_space:\n  batch_size: {type: int, low: 8, high: 64}\n",
     "search_space.batch_size: cannot be searched: the trials of one fused bundle share shapes"),
    ("search_space:\n  schedule: {type: categorical, choices: [cosine, exponential]}\n",
     "search_space.schedule: invalid choice ['exponential']; valid: ['constant', 'cosine', 'linear']"),
    ("search_space:\n  warmup_steps: {type: float, low: 0, high: 10}\n",
     "search_space.warmup_steps: is an integer hyperparameter: use type: int"),
    ("search_space:\n  lr: {type: float, low: 1e-4, high: 1e-2, scale: log}\n",
     "search_space.lr: unknown field 'scale'"),
    ("search_space:\n  beta1: {type: float, low: 0.5, high: 1.5}\n",
     "search_space.beta1: range [0.5, 1.5] leaves the valid range"),
    ("defaults:\n  betas: 0.9\n", "tune.yaml:2: defaults.betas: unknown hyperparameter (did you mean 'beta2'?)"),
    ("defaults:\n  momentum: 2.0\n", "tune.yaml:2: defaults.momentum: value 2.0 is outside [0.0, 0.999999]"),
])
def test_bad_configs_are_named(tmp_path, body, message):
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    assert message in str(ei.value)
    assert str(ei.value).startswith(path)


def test_search_space_yaml_numbers_without_dot():
    # PyYAML reads 1e-4 as a string; the parser accepts it as a number.
    space = parse_search_space({"lr": {"type": "float", "low": "1e-4", "high": "1e-2", "log": True}})
    assert space["lr"].low == 1e-4


def test_flag_list_is_pinned():
    """Flags are public interface (and global across subsystems): changing one must be deliberate."""
    import argparse

    from megatron_ext.config.base import add_flags
    from megatron_ext.hydro.config import HydroTuneConfig

    parser = argparse.ArgumentParser()
    add_flags(parser, HydroTuneConfig)
    flags = sorted(o for a in parser._actions for o in a.option_strings if o.startswith("--") and not o.startswith("--no-"))
    assert flags == sorted([
        "--activation", "--data-cache-dir", "--data-path", "--defaults", "--device", "--eval-interval",
        "--eval-iters", "--ffn-mult", "--fusion", "--hidden-size", "--max-fusion", "--max-tokens",
        "--memory-budget-mb", "--micro-batch-size", "--min-resource", "--n-trials", "--norm", "--num-attention-heads",
        "--num-layers", "--optimizer", "--output-dir", "--parametrization", "--pruner", "--reduction-factor",
        "--model-family", "--num-query-groups", "--rotary-base", "--ffn-hidden-size",
        "--sampler", "--search-space", "--seed", "--seq-length", "--shrink-mode", "--shrink-ratio", "--storage",
        "--study-name", "--target-steps", "--threads", "--trial-steps", "--vocab-size", "--help"])


def test_llama_example_config_loads_as_the_llama_block():
    cfg, space, hp, _ = load_config(os.path.join(ROOT, "configs", "tune_llama_tiny.yaml"))
    assert cfg.model_family == "llama" and (cfg.norm, cfg.activation) == ("rmsnorm", "silu")
    shape = cfg.target_shape(vocab_size=100)
    assert shape.family == "llama" and shape.swiglu and shape.position == "rope" and not shape.bias
    assert shape.kv_heads == cfg.num_query_groups < shape.n_heads
    assert shape.ffn_size == int(cfg.hidden_size * 8 / 3 / 64) * 64          # Megatron-LM's --swiglu default
    assert set(space) == {"lr", "beta2", "warmup_steps"}


@pytest.mark.parametrize("body,message", [
    ("num_query_groups: 2\n", "tune.yaml:1: key 'num_query_groups' needs model_family llama"),
    ("rotary_base: 500000\n", "tune.yaml:1: key 'rotary_base' needs model_family llama"),
    ("model_family: llama\nnum_attention_heads: 8\nnum_query_groups: 3\n",
     "tune.yaml:3: key 'num_query_groups' 3 does not divide num_attention_heads 8"),
    ("model_family: llama\nnorm: layernorm\n",
     "tune.yaml:2: key 'norm' is 'layernorm', but model_family llama uses 'rmsnorm' (remove the key)"),
    ("model_family: llama\nhidden_size: 16\nnum_attention_heads: 2\n",
     "key 'ffn_hidden_size' is 0 and Megatron-LM's --swiglu default for hidden_size 16 is 0"),
    ("model_family: mamba\n", "key 'model_family' must be one of 'gpt', 'llama', got 'mamba'"),
    ("search_space:\n  num_query_groups: {type: int, low: 1, high: 4}\n",
     "search_space.num_query_groups: cannot be searched"),
])
def test_bad_family_settings_are_named(tmp_path, body, message):
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    assert message in str(ei.value)

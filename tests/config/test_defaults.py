"""Megatron-LM's defaults (issue 44, config/defaults.py): the config's are Megatron-LM's where it has
one, the former ones are listed once, and the configs and the tests' tiny model keep theirs."""
from __future__ import annotations

import os

import pytest

from megatron_ext.config.defaults import CHANGED, FORMER_DEFAULTS, former_default_flags
from megatron_ext.config.run import config_from_values, parse_run_config
from tests.conftest import ROOT
from tests.scenario_helpers import TINY


def test_the_defaults_are_megatron_lms():
    cfg = parse_run_config([])
    m, t = cfg.model, cfg.training
    assert (m.hidden_dropout, m.attention_dropout, m.make_vocab_size_divisible_by) == (0.1, 0.1, 128)
    assert (t.adam_beta2, t.lr_decay_style, t.min_lr) == (0.999, "linear", 0.0)
    # Unchanged: they were Megatron-LM's already.
    assert (t.adam_beta1, t.adam_eps, t.weight_decay, t.clip_grad, t.seed, m.init_method_std) == (
        0.9, 1e-8, 0.01, 1.0, 1234, 0.02)


def test_the_list_of_changed_defaults_is_the_configs():
    flat = parse_run_config([]).flat()
    assert {key: flat[key] for key in CHANGED} == {key: now for key, (_, now) in CHANGED.items()}
    assert former_default_flags() == ["--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--adam-beta2",
                                      "0.95", "--lr-decay-style", "cosine", "--min-lr", "0.0001"]
    flat = parse_run_config(former_default_flags()).flat()
    assert {key: flat[key] for key in FORMER_DEFAULTS} == FORMER_DEFAULTS


def test_the_tiny_test_model_keeps_the_former_defaults():
    flat = config_from_values(dict(TINY)).flat()
    assert {key: flat[key] for key in FORMER_DEFAULTS} == FORMER_DEFAULTS


@pytest.mark.parametrize("name", ["demo", "llama3_tiny", "qwen3_moe_tiny"])
def test_the_configs_give_the_former_defaults_explicitly(name):
    cfg = parse_run_config(["--config", os.path.join(ROOT, "configs", f"{name}.yaml")])
    flat = cfg.flat()
    assert {key: flat[key] for key in FORMER_DEFAULTS} == FORMER_DEFAULTS


def test_make_vocab_size_divisible_by_is_checked():
    with pytest.raises(Exception, match="--make-vocab-size-divisible-by must be >= 1, got 0"):
        parse_run_config(["--make-vocab-size-divisible-by", "0"])

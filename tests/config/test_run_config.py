"""Flags, strict YAML and every bad-input message of the run configuration."""
from __future__ import annotations

import pytest

from megatron_ext.config.base import ConfigError
from megatron_ext.config.run import all_keys, build_parser, parse_run_config

CORE_FLAGS = [
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
    "max_position_embeddings", "hidden_dropout", "attention_dropout", "init_method_std",
    "position_embedding_type", "untie_embeddings_and_output_weights", "rotary_base", "rotary_percent",
    "use_rope_scaling", "rope_scaling_factor", "rotary_seq_len_interpolation_factor", "normalization", "swiglu",
    "squared_relu",
    "group_query_attention", "num_query_groups", "disable_bias_linear", "qk_layernorm", "num_experts",
    "moe_router_topk", "moe_ffn_hidden_size", "moe_token_dispatcher_type", "moe_router_load_balancing_type",
    "moe_aux_loss_coeff", "moe_grouped_gemm", "moe_router_pre_softmax", "moe_router_score_function",
    "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size", "moe_layer_freq",
    "make_vocab_size_divisible_by",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank",
    "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "pipeline_stage_layers",
    "data_parallel_microbatches",
    "sequence_parallel", "overlap_grad_reduce", "use_distributed_optimizer", "distributed_timeout_minutes",
    "distributed_backend", "device", "engine", "deepspeed", "deepspeed_config", "zero_stage", "universal_checkpoint", "no_pipeline_parallel",
    "micro_batch_size", "global_batch_size", "train_iters", "train_samples", "rampup_batch_size", "skip_train", "lr",
    "min_lr",
    "lr_warmup_iters", "lr_decay_iters", "lr_warmup_samples", "lr_decay_samples", "lr_warmup_fraction",
    "lr_warmup_init",
    "lr_decay_style", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad",
    "seed", "bf16", "fp16", "grad_reduce_in_bf16", "loss_scale", "initial_loss_scale", "min_loss_scale",
    "loss_scale_window", "hysteresis", "decoupled_lr", "decoupled_min_lr", "manual_gc", "manual_gc_interval",
    "manual_gc_eval", "empty_unused_memory_level", "log_num_zeros_in_grad", "calculate_per_token_loss", "override_opt_param_scheduler",
    "data_path", "split", "data_args_path", "train_data_path", "valid_data_path", "test_data_path", "mock_data", "data_cache_path",
    "doc_length_dist", "eod_mask_loss", "reset_position_ids", "reset_attention_mask",
    "create_attention_mask_in_dataloader", "mmap_bin_files", "num_dataset_builder_threads", "dataloader_type",
    "num_workers",
    "tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size", "tiktoken_pattern",
    "tiktoken_num_special_tokens", "padded_vocab_size", "tokenizer_special_tokens", "trust_remote_code", "tokenizer_hf_use_fast",
    "tokenizer_hf_include_special_tokens", "tokenizer_sentencepiece_legacy", "tokenizer_file",
    "log_interval", "log_format", "eval_interval", "eval_iters", "tensorboard_dir", "tensorboard_log_interval",
    "tensorboard_queue_size", "log_throughput", "log_timers_to_tensorboard", "timing_log_level",
    "log_validation_ppl_to_tensorboard", "log_loss_scale_to_tensorboard", "log_world_size_to_tensorboard",
    "log_params_norm", "wandb_project", "wandb_exp_name", "wandb_save_dir", "wandb_entity", "metrics_file", "progress",
    "save", "load", "save_interval", "keep_last", "pretrained_checkpoint", "finetune", "load_optim", "load_rng",
]


def test_core_flag_list_is_pinned():
    keys = all_keys()
    assert keys[:len(CORE_FLAGS)] == CORE_FLAGS
    assert len(set(keys)) == len(keys), "two sections share a flag name"
    parser_flags = {o for a in build_parser()._actions for o in a.option_strings}
    for key in keys:
        assert "--" + key.replace("_", "-") in parser_flags


def write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_yaml_then_flags_override(tmp_path):
    path = write(tmp_path, "num-layers: 6\nhidden_size: 96\nlr: 3.0e-4\nsequence_parallel: false\n")
    cfg = parse_run_config(["--config", path, "--hidden-size", "128"])
    assert cfg.model.num_layers == 6
    assert cfg.model.hidden_size == 128  # flag wins
    assert cfg.training.lr == 3e-4
    assert cfg.model.ffn_hidden_size == 4 * 128  # derived after the override
    assert cfg.source == path


def test_bool_flags_forms():
    assert parse_run_config(["--bf16"]).training.bf16 is True
    assert parse_run_config(["--bf16", "false"]).training.bf16 is False
    assert parse_run_config(["--no-progress"]).logging.progress is False


def test_unknown_yaml_key_names_key_and_file(tmp_path):
    path = write(tmp_path, "num_layers: 4\nhiden_size: 64\n")
    with pytest.raises(ConfigError) as err:
        parse_run_config(["--config", path])
    assert str(err.value) == f"{path}: unknown key 'hiden_size' (did you mean 'hidden_size'?)"


def test_yaml_type_error_names_key_and_file(tmp_path):
    path = write(tmp_path, "num_layers: four\n")
    with pytest.raises(ConfigError, match=r"run.yaml / command line: key 'num_layers' expects int, got 'four'"):
        parse_run_config(["--config", path])


def test_yaml_not_a_mapping(tmp_path):
    path = write(tmp_path, "- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        parse_run_config(["--config", path])


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        parse_run_config(["--config", str(tmp_path / "nope.yaml")])


@pytest.mark.parametrize("argv,world,message", [
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 6,
     "world size 6 is not divisible by --tensor-model-parallel-size (2) x --pipeline-model-parallel-size (2) = 4"),
    (["--num-layers", "5", "--pipeline-model-parallel-size", "2"], 4,
     "--num-layers (5) is not divisible by --pipeline-model-parallel-size (2)"),
    (["--global-batch-size", "6", "--micro-batch-size", "2", "--pipeline-model-parallel-size", "2"], 4,
     "--global-batch-size (6) is not divisible by --micro-batch-size (2) x data-parallel size "
     "(2 = world size 4 / (TP 1 x PP 2)) = 4"),
    (["--num-attention-heads", "3", "--hidden-size", "48", "--tensor-model-parallel-size", "2"], 2,
     "--num-attention-heads (3) is not divisible by --tensor-model-parallel-size (2)"),
])
def test_layout_errors(argv, world, message):
    cfg = parse_run_config(argv)
    with pytest.raises(ConfigError) as err:
        cfg.validate(world)
    assert str(err.value) == message


def test_missing_data_path(tmp_path):
    prefix = str(tmp_path / "corpus")
    cfg = parse_run_config(["--data-path", prefix])
    with pytest.raises(ConfigError) as err:
        cfg.validate(1)
    assert str(err.value).startswith(f"--data-path {prefix}: missing {prefix}.bin and {prefix}.idx")


def test_field_checks():
    with pytest.raises(ConfigError, match=r"--hidden-size \(66\) is not divisible by --num-attention-heads \(4\)"):
        parse_run_config(["--hidden-size", "66"])
    with pytest.raises(ConfigError, match="need 0 <= --min-lr <= --lr"):
        parse_run_config(["--lr", "1e-4", "--min-lr", "1e-3"])
    with pytest.raises(ConfigError, match=r"--split 'a,b': give up to three proportions train,valid,test"):
        parse_run_config(["--split", "a,b"])
    with pytest.raises(ConfigError, match="--use-distributed-optimizer is megatron's optimizer: it needs "
                                          "--engine megatron"):
        parse_run_config(["--use-distributed-optimizer", "--engine", "deepspeed"])


def test_bad_flag_value_is_one_config_error():
    with pytest.raises(ConfigError) as err:
        parse_run_config(["--lr-decay-style", "zigzag"])
    assert str(err.value).startswith("argument --lr-decay-style: invalid choice: 'zigzag' (choose from")


def test_misspelled_flag_suggests_the_nearest():
    with pytest.raises(ConfigError) as err:
        parse_run_config(["--hiden-size", "8"])
    assert str(err.value) == "unrecognized arguments: --hiden-size 8; did you mean --hidden-size?"
    with pytest.raises(ConfigError) as err:
        parse_run_config(["--hiden-size=8", "--num-layer", "3", "--qqqqqqqq"])
    assert str(err.value) == ("unrecognized arguments: --hiden-size=8 --num-layer 3 --qqqqqqqq; did you mean "
                              "--hidden-size (for --hiden-size), --num-layers (for --num-layer)?")


@pytest.mark.parametrize("unknown, known, hint", [
    # Megatron-LM's flags that a ratio alone paired with ours: one shared word ("file") or letters
    # in common are not a near flag.
    ("--vocab-file", ["--metrics-file", "--tokenizer-file"], None),
    ("--use-mcore-models", ["--helix-cost-model", "--helix-mode"], None),
    ("--hiden-size", ["--hidden-size", "--seq-length"], "--hidden-size"),
    ("--sed", ["--seed", "--save"], "--seed"),
    ("--tensor-parallel-size", ["--tensor-model-parallel-size", "--sequence-parallel"], "--tensor-model-parallel-size"),
    ("--micro-batch", ["--micro-batch-size", "--global-batch-size"], "--micro-batch-size"),
    ("hiden_size", ["hidden_size", "seq_length"], "hidden_size"),
])
def test_the_hint_is_a_near_flag_or_none(unknown, known, hint):
    from megatron_ext.config.base import nearest, suggest_flag

    assert nearest(unknown, known) == hint
    if unknown.startswith("--"):
        message = f"unrecognized arguments: {unknown} 1"
        assert suggest_flag(message, known) == (message + f"; did you mean {hint}?" if hint else message)


@pytest.mark.parametrize("key,value", [("engine", "xyz"), ("position_embedding_type", "alibi"),
                                       ("lr_decay_style", "zigzag"), ("distributed_backend", "mpi")])
def test_yaml_values_are_checked_against_choices(tmp_path, key, value):
    path = write(tmp_path, f"{key}: {value}\n")
    with pytest.raises(ConfigError) as err:
        parse_run_config(["--config", path])
    assert str(err.value).startswith(f"{path} / command line: key '{key}' must be one of ")
    assert str(err.value).endswith(f", got '{value}'")


def test_pretrain_reports_config_errors_before_building(tmp_path, monkeypatch, capsys):
    import pretrain_gpt

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    path = write(tmp_path, "num_layers: 3\npipeline_model_parallel_size: 2\n")
    assert pretrain_gpt.main(["--config", path]) == 2
    err = capsys.readouterr().err
    assert "pretrain_gpt.py: error: --num-layers (3) is not divisible by --pipeline-model-parallel-size (2)" in err


def test_pipeline_stage_layers_checks():
    cfg = parse_run_config(["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                            "--pipeline-stage-layers", "3", "1"])
    cfg.validate(2)
    assert cfg.parallel.pipeline_stage_layers == [3, 1]
    with pytest.raises(ConfigError, match=r"needs one count >= 1 per pipeline stage \(--pipeline-model-parallel-size 2\), "
                                          r"got \[4\]"):
        parse_run_config(["--pipeline-model-parallel-size", "2", "--pipeline-stage-layers", "4"])
    with pytest.raises(ConfigError, match=r"--pipeline-stage-layers 2 1 sums to 3, not --num-layers \(4\)"):
        parse_run_config(["--pipeline-model-parallel-size", "2", "--pipeline-stage-layers", "2", "1"]).validate(2)
    with pytest.raises(ConfigError, match="cannot be combined"):
        parse_run_config(["--pipeline-model-parallel-size", "2", "--pipeline-stage-layers", "3", "1",
                          "--virtual-pipeline-model-parallel-size", "2"])
    # Both engines build uneven stages (DeepSpeed through its PipelineModule's partition).
    assert parse_run_config(["--pipeline-model-parallel-size", "2", "--pipeline-stage-layers", "3", "1",
                             "--engine", "deepspeed"]).parallel.pipeline_stage_layers == [3, 1]


def test_data_parallel_microbatches_checks():
    cfg = parse_run_config(["--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                            "--micro-batch-size", "2", "--data-parallel-microbatches", "3", "1"])
    cfg.validate(4)
    with pytest.raises(ConfigError, match=r"--data-parallel-microbatches 2 1 needs one count per data-parallel "
                                          r"replica \(2\) summing to --global-batch-size \(8\) / "
                                          r"--micro-batch-size \(2\) = 4"):
        parse_run_config(["--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                          "--micro-batch-size", "2", "--data-parallel-microbatches", "2", "1"]).validate(4)
    with pytest.raises(ConfigError, match="needs counts >= 1"):
        parse_run_config(["--data-parallel-microbatches", "4", "0"])
    with pytest.raises(ConfigError, match="needs --engine megatron and plain 1F1B"):
        parse_run_config(["--data-parallel-microbatches", "3", "1", "--engine", "deepspeed"])


@pytest.mark.parametrize("spelling", ["--override-opt-param-scheduler", "--override-opt_param-scheduler"])
def test_override_opt_param_scheduler_takes_megatrons_spellings(spelling, tmp_path):
    assert parse_run_config([spelling]).training.override_opt_param_scheduler is True
    assert parse_run_config([]).training.override_opt_param_scheduler is False
    path = write(tmp_path, "override-opt_param-scheduler: true\n")
    assert parse_run_config(["--config", path]).training.override_opt_param_scheduler is True


def test_a_repeatable_list_flag_given_twice_adds_and_another_list_flag_keeps_the_last():
    # The fault-injection flags say "repeatable": each occurrence adds its specs (before, the last
    # occurrence silently replaced the others). Megatron-LM's list flags keep argparse's rule.
    cfg = parse_run_config(["--inject-slow", "1:5:2", "--inject-slow", "2:6:2.5", "--inject-slow-path", "0:1:20:3",
                            "--inject-slow-path", "2:3:20:3"])
    faults = cfg.ext("faults")
    assert faults.inject_slow == ["1:5:2", "2:6:2.5"]
    assert [f.pair for f in faults.slow_path] == [(0, 1), (2, 3)]
    assert parse_run_config(["--inject-slow", "1:5:2", "2:6:2.5"]).ext("faults").inject_slow == ["1:5:2", "2:6:2.5"]
    cfg = parse_run_config(["--data-path", "a", "--data-path", "b"])
    assert cfg.data.data_path == ["b"]

"""A DeepSpeed user's config merged with the Megatron flags (deepspeed_patches/ds_config.py) and the
flags that bring it (--deepspeed, --deepspeed_config, --zero-stage, --no-pipeline-parallel): no ranks."""
from __future__ import annotations

import json

import pytest

from deepspeed_patches import ds_config
from deepspeed_patches.trainer import check_config
from megatron_ext.config.base import ConfigError
from megatron_ext.config.run import config_from_values, parse_run_config


def cfg_with(config: dict | str | None = None, **values):
    extra = {"deepspeed": True}
    if config is not None:
        extra["deepspeed_config"] = config if isinstance(config, str) else json.dumps(config)
    return config_from_values({"global_batch_size": 8, "micro_batch_size": 2, **extra, **values})


def plan(config=None, dp: int = 2, **values):
    return ds_config.plan(cfg_with(config, **values), dp)


def test_the_launch_line_flags_parse_under_megatron_deepspeeds_names(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    cfg = parse_run_config(["--deepspeed", "--deepspeed_config", str(path), "--zero-stage", "1"])
    assert cfg.parallel.engine == "deepspeed" and cfg.parallel.deepspeed_config == str(path)
    assert parse_run_config(["--deepspeed", "--deepspeed-config", str(path)]).parallel.deepspeed_config == str(path)
    assert parse_run_config(["--deepspeed", "--no-pipeline-parallel"]).parallel.no_pipeline_parallel


@pytest.mark.parametrize("argv, message", [
    (["--deepspeed_config", "x.json"], "--deepspeed_config needs --deepspeed (or --engine deepspeed)"),
    (["--deepspeed", "--zero-stage", "4"], "--zero-stage 4: needs --deepspeed and a stage of 0, 1, 2 or 3"),
    (["--zero-stage", "1"], "--zero-stage 1: needs --deepspeed"),
    (["--universal-checkpoint"], "--universal-checkpoint (DeepSpeed's universal checkpoint) needs --deepspeed"),
    (["--deepspeed", "--no-pipeline-parallel", "--pipeline-model-parallel-size", "2"],
     "--no-pipeline-parallel (DeepSpeed's plain engine) needs --deepspeed and --pipeline-model-parallel-size 1"),
    (["--ckpt-format", "torch"], "use torch_dist (Megatron-LM's default, which it loads), megatron_ext, or deepspeed"),
])
def test_flag_errors_are_one_line(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_run_config(argv)


def test_batch_sizes_are_the_runs_and_a_disagreement_names_both():
    p = plan({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2})
    assert (p.config["train_batch_size"], p.config["train_micro_batch_size_per_gpu"],
            p.config["gradient_accumulation_steps"]) == (8, 2, 2)
    assert plan({"train_batch_size": "auto"}).config["train_batch_size"] == 8
    with pytest.raises(ConfigError, match="train_batch_size 32 disagrees with --global-batch-size 8"):
        plan({"train_batch_size": 32})
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu 4 disagrees with --micro-batch-size 2"):
        plan({"train_micro_batch_size_per_gpu": 4})
    with pytest.raises(ConfigError, match="gradient_accumulation_steps 1 disagrees"):
        plan({"gradient_accumulation_steps": 1})


def test_zero_stage_from_config_or_flag_and_the_engine_it_takes():
    assert (plan().zero_stage, plan().engine) == (0, "pipeline")            # as before: the pipeline engine
    assert (plan(zero_stage=2).zero_stage, plan(zero_stage=2).engine) == (2, "plain")
    p = plan({"zero_optimization": {"stage": 1}}, pipeline_model_parallel_size=2)
    assert (p.zero_stage, p.engine, p.deepspeed_optimizer) == (1, "pipeline", True)
    assert plan(no_pipeline_parallel=True).engine == "plain"
    with pytest.raises(ConfigError, match="zero_optimization.stage 2 disagrees with --zero-stage 1"):
        plan({"zero_optimization": {"stage": 2}}, zero_stage=1)
    with pytest.raises(ConfigError, match="ZeRO-2 with --pipeline-model-parallel-size 2: DeepSpeed's pipeline "
                                          "engine runs ZeRO stages 0 and 1 only"):
        plan(zero_stage=2, pipeline_model_parallel_size=2)
    with pytest.raises(ConfigError, match="offload"):
        plan({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})


def test_the_configs_sections_are_what_runs():
    p = plan({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.9]}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}, "gradient_clipping": 0.5},
             zero_stage=1, lr=3e-4)
    assert p.optimizer_from_config and p.scheduler_from_config and p.clip == 0.5
    assert p.config["gradient_clipping"] == 0.5 and p.config["optimizer"]["params"]["torch_adam"] is True
    assert any("runs as torch's AdamW" in n for n in p.notes)
    # without a scheduler section the flags' schedule drives lr and weight decay: they must agree
    with pytest.raises(ConfigError, match="optimizer lr 0.001 disagrees with --lr 0.0003"):
        plan({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, lr=3e-4)
    with pytest.raises(ConfigError, match="optimizer weight_decay 0.1 disagrees with --weight-decay 0.01"):
        plan({"optimizer": {"type": "AdamW", "params": {"weight_decay": 0.1}}}, weight_decay=0.01)
    # no clipping section: --clip-grad's; under the pipeline at ZeRO-0 ClippedAdamW clips, not DeepSpeed
    p = plan(clip_grad=0.7, pipeline_model_parallel_size=2)
    assert (p.clip, p.config["gradient_clipping"], p.deepspeed_optimizer) == (0.7, 0.0, False)


@pytest.mark.parametrize("config, values, message", [
    ({"optimizer": {"type": "Adamm"}}, {}, "optimizer type 'Adamm' is not one of DeepSpeed's"),
    ({"optimizer": {"params": {}}}, {}, "optimizer needs a \"type\""),
    ({"optimizer": {"type": "Lamb"}}, {"pipeline_model_parallel_size": 2},
     "optimizer Lamb with DeepSpeed's pipeline engine at ZeRO-0 runs only as AdamW here"),
    ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, {}, "move it there"),
    ({"scheduler": {"type": "Cosine"}}, {}, "scheduler type 'Cosine' is not one of DeepSpeed's"),
    ({"fp16": {"enabled": True}}, {}, "fp16 \\(loss-scaled half precision\\) is not run"),
    ({"bf16": {"enabled": False}}, {"bf16": True}, "bf16.enabled false disagrees with --bf16"),
    ({"zero_optimization": {"stage": 5}}, {}, "zero_optimization.stage 5"),
    ({"zero_optimization": {"stage": 1}}, {"sequence_parallel": True, "tensor_model_parallel_size": 2},
     "--sequence-parallel on --engine deepspeed runs at ZeRO-0"),
    (None, {"universal_checkpoint": True, "zero_stage": 3}, "--universal-checkpoint at ZeRO-3"),
    (None, {"universal_checkpoint": True, "pipeline_model_parallel_size": 2},
     "--universal-checkpoint needs DeepSpeed's optimizer"),
])
def test_sections_that_cannot_run_are_one_line(config, values, message):
    with pytest.raises(ConfigError, match=message):
        plan(config, **values)


def test_universal_loading_from_the_flag_or_the_config():
    assert plan(universal_checkpoint=True, zero_stage=1).config["checkpoint"] == {"load_universal": True}
    p = plan({"checkpoint": {"load_universal": True, "tag_validation": "Warn"}}, zero_stage=2)
    assert p.universal and p.config["checkpoint"]["tag_validation"] == "Warn"
    assert not plan(zero_stage=1).universal


def test_precision_from_the_config_or_the_flag():
    assert plan({"bf16": {"enabled": True}}).bf16 and plan(bf16=True).bf16
    assert plan(bf16=True).config["bf16"] == {"enabled": True}
    p = plan({"bf16": {"enabled": True}})
    assert any("its bf16 section trains in bf16" in n for n in p.notes)
    assert not plan().bf16 and plan().config["bf16"] == {"enabled": False}


def test_the_config_comes_from_a_file_or_inline_json_and_bad_ones_are_named(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 1}}')
    assert ds_config.plan(cfg_with(str(path)), 2).zero_stage == 1
    with pytest.raises(ConfigError, match="--deepspeed_config .*missing.json: no such file"):
        ds_config.plan(cfg_with(str(tmp_path / "missing.json")), 2)
    path.write_text('{"zero_optimization": ')
    with pytest.raises(ConfigError, match=f"{path}: not JSON"):
        ds_config.plan(cfg_with(str(path)), 2)
    with pytest.raises(ConfigError, match="a DeepSpeed config is a JSON object, got list"):
        ds_config.plan(cfg_with(str(_write(tmp_path / "l.json", "[1]"))), 2)


def _write(path, text):
    path.write_text(text)
    return path


def test_what_does_not_run_on_zero_or_the_plain_engine_is_refused_by_name():
    with pytest.raises(ConfigError, match="--squeeze .* is not run on DeepSpeed's plain engine"):
        check_config(cfg_with(zero_stage=2, squeeze="configs/tune_tiny.yaml"), 4)
    with pytest.raises(ConfigError, match="--resihp .* is not run on DeepSpeed's plain engine"):
        check_config(cfg_with(zero_stage=3, resihp=True), 4)
    with pytest.raises(ConfigError, match="--ft-on-stop continue is not run on DeepSpeed's ZeRO-1 optimizer yet"):
        check_config(cfg_with(zero_stage=1, pipeline_model_parallel_size=2, ft_on_stop="continue"), 4)
    with pytest.raises(ConfigError, match="--ckpt-format megatron_ext cannot hold DeepSpeed's ZeRO-2"):
        check_config(cfg_with(zero_stage=2, ckpt_format="megatron_ext"), 4)
    # ZeRO-1 under the pipeline keeps the timeline and the detector
    check_config(cfg_with(zero_stage=1, pipeline_model_parallel_size=2, timeline=True, resihp=True), 4)


def test_the_megatron_engine_refuses_deepspeeds_checkpoint_format():
    from megatron_ext.runtime.model import check_config as megatron_check

    with pytest.raises(ConfigError, match="--ckpt-format deepspeed .* needs --engine deepspeed"):
        megatron_check(config_from_values({"ckpt_format": "deepspeed"}))


def test_zero3_buckets_smaller_than_the_model_are_refused_on_cpu():
    small = plan({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}})
    with pytest.raises(ConfigError, match="reduce_bucket_size 1000 is below this rank's 5000 parameters: on CPU"):
        ds_config.check_zero3_buckets(small, 5000, "cpu")
    ds_config.check_zero3_buckets(small, 5000, "cuda")                 # a GPU has streams
    ds_config.check_zero3_buckets(plan(zero_stage=3), 5000, "cpu")      # DeepSpeed's default: 5e8
    ds_config.check_zero3_buckets(plan({"zero_optimization": {"stage": 2, "reduce_bucket_size": 10}}), 5000, "cpu")

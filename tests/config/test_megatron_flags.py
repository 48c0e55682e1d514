"""Megatron-LM's flags (config/megatron_flags.py): the TransformerConfig flags generated from
megatron-core's dataclass, the flags ignored or refused by name (every line exact), Megatron-LM's older
spellings, and the docs' table rendered from the one table."""
from __future__ import annotations

import dataclasses
import os

import pytest

from megatron_ext.config import megatron_flags
from megatron_ext.config.base import ConfigError
from megatron_ext.config.run import all_keys, build_parser, parse_run_config
from tests.conftest import ROOT

CPU = ["--device", "cpu"]

GENERATED = [
    "pipeline_model_parallel_comm_backend", "context_parallel_size", "expert_tensor_parallel_size",
    "perform_initialization", "use_cpu_initialization", "deterministic_mode", "async_tensor_model_parallel_allreduce",
    "tp_comm_overlap", "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad", "tp_comm_overlap_ag", "tp_comm_overlap_rs",
    "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_split_rs", "cross_entropy_loss_fusion",
    "cross_entropy_fusion_impl", "tp_comm_bootstrap_backend", "overlap_moe_expert_parallel_comm",
    "delay_wgrad_compute", "ep_overlap_early_attn_memory_release", "use_ring_exchange_p2p",
    "defer_embedding_wgrad_compute", "wgrad_deferral_limit", "overlap_p2p_communication_warmup_flush",
    "microbatch_group_size_per_virtual_pipeline_stage", "cpu_offloading_num_layers",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split", "attention_backend",
    "softmax_type", "kv_channels", "fp32_residual_connection", "apply_residual_connection_post_layernorm",
    "norm_epsilon", "apply_layernorm_1p", "add_qkv_bias", "glu_linear_offset", "activation_func_clamp_value",
    "rotary_interleaved", "qk_l2_norm", "attention_output_gate", "embedding_init_method_std",
    "init_model_with_meta_device", "apply_query_key_layer_scaling", "disable_bf16_reduced_precision_matmul",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "distribute_saved_activations",
    "recompute_modules", "fp8_format", "fp8_recipe", "fp8_quantizer_factory", "fp8_margin", "fp8_interval",
    "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad", "first_last_layers_bf16",
    "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "fp4_format", "fp4_recipe", "fp4_param_gather",
    "fp4_quantizer_factory", "moe_shared_expert_gate", "moe_shared_expert_overlap",
    "moe_router_padding_for_quantization", "moe_router_padding_for_fp8", "moe_router_num_groups",
    "moe_router_group_topk", "moe_router_dtype", "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
    "moe_router_force_load_balancing", "moe_use_legacy_grouped_gemm", "moe_z_loss_coeff", "moe_input_jitter_eps",
    "moe_per_layer_logging", "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity",
    "moe_token_drop_policy", "moe_layer_recompute", "moe_permute_fusion", "moe_router_fusion",
    "moe_apply_probs_on_input", "enable_cuda_graph", "cuda_graph_warmup_steps", "external_cuda_graph",
    "cuda_graph_impl", "clone_scatter_output_in_embedding", "config_logger_dir", "use_te_activation_func",
    "transformer_impl", "fine_grained_activation_offloading", "offload_modules", "min_offloaded_tensor_size",
]
KERNEL_SWITCHES = ["masked_softmax_fusion", "bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion",
                   "apply_rope_fusion", "persist_layer_norm", "gradient_accumulation_fusion",
                   "attention_softmax_in_fp32"]
NAMED_ONLY = ["use_mcore_models", "use_flash_attn", "auto_detect_ckpt_format", "profile",
              "use_pytorch_profiler", "profile_step_start", "profile_step_end", "profile_ranks", "overlap_param_gather",
              "fp8_param_gather",
              "recompute_activations", "use_rotary_position_embeddings", "decoder_seq_length", "legacy_tokenizer",
              "hybrid_override_pattern", "async_save"]


def test_the_generated_and_named_flag_lists_are_pinned():
    # Generated from the installed megatron-core's TransformerConfig, in its order: a new megatron-core
    # changes this list, and its flags with it.
    assert list(megatron_flags.GENERATED) == GENERATED
    section = [f.name for f in dataclasses.fields(megatron_flags.TransformerFlags)]
    assert section == KERNEL_SWITCHES + GENERATED
    assert [f.name for f in dataclasses.fields(megatron_flags.MegatronFlags)] == NAMED_ONLY
    keys = all_keys()
    assert len(set(keys)) == len(keys)
    at = keys.index(KERNEL_SWITCHES[0])
    assert keys[at:at + len(section) + len(NAMED_ONLY)] == section + NAMED_ONLY


@pytest.mark.parametrize("argv, field, value", [
    # Megatron-LM's names where they are not the field's (TransformerConfig's argparse_meta).
    (["--norm-epsilon", "1e-6"], "layernorm_epsilon", 1e-6),
    (["--apply-layernorm-1p"], "layernorm_zero_centered_gamma", True),
    (["--fp8-format", "hybrid"], "fp8", "hybrid"),
    (["--no-initialization"], "perform_initialization", False),
    # A field that defaults to True: --no-x and --disable-x, as Megatron-LM generates them.
    (["--no-clone-scatter-output-in-embedding"], "clone_scatter_output_in_embedding", False),
    (["--disable-clone-scatter-output-in-embedding"], "clone_scatter_output_in_embedding", False),
    (["--kv-channels", "32"], "kv_channels", 32),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"],
     "recompute_num_layers", 2),
    (["--recompute-modules", "core_attn", "mlp"], "recompute_modules", ["core_attn", "mlp"]),
])
def test_generated_flags_take_megatron_lms_names(argv, field, value):
    key = next(k for k in megatron_flags.GENERATED if megatron_flags.tc_field(k) == field)
    assert vars(build_parser().parse_args(argv))[key] == value


def test_generated_flags_carry_megatron_cores_help_and_choices():
    actions = {o: a for a in build_parser()._actions for o in a.option_strings}
    assert actions["--norm-epsilon"].help.startswith("Epsilon value for any LayerNorm/RMSNorm operations.")
    assert set(actions["--attention-backend"].choices) == {"flash", "fused", "unfused", "local", "auto"}
    assert actions["--recompute-granularity"].choices == ("full", "selective")
    with pytest.raises(ConfigError, match=r"argument --recompute-method: invalid choice: 'all'"):
        parse_run_config(["--recompute-method", "all"])


NOTES = {
    "--use-mcore-models": "ignored --use-mcore-models: megatron-core's GPTModel is the only model here "
                          "(Megatron-LM's legacy models are not)",
    "--auto-detect-ckpt-format": "ignored --auto-detect-ckpt-format: every reader here detects the format of the "
                                 "directory it is given (torch_dist or megatron_ext)",
    "--decoder-seq-length 128": "ignored --decoder-seq-length 128: only Megatron-LM's encoder-decoder models (T5) "
                                "read it; a GPT's sequence length is --seq-length",
    "--legacy-tokenizer": "ignored --legacy-tokenizer: the tokenizers here are megatron-core's "
                          "(megatron.core.tokenizers), which Megatron-LM's default uses too; tools/preprocess_data.py "
                          "writes the legacy GPT-2 BPE's ids byte for byte",
    "--fp8-format hybrid": "ignored --fp8-format hybrid without Transformer Engine's layers: fp8 and fp4 compute "
                           "inside Transformer Engine's layers; this run's layers are megatron-core's local ones, so "
                           "it computes in the model's precision (--bf16 / --fp16, else fp32)",
    "--attention-backend fused": "ignored --attention-backend fused without Transformer Engine's layers: Transformer "
                                 "Engine's attention kernels; megatron-core's local attention (DotProductAttention) "
                                 "runs",
    "--sequence-parallel": "ignored --sequence-parallel: with --tensor-model-parallel-size 1 there is no "
                           "tensor-parallel region to split (Megatron-LM turns it off too)",
    "--profile": "ignored --profile: no profiler range is opened here (per-operation timings: --timeline)",
    "--tp-comm-overlap": "ignored --tp-comm-overlap: Transformer Engine's userbuffers for tensor-parallel "
                         "communication overlap are not set up here",
    "--overlap-param-gather": "ignored --overlap-param-gather: the distributed optimizer all-gathers the updated "
                              "parameters right after its step here (megatron's overlap with the next forward is not "
                              "wired)",
    "--empty-unused-memory-level 1": "ignored --empty-unused-memory-level 1 on the CPU: there is no CUDA caching "
                                     "allocator to empty",
}


@pytest.mark.parametrize("flags", list(NOTES))
def test_an_ignored_flag_is_one_note_and_goes_back_to_its_default(flags):
    cfg = parse_run_config(CPU + flags.split())
    assert cfg.notes == [NOTES[flags]]
    assert megatron_flags.changed(cfg) == {}
    assert not cfg.parallel.sequence_parallel


def test_what_a_cpu_run_ignores_a_gpu_run_with_transformer_engine_passes():
    cfg = parse_run_config(CPU + ["--fp8-format", "hybrid", "--fp8-param-gather", "--attention-backend", "fused"])
    te = megatron_flags.Device(gpu=True, te=True)
    values = {**cfg.flat(), "fp8_format": "hybrid", "fp8_param_gather": True, "attention_backend": "fused"}
    from megatron_ext.config.run import config_from_values

    gpu_cfg = config_from_values(values)
    gpu_cfg.extensions["transformer"].fp8_format = "hybrid"   # as settle leaves it on such a device
    gpu_cfg.extensions["transformer"].attention_backend = "fused"
    gpu_cfg.extensions["megatron"].fp8_param_gather = True
    assert megatron_flags.settle(gpu_cfg, te) == []
    kwargs = megatron_flags.transformer_kwargs(gpu_cfg, te=True)
    assert kwargs["fp8"] == "hybrid" and kwargs["fp8_param"] is True and kwargs["attention_backend"].name == "fused"
    # Without Transformer Engine's layers the attention backend is not passed at all (megatron's
    # GPTModel records it in NVTE_* variables and asserts every later model agrees).
    assert "attention_backend" not in megatron_flags.transformer_kwargs(gpu_cfg, te=False)


@pytest.mark.parametrize("argv, message", [
    (["--context-parallel-size", "2"], "--context-parallel-size 2: context parallelism is not built here (the layout "
     "is TP x PP x DP, with EP; megatron-core's context-parallel attention also needs Transformer Engine)"),
    (["--expert-tensor-parallel-size", "2", "--num-experts", "4"], "--expert-tensor-parallel-size 2: expert layers "
     "are split over --tensor-model-parallel-size here (leave it unset or equal)"),
    (["--transformer-impl", "inference_optimized"], "--transformer-impl inference_optimized: inference-optimized "
     "layers are megatron-core's inference path; training builds Transformer Engine's or the local layers"),
    (["--softmax-type", "off-by-one"], "--softmax-type off-by-one on the CPU: megatron-core 0.16.1's local attention "
     "allocates its softmax offsets on CUDA"),
    (["--account-for-loss-in-pipeline-split"], "--account-for-loss-in-pipeline-split: stages hold megatron's even "
     "split or --pipeline-stage-layers, with the embedding on the first and the loss on the last"),
    (["--moe-z-loss-coeff", "0.001", "--moe-router-dtype", "fp32"], "--moe-router-dtype, --moe-z-loss-coeff need "
     "--num-experts"),
    (["--kv-channels", "32", "--engine", "deepspeed"], "--engine deepspeed builds its own GPT block, which "
     "megatron-core's TransformerConfig and GPTModel flags do not reach: use --engine megatron (--kv-channels 32)"),
])
def test_a_refused_flag_is_one_line(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_run_config(CPU + argv)
    assert str(err.value) == message


def test_what_is_not_refused():
    cfg = parse_run_config(CPU + ["--context-parallel-size", "1", "--expert-tensor-parallel-size", "2",
                                  "--tensor-model-parallel-size", "2", "--num-experts", "4", "--sequence-parallel"])
    assert cfg.notes == [] and cfg.parallel.sequence_parallel


@pytest.mark.parametrize("argv, key, value", [
    (["--recompute-activations"], "recompute_granularity", "selective"),
    (["--use-rotary-position-embeddings"], "position_embedding_type", "rope"),
])
def test_megatron_lms_older_spellings(argv, key, value):
    assert parse_run_config(CPU + argv).flat()[key] == value


def test_an_older_spelling_against_the_flag_it_stands_for_is_refused():
    with pytest.raises(ConfigError) as err:
        parse_run_config(CPU + ["--use-rotary-position-embeddings", "--position-embedding-type", "learned_absolute"])
    assert str(err.value) == ("--use-rotary-position-embeddings means --position-embedding-type rope, but "
                              "--position-embedding-type learned_absolute is given too: give one")


def test_the_start_up_line_lists_what_was_ignored_on_rank_0(monkeypatch, capsys):
    import pretrain_gpt

    class Idle:
        def run(self):
            return []

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(pretrain_gpt, "_build_trainer", lambda cfg, extensions: Idle())
    monkeypatch.setattr(pretrain_gpt, "_teardown", lambda cfg: None)
    monkeypatch.setattr(pretrain_gpt, "_check", lambda cfg, world, launcher=False: None)
    assert pretrain_gpt.main(CPU + ["--use-mcore-models", "--fp8-format", "hybrid"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert [ln for ln in lines if "note:" in ln] == [
        "pretrain_gpt.py: note: " + NOTES["--fp8-format hybrid"],
        "pretrain_gpt.py: note: " + NOTES["--use-mcore-models"]]


def test_the_docs_table_is_the_named_table():
    with open(os.path.join(ROOT, "docs", "runtime.md"), encoding="utf-8") as fh:
        text = fh.read()
    assert megatron_flags.markdown_table() in text, (
        "docs/runtime.md's table of flags handled by name is out of date: paste "
        "`python -m megatron_ext.config.megatron_flags`")


PP2 = CPU + ["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]


@pytest.mark.parametrize("spelling", [["--num-layers-per-virtual-pipeline-stage", "2"],
                                      ["--num-virtual-stages-per-pipeline-rank", "2"]])
def test_megatron_lms_virtual_pipeline_spellings_are_ours(spelling):
    from megatron_ext.runtime.model import build_transformer_config

    ours = parse_run_config(PP2 + ["--virtual-pipeline-model-parallel-size", "2"])
    theirs = parse_run_config(PP2 + spelling)
    assert theirs.parallel.virtual_pipeline_model_parallel_size == 2
    assert theirs.parallel.launch_layout(4) == ours.parallel.launch_layout(4)
    theirs.validate(4)
    assert (build_transformer_config(theirs, on_gpu=False).virtual_pipeline_model_parallel_size
            == build_transformer_config(ours, on_gpu=False).virtual_pipeline_model_parallel_size == 2)
    # One chunk a stage is plain 1F1B, as in Megatron-LM; the same value twice is one request.
    assert parse_run_config(PP2 + ["--num-layers-per-virtual-pipeline-stage", "4"]).parallel \
        .virtual_pipeline_model_parallel_size is None
    assert parse_run_config(PP2 + spelling + ["--virtual-pipeline-model-parallel-size", "2"]).parallel \
        .virtual_pipeline_model_parallel_size == 2


def test_megatron_lms_uneven_first_and_last_stages_are_ours():
    theirs = parse_run_config(CPU + ["--num-layers", "8", "--pipeline-model-parallel-size", "4",
                                     "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers",
                                     "1"])
    ours = parse_run_config(CPU + ["--num-layers", "8", "--pipeline-model-parallel-size", "4",
                                   "--pipeline-stage-layers", "1", "3", "3", "1"])
    assert theirs.parallel.launch_layout(4) == ours.parallel.launch_layout(4)
    last = parse_run_config(CPU + ["--num-layers", "7", "--pipeline-model-parallel-size", "3",
                                   "--decoder-last-pipeline-num-layers", "3"])
    assert last.parallel.pipeline_stage_layers == [2, 2, 3]


@pytest.mark.parametrize("argv, message", [
    (PP2 + ["--num-layers-per-virtual-pipeline-stage", "3"], "--num-layers-per-virtual-pipeline-stage 3: --num-layers "
     "(8) must split into --pipeline-model-parallel-size (2) stages of whole chunks of 3 layers"),
    (PP2 + ["--num-layers-per-virtual-pipeline-stage", "2", "--num-virtual-stages-per-pipeline-rank", "2"],
     "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank each set the model chunks "
     "per stage: give one"),
    (PP2 + ["--num-virtual-stages-per-pipeline-rank", "2", "--virtual-pipeline-model-parallel-size", "4"],
     "--virtual-pipeline-model-parallel-size 4 and Megatron-LM's spelling of it (2 chunks per stage) disagree: give "
     "one"),
    (CPU + ["--num-layers", "8", "--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "3"],
     "--decoder-first/last-pipeline-num-layers (3, None): --num-layers (8) less those must split evenly over the "
     "other stages of --pipeline-model-parallel-size (4)"),
])
def test_bad_megatron_stage_spellings_are_one_line(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_run_config(argv)
    assert str(err.value) == message


def test_distributed_timeout_minutes_is_every_collectives_timeout():
    from megatron_ext.ft.config import process_group_timeout_s

    assert process_group_timeout_s(parse_run_config(CPU)) == 600   # Megatron-LM's 10 minutes
    assert process_group_timeout_s(parse_run_config(CPU + ["--distributed-timeout-minutes", "60"])) == 3600
    with pytest.raises(ConfigError, match="--distributed-timeout-minutes must be > 0, got 0"):
        parse_run_config(CPU + ["--distributed-timeout-minutes", "0"])


@pytest.mark.parametrize("flags, message", [
    (["--hybrid-override-pattern", "M*M*"], "--hybrid-override-pattern M*M*: hybrid Mamba models are not "
                                            "built here (the layers are megatron-core's GPT block)"),
    (["--async-save"], "--async-save: checkpoints are saved synchronously here (megatron's asynchronous "
                       "writer, a process per rank that finishes the save during training, is not wired)"),
])
def test_flags_refused_by_name_say_why(flags, message):
    with pytest.raises(ConfigError) as err:
        parse_run_config(CPU + flags)
    assert str(err.value) == message


def test_data_args_path_reads_the_blend_from_a_file(tmp_path):
    blend = tmp_path / "blend.txt"
    blend.write_text("0.3 /data/a_text_document\n0.7 /data/b_text_document\n")
    assert parse_run_config(CPU + ["--data-args-path", str(blend)]).data.data_path == [
        "0.3", "/data/a_text_document", "0.7", "/data/b_text_document"]
    with pytest.raises(ConfigError, match=r"^give --data-path or --data-args-path, not both$"):
        parse_run_config(CPU + ["--data-args-path", str(blend), "--data-path", "/data/a_text_document"])
    with pytest.raises(ConfigError, match=r"--data-args-path .*missing.txt: No such file or directory$"):
        parse_run_config(CPU + ["--data-args-path", str(tmp_path / "missing.txt")])

"""Model families: flag checks (every refusal names its flags), the registry, initialisation by
global name of the new parameters, and optimizer state of SwiGLU halves (one in-process rank)."""
from __future__ import annotations

import pytest
import torch

from megatron_ext.config.base import ConfigError
from megatron_ext.config.defaults import FORMER_DEFAULTS
from megatron_ext.config.run import config_from_values, parse_run_config
from megatron_ext.engines import DEEPSPEED
from megatron_ext.models import families as model_families
from megatron_ext.runtime import families
from megatron_ext.runtime.model import _full_value, _seed_for, build_model, iter_sharded_tensors, unwrap
from megatron_ext.runtime.optimizer import CPUOptimizer, collect_param_states, restore_param_states
from tests.runtime import trainer_helpers

LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
         "--position-embedding-type", "rope", "--disable-bias-linear", "--qk-layernorm"]
MOE = LLAMA + ["--num-experts", "4"]


@pytest.mark.parametrize("argv, message", [
    (["--group-query-attention"], "--group-query-attention needs --num-query-groups"),
    (["--num-query-groups", "2"], "--num-query-groups needs --group-query-attention"),
    (["--group-query-attention", "--num-query-groups", "3"],
     "--num-attention-heads (4) is not divisible by --num-query-groups (3)"),
    (["--rotary-base", "500000"], "--rotary-base needs --position-embedding-type rope"),
    (["--moe-router-topk", "1", "--moe-aux-loss-coeff", "0.01"],
     "--moe-router-topk, --moe-aux-loss-coeff need --num-experts"),
    (["--moe-grouped-gemm"], "--moe-grouped-gemm needs --num-experts"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk (5) must be between 1 and --num-experts (4)"),
    (["--num-experts", "0"], "--num-experts must be >= 1, got 0"),
    (["--num-experts", "2", "--moe-aux-loss-coeff", "-1"], "--moe-aux-loss-coeff must be >= 0, got -1.0"),
    (["--swiglu", "--hidden-size", "16", "--num-attention-heads", "2"],
     "--swiglu with --hidden-size 16 gives Megatron-LM's default --ffn-hidden-size of 0: give --ffn-hidden-size"),
    (["--expert-model-parallel-size", "0"], "--expert-model-parallel-size must be >= 1, got 0"),
    (["--moe-router-pre-softmax", "--moe-router-score-function", "sigmoid", "--moe-router-topk-scaling-factor", "2",
      "--moe-shared-expert-intermediate-size", "64", "--moe-layer-freq", "2"],
     "--moe-router-pre-softmax, --moe-router-score-function, --moe-router-topk-scaling-factor, "
     "--moe-shared-expert-intermediate-size, --moe-layer-freq need --num-experts"),
    (["--num-experts", "4", "--moe-router-topk-scaling-factor", "0"], "--moe-router-topk-scaling-factor must be > 0, "
     "got 0.0"),
    (["--num-experts", "4", "--moe-shared-expert-intermediate-size", "0"],
     "--moe-shared-expert-intermediate-size must be >= 1, got 0"),
    (["--num-experts", "4", "--moe-layer-freq", "([1]*3+[0]*1)*3"],
     "--moe-layer-freq ([1]*3+[0]*1)*3: megatron-ext makes every layer's MLP an MoE layer (one layer spec for all "
     "layers), so dense layers between MoE layers are not supported: leave it at 1"),
])
def test_field_checks_name_the_flags(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_run_config(argv)
    assert str(err.value) == message


@pytest.mark.parametrize("argv, world, message", [
    (MOE + ["--expert-model-parallel-size", "3", "--global-batch-size", "12"], 6, "--num-experts (4) is not divisible by "
     "--expert-model-parallel-size (3)"),
    (MOE + ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 2,
     "world size 2 is not divisible by --expert-model-parallel-size (2) x --tensor-model-parallel-size (1) x "
     "--pipeline-model-parallel-size (2) = 4"),
    (["--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size (2) needs --num-experts"),
    (MOE + ["--tensor-model-parallel-size", "2"], 2,
     "--num-experts with --tensor-model-parallel-size > 1 (2) needs --sequence-parallel"),
    (MOE + ["--moe-ffn-hidden-size", "33", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2,
     "--moe-ffn-hidden-size (33) is not divisible by --tensor-model-parallel-size (2)"),
    (LLAMA + ["--num-attention-heads", "8", "--hidden-size", "64", "--tensor-model-parallel-size", "4",
              "--ffn-hidden-size", "128"], 4, "--num-query-groups (2) is not divisible by --tensor-model-parallel-size (4)"),
    (MOE + ["--moe-grouped-gemm", "--device", "cpu"], 1, "--moe-grouped-gemm runs experts as one grouped GEMM "
     "kernel on a GPU (Transformer Engine); this run is on CPU: leave it off"),
    (MOE + ["--moe-grouped-gemm", "--device", "cuda", "--doc-length-dist", "fixed:16"], 1,
     "--moe-grouped-gemm needs Transformer Engine's layer spec, but --doc-length-dist builds on megatron's "
     "local layer spec: leave it off"),
    (MOE + ["--moe-token-dispatcher-type", "alltoall", "--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--expert-model-parallel-size", "2", "--device", "cpu"], 4,
     "--moe-token-dispatcher-type alltoall with --tensor-model-parallel-size > 1 and --expert-model-parallel-size "
     "> 1 needs NCCL (uneven all-gathers); on gloo use --moe-token-dispatcher-type allgather"),
    (MOE + ["--moe-shared-expert-intermediate-size", "33", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
     2, "--moe-shared-expert-intermediate-size (33) is not divisible by --tensor-model-parallel-size (2)"),
    (MOE + ["--moe-shared-expert-intermediate-size", "32", "--helix"], 1, "--moe-shared-expert-intermediate-size "
     "with --helix: Helix's traceable MoE dispatch (helix/adapter_moe.py) does not implement shared experts; drop "
     "one of them"),
    (MOE + ["--engine", "deepspeed"], 1, DEEPSPEED.refusals[model_families.MOE.engine_feature] + " (model flags: --normalization --swiglu "
     "--group-query-attention --position-embedding-type --disable-bias-linear --qk-layernorm --num-experts)"),
])
def test_layout_checks_run_before_any_model(argv, world, message):
    cfg = parse_run_config(argv)
    with pytest.raises(ConfigError) as err:
        cfg.validate(world)
    assert str(err.value) == message


def test_family_registry():
    assert model_families.family_of(parse_run_config([]).model) is model_families.GPT
    assert model_families.family_of(parse_run_config(["--normalization", "RMSNorm"]).model) is model_families.LLAMA
    assert model_families.family_of(parse_run_config(LLAMA).model) is model_families.LLAMA
    assert model_families.family_of(parse_run_config(MOE).model) is model_families.MOE
    # The GPT block passes no family field to TransformerConfig: its config is what it always was.
    assert set(families.transformer_config_kwargs(parse_run_config([]).model)) == {
        "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "hidden_dropout",
        "attention_dropout", "init_method_std"}


def test_swiglu_default_ffn_and_moe_defaults():
    m = parse_run_config(["--swiglu", "--hidden-size", "96", "--num-attention-heads", "4"]).model
    assert m.ffn_hidden_size == 256  # int(96 * 8 / 3 / 64) * 64, Megatron-LM's rule
    m = parse_run_config(MOE).model
    assert m.moe_ffn_hidden_size == m.ffn_hidden_size == 128


def test_configs_parse_and_validate_for_four_ranks():
    for name in ("llama3_tiny", "qwen3_moe_tiny"):
        cfg = parse_run_config(["--config", f"configs/{name}.yaml"])
        cfg.validate(4)
    assert model_families.family_of(parse_run_config(["--config", "configs/llama3_tiny.yaml"]).model) is model_families.LLAMA
    assert model_families.family_of(parse_run_config(["--config", "configs/qwen3_moe_tiny.yaml"]).model) is model_families.MOE


# --- in-process model ---------------------------------------------------------------------------

SMALL = {**FORMER_DEFAULTS, "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "group_query_attention": True,
         "num_query_groups": 2, "normalization": "RMSNorm", "swiglu": True, "ffn_hidden_size": 48,
         "position_embedding_type": "rope", "disable_bias_linear": True, "qk_layernorm": True, "num_experts": 4,
         "moe_ffn_hidden_size": 24, "seq_length": 16, "train_iters": 1, "eval_iters": 0, "progress": False}


@pytest.fixture(scope="module")
def one_rank():
    yield from trainer_helpers.one_rank(SMALL)


@pytest.fixture(scope="module")
def moe_model(one_rank):
    cfg = config_from_values(dict(SMALL))
    return cfg, build_model(cfg, one_rank, vocab_size=100, wrap_ddp=False)


def test_megatron_lm_moe_flags_reach_the_model(one_rank):
    # Megatron-LM's router and shared-expert flags, by their Megatron-LM names: in the
    # TransformerConfig, and in what the layers compute.
    cfg = parse_run_config([*MOE, "--hidden-size", "32", "--ffn-hidden-size", "48", "--moe-ffn-hidden-size", "24",
                            "--num-layers", "2", "--moe-router-pre-softmax", "--moe-router-score-function", "sigmoid",
                            "--moe-router-topk-scaling-factor", "2.5", "--moe-shared-expert-intermediate-size", "16",
                            "--moe-layer-freq", "1"])
    bundle = build_model(cfg, one_rank, vocab_size=100, wrap_ddp=False)
    tc = bundle.config
    assert (tc.moe_router_pre_softmax, tc.moe_router_score_function, tc.moe_router_topk_scaling_factor,
            tc.moe_shared_expert_intermediate_size, tc.moe_layer_freq) == (True, "sigmoid", 2.5, 16, 1)
    mlp = unwrap(bundle.chunks[0]).decoder.layers[0].mlp
    assert mlp.shared_experts.linear_fc1.weight.shape == (2 * 16, 32)  # SwiGLU: [W; V]
    with torch.no_grad():
        probs, routing_map = mlp.router(torch.randn(8, 2, 32))
    # Sigmoid scores of the top 2, renormalised, times the scaling factor: 2.5 per token.
    assert routing_map.sum(dim=-1).tolist() == [2] * 16
    assert torch.allclose(probs.sum(dim=-1), torch.full((16,), 2.5))


def test_megatron_core_refusal_is_one_line_naming_the_flag():
    from megatron_ext.runtime.model import check_config

    cfg = parse_run_config(["--config", "configs/qwen3_moe_tiny.yaml", "--moe-router-topk", "1"])
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert str(err.value) == ("--moe-router-topk 1: megatron-core refuses it (TransformerConfig): Please use "
                              "--moe-router-pre-softmax when topk is 1.")
    check_config(parse_run_config(["--config", "configs/qwen3_moe_tiny.yaml", "--moe-router-topk", "1",
                                   "--moe-router-pre-softmax"]))


def test_every_parameter_is_initialised_by_global_name(moe_model):
    cfg, bundle = moe_model
    model = unwrap(bundle.chunks[0])
    sd = model.sharded_state_dict()
    pieces = list(iter_sharded_tensors(sd))
    covered = {}
    for st in pieces:
        # Each piece's values are its slice of the full tensor drawn for (seed, key, global index):
        # expert weights use the global expert index, SwiGLU halves are slices of the full [W; V].
        pre = st.prepend_axis_num
        full = _full_value(st.key, tuple(st.global_shape[pre:]), _seed_for(cfg.training.seed, st.key,
                           tuple(st.global_offset[:pre])), cfg.model.init_method_std, cfg.model.num_layers)
        region = tuple(slice(o, o + n) for o, n in zip(st.global_offset[pre:], st.data.shape))
        assert torch.equal(st.data, full[region]), st.key
        base = st.data._base if st.data._base is not None else st.data
        covered[id(base)] = covered.get(id(base), 0) + st.data.numel()
    # The pieces cover every parameter of the model exactly once.
    params = list(model.parameters())
    assert {id(p) for p in params} == set(covered)
    assert all(covered[id(p)] == p.numel() for p in params)
    fc1 = model.decoder.layers[0].mlp.experts.local_experts[3].linear_fc1.weight
    assert fc1.shape == (2 * 24, 32)
    # Experts differ from each other (seeded by their global index).
    fc1_0 = model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight
    assert not torch.equal(fc1, fc1_0)


def test_optimizer_state_of_swiglu_halves_round_trips(moe_model):
    cfg, bundle = moe_model
    model = unwrap(bundle.chunks[0])
    fc1 = model.decoder.layers[1].mlp.experts.local_experts[2].linear_fc1.weight
    opt = CPUOptimizer([fc1], cfg.training)
    fc1.main_grad = torch.randn_like(fc1)
    opt.step()
    w, v = torch.chunk(fc1, 2, dim=0)
    states = collect_param_states(opt, [w, v])
    whole = opt.optimizer.state[fc1]
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(torch.cat([states[0][k], states[1][k]]), whole[k])
    assert states[0]["step"] == states[1]["step"] == 1.0
    fresh = CPUOptimizer([fc1], cfg.training)
    restore_param_states(fresh, [v, w], [states[1], states[0]])
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(fresh.optimizer.state[fc1][k], whole[k])
    with pytest.raises(ValueError, match="do not cover it"):
        restore_param_states(fresh, [w], [states[0]])

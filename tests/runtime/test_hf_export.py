"""Export to and import from Hugging Face transformers (megatron_ext/convert/hf.py).

transformers' own GPT2LMHeadModel, LlamaForCausalLM, Qwen3ForCausalLM and Qwen3MoeForCausalLM, loaded
from the export, give the logits of the runtime's megatron-core model loaded from the checkpoint, on
the same tokens; a TP2 and a DP2 x EP2 checkpoint export the same way; an import of the export gives
back every tensor bit for bit and trains on.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_ext.config.run import config_from_values, parse_run_config
from megatron_ext.convert import hf as hf_export
from megatron_ext.runtime import checkpoint as ckpt
from megatron_ext.runtime import distributed
from megatron_ext.runtime.loop import Trainer
from tests.conftest import run_torchrun
from tests.runtime.hf_export_scenarios import BASE, MODELS

# Both sides compute in fp32 with other kernels and summation orders (HF: sdpa attention, an expert
# loop with index_add; megatron: its core attention, token permutation): measured max |diff| 2-8e-6 on
# logits up to ~7. The defects this must catch move the same models' logits by (measured): GELU's tanh
# approximation 4.4e-4, norm epsilon 1e-6 7e-4, q-norm gains left at one 0.28, a dropped bias 0.1,
# norm_topk_prob false 3.8, rotary base 10000 5.8, swapped SwiGLU halves 6-8, interleaved rotary 7-9.
ATOL = 1e-4
HF_CLASS = {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "llama_bias": "LlamaForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "moe": "Qwen3MoeForCausalLM", "moe_sinkhorn": "Qwen3MoeForCausalLM",
            "moe_presoftmax": "Qwen3MoeForCausalLM"}


@pytest.fixture(scope="module")
def ctx():
    context = distributed.setup(config_from_values(dict(BASE)).parallel, seed=1234)
    yield context
    distributed.teardown()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_export")


@pytest.fixture(scope="module")
def checkpoints(ctx, root):
    """One trained single-rank checkpoint per model."""
    out = {}
    for name, values in MODELS.items():
        save = str(root / "ckpt" / name)
        Trainer(config_from_values({**BASE, **values, "save": save}), ctx).setup().run()
        out[name] = save
    return out


@pytest.fixture(scope="module")
def multirank(root):
    """TP2 (Qwen3-style) and DP2 x EP2 (MoE) checkpoints from one 2-rank launch."""
    run_torchrun("tests/runtime/hf_export_scenarios.py", str(root / "multi"), nproc=2)
    return {"qwen3_tp2": str(root / "multi" / "qwen3_tp2"), "moe_ep2": str(root / "multi" / "moe_ep2")}


def tokens(batch: int = 2, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, 4096, (batch, seq), generator=torch.Generator().manual_seed(0))


def hf_model(out: str):
    tf = hf_export.transformers_module()
    model, info = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    # Every tensor of the export has its place in the HF model and every HF weight came from it.
    assert {k: v for k, v in info.items() if v} == {}
    return model.eval()


def hf_logits(out: str, toks: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(out)(toks).logits.float()


def assert_same_logits(ckpt: str, out: str, ctx) -> float:
    toks = tokens()
    ours = hf_export.megatron_logits(ckpt, toks, ctx)
    theirs = hf_logits(out, toks)
    assert ours.shape == theirs.shape == (2, 32, 4096)
    diff = float((ours - theirs).abs().max())
    print(f"{out}: max |logit diff| {diff:.3g}, max |logit| {float(ours.abs().max()):.3g}")
    assert diff < ATOL
    return diff


@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_gives_our_logits(ctx, checkpoints, root, name):
    out = str(root / "hf" / name)
    done = hf_export.export(checkpoints[name], out)
    assert done.hf_class == HF_CLASS[name]
    assert type(hf_model(out)).__name__ == HF_CLASS[name]
    assert_same_logits(checkpoints[name], out, ctx)


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["qwen3_tp2", "moe_ep2"])
def test_export_from_a_multirank_layout(ctx, multirank, root, name):
    from megatron_ext.runtime import dist_ckpt

    saved = os.path.join(multirank[name], "iter_0000003")
    assert dist_ckpt.read_common(saved)["megatron_ext"]["world_size"] == 2
    assert sorted(f for f in os.listdir(saved) if f.endswith(".distcp"))[-1].startswith("__1_")  # both ranks wrote
    out = str(root / "hf" / name)
    hf_export.export(multirank[name], out)
    # ours: the TP2 / EP2 checkpoint resharded onto one rank by the runtime's loader
    assert_same_logits(multirank[name], out, ctx)


def test_tokenizer_travels(checkpoints, root):
    from megatron_ext.data.tokenizer import EOD, BPETokenizer

    out = str(root / "hf_tok")
    hf_export.export(checkpoints["gpt"], out)
    meta = {"config": ckpt.config_of(checkpoints["gpt"])}
    ours = BPETokenizer(hf_export.tokenizer_file_for(meta, None))
    theirs = hf_export.transformers_module().AutoTokenizer.from_pretrained(out)
    text = "def main(argv):\n    return sorted(set(argv), key=len)  # héllo\n"
    assert theirs.encode(text, add_special_tokens=False) == ours.tokenize(text)
    assert theirs.eos_token == EOD and theirs.eos_token_id == ours.eod
    assert theirs.decode(ours.tokenize(text)) == text


@pytest.mark.parametrize("name", ["gpt", "qwen3", "moe", "moe_presoftmax"])
def test_import_gives_back_the_checkpoint_and_trains_on(ctx, checkpoints, root, name):
    out = str(root / "hf_rt" / name)
    hf_export.export(checkpoints[name], out)
    back = str(root / "imported" / name)
    # no --seq-length: model.yaml carries the model's context (32 here), as every other model field
    done = hf_export.import_hf(out, back, ["--lr", "1e-3"])
    _, original = hf_export.read_full_tensors(checkpoints[name])
    _, imported = hf_export.read_full_tensors(back)
    assert set(imported) == set(original)
    assert all(torch.equal(imported[k], original[k]) for k in original)
    toks = tokens()
    assert torch.equal(hf_export.megatron_logits(back, toks, ctx),
                       hf_export.megatron_logits(checkpoints[name], toks, ctx))

    # pretrain_gpt.py --config <import>/model.yaml --load <import>: the same model flags, iteration 0
    cfg = parse_run_config(["--config", done.model_yaml, "--load", back, "--lr", "1e-3", "--train-iters", "2",
                            "--eval-iters", "0", "--progress", "false", "--global-batch-size", "4",
                            "--micro-batch-size", "2", "--lr-decay-style", "constant"])
    # (the token dispatcher is the run's choice of communication, not part of the model)
    assert cfg.model == config_from_values({**BASE, **MODELS[name], "moe_token_dispatcher_type": "allgather"}).model
    trainer = Trainer(cfg, ctx).setup()
    assert trainer.iteration == 0
    history = trainer.run()
    losses = [h["loss"] for h in history if h["kind"] == "train"]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_import_reads_fused_experts(checkpoints, root):
    """transformers 5 holds a Qwen3-MoE layer's experts as two 3-D tensors (gate_up_proj, down_proj);
    a directory saved from that state dict imports to the same tensors as the hub's per-expert one."""
    from safetensors.torch import save_file

    out = str(root / "hf_fused")
    hf_export.export(checkpoints["moe"], out)
    state = hf_model(out).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file({k: v.contiguous() for k, v in state.items()},
              os.path.join(out, hf_export.WEIGHTS), metadata={"format": "pt"})
    back = str(root / "imported_fused")
    hf_export.import_hf(out, back, ["--seq-length", "32"])
    _, original = hf_export.read_full_tensors(checkpoints["moe"])
    _, imported = hf_export.read_full_tensors(back)
    assert set(imported) == set(original) and all(torch.equal(imported[k], original[k]) for k in original)


def test_import_refuses_flags_that_contradict_the_model(checkpoints, root):
    out = str(root / "hf_flags")
    hf_export.export(checkpoints["llama"], out)
    with pytest.raises(hf_export.ConversionError) as err:
        hf_export.import_hf(out, str(root / "imported_flags"), ["--seq-length", "32", "--hidden-size", "128"])
    assert str(err.value) == (f"--hidden-size 128 contradicts the Hugging Face model {out}/config.json (64): "
                              "leave it out")


# --- errors: one line naming what and where --------------------------------------------------------

def test_a_bad_checkpoint_path_is_one_line(tmp_path, capsys):
    from tools.convert_checkpoint import main

    missing = str(tmp_path / "nope")
    assert main(["export", missing, str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"convert_checkpoint.py: error: {missing}: no such checkpoint directory\n"
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"convert_checkpoint.py: error: {tmp_path}: not a checkpoint directory (no "
                                       "latest_checkpointed_iteration.txt, no 'latest' file, no meta.json)\n")


@pytest.mark.parametrize("values, message", [
    ({"swiglu": True, "ffn_hidden_size": 128},
     "ckpt: the llama model (--swiglu) has no Hugging Face equivalent: Llama needs --normalization RMSNorm, "
     "--position-embedding-type rope"),
    ({"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope", "qk_layernorm": True},
     "ckpt: --qk-layernorm with biases has no Hugging Face equivalent: Qwen3 (the HF model with q/k norms) has "
     "no MLP biases; use --disable-bias-linear"),
    ({**MODELS["moe"], "qk_layernorm": False},
     "ckpt: the MoE model without --qk-layernorm has no Hugging Face equivalent: Qwen3-MoE normalises queries "
     "and keys per head"),
    ({**MODELS["moe"], "moe_router_topk": 1, "moe_router_load_balancing_type": "sinkhorn", "moe_aux_loss_coeff": 0},
     "ckpt: Sinkhorn routing with --moe-router-topk 1 weighs the expert by a sigmoid, which Qwen3-MoE's router "
     "does not"),
    ({**MODELS["moe"], "moe_router_score_function": "sigmoid"},
     "ckpt: --moe-router-score-function sigmoid has no Hugging Face equivalent: Qwen3-MoE's router scores the "
     "experts by a softmax"),
    ({**MODELS["moe"], "moe_router_topk_scaling_factor": 2.5},
     "ckpt: --moe-router-topk-scaling-factor 2.5 has no Hugging Face equivalent: Qwen3-MoE's router does not scale "
     "the top-k weights"),
    ({**MODELS["moe"], "moe_shared_expert_intermediate_size": 32},
     "ckpt: --moe-shared-expert-intermediate-size has no Hugging Face equivalent: Qwen3-MoE has no shared expert"),
])
def test_a_model_without_a_counterpart_is_refused(values, message):
    m = config_from_values({**BASE, **values}).model
    with pytest.raises(hf_export.ConversionError) as err:
        hf_export.hf_model_type(m, "ckpt")
    assert str(err.value) == message


@pytest.mark.parametrize("model_type, kwargs, message", [
    ("bert", {}, "config.json: model_type 'bert' is not one of gpt2, llama, qwen3, qwen3_moe"),
    ("gpt2", {}, "config.json: activation_function 'gelu_new' cannot be mapped: megatron-ext's GPT block uses "
     "the exact GELU (\"gelu\")"),
    ("llama", {"rms_norm_eps": 1e-6}, "config.json: rms_norm_eps 1e-06 cannot be mapped: megatron's norms use "
     "epsilon 1e-05 (no flag sets another)"),
    ("llama", {"rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 8192}},
     "config.json: rope_parameters.rope_type 'llama3' cannot be mapped: megatron-ext's rotary embedding is unscaled"),
])
def test_an_hf_config_that_cannot_be_mapped_is_refused(model_type, kwargs, message):
    tf = hf_export.transformers_module()
    config = tf.AutoConfig.for_model(model_type, **kwargs)
    with pytest.raises(hf_export.ConversionError) as err:
        hf_export.model_values(config, "config.json")
    assert str(err.value) == message

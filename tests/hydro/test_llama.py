"""The LLaMA-style block in Hydro: what its layers compute, shrinking and muP of its widths, fusion."""
import pytest
import torch
from torch import nn

from megatron_ext.hydro.fuse import fuse_model
from megatron_ext.hydro.models import GPT, GPTShape, SelfAttention, llama_shape
from megatron_ext.hydro.nn import FusedGPT, FusedSelfAttention
from megatron_ext.hydro.parametrization import apply_mup, mup_multipliers, param_shapes
from megatron_ext.hydro.shrink import shrink_model

from tests.hydro.hydro_helpers import import_transformers

V, T = 37, 12


@pytest.fixture(autouse=True)
def _float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def llama(d=32, heads=4, groups=2, parametrization="sp", seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(llama_shape(vocab_size=V, seq_len=T, d_model=d, n_layers=2, n_heads=heads, n_query_groups=groups,
                           rotary_base=500000.0, parametrization=parametrization, **kw))


def test_llama_block_computes_what_transformers_llama_computes():
    """An independent implementation: transformers' LlamaForCausalLM with our weights gives our
    logits, so RMSNorm, SwiGLU, rotary positions (base, half pairing) and the query-head-to-group
    map mean what they mean in LLaMA (and in megatron's llama family)."""
    tr = import_transformers()
    if tr is None:
        pytest.skip("transformers is not installed (the dev extra)")
    ours = llama(d=32, heads=4, groups=2, ffn_hidden=48)
    for p in ours.parameters():   # RMSNorm gains away from 1, so a gain mapped wrongly shows
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    cfg = tr.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=T, rms_norm_eps=1e-5, rope_theta=500000.0,
                         tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    hf = tr.LlamaForCausalLM(cfg).double().eval()
    sd = {"model.embed_tokens.weight": ours.tok.weight, "model.norm.weight": ours.ln_f.weight,
          "lm_head.weight": ours.head.weight}
    for i, blk in enumerate(ours.blocks):
        q, k, v = blk.attn.qkv.weight.split([32, 16, 16])
        pre = f"model.layers.{i}."
        sd.update({pre + "self_attn.q_proj.weight": q, pre + "self_attn.k_proj.weight": k,
                   pre + "self_attn.v_proj.weight": v, pre + "self_attn.o_proj.weight": blk.attn.proj.weight,
                   pre + "mlp.gate_proj.weight": blk.mlp.gate.weight, pre + "mlp.up_proj.weight": blk.mlp.fc1.weight,
                   pre + "mlp.down_proj.weight": blk.mlp.fc2.weight, pre + "input_layernorm.weight": blk.ln1.weight,
                   pre + "post_attention_layernorm.weight": blk.ln2.weight})
    missing, unexpected = hf.load_state_dict({k: t.detach() for k, t in sd.items()}, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m]
    ids = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = ours(ids), hf(ids).logits
    # transformers computes RMSNorm and the rotary frequencies in float32 even for a float64 model:
    # agreement to float32 rounding (a wrong pairing or group map is off by O(0.1))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert float((got - want).abs().max()) < 1e-5 * float(want.abs().max())


def test_grouped_query_attention_with_rope_fuses_and_matches_each_trial():
    plains = [SelfAttention(16, 4, scale=0.25, bias=False, n_query_groups=2, rotary_base=10000.0) for _ in range(3)]
    fused = FusedSelfAttention.from_plain(plains)
    assert fused.qkv.weight.shape == (3, 16 + 2 * 2 * 4, 16)        # q: 4 heads, k and v: 2 groups of 4
    x = torch.randn(5, T, 16)
    y = fused(torch.cat([x] * 3))
    w = torch.randn_like(y)
    (y * w).sum().backward()
    for b, p in enumerate(plains):
        ref = p(x)
        torch.testing.assert_close(y[b * 5:(b + 1) * 5], ref, atol=1e-12, rtol=1e-10)
        (ref * w[b * 5:(b + 1) * 5]).sum().backward()
        torch.testing.assert_close(fused.qkv.weight.grad[b], p.qkv.weight.grad, atol=1e-10, rtol=1e-8)
    with pytest.raises(ValueError, match="trial 1 has kv_heads=4, trial 0 has 2"):
        FusedSelfAttention.from_plain([plains[0], SelfAttention(16, 4, scale=0.25, bias=False)])


def test_fx_fused_and_hand_written_fused_llama_equal_the_plain_models():
    ids = torch.randint(0, V, (2, T))
    model = llama()
    gm = fuse_model(model, 3, seeds=[1, 2, 3], example_inputs=(ids,), rtol=1e-10)   # checked per trial
    assert not hasattr(gm, "pos") and isinstance(gm.get_submodule("blocks.0.attn"), FusedSelfAttention)
    assert gm.get_submodule("blocks.1.mlp.gate").weight.shape == (3, 64, 32)        # int(8 * 32 / 3 / 64) * 64
    plains = [llama(seed=s) for s in range(3)]
    hand = FusedGPT.from_plain(plains)
    out = hand(ids, shared_input=True)
    for b, p in enumerate(plains):
        torch.testing.assert_close(out[b * 2:(b + 1) * 2], p(ids), atol=1e-12, rtol=1e-10)
    assert set(hand.state_dict()) == set(plains[0].state_dict())


@pytest.mark.parametrize("mode,heads,groups,head_dim,after", [
    ("heads", 2, 1, 8, "16 (2 heads, 1 query group, head dim 8)"),          # groups scale with the heads
    ("head_dim", 8, 4, 2, "16 (8 heads, 4 query groups, head dim 2)")])
def test_shrink_scales_swiglu_and_attention_of_the_llama_block(mode, heads, groups, head_dim, after):
    ids = torch.randint(0, V, (2, T))
    small = shrink_model(llama(d=64, heads=8, groups=4), 0.25, example_inputs=(ids,), mode=mode)
    attn = small.get_submodule("blocks.0.attn")
    assert (attn.n_heads, attn.kv_heads, attn.d_model // attn.n_heads) == (heads, groups, head_dim)
    assert attn.rotary_base == 500000.0
    for name in ("gate", "fc1"):
        assert small.get_submodule(f"blocks.0.mlp.{name}").weight.shape == (32, 16)   # SwiGLU 128 -> 32
    assert small.get_submodule("blocks.0.mlp.fc2").weight.shape == (16, 32)
    assert small.get_submodule("blocks.0.ln1").weight.shape == (16,)
    assert small(ids).shape == (2, T, V)
    rep = small.shrink_report
    assert rep.changed["blocks.0.attn"] == "attention 64 (8 heads, 4 query groups, head dim 8) -> " + after
    assert rep.changed["blocks.0.mlp.gate"] == "Linear 64x128 -> 16x32"


def test_shrink_keeps_rotary_head_dims_even():
    ids = torch.randint(0, V, (2, T))
    small = shrink_model(llama(d=48, heads=4, groups=2, ffn_hidden=96), 0.5, example_inputs=(ids,), mode="head_dim")
    assert small.get_submodule("blocks.0.attn").d_model // 4 == 6          # 12 * 0.5 = 6, even: kept
    small = shrink_model(llama(d=40, heads=4, groups=2, ffn_hidden=80), 0.5, example_inputs=(ids,), mode="head_dim")
    assert small.get_submodule("blocks.0.attn").d_model // 4 == 6          # 10 * 0.5 = 5 -> 6 (rotation pairs)
    assert small.shrink_report.changed["blocks.0.attn"].endswith("-> 24 (4 heads, 2 query groups, head dim 6)")
    assert small.get_submodule("blocks.0.mlp.fc1").out_features == 40      # the MLP still takes the ratio


def test_mup_scales_swiglu_and_attention_lrs_and_leaves_rmsnorm_gains():
    ids = torch.randint(0, V, (2, T))
    target = llama(d=64, heads=8, groups=4, parametrization="mup", ffn_hidden=256)
    proxy = shrink_model(target, 0.25, example_inputs=(ids,))
    apply_mup(target, param_shapes(proxy), param_shapes(target))
    mults = mup_multipliers(target, "adam")
    for name in ("mlp.gate", "mlp.fc1", "mlp.fc2", "attn.qkv", "attn.proj"):
        assert mults[f"blocks.0.{name}.weight"] == (0.25, 4.0), name         # hidden matrices: lr / width_mult
    assert mults["blocks.0.ln1.weight"] == (1.0, 1.0) and mults["ln_f.weight"] == (1.0, 1.0)   # vector-like
    assert mults["tok.weight"] == (1.0, 1.0) and target.head.width_mult() == 4.0
    assert "head.bias" not in mults and "blocks.0.mlp.fc1.bias" not in mults   # no biases in the llama block


def test_shape_flags_are_checked():
    with pytest.raises(ValueError, match="n_heads 4 must be divisible by n_query_groups 3"):
        GPTShape(vocab_size=V, seq_len=T, d_model=32, n_heads=4, n_query_groups=3)
    with pytest.raises(ValueError, match="rotary embeddings need an even head dim, got 3"):
        GPTShape(vocab_size=V, seq_len=T, d_model=12, n_heads=4, position="rope")
    with pytest.raises(ValueError, match="swiglu gates with SiLU"):
        GPTShape(vocab_size=V, seq_len=T, swiglu=True)
    assert llama().shape.family == "llama" and GPTShape(vocab_size=V, seq_len=T).family == "gpt"
    assert isinstance(llama().blocks[0].ln1, nn.RMSNorm) and llama().pos is None

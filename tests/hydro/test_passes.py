"""torch.fx passes: fuse_model and shrink_model, with their checks and error reports."""
import pytest
import torch
from torch import nn

from megatron_ext.hydro.fuse import fuse_model
from megatron_ext.hydro.fx_common import PassError
from megatron_ext.hydro.models import GPT, GPTShape, SmallCNN
from megatron_ext.hydro.nn import FusedBatchNorm, FusedConv2d, FusedLinear, FusedSelfAttention, expand_trials
from megatron_ext.hydro.parametrization import apply_mup, mup_multipliers, param_shapes
from megatron_ext.hydro.shrink import shrink_model


def gpt(d=32, heads=4, parametrization="sp"):
    torch.manual_seed(0)
    return GPT(GPTShape(vocab_size=23, seq_len=8, d_model=d, n_layers=2, n_heads=heads, parametrization=parametrization))


def test_fuse_gpt_and_cnn_trials_match_their_own_inits():
    ids = torch.randint(0, 23, (3, 8))
    model = gpt()
    gm = fuse_model(model, 4, seeds=[1, 2, 3, 4], example_inputs=(ids,))
    assert isinstance(gm.get_submodule("blocks.0.attn"), FusedSelfAttention)
    assert isinstance(gm.get_submodule("head"), FusedLinear)
    out = gm(expand_trials(ids, 4))
    assert out.shape == (12, 8, 23)
    # trials differ (own init) and trial b is the model re-initialised with seed b+1
    assert not torch.allclose(out[:3], out[3:6])
    w = gm.get_submodule("blocks.1.mlp.fc1").weight
    assert not torch.equal(w[0], w[1])

    cnn = SmallCNN(channels=4)
    img = torch.randn(5, 3, 8, 8)
    g2 = fuse_model(cnn, 3, seeds=[0, 1, 2], example_inputs=(img,))
    assert isinstance(g2.get_submodule("conv2"), FusedConv2d) and isinstance(g2.get_submodule("bn1"), FusedBatchNorm)
    assert g2(expand_trials(img, 3)).shape == (15, 10)


class WithLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(4, 4)
        self.fc = nn.Linear(4, 2)
        self.scale = nn.Parameter(torch.ones(2))

    def forward(self, x):
        return self.fc(self.rnn(x)[0]) * self.scale


def test_unsupported_modules_are_named():
    with pytest.raises(PassError) as ei:
        fuse_model(WithLSTM(), 2, example_inputs=(torch.randn(3, 5, 4),))
    msg = str(ei.value)
    assert "rnn (LSTM)" in msg and "scale (parameter read directly" in msg
    assert "fc (" not in msg  # the supported Linear is not reported


class MixesBatch(nn.Module):
    """Subtracts the batch mean: fine for one model, wrong for fused trials (it mixes trials)."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h - h.mean(dim=0, keepdim=True)


def test_fuse_check_names_the_node_that_mixes_samples():
    with pytest.raises(PassError, match=r"trial 0 differs .* first diverging node: mean"):
        fuse_model(MixesBatch(), 2, seeds=[0, 1], example_inputs=(torch.randn(3, 4),))
    fuse_model(MixesBatch(), 2, seeds=[0, 1], example_inputs=(torch.randn(3, 4),), check=False)  # opt-out works


def test_fuse_check_leaves_batchnorm_state_untouched():
    cnn = SmallCNN(channels=4)
    gm = fuse_model(cnn, 2, example_inputs=(torch.randn(4, 3, 8, 8),))
    assert torch.equal(gm.get_submodule("bn1").running_mean, torch.zeros(2, 4))
    assert gm.training


@pytest.mark.parametrize("mode,heads,head_dim", [("heads", 2, 8), ("head_dim", 4, 4)])
def test_shrink_gpt_scales_hidden_ffn_and_attention(mode, heads, head_dim):
    ids = torch.randint(0, 23, (2, 8))
    small = shrink_model(gpt(32, 4), 0.5, example_inputs=(ids,), mode=mode)
    attn = small.get_submodule("blocks.0.attn")
    assert (attn.n_heads, attn.d_model // attn.n_heads) == (heads, head_dim)
    assert small.get_submodule("tok").weight.shape == (23, 16)         # vocab fixed, width halved
    assert small.get_submodule("blocks.1.mlp.fc1").weight.shape == (64, 16)
    assert small.get_submodule("head").weight.shape == (23, 16)
    assert small(ids).shape == (2, 8, 23)
    rep = small.shrink_report
    assert rep.changed["blocks.0.mlp.fc1"] == "Linear 32x128 -> 16x64"
    assert any("model output" in f for f in rep.fixed)


def test_shrink_keeps_the_attention_rule_of_the_parametrization():
    ids = torch.randint(0, 23, (2, 8))
    sp = shrink_model(gpt(32, 4, "sp"), 1.0, example_inputs=(ids,), mode="head_dim")
    assert sp.get_submodule("blocks.0.attn").scale == pytest.approx(1 / 8 ** 0.5)
    small = shrink_model(gpt(32, 4, "sp"), 0.5, example_inputs=(ids,), mode="head_dim")
    assert small.get_submodule("blocks.0.attn").scale == pytest.approx(1 / 4 ** 0.5)
    small = shrink_model(gpt(32, 4, "mup"), 0.5, example_inputs=(ids,), mode="head_dim")
    assert small.get_submodule("blocks.0.attn").scale == pytest.approx(1 / 4)   # muP: 1/d


def test_shrink_cnn_and_widen():
    img = torch.randn(2, 3, 8, 8)
    small = shrink_model(SmallCNN(channels=8), 0.5, example_inputs=(img,))
    assert small.get_submodule("conv1").weight.shape == (4, 3, 3, 3)
    assert small.get_submodule("fc").weight.shape == (10, 8)
    wide = shrink_model(SmallCNN(channels=8), 2.0, example_inputs=(img,))
    assert wide.get_submodule("bn2").num_features == 32 and wide(img).shape == (2, 10)


class HardCoded(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc1(x).view(-1, 2, 4)        # hard-codes the width 8 as 2 x 4
        return self.fc2(h.reshape(-1, 8))


def test_shrink_keeps_widths_behind_opaque_reshapes():
    small = shrink_model(HardCoded(), 0.5, example_inputs=(torch.randn(3, 4),))
    assert small.get_submodule("fc1").out_features == 8    # fixed by the reshape, reported as such
    assert any("view" in f for f in small.shrink_report.fixed)


def test_shrink_refuses_bad_arguments():
    with pytest.raises(PassError, match="ratio must be > 0"):
        shrink_model(SmallCNN(), 0.0, example_inputs=(torch.randn(1, 3, 8, 8),))
    with pytest.raises(PassError, match="rnn \\(LSTM\\)"):
        shrink_model(WithLSTM(), 0.5, example_inputs=(torch.randn(3, 5, 4),))


def test_mup_on_shrunk_proxy_scales_hidden_lrs_by_width():
    ids = torch.randint(0, 23, (2, 8))
    target = gpt(64, 8, "mup")
    proxy = shrink_model(target, 0.25, example_inputs=(ids,))
    base, delta = param_shapes(proxy), param_shapes(target)
    apply_mup(target, base, delta)
    mults = mup_multipliers(target, "adam")
    assert mults["blocks.0.mlp.fc1.weight"] == (0.25, 4.0)      # hidden matrix: lr / width_mult
    assert mults["tok.weight"] == (1.0, 1.0) and mults["head.weight"] == (1.0, 1.0)
    assert target.head.width_mult() == 4.0
    sgd = mup_multipliers(target, "sgd")
    assert sgd["tok.weight"][0] == 4.0 and sgd["blocks.0.mlp.fc1.weight"][0] == 1.0

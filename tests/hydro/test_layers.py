"""Each fused layer equals B plain layers run one by one (forward, gradients, running state)."""
import mup
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_ext.hydro.models import GPT, GPTShape, SelfAttention
from megatron_ext.hydro.nn import (FusedBatchNorm, FusedConv2d, FusedDropout, FusedEmbedding, FusedGPT, FusedLayerNorm,
                                   FusedLinear, FusedRMSNorm, FusedSelfAttention, fused_cross_entropy, resize_trials,
                                   unfuse_state)

B, N = 3, 4


@pytest.fixture(autouse=True)
def _float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def _plains(make, seed0=0):
    out = []
    for b in range(B):
        torch.manual_seed(seed0 + b)
        out.append(make())
    return out


def _check(fused, plains, x_plain, x_fused=None, atol=1e-12):
    """Fused output rows of trial b == plain b's output; gradients w.r.t. every parameter match."""
    x_fused = x_fused if x_fused is not None else torch.cat([x_plain] * B)
    y = fused(x_fused)
    ys = [p(x_plain) for p in plains]
    n = x_plain.shape[0]
    for b in range(B):
        torch.testing.assert_close(y[b * n:(b + 1) * n], ys[b], atol=atol, rtol=1e-10)
    if y.is_floating_point() and y.requires_grad:
        w = torch.randn_like(y)
        (y * w).sum().backward()
        for b, p in enumerate(plains):
            (ys[b] * w[b * n:(b + 1) * n]).sum().backward()
        fused_grads = {k: v.grad for k, v in fused.named_parameters()}
        for b, p in enumerate(plains):
            for k, v in p.named_parameters():
                torch.testing.assert_close(fused_grads[k][b], v.grad, atol=1e-10, rtol=1e-8)


def test_linear_and_mureadout():
    plains = _plains(lambda: nn.Linear(5, 7))
    _check(FusedLinear.from_plain(plains), plains, torch.randn(N, 2, 5))
    ro = _plains(lambda: mup.MuReadout(6, 4, output_mult=2.0))
    for m in ro:
        mup.set_base_shapes(m, {"weight": (4, 3), "bias": (4,)}, rescale_params=False, do_assert=False)
    fused = FusedLinear.from_plain(ro)
    assert fused.input_mult == pytest.approx(2.0 / 2.0)  # output_mult / width_mult (6 over base 3)
    _check(fused, ro, torch.randn(N, 6))


def test_embedding_norms_attention():
    ids = torch.randint(0, 11, (N, 5))
    plains = _plains(lambda: nn.Embedding(11, 6))
    _check(FusedEmbedding.from_plain(plains), plains, ids)
    for make, cls in ((lambda: nn.LayerNorm(6), FusedLayerNorm), (lambda: nn.RMSNorm(6, eps=1e-5), FusedRMSNorm)):
        plains = _plains(make)
        for p in plains:  # non-trivial affine parameters
            for t in p.parameters():
                t.data.normal_()
        _check(cls.from_plain(plains), plains, torch.randn(N, 5, 6))
    plains = _plains(lambda: SelfAttention(8, 2, scale=0.3))
    _check(FusedSelfAttention.from_plain(plains), plains, torch.randn(N, 5, 8))


@pytest.mark.parametrize("groups", [1, 2])
def test_conv2d_grouped(groups):
    plains = _plains(lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=groups))
    _check(FusedConv2d.from_plain(plains), plains, torch.randn(N, 4, 7, 7))


def test_batchnorm_statistics_are_per_trial():
    plains = _plains(lambda: nn.BatchNorm2d(3, momentum=0.3))
    fused = FusedBatchNorm.from_plain(plains)
    xs = [torch.randn(N, 3, 4, 4) * (b + 1) + b for b in range(B)]  # each trial its own data
    y = fused(torch.cat(xs))
    for b, p in enumerate(plains):
        torch.testing.assert_close(y[b * N:(b + 1) * N], p(xs[b]))
        torch.testing.assert_close(fused.running_mean[b], p.running_mean)
        torch.testing.assert_close(fused.running_var[b], p.running_var)
        assert int(fused.num_batches_tracked[b]) == int(p.num_batches_tracked) == 1
    fused.eval()
    for p in plains:
        p.eval()
    _check(fused, plains, torch.randn(N, 3, 4, 4))


def test_dropout_probability_per_trial():
    torch.manual_seed(0)
    d = FusedDropout(3)
    d.set_p([0.0, 0.5, 1.0])
    x = torch.ones(3 * 2000, 4)
    y = d(x).reshape(3, 2000, 4)
    assert torch.equal(y[0], torch.ones(2000, 4))
    assert abs(float((y[1] == 0).double().mean()) - 0.5) < 0.03 and float(y[1].max()) == 2.0
    assert float(y[2].abs().max()) == 0.0
    d.eval()
    assert torch.equal(d(x), x)


def test_fused_gpt_matches_plain_gpts_and_loss_is_per_trial():
    shape = GPTShape(vocab_size=13, seq_len=6, d_model=8, n_layers=2, n_heads=2, norm="rmsnorm", activation="silu")
    plains = _plains(lambda: GPT(shape).double())
    fused = FusedGPT.from_plain(plains)
    ids, tgt = torch.randint(0, 13, (N, 6)), torch.randint(0, 13, (N, 6))
    logits = fused(ids, shared_input=True)
    losses = fused_cross_entropy(logits, tgt, B)
    for b, p in enumerate(plains):
        ref = p(ids)
        torch.testing.assert_close(logits[b * N:(b + 1) * N], ref)
        torch.testing.assert_close(losses[b], F.cross_entropy(ref.reshape(-1, 13), tgt.reshape(-1)))
    state1 = unfuse_state(fused, 1)
    for k, v in plains[1].state_dict().items():
        assert torch.equal(state1[k], v)


def test_resize_keeps_parameter_identity():
    plains = _plains(lambda: nn.Linear(3, 2))
    fused = FusedLinear.from_plain(plains)
    w = fused.weight
    extra = nn.Linear(3, 2)
    resize_trials(fused, [2, 0], [extra.state_dict()])
    assert fused.weight is w and fused.weight.shape == (3, 2, 3)
    assert torch.equal(fused.weight[0], plains[2].weight) and torch.equal(fused.weight[1], plains[0].weight)
    assert torch.equal(fused.weight[2], extra.weight)


def test_mismatched_trials_are_refused():
    with pytest.raises(ValueError, match="trial 1 has out_features=3, trial 0 has 2"):
        FusedLinear.from_plain([nn.Linear(3, 2), nn.Linear(3, 3)])
    with pytest.raises(ValueError, match="without base shapes"):
        FusedLinear.from_plain([mup.MuReadout(3, 2)])

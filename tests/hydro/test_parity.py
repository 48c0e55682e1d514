"""Fused trials trained together equal the same trials trained alone (item 4 and item 6)."""
import mup
import pytest
import torch
import torch.nn.functional as F

from megatron_ext.hydro.bundle import TrialBundle, TrialSpec
from megatron_ext.hydro.nn import fused_cross_entropy
from megatron_ext.hydro.optim import TrialHParams
from megatron_ext.hydro.parametrization import mup_multipliers
from megatron_ext.hydro.schedule import LRSchedule

from tests.hydro.hydro_helpers import LLAMA_KW, gpt_factory, token_batch

FAMILIES = {"gpt": {}, "llama": LLAMA_KW}   # GPTShape flags per block

STEPS = 6


def train_alone(factory, spec: TrialSpec, kind: str, batches, mup_on: bool):
    model = factory(spec.seed)
    h = spec.hparams
    if kind == "sgd":
        kw = dict(lr=h.lr, momentum=h.momentum, dampening=h.dampening, weight_decay=h.weight_decay)
        opt = (mup.MuSGD if mup_on else torch.optim.SGD)(model.parameters(), **kw)
    else:
        kw = dict(lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps, weight_decay=h.weight_decay)
        if mup_on:
            opt = (mup.MuAdamW if kind == "adamw" else mup.MuAdam)(model.parameters(), **kw)
        else:
            opt = (torch.optim.AdamW if kind == "adamw" else torch.optim.Adam)(model.parameters(), **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, h.schedule.factor)
    for x, y in batches:
        opt.zero_grad()
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        if h.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), h.grad_clip)
        opt.step()
        sched.step()
    return model.state_dict()


def max_rel_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for k in b:
        ref = b[k].double()
        if not ref.is_floating_point():
            continue
        worst = max(worst, float((a[k].double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)))
    return worst


def specs_for(kind):
    return [
        TrialSpec(0, seed=11, hparams=TrialHParams(lr=3e-3, beta1=0.9, beta2=0.99, weight_decay=0.0, momentum=0.9,
                                                    schedule=LRSchedule(kind="cosine", warmup_steps=2, total_steps=STEPS))),
        TrialSpec(1, seed=12, hparams=TrialHParams(lr=1e-2, beta1=0.8, beta2=0.999, weight_decay=0.1, momentum=0.0,
                                                    grad_clip=0.5)),
        TrialSpec(2, seed=13, hparams=TrialHParams(lr=1e-3, beta1=0.95, beta2=0.9, eps=1e-6, weight_decay=0.01,
                                                    momentum=0.5, dampening=0.1,
                                                    schedule=LRSchedule(kind="linear", total_steps=STEPS, min_ratio=0.1))),
    ]


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("parametrization", ["sp", "mup"])
def test_fused_trials_equal_trials_alone_float64(kind, parametrization, family):
    factory = gpt_factory(d_model=32, n_heads=4, parametrization=parametrization, base_d=16, **FAMILIES[family])
    specs = specs_for(kind)
    mults = None
    if parametrization == "mup":
        mults = mup_multipliers(factory(0), kind)
        assert any(lm != 1.0 for lm, _ in mults.values()), "muP must scale some learning rates at width 2x base"
    batches = [token_batch(100 + i) for i in range(STEPS)]
    bundle = TrialBundle(factory, specs, optimizer=kind, loss_fn=fused_cross_entropy,
                         example_inputs=(batches[0][0],), multipliers=mults)
    for x, y in batches:
        bundle.train_step(x, y)
    for spec in specs:
        ref = train_alone(factory, spec, kind, batches, parametrization == "mup")
        got = bundle.trial_state(spec.trial_id)
        assert max_rel_diff(got, ref) < 1e-10, (kind, parametrization, family, spec.trial_id)
        # the trial moved: parity is not the trivial "nothing trained"
        assert max_rel_diff(got, factory(spec.seed).state_dict()) > 1e-4


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_fused_parity_float32_within_1e5(kind, family):
    factory = gpt_factory(d_model=32, n_heads=4, dtype=torch.float32, **FAMILIES[family])
    specs = specs_for(kind)
    batches = [token_batch(200 + i) for i in range(STEPS)]
    bundle = TrialBundle(factory, specs, optimizer=kind, loss_fn=fused_cross_entropy,
                         example_inputs=(batches[0][0],))
    for x, y in batches:
        bundle.train_step(x, y)
    for spec in specs:
        ref = train_alone(factory, spec, kind, batches, False)
        assert max_rel_diff(bundle.trial_state(spec.trial_id), ref) < 1e-5


def test_resize_keeps_survivors_and_new_trials_start_fresh():
    """Drop a trial and add one mid-run: survivors match trials run alone through all steps;
    the newcomer matches a trial run alone from the step it joined (its own step count)."""
    kind = "adam"
    factory = gpt_factory(d_model=16, n_heads=2)
    specs = specs_for(kind)
    batches = [token_batch(300 + i) for i in range(STEPS)]
    bundle = TrialBundle(factory, specs, optimizer=kind, loss_fn=fused_cross_entropy,
                         example_inputs=(batches[0][0],))
    half = STEPS // 2
    for x, y in batches[:half]:
        bundle.train_step(x, y)
    newcomer = TrialSpec("new", seed=99, hparams=TrialHParams(lr=5e-3, schedule=LRSchedule(kind="cosine", warmup_steps=1, total_steps=half)))
    bundle.resize([2, 0], [newcomer])
    assert bundle.trial_ids == [2, 0, "new"]
    assert bundle.num_trials == 3 and bundle.model.get_submodule("blocks.0.attn.qkv").weight.shape[0] == 3
    for x, y in batches[half:]:
        bundle.train_step(x, y)
    assert bundle.steps_of(0) == STEPS and bundle.steps_of("new") == STEPS - half
    for spec in (specs[0], specs[2]):
        ref = train_alone(factory, spec, kind, batches, False)
        assert max_rel_diff(bundle.trial_state(spec.trial_id), ref) < 1e-10
    ref_new = train_alone(factory, newcomer, kind, batches[half:], False)
    assert max_rel_diff(bundle.trial_state("new"), ref_new) < 1e-10
    with pytest.raises(KeyError, match="trial 1 is not in this bundle"):
        bundle.trial_state(1)
    with pytest.raises(ValueError, match="already in the bundle"):
        bundle.add([TrialSpec(0, seed=1)])

"""Bundle interface for bubbles: pause points between layers, memory footprint, elastic fusion."""
import threading

import pytest
import torch

from megatron_ext.hydro.bundle import TrialBundle, TrialSpec
from megatron_ext.hydro.memory import LinearMemoryModel, fusion_count, probe_memory_model
from megatron_ext.hydro.nn import fused_cross_entropy
from megatron_ext.hydro.optim import TrialHParams

from tests.hydro.hydro_helpers import gpt_factory, token_batch


def make_bundle(n=3, d=16):
    factory = gpt_factory(d_model=d, n_heads=2)
    specs = [TrialSpec(i, seed=i, hparams=TrialHParams(lr=1e-3 * (i + 1))) for i in range(n)]
    return TrialBundle(factory, specs, optimizer="adam", loss_fn=fused_cross_entropy,
                       example_inputs=(token_batch(0)[0],))


def test_pause_parks_between_layers_and_resume_changes_nothing():
    batches = [token_batch(10 + i) for i in range(3)]
    ref = make_bundle()
    for x, y in batches:
        ref.train_step(x, y)
    per_step = ref.gate.checkpoints // 3
    # forward: embeddings, 1 block, final norm, head; backward: the same layers with outputs needing grad
    assert per_step >= 8

    bundle = make_bundle()
    seen = []
    bundle.gate.on_checkpoint = seen.append
    parked_at = []

    def run():
        for x, y in batches:
            bundle.train_step(x, y)

    # Ask for a pause before starting: the bundle must park at its very first pause point.
    bundle.gate.request_pause()
    t = threading.Thread(target=run)
    t.start()
    assert bundle.gate.pause(timeout_s=30), "bundle did not reach a pause point"
    for _ in range(per_step + 3):                   # walk through a step one layer at a time
        parked_at.append(bundle.gate.parked_at)
        n = bundle.gate.checkpoints
        threading.Event().wait(0.01)
        assert bundle.gate.checkpoints == n, "a parked bundle must not advance"
        assert bundle.gate.advance(timeout_s=30), "bundle did not reach its next pause point"
    bundle.gate.resume()
    t.join(timeout=60)
    assert not t.is_alive()
    assert parked_at[0] == "forward tok"
    assert any(p.startswith("backward ") for p in parked_at)
    assert any(p.startswith("forward blocks.0") for p in parked_at)
    for tid in range(3):   # pausing is invisible in the result
        for k, v in ref.trial_state(tid).items():
            assert torch.equal(bundle.trial_state(tid)[k], v), k


def test_memory_footprint_is_per_trial_and_follows_resize():
    b = make_bundle(4)
    fp0 = b.memory_footprint()
    assert fp0["optimizer_bytes"] == 0 and fp0["activation_bytes"] == 0
    b.train_step(*token_batch(1))
    fp = b.memory_footprint()
    n_params = sum(p.numel() for p in b.model.parameters())
    assert fp["param_bytes"] == n_params * 8                       # float64 test models
    assert fp["optimizer_bytes"] == 2 * fp["param_bytes"]          # Adam: two moments
    assert fp["activation_bytes"] > 0 and fp["per_trial_bytes"] == fp["total_bytes"] // 4
    b.resize([0, 2])
    b.train_step(*token_batch(2))
    fp2 = b.memory_footprint()
    assert fp2["num_trials"] == 2 and fp2["param_bytes"] * 2 == fp["param_bytes"]
    assert fp2["optimizer_bytes"] * 2 == fp["optimizer_bytes"]


def test_fusion_count_from_memory_model():
    model = LinearMemoryModel(shared_bytes=100, per_trial_bytes=50)
    assert fusion_count(model, 400, 16) == 6
    assert fusion_count(model, 10_000, 8) == 8
    with pytest.raises(MemoryError, match=r"one trial needs 0.0 MiB but the budget is 0.0 MiB"):
        fusion_count(model, 120, 8)
    probed = probe_memory_model(lambda b: make_bundle(b), token_batch(3))
    two = make_bundle(2)
    two.train_step(*token_batch(3))
    assert probed(2) == two.memory_footprint()["total_bytes"]
    assert probed.per_trial_bytes > 0


def test_resize_refuses_nonsense():
    b = make_bundle(2)
    with pytest.raises(ValueError, match="zero trials"):
        b.resize([])
    with pytest.raises(KeyError, match="trial 7 is not in this bundle"):
        b.resize([7])

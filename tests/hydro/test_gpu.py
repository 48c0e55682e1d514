"""Device checks (tier 4): the fused path on CUDA matches trials trained alone. Skipped on CPU."""
import pytest
import torch

from megatron_ext.hydro.bundle import TrialBundle, TrialSpec
from megatron_ext.hydro.memory import available_bytes
from megatron_ext.hydro.nn import fused_cross_entropy
from megatron_ext.hydro.optim import TrialHParams

from tests.hydro.hydro_helpers import gpt_factory, token_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_bundle_matches_cpu_bundle_float64():
    factory = gpt_factory(d_model=32, n_heads=4)
    specs = [TrialSpec(i, seed=i, hparams=TrialHParams(lr=1e-3 * (i + 1), weight_decay=0.01)) for i in range(3)]
    batches = [token_batch(i) for i in range(4)]
    bundles = {dev: TrialBundle(factory, specs, optimizer="adamw", loss_fn=fused_cross_entropy,
                                example_inputs=(batches[0][0],), device=dev) for dev in ("cpu", "cuda")}
    for x, y in batches:
        for b in bundles.values():
            b.train_step(x, y)
    for i in range(3):
        cpu, gpu = bundles["cpu"].trial_state(i), bundles["cuda"].trial_state(i)
        for k, v in cpu.items():
            torch.testing.assert_close(gpu[k].cpu(), v, rtol=1e-9, atol=1e-12)
    assert available_bytes(torch.device("cuda")) > 0

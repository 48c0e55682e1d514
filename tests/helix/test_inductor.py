"""The Inductor registration: Inductor's own pass pipeline finds and runs the Helix passes.

On CPU the graphs go through Inductor's real pre-grad and post-grad entry points (which read
``config.pre_grad_custom_pass`` / ``config.post_grad_custom_post_pass``) and then run as Python,
skipping only the C++ code generation (a cold compile takes minutes on this class of machine).
The full ``backend="inductor"`` compile is the GPU test below.
"""
import pytest
import torch

from megatron_ext.helix.collectives import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from megatron_ext.helix.inductor import HelixPostGradPass, HelixPreGradPass, register_inductor_passes
from megatron_ext.helix.ir import tile_of
from tests.helix.helix_helpers import fake_world, parity


class MLP(torch.nn.Module):
    def __init__(self, g):
        super().__init__()
        self.g = g
        self.w1 = torch.nn.Parameter(torch.randn(64, 32) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(32, 64) * 0.1)

    def forward(self, x):
        h = copy_to_tensor_parallel_region(x, self.g)
        return reduce_from_tensor_parallel_region(torch.mm(torch.mm(h, self.w1.t()).relu(), self.w2.t()), self.g)


def _inductor_pipeline(graphs):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import _recursive_post_grad_passes, _recursive_pre_grad_passes
    from torch._inductor.virtualized import V

    def post(gm, _):
        vals = [n.meta["val"] for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        with V.set_fake_mode(torch._guards.detect_fake_mode(vals)):
            _recursive_post_grad_passes(gm, is_inference=False)
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        gm = _recursive_pre_grad_passes(gm, example_inputs)
        return aot_autograd(fw_compiler=post, bw_compiler=post)(gm, example_inputs)

    return backend


def test_registered_passes_run_inside_inductors_pipeline():
    from torch._inductor import config

    before = (config.pre_grad_custom_pass, config.post_grad_custom_post_pass)
    reg = register_inductor_passes(2, interconnect="cross_node")
    try:
        assert isinstance(config.pre_grad_custom_pass, HelixPreGradPass)
        assert isinstance(config.post_grad_custom_post_pass, HelixPostGradPass)
        with fake_world(0) as g:
            m = MLP(g)
            graphs = []
            compiled = torch.compile(m, backend=_inductor_pipeline(graphs))
            err = parity(m, compiled, [torch.randn(8, 32, requires_grad=True)], list(m.parameters()))
    finally:
        reg.restore()
    assert (config.pre_grad_custom_pass, config.post_grad_custom_post_pass) == before
    assert reg.counters.graphs_tiled == 1            # the model graph; autograd.Function bodies are skipped
    assert reg.counters.post_grad_calls == 2 and reg.counters.graphs_reordered == 2   # forward and backward
    assert err["out"] < 1e-5 and err["grad"] < 1e-4, err
    for gm in graphs:
        assert {tile_of(n) for n in gm.graph.nodes} >= {0, 1}


def test_pass_uuids_change_with_their_settings():
    from megatron_ext.helix.inductor import PassCounters

    c = PassCounters()
    assert HelixPreGradPass(2, c).uuid() != HelixPreGradPass(4, c).uuid()


@pytest.mark.gpu
def test_full_inductor_compile_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    reg = register_inductor_passes(2, interconnect="cross_node")
    try:
        with fake_world(0) as g:
            m = MLP(g).cuda()
            x = torch.randn(8, 32, device="cuda", requires_grad=True)
            compiled = torch.compile(m, backend="inductor")
            err = parity(m, compiled, [x], list(m.parameters()))
    finally:
        reg.restore()
    assert reg.counters.graphs_tiled >= 1 and reg.counters.post_grad_calls >= 2
    assert err["out"] < 1e-3 and err["grad"] < 1e-2, err

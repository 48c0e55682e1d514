"""The megatron-core CPU shims: each upstream fragment still exists, and each shim does its job."""
from __future__ import annotations

import importlib

import pytest
import torch

from megatron_ext.compat import megatron_cpu


@pytest.fixture
def applied():
    megatron_cpu.apply()
    yield
    megatron_cpu.remove()


def test_pinned_version():
    assert megatron_cpu.check_version() == "0.16.1"


@pytest.mark.parametrize("shim", megatron_cpu.SHIMS, ids=lambda s: s.name)
def test_upstream_fragment_still_present(shim):
    # Fails when megatron-core moves or rewrites the code a shim exists for: re-check the shim then.
    assert shim.name not in megatron_cpu.missing_fragments()


def test_moved_symbol_is_reported(monkeypatch):
    ghost = megatron_cpu.Shim("ghost", "megatron.core.utils", "torch", "device=torch.cuda.nonexistent()", "test")
    monkeypatch.setattr(megatron_cpu, "SHIMS", megatron_cpu.SHIMS + (ghost,))
    assert megatron_cpu.missing_fragments() == ["ghost"]
    with pytest.raises(RuntimeError, match=r"source changed under shims \['ghost'\]"):
        megatron_cpu.apply()
    assert not megatron_cpu.applied()


def test_device_queries_answer_cpu(applied):
    p2p = importlib.import_module("megatron.core.pipeline_parallel.p2p_communication")
    assert p2p.torch.cuda.current_device() == torch.device("cpu")
    sched = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    t = sched.torch.zeros([], dtype=torch.int, device="cuda")
    assert t.device.type == "cpu"
    utils = importlib.import_module("megatron.core.transformer.utils")
    assert utils.torch.ones(2, 2, device="cuda").device.type == "cpu"
    # torch itself is untouched
    assert torch.zeros is not sched.torch.zeros


def test_apply_is_idempotent_and_removable(applied):
    layers = importlib.import_module("megatron.core.tensor_parallel.layers")
    proxy = layers.torch
    megatron_cpu.apply()
    assert layers.torch is proxy
    megatron_cpu.remove()
    assert layers.torch is torch
    megatron_cpu.apply()


def test_rng_tracker_forks_cpu_generator(applied):
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    tracker = random.get_cuda_rng_tracker()
    assert type(tracker).__name__ == "CpuRNGStatesTracker"
    tracker.reset()
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(7)
    with tracker.fork():
        a = torch.rand(3)
    outside = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(outside, torch.rand(3)), "the fork leaked into the default generator"
    expected = torch.Generator().manual_seed(123)
    assert torch.equal(a, torch.rand(3, generator=expected))
    with tracker.fork():
        b = torch.rand(3)  # continues the tracked stream, not a restart
    assert torch.equal(b, torch.rand(3, generator=expected))
    with pytest.raises(Exception, match="seed 123 already exists"):
        tracker.add("other", 123)


def test_tied_embedding_setup_keeps_tensors_on_cpu(applied):
    lm = importlib.import_module("megatron.core.models.common.language_module.language_module")
    seen = {}

    class Probe:
        pass

    def fake(self):
        seen["cuda"] = torch.ones(1).cuda().device.type

    wrapped = megatron_cpu._without_tensor_cuda(fake)
    wrapped(Probe())
    assert seen["cuda"] == "cpu"
    assert torch.Tensor.cuda is not None and lm.LanguageModule.setup_embeddings_and_output_layer.__wrapped__


def test_cuda_type_names_only_inside_the_block():
    t = torch.zeros(2, dtype=torch.bfloat16)
    assert t.type() == "torch.BFloat16Tensor"
    with megatron_cpu.cuda_type_names():
        assert t.type() == "torch.cuda.BFloat16Tensor"
        assert t.float().type() == "torch.cuda.FloatTensor"
        # A cast through .type(dtype) is untouched and stays on CPU.
        assert t.type(torch.float32).device.type == "cpu"
    assert t.type() == "torch.BFloat16Tensor"
    with pytest.raises(ValueError, match="boom"), megatron_cpu.cuda_type_names():
        raise ValueError("boom")
    assert t.type() == "torch.BFloat16Tensor", "an exception left Tensor.type patched"


def test_moved_type_name_check_is_reported(monkeypatch):
    checks = megatron_cpu.TYPE_NAME_CHECKS + (("megatron.core.optimizer.clip_grads", "param.type() == 'gone'"),)
    monkeypatch.setattr(megatron_cpu, "TYPE_NAME_CHECKS", checks)
    assert megatron_cpu.missing_fragments() == ["cuda-type-names"]


def test_type_name_checks_still_present():
    assert "cuda-type-names" not in megatron_cpu.missing_fragments()


# --- megatron_import: megatron's jit_fuser on a machine without CUDA ---------------------------------

def test_importing_megatron_core_after_the_package_does_not_import_dynamo():
    # A fresh interpreter: this one may have imported dynamo already.
    import subprocess
    import sys

    code = ("import sys, megatron_ext, megatron.core.models.gpt, megatron.core.jit as j; "
            "print(j.jit_fuser is j.noop_decorator, 'torch._inductor.compile_fx' in sys.modules, "
            "'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False", "False"]


def test_the_fragment_the_import_shim_relies_on_is_there():
    import inspect

    from megatron.core import jit

    source = inspect.getsource(jit)
    assert "jit_fuser = torch.compile" in source and "def noop_decorator" in source


def test_jit_fuser_is_kept_with_cuda_or_without_a_noop(monkeypatch):
    import types

    from megatron_ext.compat import megatron_import

    module = types.SimpleNamespace(jit_fuser=torch.compile, noop_decorator=lambda f: f)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not megatron_import.replace_jit_fuser(module) and module.jit_fuser is torch.compile
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not megatron_import.replace_jit_fuser(types.SimpleNamespace(jit_fuser=torch.compile))
    assert megatron_import.replace_jit_fuser(module) and module.jit_fuser is module.noop_decorator

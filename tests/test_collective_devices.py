"""The job's own collectives over its NCCL groups hand over tensors on the job's device, since NCCL
cannot reduce, gather or broadcast a CPU tensor: the DeepSpeed engine's gradient norm, the
timeline's clock offsets and bubble fractions, the squeezer's verdicts and progress, the loop's
loss. One rule says where (``runtime/distributed.collective_device``): the job's device under NCCL,
the CPU where the backend has a gloo side.

The suite runs gloo on CPU only, so each collective is replaced by a spy that records where its
tensor is and stops the call there, and the job's device is ``meta`` (a device other than the CPU
that every CPU build has)."""
from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from megatron_ext.layout import Layout

JOB_DEVICE = torch.device("meta")


class AtCollective(Exception):
    pass


@pytest.fixture
def seen(monkeypatch):
    """A two-rank job whose tensor collectives record their tensors' devices and stop there."""
    devices: list[tuple[str, torch.device]] = []

    def spy(name):
        def collective(tensor, *args, **kwargs):
            devices.append((name, (tensor[0] if isinstance(tensor, list) else tensor).device))
            if name == "all_gather":
                devices.append(("all_gather input", args[0].device))
            raise AtCollective(name)
        return collective

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    for name in ("all_reduce", "broadcast", "all_gather"):
        monkeypatch.setattr(dist, name, spy(name))
    return devices


def test_the_deepspeed_gradient_norm_is_reduced_on_the_jobs_device(seen):
    pytest.importorskip("deepspeed")
    from deepspeed_patches.trainer import ClippedAdamW

    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.full((3,), 2.0)
    opt = ClippedAdamW([w], norm_params=[w], norm_group=object(), clip_grad=1.0, norm_device=JOB_DEVICE, lr=1e-3)
    with pytest.raises(AtCollective):
        opt.grad_norm()
    assert seen == [("all_reduce", JOB_DEVICE)]


def test_the_deepspeed_gradient_norm_defaults_to_the_cpu_and_sums_every_gradient(monkeypatch):
    pytest.importorskip("deepspeed")
    from deepspeed_patches.trainer import ClippedAdamW

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    a.grad, b.grad = torch.full((3,), 2.0), torch.full((2,), 1.0)
    opt = ClippedAdamW([a, b], norm_params=[a, b], norm_group=None, clip_grad=1.0, lr=1e-3)
    assert opt.norm_device == torch.device("cpu") and opt.grad_norm() == pytest.approx((3 * 4 + 2) ** 0.5)


def test_the_timelines_bubble_fractions_are_reduced_on_the_jobs_device(seen):
    from megatron_ext.pipeline.collect import stage_bubble_fractions
    from megatron_ext.pipeline.events import EventRecorder

    with pytest.raises(AtCollective):
        stage_bubble_fractions(EventRecorder(16), stage=0, num_stages=2, is_representative=True, offset_s=0.0,
                               device=JOB_DEVICE)
    assert seen == [("all_reduce", JOB_DEVICE)]


def test_the_timelines_clock_offsets_are_broadcast_on_the_jobs_device(seen, monkeypatch):
    from megatron_ext.pipeline.collect import clock_offsets

    def two_hosts(out, obj, group=None):
        out[:] = ["node-a", "node-b"]

    monkeypatch.setattr(dist, "all_gather_object", two_hosts)
    monkeypatch.setattr(dist, "barrier", lambda group=None: None)
    with pytest.raises(AtCollective):
        clock_offsets(lambda: 1.0, JOB_DEVICE)
    assert seen == [("broadcast", JOB_DEVICE)]


def _squeezer(stats=None):
    from megatron_ext.hydro.squeezer.extension import SqueezerExtension

    ext = SqueezerExtension.__new__(SqueezerExtension)    # only what the two collectives read
    ext.squeezer = types.SimpleNamespace(stats=lambda: stats)
    return ext


def test_the_squeezers_progress_and_verdicts_are_reduced_on_the_jobs_device(seen):
    trainer = types.SimpleNamespace(ctx=types.SimpleNamespace(device=JOB_DEVICE, backend="nccl", rank=0))
    ext = _squeezer({"busy_s": 1.0, "window_s": 2.0, "trial_steps": 3, "trials_done": 1})
    with pytest.raises(AtCollective):
        ext._progress(trainer, types.SimpleNamespace(extra={}))
    res = types.SimpleNamespace(action="keep", slowdown=0.01, p_value=0.5, off=8, iterations=(1, 8))
    with pytest.raises(AtCollective):
        ext._agree(trainer, res)
    assert seen == [("all_reduce", JOB_DEVICE), ("all_gather", JOB_DEVICE), ("all_gather input", JOB_DEVICE)]


def test_the_loops_loss_is_reduced_over_data_parallel_ranks_on_the_jobs_device(seen):
    from megatron_ext.runtime.loop import Trainer

    trainer = Trainer.__new__(Trainer)    # only what the loss reduction reads
    trainer.cfg = types.SimpleNamespace(training=types.SimpleNamespace(calculate_per_token_loss=False))
    trainer.ctx = types.SimpleNamespace(is_last_stage=True, layout=Layout(1, 1, 2),
                                        pgs=types.SimpleNamespace(dp=None), device=JOB_DEVICE, backend="nccl")
    with pytest.raises(AtCollective):
        trainer._reduce_loss([{"lm loss": torch.tensor(2.0)}])
    assert seen == [("all_reduce", JOB_DEVICE)]


@pytest.mark.parametrize("backend, expected", [
    ("nccl", JOB_DEVICE),                     # NCCL cannot reduce a CPU tensor
    ("gloo", torch.device("cpu")),            # gloo on a CUDA job: the CPU, where gloo reduces everything
    ("cpu:gloo,cuda:nccl", torch.device("cpu")),
])
def test_the_jobs_collective_device_follows_its_backend(backend, expected):
    from megatron_ext.runtime.distributed import collective_device

    assert collective_device(types.SimpleNamespace(backend=backend, device=JOB_DEVICE)) == expected

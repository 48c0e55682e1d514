"""The peak-memory measurement counts only steps whose allocator accounting closes."""
import pytest
import torch

from megatron_ext.helix.measure import UnclosedAccounting, step_peak_bytes


def _layer():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64, bias=False)
    x = torch.randn(32, 64, requires_grad=True)
    return lin, x, torch.randn(32, 64)


def test_a_step_that_leaves_more_than_its_gradients_alive_is_re_run():
    # A buffer still referenced after the step looks, to the allocator events, exactly like a free
    # the profiler did not record (one made on another thread): the step must be measured again.
    lin, x, gy = _layer()
    clean = step_peak_bytes(lin, x, gy, lin.parameters())
    held, calls = [], []

    def leaky(inp):
        calls.append(1)
        y = lin(inp)
        if len(calls) <= 2:
            held.append(torch.empty(4096))  # 16 KiB alive past the step, on the first two runs
        return y

    assert step_peak_bytes(leaky, x, gy, lin.parameters()) == clean
    assert len(calls) == 3


def test_accounting_that_never_closes_is_an_error_not_a_figure():
    lin, x, gy = _layer()
    held = []

    def leaky(inp):
        held.append(torch.empty(4096))
        return lin(inp)

    with pytest.raises(UnclosedAccounting, match="did not close in 3 profiled steps"):
        step_peak_bytes(leaky, x, gy, lin.parameters(), attempts=3)


def test_every_rank_re_runs_when_any_rank_did_not_close():
    lin, x, gy = _layer()
    verdicts = iter([False, True])       # "another rank" fails the first step
    seen = []

    def agree(ok: bool) -> bool:
        seen.append(ok)
        return ok and next(verdicts)

    step_peak_bytes(lin, x, gy, lin.parameters(), agree=agree)
    assert seen == [True, True]


@pytest.mark.parametrize("backend, cuda, expected", [
    ("gloo", False, "cpu"), ("gloo", True, "cpu"),
    ("cpu:gloo,cuda:nccl", True, "cpu"),      # a mixed group reduces CPU tensors on its gloo side
    ("nccl", True, "cuda:0"),                  # NCCL cannot reduce a CPU tensor
])
def test_rank_agreements_put_their_tensor_where_the_groups_backend_can_reduce_it(monkeypatch, backend, cuda,
                                                                                 expected):
    # agree_max (the ranks' cost figures, Helix's decisions) and all_ranks_agree run on the model's
    # own process groups, which are NCCL on a GPU job.
    from megatron_ext.runtime.distributed import collective_device

    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert collective_device() == torch.device(expected)

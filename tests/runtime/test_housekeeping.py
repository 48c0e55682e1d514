"""--manual-gc and --empty-unused-memory-level (runtime/housekeeping.py): the collector is off for the
run and collects at the same points on every rank, and is left as it was found."""
from __future__ import annotations

import gc

import pytest
import torch

from megatron_ext.config.run import parse_run_config
from megatron_ext.runtime.housekeeping import Housekeeping


@pytest.fixture
def collections(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(1) or 0)
    yield calls
    gc.enable()


def test_manual_gc_collects_every_interval_and_around_validation(collections):
    t = parse_run_config(["--manual-gc", "--manual-gc-interval", "3"]).training
    keeper = Housekeeping(t, torch.device("cpu"))
    keeper.start()
    assert not gc.isenabled() and len(collections) == 1
    for iteration in range(1, 8):
        keeper.after_iteration(iteration)
    assert len(collections) == 1 + 2   # iterations 3 and 6
    with keeper.validation():
        assert len(collections) == 4
    assert len(collections) == 5
    keeper.stop()
    assert gc.isenabled()


def test_without_manual_gc_nothing_changes(collections):
    keeper = Housekeeping(parse_run_config(["--no-manual-gc-eval"]).training, torch.device("cpu"))
    keeper.start()
    assert gc.isenabled()
    keeper.after_iteration(3)
    with keeper.validation():
        pass
    keeper.stop()
    assert collections == [] and gc.isenabled()


def test_empty_unused_memory_level_empties_the_cuda_cache(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    keeper = Housekeeping(parse_run_config(["--device", "cuda", "--empty-unused-memory-level", "1"]).training,
                          torch.device("cuda"))
    keeper.after_iteration(1)
    Housekeeping(parse_run_config([]).training, torch.device("cuda")).after_iteration(1)
    assert emptied == [1]

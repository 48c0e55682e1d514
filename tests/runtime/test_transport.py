"""The live re-layout's point-to-point transport: the transfer plan (pure) and the pieces it cuts,
against hand-worked layouts (the live multi-rank runs, with their bytes, are in test_relayout.py)."""
from __future__ import annotations

import re

import pytest
import torch

from megatron_ext.runtime.reshard import CheckpointError
from megatron_ext.runtime.transport import cut, plan_transfers


def g(key, offset, shape, global_shape, index=()):
    return {"key": key, "index": tuple(index), "offset": tuple(offset), "shape": tuple(shape),
            "global_shape": tuple(global_shape)}


def test_tp2_to_tp1_sends_each_rank_only_the_half_it_lacks():
    # w [8, 4] split by rows over TP2 (rank 0 rows 0-3, rank 1 rows 4-7); b [4] replicated, held by
    # rank 0 (main replica). New layout: both ranks hold all of w and b (DP2 of TP1).
    held = [[g("w", (0, 0), (4, 4), (8, 4)), g("b", (0,), (4,), (4,))], [g("w", (4, 0), (4, 4), (8, 4))]]
    whole = [g("w", (0, 0), (8, 4), (8, 4)), g("b", (0,), (4,), (4,))]
    plan = plan_transfers(held, [whole, whole])
    assert plan == {(0, 0): [(0, (0, 0), (4, 4)), (1, (0,), (4,))],
                    (1, 0): [(0, (4, 0), (8, 4))],
                    (0, 1): [(0, (0, 0), (4, 4)), (1, (0,), (4,))],
                    (1, 1): [(0, (4, 0), (8, 4))]}


def test_a_stage_move_sends_whole_shards_and_nothing_stays_put_that_moved():
    # PP2 -> PP2 with the two processes swapped: layer 0 (index 0) on rank 0 moves to rank 1 and
    # layer 1 back: two messages, no local piece.
    held = [[g("layer.w", (0,), (6,), (6,), index=(0,))], [g("layer.w", (0,), (6,), (6,), index=(1,))]]
    needed = [[g("layer.w", (0,), (6,), (6,), index=(1,))], [g("layer.w", (0,), (6,), (6,), index=(0,))]]
    assert plan_transfers(held, needed) == {(1, 0): [(0, (0,), (6,))], (0, 1): [(0, (0,), (6,))]}


def test_an_uncovered_slice_is_refused_before_anything_moves():
    held = [[g("w", (0, 0), (4, 4), (8, 4))], []]
    with pytest.raises(CheckpointError, match=re.escape("live re-layout: saved shards of w do not cover "
                                                        "this rank's slice")):
        plan_transfers(held, [[g("w", (0, 0), (8, 4), (8, 4))], []])
    with pytest.raises(CheckpointError, match=re.escape("live re-layout: no tensor v in the checkpoint")):
        plan_transfers(held, [[], [g("v", (0,), (2,), (2,))]])


def test_cut_takes_the_box_of_every_state_tensor():
    t = torch.arange(32.0).reshape(8, 4)
    item = {**g("w", (4, 0), (4, 4), (8, 4)), "tensor": t[4:].clone(), "main": t[4:].double(),
            "optim": {"exp_avg": t[4:] * 2, "exp_avg_sq": t[4:] * 3}, "step": 7}
    piece = cut(item, (5, 1), (7, 3))
    assert piece["offset"] == (5, 1) and piece["shape"] == (2, 2) and piece["step"] == 7
    assert torch.equal(piece["tensor"], t[5:7, 1:3])
    assert torch.equal(piece["main"], t[5:7, 1:3].double())
    assert torch.equal(piece["optim"]["exp_avg_sq"], t[5:7, 1:3] * 3)
    piece["tensor"].zero_()
    assert item["tensor"].sum() > 0  # a copy: sending it does not alias the old model's state

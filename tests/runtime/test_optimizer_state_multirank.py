"""megatron's DistributedOptimizer and resharded optimizer state on 2 CPU ranks (tier 3).

One launch of optimizer_state_scenarios.py (about 20 s): the distributed optimizer trains like the
plain runtime, resumes exactly under bf16, and its checkpoints (state gathered from the DP shards)
move to TP2 and back with every master weight, moment and step count unchanged.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import run_torchrun

pytestmark = pytest.mark.multirank

KINDS = ("tensor", "main", "exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("optim_state")
    out, root = tmp / "curves.json", tmp / "ckpt"
    run_torchrun("tests/runtime/optimizer_state_scenarios.py", str(out), str(root), nproc=2)
    return json.loads(out.read_text()), str(root)


def max_rel(a, b):
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def assemble(root: str) -> dict[tuple, dict[str, object]]:
    """Whole tensors of a checkpoint (torch_dist, the default format), per (key, layer index) and kind:
    the weight, its fp32 master and moments under megatron's optimizer keys, the step counts."""
    import numpy as np

    from megatron_ext.runtime import dist_ckpt

    path = dist_ckpt.resolve(root)
    common = dist_ckpt.read_common(path)
    shapes, dtypes = dist_ckpt.tensor_shapes(path), dist_ckpt.tensor_dtypes(path)
    stacked = dist_ckpt.stacked_axes(common, shapes)
    steps = common["megatron_ext"]["optimizer_steps"]
    whole: dict[tuple, dict[str, object]] = {}
    for key in (k for k in shapes if not k.startswith("optimizer.")):
        kinds = {"tensor": key, **{kind: dist_ckpt.optimizer_key(kind, key) for kind in KINDS[1:]}}
        for kind, saved in kinds.items():
            assert saved in shapes, f"{root}: {key} has no {kind}"
        full = {kind: torch.empty(shapes[saved], dtype=dtypes[saved])
                for kind, saved in kinds.items()}
        dist_ckpt.read_slices(path, {kinds[kind]: [((0,) * t.dim(), t)] for kind, t in full.items()})
        for index in np.ndindex(*shapes[key][:stacked[key]]):
            index = tuple(int(i) for i in index)
            slot = whole.setdefault((key, index), {"steps": {steps[f"{key}@{','.join(map(str, index))}"]}})
            for kind, t in full.items():
                slot[kind] = t[index]
    return whole


def test_distributed_optimizer_trains_like_the_plain_runtime(launched):
    curves, _ = launched
    assert curves["fp32_plain"][-1] < curves["fp32_plain"][0] - 0.3
    assert max_rel(curves["fp32_do"], curves["fp32_plain"]) < 1e-5


def test_distributed_optimizer_resumes_exactly_under_bf16(launched):
    curves, _ = launched
    straight = curves["bf16_do_straight20"]
    assert max_rel(curves["bf16_do_first10"] + curves["bf16_do_resumed10"], straight) < 1e-6


def test_checkpoint_of_sharded_state_is_whole(launched):
    _, root = launched
    whole = assemble(os.path.join(root, "bf16_do"))
    for name, slot in whole.items():
        assert slot["steps"] == {10.0}, name
        assert slot["tensor"].dtype == torch.bfloat16 and slot["main"].dtype == torch.float32
        assert torch.equal(slot["main"].to(torch.bfloat16), slot["tensor"]), name


@pytest.mark.parametrize("moved", ["bf16_tp2_from_do", "bf16_do_from_tp2"])
def test_state_survives_resharding_unchanged(launched, moved):
    # DP2 sharded state -> loaded under TP2 -> saved; and that back under DP2 -> saved: bit-equal.
    _, root = launched
    original = assemble(os.path.join(root, "bf16_do"))
    again = assemble(os.path.join(root, moved))
    assert again.keys() == original.keys()
    for name in original:
        assert again[name]["steps"] == original[name]["steps"], name
        for kind in KINDS:
            assert torch.equal(again[name][kind], original[name][kind]), (moved, name, kind)


def test_reshard_to_tp2_goes_on(launched):
    curves, _ = launched
    assert max_rel(curves["bf16_tp2_resumed10"], curves["bf16_do_straight20"][10:]) < 1e-4

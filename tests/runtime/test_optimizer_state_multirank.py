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

from megatron_ext.runtime import checkpoint as ckpt
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
    """Whole tensors of a checkpoint, per (key, layer index) and kind, cut together from its shards."""
    path = ckpt.resolve(root)
    meta = ckpt.read_meta(path)
    payloads = {f: torch.load(os.path.join(path, f), weights_only=False)
                for f in {s["file"] for s in meta["shards"]}}
    whole: dict[tuple, dict[str, object]] = {}
    for payload in payloads.values():
        for p in payload:
            name = (p["key"], tuple(p["index"]))
            slot = whole.setdefault(name, {"steps": set()})
            dst = tuple(slice(o, o + n) for o, n in zip(p["offset"], p["shape"]))
            sources = {"tensor": p["tensor"], "main": p.get("main"), **p["optim"]}
            for kind in KINDS:
                assert sources.get(kind) is not None, f"{root}: {name} has no {kind}"
                full = slot.setdefault(kind, torch.full(p["global_shape"], float("nan"), dtype=sources[kind].dtype))
                full[dst] = sources[kind]
            slot["steps"].add(p["step"])
    for name, slot in whole.items():
        for kind in KINDS:
            assert not torch.isnan(slot[kind].float()).any(), f"{root}: shards of {name} leave {kind} uncovered"
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

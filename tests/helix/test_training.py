"""``pretrain_gpt.py --helix`` trains with loss parity: 2 CPU ranks, TP2, 5 iterations, tiny model
(tests/helix/helix_training.py runs the Helix run and the plain run in one torchrun launch)."""
from __future__ import annotations

import json

import pytest

from tests.conftest import run_torchrun
from tests.helix.helix_helpers import rank0_graphs

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out = tmp_path_factory.mktemp("helix_training")
    proc = run_torchrun("tests/helix/helix_training.py", str(out), nproc=2, timeout=600)
    return out, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def curves(launch):
    out, _ = launch
    return {name: [r["loss"] for r in map(json.loads, (out / f"{name}.jsonl").read_text().splitlines()) if r["kind"] == "train"]
            for name in ("eager", "helix_tiled", "helix")}


def test_each_helix_run_compiles_its_chunk_once(launch):
    # Every micro-batch after the first reuses the first one's graph: megatron's attention buffer
    # is allocated before compiling (adapter.prefill_first_call_state); allocated inside the first
    # graph, it failed Dynamo's guard at the second micro-batch and the chunk was compiled again.
    _, log = launch
    graphs = rank0_graphs(log)
    # the forced tiled run: one graph; the default run: one per measured-selection candidate that
    # compiled in its 5 iterations (six candidates: the first five warm-ups), each backend its graph 0
    assert graphs == ["0"] * 6, graphs


@pytest.mark.parametrize("run", ["helix_tiled", "helix"])
def test_helix_reproduces_the_loss_curve_of_the_plain_run(curves, run):
    eager, helix = curves["eager"], curves[run]
    assert len(eager) == len(helix) == 5
    assert eager[-1] < eager[0] - 0.05, "the reference run did not learn"
    assert max(abs(h - e) / abs(e) for h, e in zip(helix, eager)) < 1e-4, (helix, eager)

"""``pretrain_gpt.py --helix`` trains with loss parity: 2 CPU ranks, TP2, 5 iterations, tiny model
(tests/helix/helix_training.py runs the Helix run and the plain run in one torchrun launch)."""
from __future__ import annotations

import json

import pytest

from tests.conftest import run_torchrun

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    out = tmp_path_factory.mktemp("helix_training")
    run_torchrun("tests/helix/helix_training.py", str(out), nproc=2, timeout=600)
    return {name: [json.loads(line)["loss"] for line in (out / f"{name}.jsonl").read_text().splitlines()]
            for name in ("eager", "helix_tiled", "helix")}


@pytest.mark.parametrize("run", ["helix_tiled", "helix"])
def test_helix_reproduces_the_loss_curve_of_the_plain_run(curves, run):
    eager, helix = curves["eager"], curves[run]
    assert len(eager) == len(helix) == 5
    assert eager[-1] < eager[0] - 0.05, "the reference run did not learn"
    assert max(abs(h - e) / abs(e) for h, e in zip(helix, eager)) < 1e-4, (helix, eager)

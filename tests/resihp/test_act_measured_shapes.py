"""The live actor (``resihp/act.py``) on one process, over a stand-in trainer of four devices: what it
learns from the measured iterations of the layout in force and what it hands the next decider."""
from __future__ import annotations

import dataclasses
import types

import pytest

from megatron_ext.config.run import config_from_values
from megatron_ext.ft.target import KNOBS
from megatron_ext.layout import Layout
from megatron_ext.resihp.act import Actor
from megatron_ext.resihp.config import ResiHPConfig
from megatron_ext.resihp.verdicts import Verdict


class Ctx:
    def __init__(self, layout: Layout) -> None:
        self.rank, self.layout = 0, layout

    @property
    def members(self):
        return self.layout.members

    @property
    def vpp(self):
        return None


class Trainer:
    """What the actor reads of ``runtime.loop.Trainer``; ``request_layout`` applies at once."""

    relayout_knobs = KNOBS

    def __init__(self, layout: Layout) -> None:
        self.cfg = config_from_values({"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
                                       "seq_length": 32, "micro_batch_size": 2, "global_batch_size": 16,
                                       "pipeline_model_parallel_size": layout.pp,
                                       "tensor_model_parallel_size": layout.tp})
        self.ctx = Ctx(layout)
        self.extensions: list = []
        self.splits = types.SimpleNamespace(tokenizer=types.SimpleNamespace(vocab_size=256))
        self.train_stream = types.SimpleNamespace(num_microbatches=8)
        self.requested: list[Layout] = []

    def check_target(self, target) -> None:
        pass

    def request_layout(self, target, *, reason: str = "") -> None:
        self.requested.append(target)
        self.ctx.layout = target


def slow(rank: int, it: int, factor: float) -> Verdict:
    return Verdict(kind="fail_slow", rank=rank, stage=None, iteration=it, factor=factor, confidence=1.0,
                   detector="test", detail={"launch_rank": rank})


def recovered(rank: int, it: int) -> Verdict:
    return Verdict(kind="recovered", rank=rank, stage=None, iteration=it, factor=None, confidence=1.0,
                   detector="test", detail={"launch_rank": rank})


def actor(mode: str = "relayout") -> Actor:
    return Actor(dataclasses.replace(ResiHPConfig(), resihp_act=mode), rank=0, decider=0)


def test_the_live_actor_learns_the_shape_in_force_once_nothing_in_it_is_believed_slow():
    trainer = Trainer(Layout(tp=1, pp=2, dp=2))
    act = actor()
    for it in range(1, 6):
        assert act.observe(trainer, it, [], 1.0) is None      # healthy: the planner's scale
    plan = act.observe(trainer, 6, [slow(1, 6, 3.0)], 1.0)
    assert plan is not None and trainer.requested, "a x3 device in a PP2 stage is worth a plan"
    pol = act.policy
    # The start shape is the scale's own: x1 by construction.
    assert pol.planner.shape_factors == {(1, 2): 1.0}
    for it in range(7, 40):                                   # device 1 still believed slow: nothing learned
        act.observe(trainer, it, [], 1.3)
    assert pol.planner.shape_factors == {(1, 2): 1.0}
    # Device 1 recovers; once the hysteresis believes it, 20 healthy iterations set the factor
    # (the first after a change dropped), measured against the layout in force.
    it = 40
    act.observe(trainer, it, [recovered(1, it)], 1.3)
    while pol.speeds[1] < 1:
        it += 1
        act.observe(trainer, it, [], 1.3)
    for _ in range(25):
        it += 1
        act.observe(trainer, it, [], 1.3)
    lay = pol.layout
    predicted = pol.planner.iteration_s(lay, pol.speeds)
    assert pol.planner.shape_factors[(lay.tp, lay.pp)] == pytest.approx(1.3 / predicted, rel=1e-9)
    # What the next decider is handed: the scale as taken and the choice of the layout in force.
    beliefs = act._beliefs()
    assert beliefs["device_flops"] == pol.planner.cluster.device_flops and beliefs["chosen"] is True


def test_the_next_decider_keeps_the_scale_though_the_layout_in_force_is_another():
    first = Trainer(Layout(tp=1, pp=2, dp=2))
    act = actor()
    for it in range(1, 6):
        act.observe(first, it, [], 1.0)
    act.observe(first, 6, [slow(1, 6, 3.0)], 1.0)
    carried = act._beliefs()
    # Another process decides in another shape: its planner is priced at the carried scale, not
    # rescaled so that the new shape predicts the start's healthy time.
    other = Trainer(Layout(tp=2, pp=1, dp=2))
    nxt = actor()
    nxt.carried = carried
    nxt.observe(other, 7, [], 1.0)
    assert nxt.policy.planner.cluster.device_flops == carried["device_flops"]
    assert nxt.policy.planner.shape_factors == {(1, 2): 1.0}   # not x1 for the shape it was handed


def test_under_plan_the_actor_learns_nothing_from_the_times():
    trainer = Trainer(Layout(tp=1, pp=2, dp=2))
    act = actor("plan")
    for it in range(1, 6):
        act.observe(trainer, it, [], 1.0)
    act.observe(trainer, 6, [slow(1, 6, 3.0)], 1.0)
    act.observe(trainer, 7, [recovered(1, 7)], 1.0)
    for it in range(8, 120):
        act.observe(trainer, it, [], 2.0)
    assert act.policy.planner.shape_factors == {(1, 2): 1.0} and trainer.requested == []

"""The one set of rules a layout target passes before anything changes (``ft.target.check``)."""
from __future__ import annotations

import re

import pytest

from megatron_ext.config.base import ConfigError
from megatron_ext.config.run import config_from_values
from megatron_ext.ft.target import KNOBS, LayoutTarget, check

CFG = config_from_values({"num_layers": 4, "hidden_size": 32, "num_attention_heads": 2, "seq_length": 32,
                          "global_batch_size": 8, "micro_batch_size": 1, "pipeline_model_parallel_size": 2})
MEMBERS = (0, 2, 1, 3)


def refused(target, **kw) -> str:
    with pytest.raises(ConfigError) as err:
        check(target, cfg=CFG, members=MEMBERS, **{"knobs": KNOBS, "membership_may_change": False, **kw})
    return str(err.value)


def test_a_planned_change_keeps_every_rank_and_may_permute_them():
    check(LayoutTarget(tp=1, pp=2, members=(1, 2, 0, 3)), cfg=CFG, members=MEMBERS, knobs=KNOBS,
          membership_may_change=False)
    assert refused(LayoutTarget(tp=1, pp=2, members=(1, 2, 0, 3)), knobs=KNOBS - {"permute"}) == (
        "relayout to tp1pp2dp2: the engine cannot permute ranks live (--engine megatron can)")
    assert refused(LayoutTarget(tp=1, pp=2, members=(0, 2))).startswith(
        "relayout rank_order [0, 2]: expected each rank 0..3 once")


def test_after_a_loss_or_a_rejoin_the_members_may_change():
    check(LayoutTarget(tp=1, pp=2, members=(0, 2)), cfg=CFG, members=MEMBERS, knobs=KNOBS, membership_may_change=True)
    check(LayoutTarget(tp=1, pp=2, members=(0, 2, 1, 3, 4, 5, 6, 7)), cfg=CFG, members=MEMBERS, knobs=KNOBS,
          membership_may_change=True)


def test_shapes_stages_and_splits_are_checked_with_the_run_config():
    assert refused(LayoutTarget(tp=1, pp=2, members=(0, 0, 1, 3))) == (
        "relayout to tp1pp2dp2: members [0, 0, 1, 3] name a rank twice")
    with pytest.raises(ValueError, match=r"^4 rank\(s\) cannot form TP 1 x PP 3$"):  # the value itself refuses
        LayoutTarget(tp=1, pp=3, members=MEMBERS)
    assert refused(LayoutTarget(tp=1, pp=2, members=MEMBERS, replica_microbatches=(5, 3)),
                   knobs=KNOBS - {"microbatches"}) == (
        "relayout to tp1pp2dp2: uneven micro-batches per replica [5, 3] are not built for this engine "
        "(--engine megatron is)")
    assert refused(LayoutTarget(tp=1, pp=2, vp=2, members=MEMBERS, stage_layers=(3, 1))) == (
        "relayout to tp1pp2dp2vp2: uneven stages [3, 1] with virtual stages would need uneven interleaved chunks")
    # The run config's own rules: layers per stage must add up to the model's.
    with pytest.raises(ConfigError, match=re.escape("--pipeline-stage-layers")):
        check(LayoutTarget(tp=1, pp=2, members=MEMBERS, stage_layers=(3, 3)), cfg=CFG, members=MEMBERS, knobs=KNOBS,
              membership_may_change=False)


def test_a_target_round_trips_and_writes_even_splits_as_none():
    t = LayoutTarget(tp=1, pp=2, members=(3, 1), vp=1, stage_layers=(2, 2), replica_microbatches=(8,))
    n = t.normalised()
    assert (n.stage_layers, n.replica_microbatches) == (None, None)
    u = LayoutTarget(tp=1, pp=2, members=MEMBERS, stage_layers=(3, 1), replica_microbatches=(5, 3))
    assert LayoutTarget.from_dict(u.to_dict()) == u
    assert u.describe() == "tp1pp2dp2 (layers 3/1) (micro-batches 5/3) on rank(s) 0,2,1,3"
    assert CFG.parallel.launch_layout(4).with_members(MEMBERS) == LayoutTarget(tp=1, pp=2, members=MEMBERS)

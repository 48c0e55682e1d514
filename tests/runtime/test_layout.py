"""Layout <-> rank groups: pure properties, and agreement with megatron's parallel_state."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ext.layout import Coord, Layout, even_stage_layers

sizes = st.sampled_from([1, 2, 3, 4, 8])


@given(tp=sizes, pp=sizes, dp=sizes)
@settings(max_examples=60, deadline=None)
def test_groups_partition_the_world(tp, pp, dp):
    lay = Layout(tp, pp, dp)
    for groups, size in ((lay.tp_groups(), tp), (lay.pp_groups(), pp), (lay.dp_groups(), dp),
                         (lay.mp_groups(), tp * pp)):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(lay.world_size))
        assert all(len(g) == size for g in groups)
    for rank, c in lay.rank_coords():
        assert lay.rank(c) == rank
    # pipeline groups run from the first stage to the last
    for g in lay.pp_groups():
        assert [lay.coord(r).pp for r in g] == list(range(pp))


def test_rank_order_is_tp_fastest_then_dp_then_pp():
    lay = Layout(tp=2, pp=2, dp=2)
    assert [lay.coord(r) for r in range(4)] == [Coord(0, 0, 0), Coord(1, 0, 0), Coord(0, 0, 1), Coord(1, 0, 1)]
    assert lay.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_errors():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by --tensor-model-parallel-size \(2\) x "
                                         r"--pipeline-model-parallel-size \(2\) = 4"):
        Layout.from_world(6, 2, 2)
    with pytest.raises(ValueError, match="Layout.tp must be a positive integer"):
        Layout(0, 1, 1)
    with pytest.raises(ValueError, match="rank 8 is outside tp2pp2dp2"):
        Layout(2, 2, 2).coord(8)
    with pytest.raises(ValueError, match=r"--num-layers \(6\) is not divisible by --pipeline-model-parallel-size \(4\)"):
        even_stage_layers(6, 4)
    assert even_stage_layers(8, 4) == (2, 2, 2, 2)
    assert Layout(1, 4, 1).layers_of_stages(8) == (2, 2, 2, 2)
    assert Layout(1, 2, 1, stage_layers=(3, 1)).layers_of_stages(4) == (3, 1)


def _megatron_groups(world: int, rank: int, tp: int, pp: int):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     order="tp-cp-ep-dp-pp", create_gloo_process_groups=False)
        groups = {
            "tp": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
            "pp": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
            "dp": dist.get_process_group_ranks(ps.get_data_parallel_group()),
            "mp": dist.get_process_group_ranks(ps.get_model_parallel_group()),
        }
        ps.destroy_model_parallel()
        return groups
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,tp,pp,ranks", [(8, 2, 2, [0, 5, 7]), (64, 4, 4, [0, 13, 63]),
                                               (1024, 8, 8, [0, 517, 1023])])
def test_matches_megatron_parallel_state(world, tp, pp, ranks):
    lay = Layout.from_world(world, tp, pp)
    for rank in ranks:
        got = _megatron_groups(world, rank, tp, pp)
        mine = {name: next(g for g in getattr(lay, f"{name}_groups")() if rank in g) for name in got}
        assert got == mine, (rank, got, mine)

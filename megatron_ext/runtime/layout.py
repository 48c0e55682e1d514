"""Parallel layout (tp, pp, dp) <-> global ranks: a pure function of the sizes.

The one layout type of the project: the runtime's process groups are built from it, and ResiHP's
trace (``resihp.trace.TraceLayout``: schedule, micro-batches, an explicit rank order) and planner
(``resihp.planner_types.PlanLayout``: layers per stage, micro-batches per replica, devices per slot)
extend it with what they need.

The rank order is megatron-core's default ``order="tp-cp-ep-dp-pp"`` with cp = ep = 1: tensor
parallel ranks are adjacent (they share the fastest links), then data parallel, then pipeline
stages. ``tests/runtime/test_layout.py`` checks these groups against the ones megatron's
``parallel_state.initialize_model_parallel`` builds, so a relayout can rebuild groups from here.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator


@dataclasses.dataclass(frozen=True)
class Coord:
    tp: int
    pp: int
    dp: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """A 3D layout over ``tp * pp * dp`` consecutive global ranks starting at 0."""

    tp: int
    pp: int
    dp: int

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name} must be a positive integer, got {value!r}")

    @classmethod
    def from_world(cls, world_size: int, tp: int, pp: int) -> "Layout":
        """Derive dp from the world size; raises ValueError when it does not divide."""
        if world_size % (tp * pp):
            raise ValueError(
                f"world size {world_size} is not divisible by tensor-model-parallel-size ({tp}) x "
                f"pipeline-model-parallel-size ({pp}) = {tp * pp}")
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def name(self) -> str:
        return f"tp{self.tp}pp{self.pp}dp{self.dp}"

    def rank(self, coord: Coord) -> int:
        if not (0 <= coord.tp < self.tp and 0 <= coord.pp < self.pp and 0 <= coord.dp < self.dp):
            raise ValueError(f"{coord} is outside {self.name}")
        return coord.tp + self.tp * (coord.dp + self.dp * coord.pp)

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside {self.name} (world size {self.world_size})")
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return Coord(tp=tp, pp=pp, dp=dp)

    def rank_coords(self) -> Iterator[tuple[int, Coord]]:
        """Every rank with its coordinate, in rank order."""
        for rank in range(self.world_size):
            yield rank, self.coord(rank)

    def _groups(self, axis: str) -> list[list[int]]:
        groups: dict[tuple, list[int]] = {}
        for rank, c in self.rank_coords():
            key = tuple(getattr(c, a) for a in ("tp", "pp", "dp") if a != axis)
            groups.setdefault(key, []).append(rank)
        return sorted(groups.values())

    def tp_groups(self) -> list[list[int]]:
        return self._groups("tp")

    def pp_groups(self) -> list[list[int]]:
        """Each list runs from the first stage to the last."""
        return self._groups("pp")

    def dp_groups(self) -> list[list[int]]:
        return self._groups("dp")

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups (tp x pp): the ranks that together hold one model replica."""
        groups: dict[int, list[int]] = {}
        for rank, c in self.rank_coords():
            groups.setdefault(c.dp, []).append(rank)
        return sorted(groups.values())

    def stage_ranks(self, stage: int) -> list[int]:
        return [r for r, c in self.rank_coords() if c.pp == stage]


def layers_per_stage(num_layers: int, pp: int) -> list[int]:
    """Even split of layers over stages (megatron's default); raises when it does not divide."""
    if num_layers % pp:
        raise ValueError(f"num-layers ({num_layers}) is not divisible by pipeline-model-parallel-size ({pp})")
    return [num_layers // pp] * pp


def stage_layer_range(num_layers: int, pp: int, stage: int) -> range:
    per = layers_per_stage(num_layers, pp)
    start = sum(per[:stage])
    return range(start, start + per[stage])

"""The one layout value of the project: how a job's ranks form TP x PP x DP, and what each holds.

``Layout`` is what the runtime builds its process groups from (``DistContext.layout``), what the
fault-tolerance core changes a live job to (``ft.target.LayoutTarget`` is this type), what ResiHP's
trace reader and planner extend (``resihp.trace.TraceLayout``, ``resihp.planner_types.PlanLayout``)
and what the config's launch request (``ParallelConfig``) becomes at launch. It sits below the config
and the runtime (it imports neither), so all of them can use it.

A layout is its sizes (``tp``, ``pp``, ``dp``; ``vp`` virtual stages per rank), the layers of each
pipeline stage (``stage_layers``; None: megatron's even split), the micro-batches of each
data-parallel replica (``replica_microbatches``; None: an even split of the global batch) and its
``members``: the launch rank in each rank's place, in rank order (default ``0..world-1``; a live
permutation or a fail-stop renumbers them).

The rank order is megatron-core's default ``order="tp-cp-ep-dp-pp"`` with cp = ep = 1: tensor
parallel ranks are adjacent (they share the fastest links), then data parallel, then pipeline
stages. ``tests/runtime/test_layout.py`` checks these groups against the ones megatron's
``parallel_state.initialize_model_parallel`` builds, so a re-layout can rebuild groups from here.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator


@dataclasses.dataclass(frozen=True)
class Coord:
    tp: int
    pp: int
    dp: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """A layout over ``tp * pp * dp`` ranks. ``dp`` 0: as many replicas as ``members`` fill."""

    tp: int
    pp: int
    dp: int = 0
    _: dataclasses.KW_ONLY
    vp: int = 1
    stage_layers: tuple[int, ...] | None = None
    replica_microbatches: tuple[int, ...] | None = None
    members: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "vp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Layout.{name} must be a positive integer, got {value!r}")
        members = None if self.members is None else tuple(int(m) for m in self.members)
        dp = self.dp
        if not dp:
            if members is None:
                raise ValueError("Layout needs dp or members")
            dp = len(members) // (self.tp * self.pp)
            if dp < 1 or len(members) % (self.tp * self.pp):
                raise ValueError(f"{len(members)} rank(s) cannot form TP {self.tp} x PP {self.pp}")
        if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
            raise ValueError(f"Layout.dp must be a positive integer, got {dp!r}")
        object.__setattr__(self, "dp", dp)
        world = self.tp * self.pp * dp
        if members is None:
            members = tuple(range(world))
        if len(members) != world:
            raise ValueError(f"Layout {self.name}: {len(members)} member(s) for {world} rank(s)")
        object.__setattr__(self, "members", members)
        for name in ("stage_layers", "replica_microbatches"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(int(n) for n in value))

    # --- sizes, name, checks -------------------------------------------------------------------------
    @classmethod
    def from_world(cls, world_size: int, tp: int, pp: int, **fields: Any) -> "Layout":
        """Derive dp from the world size: the one check that TP x PP divides it."""
        check_divides(world_size, tp, pp)
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp), **fields)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def name(self) -> str:
        """``tp2pp2dp1`` (``vp2`` appended with virtual stages)."""
        return f"tp{self.tp}pp{self.pp}dp{self.dp}" + (f"vp{self.vp}" if self.vp > 1 else "")

    def describe(self) -> str:
        """One line: ``tp1pp2dp1 (layers 3/1) (micro-batches 5/3) on rank(s) 0,2``."""
        return (self.name + (f" (layers {'/'.join(map(str, self.stage_layers))})" if self.stage_layers else "")
                + (f" (micro-batches {'/'.join(map(str, self.replica_microbatches))})"
                   if self.replica_microbatches else "")
                + f" on rank(s) {','.join(map(str, self.members))}")

    def normalised(self) -> "Layout":
        """Even stages and an even split written as None (what the config and the logs expect)."""
        stages, mbs = self.stage_layers, self.replica_microbatches
        return dataclasses.replace(self, stage_layers=None if stages is not None and len(set(stages)) == 1 else stages,
                                   replica_microbatches=None if mbs is not None and len(set(mbs)) == 1 else mbs)

    def layers_of_stages(self, num_layers: int) -> tuple[int, ...]:
        """Layers of each stage: ``stage_layers``, else megatron's even split of ``num_layers``."""
        return self.stage_layers if self.stage_layers is not None else even_stage_layers(num_layers, self.pp)

    def with_members(self, members: Iterable[int]) -> "Layout":
        """The same layout with ``members`` in its ranks' places."""
        return dataclasses.replace(self, members=tuple(members))

    # --- ranks and groups ------------------------------------------------------------------------
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

    # --- the store's and the logs' form ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"tp": self.tp, "pp": self.pp, "vp": self.vp, "members": list(self.members),
                "stage_layers": list(self.stage_layers) if self.stage_layers else None,
                "replica_microbatches": list(self.replica_microbatches) if self.replica_microbatches else None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Layout":
        return cls(tp=int(d["tp"]), pp=int(d["pp"]), members=tuple(d["members"]), vp=int(d.get("vp") or 1),
                   stage_layers=tuple(d["stage_layers"]) if d.get("stage_layers") else None,
                   replica_microbatches=tuple(d["replica_microbatches"]) if d.get("replica_microbatches") else None)


def check_divides(world_size: int, tp: int, pp: int) -> None:
    """The one check that a world forms TP x PP x DP; raises ValueError naming megatron's flags."""
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
                         f"--pipeline-model-parallel-size ({pp}) = {tp * pp}")


def even_stage_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """Megatron's default split of layers over stages (equal stages); raises when it does not divide."""
    if num_layers % pp:
        raise ValueError(f"--num-layers ({num_layers}) is not divisible by --pipeline-model-parallel-size ({pp})")
    return (num_layers // pp,) * pp


def split_even(total: int, parts: int) -> list[int]:
    """``total`` over ``parts`` as evenly as possible, the first parts taking the remainder (the
    planner's split of layers over virtual stages and of micro-batches over replicas, where they
    need not divide)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]

"""ResiHP trace format v1: one JSON object per line, one line per training iteration.

It records what the detector sees (layout, per rank / chunk / micro-batch compute durations, the
micro-batches' document lengths, the observed iteration time) plus fault labels when faults were
injected, so detection can be replayed offline (``python -m megatron_ext.resihp.replay``) and
other tools can write traces for it. The contract is docs/resihp_trace_format.md; change it only
by adding optional keys, or by bumping ``TRACE_VERSION``.
"""
from __future__ import annotations

import dataclasses
import functools
import gzip
import io
import json
import logging
import math
import os
from typing import Any, Iterator, Sequence

import numpy as np

from megatron_ext.errors import UserError
from megatron_ext.models.flops import ModelSpec
from megatron_ext.pipeline.schedule_orders import SCHEDULES
from megatron_ext.resihp.jsonl import JsonLinesWriter
from megatron_ext.layout import Coord, Layout

logger = logging.getLogger(__name__)

TRACE_FORMAT = "resihp-trace"
TRACE_VERSION = 1
FAULT_KINDS = ("slow", "stop")


class TraceError(UserError, ValueError):
    """A trace record is malformed; the message starts with ``file:line``."""


UNRECORDED = ("members", "stage_layers", "replica_microbatches")
"""Fields of the base layout a trace does not record: ``ranks`` is its rank order, and a record
carries its stages' layers itself (format v1, docs/resihp_trace_format.md)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceLayout(Layout):
    """The project's ``Layout`` as a trace records it: plus virtual stages, the schedule, the
    micro-batches of the iteration and, where a re-layout permuted them, the ranks' coordinates
    (``ranks[r] = (stage, dp, tp)``; when absent, megatron's default order: tensor-parallel rank
    fastest, then data-parallel, pipeline stage slowest)."""

    vp: int = 1
    schedule: str = "1f1b"
    num_microbatches: int
    microbatch_group_size: int | None = None
    ranks: tuple[tuple[int, int, int], ...] | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "vp", "num_microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"layout.{name} must be >= 1, got {getattr(self, name)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"layout.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.vp > 1 and self.schedule != "interleaved":
            raise ValueError(f"layout.vp = {self.vp} needs schedule 'interleaved', got {self.schedule!r}")
        if self.ranks is not None:
            ranks = tuple(tuple(int(x) for x in c) for c in self.ranks)
            object.__setattr__(self, "ranks", ranks)
            want = {(s, d, t) for s in range(self.pp) for d in range(self.dp) for t in range(self.tp)}
            if len(ranks) != self.world_size or set(ranks) != want:
                raise ValueError(f"layout.ranks must list each (stage, dp, tp) of a {self.pp}x{self.dp}x{self.tp} "
                                 f"layout once, one per rank; got {len(ranks)} entries")

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, dp, tp) of a rank."""
        if self.ranks is not None:
            return self.ranks[rank]
        c = Layout.coord(self, rank)
        return c.pp, c.dp, c.tp

    def coord(self, rank: int) -> Coord:
        stage, dp, tp = self.coords(rank)
        return Coord(tp=tp, pp=stage, dp=dp)

    @functools.cached_property
    def coord_array(self) -> np.ndarray:
        """(world, 3) array of (stage, dp, tp)."""
        return np.array([self.coords(r) for r in range(self.world_size)], dtype=np.int64).reshape(-1, 3)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in UNRECORDED}
        if self.ranks is None:
            del out["ranks"]
        else:
            out["ranks"] = [list(c) for c in self.ranks]
        if self.microbatch_group_size is None:
            del out["microbatch_group_size"]
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultLabel:
    """Ground truth of an injected fault, active in the record that carries it."""

    kind: str           # "slow" or "stop"
    rank: int
    since: int          # first iteration the fault was active
    factor: float | None = None  # slowdown factor of a "slow" fault

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(kw_only=True, eq=False)
class TraceRecord:
    """One iteration as the detector sees it. Durations are seconds of a rank's own compute for
    each (chunk, micro-batch), shaped ``(world_size, vp, num_microbatches)``; NaN marks a rank
    that reported nothing (stopped)."""

    iteration: int
    iteration_s: float
    layout: TraceLayout
    model: ModelSpec
    documents: list[list[list[int]]]  # [dp replica][micro-batch] -> document lengths
    fwd_s: np.ndarray
    bwd_s: np.ndarray
    time_s: float | None = None       # wall clock (s) at the end of the iteration
    layers: list[list[int]] | None = None  # layers per [stage][chunk]; default: even split
    faults: tuple[FaultLabel, ...] = ()
    # MoE (optional, shaped like fwd_s; NaN: not known): (token, expert) pairs each rank's experts
    # computed over the chunk's MoE layers in the micro-batch's forward, and the seconds each op
    # spent inside the token dispatcher's collectives (already excluded from fwd_s / bwd_s).
    routed_tokens: np.ndarray | None = None
    moe_comm_fwd_s: np.ndarray | None = None
    moe_comm_bwd_s: np.ndarray | None = None
    # The device (launch rank) each rank is in this iteration; None: rank r is device r. A live
    # rank permutation or a fail-stop regroup renumbers the ranks, and the detector's per-device
    # state (known slowdowns, noise, verdict history) follows the device, not the number.
    devices: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.devices is not None:
            self.devices = tuple(int(d) for d in self.devices)
            if (len(self.devices) != self.layout.world_size or len(set(self.devices)) != len(self.devices)
                    or min(self.devices) < 0):
                raise ValueError(f"devices must name {self.layout.world_size} distinct launch ranks >= 0, one per "
                                 f"rank; got {list(self.devices)}")

    def device_of(self, rank: int) -> int:
        """The launch rank that is ``rank`` in this iteration."""
        return rank if self.devices is None else self.devices[rank]

    @functools.cached_property
    def doc_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, sum of squared document lengths), each shaped (dp, num_microbatches)."""
        dp, m = self.layout.dp, self.layout.num_microbatches
        tokens, sq = np.zeros((dp, m)), np.zeros((dp, m))
        for d in range(dp):
            for i, docs in enumerate(self.documents[d]):
                a = np.asarray(docs, dtype=float)
                tokens[d, i], sq[d, i] = a.sum(), (a * a).sum()
        return tokens, sq

    @property
    def present(self) -> np.ndarray:
        """(world,) bool: ranks that reported durations."""
        return ~(np.isnan(self.fwd_s).all(axis=(1, 2)) & np.isnan(self.bwd_s).all(axis=(1, 2)))

    def to_dict(self) -> dict[str, Any]:
        def ranks(a: np.ndarray) -> list:
            # null: a rank that reported nothing; inside a row, an op the rank did not run (its
            # replica has fewer micro-batches).
            return [None if np.isnan(row).all() else [[None if np.isnan(x) else round(float(x), 9) for x in c]
                                                       for c in row] for row in a]

        out: dict[str, Any] = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "iteration": self.iteration}
        if self.time_s is not None:
            out["time_s"] = self.time_s
        out.update(iteration_s=self.iteration_s, layout=self.layout.to_dict(), model=self.model.to_dict())
        if self.layers is not None:
            out["layers"] = self.layers
        out.update(documents=self.documents, fwd_s=ranks(self.fwd_s), bwd_s=ranks(self.bwd_s))
        if self.routed_tokens is not None:
            out["routed_tokens"] = [None if np.isnan(row).all() else [[None if np.isnan(x) else int(round(x)) for x in c]
                                                                       for c in row] for row in self.routed_tokens]
        for key in ("moe_comm_fwd_s", "moe_comm_bwd_s"):
            if getattr(self, key) is not None:
                out[key] = ranks(getattr(self, key))
        if self.devices is not None:
            out["devices"] = list(self.devices)
        if self.faults:
            out["faults"] = [f.to_dict() for f in self.faults]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "TraceRecord":
        return _parse(data, where)


# ------------------------------------------------------------------------------------ parsing
def _require(data: dict, key: str, types: type | tuple, where: str) -> Any:
    if key not in data:
        raise TraceError(f"{where}: missing key '{key}'")
    value = data[key]
    # bool is an int to isinstance; a JSON true is never a count or a duration here.
    if not isinstance(value, types) or isinstance(value, bool):
        raise TraceError(f"{where}: key '{key}' expects {_type_name(types)}, got {value!r:.60}")
    return value


def _type_name(types: type | tuple) -> str:
    return " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))


def _durations(value: Any, key: str, world: int, vp: int, m: int, where: str, *,
               what: str = "durations") -> np.ndarray:
    if value is None:
        raise TraceError(f"{where}: missing key '{key}'")
    if not isinstance(value, list) or len(value) != world:
        raise TraceError(f"{where}: key '{key}' must list {world} ranks (tp*pp*dp), "
                         f"got {len(value) if isinstance(value, list) else type(value).__name__}")
    out = np.full((world, vp, m), np.nan)
    for r, row in enumerate(value):
        if row is None:
            continue
        try:
            arr = np.asarray(row, dtype=float)
        except (TypeError, ValueError):
            raise TraceError(f"{where}: key '{key}' rank {r}: not a [chunk][micro-batch] table of numbers") from None
        if arr.shape != (vp, m):
            raise TraceError(f"{where}: key '{key}' rank {r}: expected shape [vp={vp}][microbatches={m}], "
                             f"got {list(arr.shape)}")
        ran = arr[~np.isnan(arr)]  # null entries: ops this rank did not run
        if not np.isfinite(ran).all() or (ran < 0).any():
            raise TraceError(f"{where}: key '{key}' rank {r}: {what} must be finite and >= 0")
        if what == "counts" and (ran != np.round(ran)).any():
            raise TraceError(f"{where}: key '{key}' rank {r}: counts must be integers")
        out[r] = arr
    return out


def _parse(data: Any, where: str) -> TraceRecord:
    if not isinstance(data, dict):
        raise TraceError(f"{where}: a record must be a JSON object, got {type(data).__name__}")
    fmt = data.get("format")
    if fmt != TRACE_FORMAT:
        raise TraceError(f"{where}: key 'format' must be {TRACE_FORMAT!r}, got {fmt!r}")
    version = _require(data, "version", int, where)
    if version > TRACE_VERSION:
        raise TraceError(f"{where}: trace format version {version} is newer than this reader "
                         f"(version {TRACE_VERSION}); update megatron-ext")
    if version < 1:
        raise TraceError(f"{where}: key 'version' must be >= 1, got {version}")
    known = {"format", "version", "iteration", "time_s", "iteration_s", "layout", "model", "layers",
             "documents", "fwd_s", "bwd_s", "faults", "routed_tokens", "moe_comm_fwd_s", "moe_comm_bwd_s", "devices"}
    unknown = sorted(k for k in data if k not in known and not str(k).startswith("x_"))
    if unknown:
        raise TraceError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                         "(extensions must start with 'x_')")
    iteration = _require(data, "iteration", int, where)
    iteration_s = float(_require(data, "iteration_s", (int, float), where))
    if not math.isfinite(iteration_s) or iteration_s < 0:
        raise TraceError(f"{where}: key 'iteration_s' must be finite and >= 0, got {iteration_s}")
    time_s = data.get("time_s")
    if time_s is not None and (isinstance(time_s, bool) or not isinstance(time_s, (int, float))):
        raise TraceError(f"{where}: key 'time_s' expects a number, got {time_s!r:.60}")
    lay = _require(data, "layout", dict, where)
    try:
        layout = TraceLayout(**lay)
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{where}: key 'layout': {exc}") from None
    try:
        model = ModelSpec.from_dict(_require(data, "model", dict, where), where=f"{where}: key 'model'")
    except (TypeError, ValueError) as exc:
        raise TraceError(str(exc)) from None
    layers = data.get("layers")
    if layers is not None and (not isinstance(layers, list) or len(layers) != layout.pp
                               or any(not isinstance(r, list) or len(r) != layout.vp for r in layers)):
        raise TraceError(f"{where}: key 'layers' must be a [pp={layout.pp}][vp={layout.vp}] table of layer counts")
    docs = _require(data, "documents", list, where)
    m = layout.num_microbatches
    if len(docs) != layout.dp or any(not isinstance(d, list) or len(d) != m for d in docs):
        raise TraceError(f"{where}: key 'documents' must be a [dp={layout.dp}][microbatches={m}] table of "
                         "document-length lists")
    for d, row in enumerate(docs):
        for i, lengths in enumerate(row):
            if (not isinstance(lengths, list)
                    or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in lengths)):
                raise TraceError(f"{where}: key 'documents' [{d}][{i}]: expected a list of non-negative "
                                 f"integer lengths, got {lengths!r:.60}")
    world = layout.world_size
    fwd = _durations(data.get("fwd_s"), "fwd_s", world, layout.vp, m, where)
    bwd = _durations(data.get("bwd_s"), "bwd_s", world, layout.vp, m, where)
    moe: dict[str, np.ndarray | None] = {}
    for key in ("routed_tokens", "moe_comm_fwd_s", "moe_comm_bwd_s"):
        value = data.get(key)
        moe[key] = None if value is None else _durations(value, key, world, layout.vp, m, where,
                                                         what="counts" if key == "routed_tokens" else "durations")
    if moe["routed_tokens"] is not None and model.num_experts is None:
        raise TraceError(f"{where}: key 'routed_tokens' needs a model with experts ('model' has no num_experts)")
    devices = data.get("devices")
    if devices is not None:
        if (not isinstance(devices, list) or len(devices) != world
                or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in devices)
                or len(set(devices)) != world):
            raise TraceError(f"{where}: key 'devices' must list {world} distinct launch ranks (ints >= 0), one per "
                             f"rank, got {devices!r:.60}")
        devices = tuple(devices)
    faults = []
    for k, f in enumerate(data.get("faults") or []):
        if not isinstance(f, dict):
            raise TraceError(f"{where}: key 'faults' [{k}]: expected an object, got {f!r:.60}")
        try:
            label = FaultLabel(**f)
        except TypeError as exc:
            raise TraceError(f"{where}: key 'faults' [{k}]: {exc}") from None
        if label.kind not in FAULT_KINDS:
            raise TraceError(f"{where}: key 'faults' [{k}]: kind must be one of {', '.join(FAULT_KINDS)}, "
                             f"got {label.kind!r}")
        # A label names a device: with 'devices' a launch rank, possibly one that has left (stopped).
        if devices is None and not 0 <= label.rank < world:
            raise TraceError(f"{where}: key 'faults' [{k}]: rank {label.rank} outside 0..{world - 1}")
        if label.rank < 0:
            raise TraceError(f"{where}: key 'faults' [{k}]: rank {label.rank} is not a launch rank (>= 0)")
        faults.append(label)
    return TraceRecord(iteration=iteration, iteration_s=iteration_s, layout=layout, model=model,
                           documents=docs, fwd_s=fwd, bwd_s=bwd,
                           time_s=None if time_s is None else float(time_s), layers=layers, faults=tuple(faults),
                           devices=devices, **moe)


# ------------------------------------------------------------------------------------ files
def read_trace(path: str | os.PathLike) -> Iterator[TraceRecord]:
    """Yield the records of a trace file; errors name the file and line. A file whose name ends
    in ``.gz`` is read through gzip (the format is unchanged; compression only stores it)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise TraceError(f"trace file {path} does not exist")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                # The writer ends every record with its newline in one flushed write, so a last line
                # without one is a record a crashed run did not finish: skip it, keep the rest.
                if not line.endswith("\n"):
                    logger.warning("%s: last line is cut short (the writer stopped mid-record); skipped", where)
                    return
                # json's messages such as 'Unterminated string starting at' expect a position after them
                raise TraceError(f"{where}: not valid JSON ({exc.msg.removesuffix(' at')}, column {exc.colno})") from None
            yield _parse(data, where)


class TraceWriter(JsonLinesWriter):
    """Writes records, one line each, flushed per record so a crashed run keeps its trace."""

    def __init__(self, path: str | os.PathLike | io.TextIOBase):
        super().__init__(path, "w")


def write_trace(path: str | os.PathLike, records: Sequence[TraceRecord]) -> None:
    with TraceWriter(path) as w:
        for rec in records:
            w.write(rec)

"""Job traces and virtual-cluster (VC) files: parsing with located errors, VC filtering, load scaling.

Two trace formats are read (docs/cluster.md describes both):

* **philly** — ``timestamp,duration,num_gpus,gpu_time,cluster`` as processed for the Pollux simulator
  (submit time ``YYYY-MM-DD HH:MM:SS``, run time in seconds, GPUs, GPU-seconds, VC id). ``gpu_time``
  is informational and ignored.
* **generic** — named columns ``job_id,submit_time,num_gpus,vc`` plus ``duration`` or ``work`` and
  optional ``user,kind,pp_stages,micro_batches,bubble_fraction,mem_gb,act_mem_gb``.

A malformed row is reported as ``path:line: reason``. Rows need not be sorted by time. Jobs of VCs
absent from the VC file are dropped and counted per VC (the Philly copy has four such VCs). A path
ending in ``.gz`` is read through gzip. :func:`default_trace` gives the embedded Philly trace and its
VC file (package data; sources and licences in ``data/NOTICE.md``).
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import difflib
import gzip
import logging
import math
import os
from importlib import resources
from typing import Iterable, Mapping

from megatron_ext.errors import UserError
from megatron_ext.pipeline.bubbles import schedule_bubble_fraction

logger = logging.getLogger(__name__)

KINDS = ("train", "hpo", "pipeline")
PHILLY_COLUMNS = ("timestamp", "duration", "num_gpus", "gpu_time", "cluster")
GENERIC_REQUIRED = ("job_id", "submit_time", "num_gpus", "vc")
GENERIC_OPTIONAL = ("duration", "work", "user", "kind", "pp_stages", "micro_batches",
                    "bubble_fraction", "mem_gb", "act_mem_gb")
_MAX_REPORTED = 5
_EPOCH_ORDINAL = datetime.date(1970, 1, 1).toordinal()


class TraceError(UserError, ValueError):
    """A trace or VC file that cannot be used; the message names the file, line and reason."""


class Job:
    """One job of a trace: its static description (simulation state lives in the engines)."""

    __slots__ = ("job_id", "line", "submit", "duration", "gpus", "vc", "user", "kind", "pp_stages",
                 "micro_batches", "bubble_fraction", "mem_gb", "act_mem_gb")

    def __init__(self, job_id: str, line: int, submit: float, duration: float, gpus: int, vc: str,
                 user: str | None = None, kind: str = "train", pp_stages: int = 1, micro_batches: int = 1,
                 bubble_fraction: float | None = None, mem_gb: float = 0.0, act_mem_gb: float = 0.0):
        self.job_id = job_id
        self.line = line
        self.submit = submit        # seconds after the first submit, already divided by the load scale
        self.duration = duration    # exclusive run time in seconds on this job's VC
        self.gpus = gpus
        self.vc = vc
        self.user = user
        self.kind = kind
        self.pp_stages = pp_stages
        self.micro_batches = micro_batches
        self.bubble_fraction = bubble_fraction
        self.mem_gb = mem_gb
        self.act_mem_gb = act_mem_gb

    @property
    def bubble(self) -> float:
        """Idle fraction of each GPU of a pipeline job: measured if given, else the 1F1B/GPipe
        schedule's (p-1)/(m+p-1)."""
        if self.kind != "pipeline":
            return 0.0
        if self.bubble_fraction is not None:
            return self.bubble_fraction
        return schedule_bubble_fraction(self.pp_stages, self.micro_batches)

    def __repr__(self) -> str:
        return (f"Job({self.job_id!r}, vc={self.vc!r}, submit={self.submit}, duration={self.duration}, "
                f"gpus={self.gpus}, kind={self.kind!r})")


@dataclasses.dataclass(frozen=True)
class VCSpec:
    name: str
    nodes: int
    gpus_per_node: int
    gpu_type: str | None = None
    speed: float = 1.0  # relative speed of its GPU type; a job's 'work' runs work/speed seconds here

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclasses.dataclass
class Trace:
    jobs: list[Job]                      # sorted by submit time, file order among equal times
    vcs: dict[str, VCSpec]               # only VCs that have jobs or were configured
    path: str
    fmt: str
    load_scale: float
    first_submit: float                  # absolute submit time (epoch s for Philly) mapped to 0
    dropped: dict[str, int]              # jobs of VCs absent from the VC file, per VC
    rejected: list[tuple[int, str]]      # (line, reason) of rows skipped with skip_bad_rows

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())


class _Bad(ValueError):
    """A row-level problem; becomes 'path:line: reason'."""


def _epoch_seconds(text: str, cache: dict[str, int]) -> int:
    """'YYYY-MM-DD HH:MM:SS' -> seconds since 1970 (UTC). Cached per day: the hot path of parsing."""
    if (len(text) != 19 or text[4] != "-" or text[7] != "-" or text[10] != " " or text[13] != ":"
            or text[16] != ":"):
        raise _Bad(f"timestamp {text!r} is not YYYY-MM-DD HH:MM:SS")
    day = cache.get(text[:10])
    if day is None:
        try:
            day = (datetime.date.fromisoformat(text[:10]).toordinal() - _EPOCH_ORDINAL) * 86400
        except ValueError:
            raise _Bad(f"timestamp {text!r} has no valid date") from None
        cache[text[:10]] = day
    hh, mm, ss = text[11:13], text[14:16], text[17:19]
    if not (hh.isdigit() and mm.isdigit() and ss.isdigit()) or int(hh) > 23 or int(mm) > 59 or int(ss) > 59:
        raise _Bad(f"timestamp {text!r} has no valid time of day")
    return day + int(hh) * 3600 + int(mm) * 60 + int(ss)


def _number(name: str, text: str, *, positive: bool = False, nonneg: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _Bad(f"{name} {text!r} is not a number") from None
    if not math.isfinite(value):
        raise _Bad(f"{name} {text!r} is not a finite number")
    if positive and value <= 0:
        raise _Bad(f"{name} {text} must be > 0")
    if nonneg and value < 0:
        raise _Bad(f"{name} {text} must be >= 0")
    return value


def _integer(name: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        try:
            as_float = float(text)
        except ValueError:
            raise _Bad(f"{name} {text!r} is not an integer") from None
        if not as_float.is_integer():
            raise _Bad(f"{name} {text!r} is not an integer") from None
        value = int(as_float)
    if value < minimum:
        raise _Bad(f"{name} {value} must be >= {minimum}")
    return value


def _open_csv(path: str):
    if not os.path.isfile(path):
        raise TraceError(f"{path}: file does not exist")
    if path.endswith(".gz"):
        return gzip.open(path, "rt", newline="", encoding="utf-8")
    return open(path, newline="", encoding="utf-8")


def _unreadable(path: str, exc: BaseException) -> TraceError:
    # A truncated .gz raises EOFError and a corrupt one gzip.BadGzipFile only once rows are read.
    return TraceError(f"{path}: cannot be read ({type(exc).__name__}: {exc})")


DEFAULT_TRACE_FILES = ("philly.csv.gz", "philly_vc.csv")


def default_trace() -> tuple[str, str]:
    """(trace, VC file) of the embedded default: Microsoft's Philly trace as the Pollux artifact
    summarized it, and the Helios artifact's Philly VC sizes. Package data of ``megatron_ext.cluster``
    (``data/``), so it is there in a fresh clone, an editable install and a wheel alike."""
    base = resources.files("megatron_ext.cluster").joinpath("data")
    paths = [base.joinpath(name) for name in DEFAULT_TRACE_FILES]
    for p in paths:
        if not p.is_file():
            raise TraceError(f"the embedded default trace file {p} is missing from this installation of "
                             "megatron-ext; reinstall it, or pass --trace and --vc-config")
    return str(paths[0]), str(paths[1])


def read_vc_config(path: str | os.PathLike, gpus_per_node: int = 8,
                   gpu_speeds: Mapping[str, float] | None = None) -> dict[str, VCSpec]:
    """Read 'vc,node num[,gpus_per_node][,gpu_type]' (the Helios ``philly_vc.csv`` layout)."""
    path = os.fspath(path)
    try:
        return _read_vc_rows(path, gpus_per_node, dict(gpu_speeds or {}))
    except (OSError, EOFError) as exc:
        raise _unreadable(path, exc) from None


def _read_vc_rows(path: str, gpus_per_node: int, speeds: dict[str, float]) -> dict[str, VCSpec]:
    out: dict[str, VCSpec] = {}
    with _open_csv(path) as fh:
        reader = csv.reader(fh)
        header = [h.strip() for h in next(reader, [])]
        if not header:
            raise TraceError(f"{path}: empty VC file (expected a header 'vc,node num')")
        cols = {h: i for i, h in enumerate(header)}
        nodes_col = "node num" if "node num" in cols else "nodes"
        missing = [c for c in ("vc", nodes_col) if c not in cols]
        missing = ["node num" if c == "nodes" else c for c in missing]
        if missing:
            raise TraceError(f"{path}:1: VC file header {','.join(header)!r} lacks column(s) "
                             f"{', '.join(repr(m) for m in missing)} (expected 'vc,node num')")
        unknown = [h for h in header if h not in ("vc", nodes_col, "gpus_per_node", "gpu_type")]
        if unknown:
            raise TraceError(f"{path}:1: unknown VC column(s) {', '.join(repr(u) for u in unknown)}; "
                             "known: vc, node num, gpus_per_node, gpu_type")
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            try:
                if len(row) != len(header):
                    raise _Bad(f"expected {len(header)} fields, got {len(row)}")
                name = row[cols["vc"]].strip()
                if not name:
                    raise _Bad("vc is empty")
                if name in out:
                    raise _Bad(f"vc {name!r} is listed twice")
                nodes = _integer(nodes_col, row[cols[nodes_col]].strip(), 1)
                gpn = gpus_per_node
                if "gpus_per_node" in cols:
                    gpn = _integer("gpus_per_node", row[cols["gpus_per_node"]].strip(), 1)
                gtype = row[cols["gpu_type"]].strip() or None if "gpu_type" in cols else None
                speed = 1.0
                if speeds:
                    if gtype not in speeds:
                        raise _Bad(f"gpu_type {gtype!r} has no speed in --gpu-speeds "
                                   f"({', '.join(sorted(speeds))})")
                    speed = speeds[gtype]
            except _Bad as exc:
                raise TraceError(f"{path}:{line}: {exc}") from None
            out[name] = VCSpec(name, nodes, gpn, gtype, speed)
    if not out:
        raise TraceError(f"{path}: no VC rows")
    return out


def _sniff_format(path: str, header: list[str]) -> str:
    if tuple(header) == PHILLY_COLUMNS:
        return "philly"
    if "job_id" in header:
        return "generic"
    raise TraceError(f"{path}:1: cannot tell the trace format from header {','.join(header)!r}: expected "
                     f"{','.join(PHILLY_COLUMNS)!r} (philly) or named columns with job_id (generic)")


def _philly_rows(path: str, reader, header: list[str], bad: list[tuple[int, str]]) -> list[list]:
    if tuple(header) != PHILLY_COLUMNS:
        raise TraceError(f"{path}:1: Philly header must be {','.join(PHILLY_COLUMNS)!r}, "
                         f"got {','.join(header)!r}")
    cache: dict[str, int] = {}
    rows = []
    for row in reader:
        line = reader.line_num
        if not row:
            continue
        try:
            if len(row) != 5:
                raise _Bad(f"expected 5 fields ({','.join(PHILLY_COLUMNS)}), got {len(row)}")
            ts, dur, gpus, _gpu_time, vc = row
            submit = _epoch_seconds(ts.strip(), cache)
            duration = _number("duration", dur, positive=True)
            ngpu = _integer("num_gpus", gpus.strip(), 1)
            vc = vc.strip()
            if not vc:
                raise _Bad("cluster (VC id) is empty")
        except _Bad as exc:
            bad.append((line, str(exc)))
            continue
        # job_id, line, submit, duration, work, gpus, vc, extras
        rows.append([str(line), line, submit, duration, None, ngpu, vc, None])
    return rows


def _generic_rows(path: str, reader, header: list[str], bad: list[tuple[int, str]]) -> list[list]:
    cols = {h: i for i, h in enumerate(header)}
    known = GENERIC_REQUIRED + GENERIC_OPTIONAL
    unknown = [h for h in header if h not in known]
    if unknown:
        hints = []
        for u in unknown:
            close = difflib.get_close_matches(u, known, n=1)
            hints.append(repr(u) + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise TraceError(f"{path}:1: unknown column(s) {', '.join(hints)}; known: {', '.join(known)}")
    missing = [c for c in GENERIC_REQUIRED if c not in cols]
    if missing:
        raise TraceError(f"{path}:1: missing required column(s) {', '.join(missing)}")
    if "duration" not in cols and "work" not in cols:
        raise TraceError(f"{path}:1: needs a 'duration' or a 'work' column")
    if len(cols) != len(header):
        raise TraceError(f"{path}:1: a column is named twice in {','.join(header)!r}")
    cache: dict[str, int] = {}
    seen: dict[str, int] = {}
    forms: dict[str, int] = {}  # submit_time form ('seconds' or 'timestamps') -> first line using it
    rows = []

    def get(row: list[str], name: str) -> str:
        i = cols.get(name)
        return row[i].strip() if i is not None else ""

    for row in reader:
        line = reader.line_num
        if not row:
            continue
        try:
            if len(row) != len(header):
                raise _Bad(f"expected {len(header)} fields, got {len(row)}")
            job_id = get(row, "job_id")
            if not job_id:
                raise _Bad("job_id is empty")
            if job_id in seen:
                raise _Bad(f"job_id {job_id!r} already used on line {seen[job_id]}")
            text = get(row, "submit_time")
            try:
                submit, form = float(text), "seconds"
            except ValueError:
                submit, form = float(_epoch_seconds(text, cache)), "timestamps"
            if not math.isfinite(submit):
                raise _Bad(f"submit_time {text!r} is not a finite number")
            if forms and form not in forms:
                raise _Bad(f"submit_time {text!r} is given as {form[:-1]} but line {forms[next(iter(forms))]} "
                           f"gives {next(iter(forms))}; use one form in a file")
            forms.setdefault(form, line)
            ngpu = _integer("num_gpus", get(row, "num_gpus"), 1)
            vc = get(row, "vc")
            if not vc:
                raise _Bad("vc is empty")
            dur_text, work_text = get(row, "duration"), get(row, "work")
            if bool(dur_text) == bool(work_text):
                raise _Bad("give exactly one of duration and work")
            duration = _number("duration", dur_text, positive=True) if dur_text else None
            work = _number("work", work_text, positive=True) if work_text else None
            kind = get(row, "kind") or "train"
            if kind not in KINDS:
                raise _Bad(f"kind {kind!r} is not one of {', '.join(KINDS)}")
            extras = {"user": get(row, "user") or None, "kind": kind}
            pp_text, mb_text, bf_text = get(row, "pp_stages"), get(row, "micro_batches"), get(row, "bubble_fraction")
            if kind == "pipeline":
                if bf_text:
                    bf = _number("bubble_fraction", bf_text, nonneg=True)
                    if bf >= 1:
                        raise _Bad(f"bubble_fraction {bf_text} must be < 1")
                    extras["bubble_fraction"] = bf
                if pp_text or not bf_text:
                    if not pp_text or not mb_text:
                        raise _Bad("kind 'pipeline' needs pp_stages and micro_batches, or bubble_fraction")
                    pp = _integer("pp_stages", pp_text, 2)
                    if ngpu % pp:
                        raise _Bad(f"num_gpus {ngpu} is not a multiple of pp_stages {pp}")
                    extras["pp_stages"] = pp
                    extras["micro_batches"] = _integer("micro_batches", mb_text, 1)
            elif pp_text or mb_text or bf_text:
                raise _Bad(f"pp_stages/micro_batches/bubble_fraction only apply to kind 'pipeline', not {kind!r}")
            for name in ("mem_gb", "act_mem_gb"):
                text = get(row, name)
                if text:
                    extras[name] = _number(name, text, nonneg=True)
        except _Bad as exc:
            bad.append((line, str(exc)))
            continue
        seen[job_id] = line
        rows.append([job_id, line, submit, duration, work, ngpu, vc, extras])
    return rows


def read_trace(path: str | os.PathLike, vcs: Mapping[str, VCSpec], *, fmt: str = "auto",
               load_scale: float = 1.0, skip_bad_rows: bool = False) -> Trace:
    """Parse a trace, keep the jobs of configured VCs, and map submit times to
    ``(t - first_submit) / load_scale``. Bad rows raise :class:`TraceError` unless ``skip_bad_rows``."""
    path = os.fspath(path)
    if load_scale <= 0:
        raise TraceError(f"load scale must be > 0, got {load_scale}")
    bad: list[tuple[int, str]] = []
    try:
        with _open_csv(path) as fh:
            reader = csv.reader(fh)
            header = [h.strip() for h in next(reader, [])]
            if not header:
                raise TraceError(f"{path}: empty trace file")
            if fmt == "auto":
                fmt = _sniff_format(path, header)
            if fmt == "philly":
                rows = _philly_rows(path, reader, header, bad)
            elif fmt == "generic":
                rows = _generic_rows(path, reader, header, bad)
            else:
                raise TraceError(f"unknown trace format {fmt!r}")
    except (OSError, EOFError) as exc:
        raise _unreadable(path, exc) from None

    dropped: dict[str, int] = {}
    kept = []
    for r in rows:
        spec = vcs.get(r[6])
        if spec is None:
            dropped[r[6]] = dropped.get(r[6], 0) + 1
            continue
        if r[5] > spec.gpus:
            bad.append((r[1], f"num_gpus {r[5]} exceeds the {spec.gpus} GPUs of VC {r[6]!r}"))
            continue
        kept.append(r)
    if bad:
        bad.sort()
        if not skip_bad_rows:
            shown = "; ".join(f"line {ln}: {why}" for ln, why in bad[:_MAX_REPORTED])
            more = f" (and {len(bad) - _MAX_REPORTED} more)" if len(bad) > _MAX_REPORTED else ""
            raise TraceError(f"{path}: {len(bad)} bad row(s): {shown}{more}. Fix them, or pass "
                             "--skip-bad-rows to drop them")
        for ln, why in bad:
            logger.warning("%s:%d: rejected: %s", path, ln, why)
    if dropped:
        logger.info("%s: dropped %d jobs of VCs absent from the VC file: %s", path,
                    sum(dropped.values()), ", ".join(f"{k}={v}" for k, v in sorted(dropped.items())))
    if not kept:
        raise TraceError(f"{path}: no jobs left after dropping VCs absent from the VC file "
                         f"(trace VCs: {', '.join(sorted(dropped)) or 'none'})")

    first = min(r[2] for r in kept)
    jobs = []
    for job_id, line, submit, duration, work, ngpu, vc, extras in kept:
        if duration is None:
            duration = work / vcs[vc].speed
        job = Job(job_id, line, (submit - first) / load_scale, duration, ngpu, vc)
        if extras:
            for key, value in extras.items():
                setattr(job, key, value)
        jobs.append(job)
    jobs.sort(key=lambda j: j.submit)  # stable: file order among equal submit times
    return Trace(jobs=jobs, vcs=dict(vcs), path=path, fmt=fmt, load_scale=load_scale,
                 first_submit=first, dropped=dropped, rejected=bad)


def jobs_by_vc(jobs: Iterable[Job]) -> dict[str, list[Job]]:
    out: dict[str, list[Job]] = {}
    for job in jobs:
        out.setdefault(job.vc, []).append(job)
    return out

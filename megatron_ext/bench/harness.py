"""One way to measure and report a benchmark: interleaved rotated arms, an A/A noise floor,
bootstrap intervals, provenance.

A shared machine's load drifts during a run. Arms measured one after another each see a different
slice of that drift; arms interleaved round by round see the same drift, and rotating which arm
goes first each round keeps "first in the round" (a warm or a cold cache, a neighbour's burst) from
always landing on the same arm. What drift is left shows up in the A/A arm: the reference arm run
twice per round, compared with itself. Its ratio should be 1; how far its interval strays from 1 is
the smallest difference this run can resolve, and every comparison is printed beside it.

Pure Python + numpy; nothing here imports torch.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

# The rotation and the paired-ratio interval live below the extensions (the job's own measured
# selection, helix/selection.py, uses them too); the harness is their home for the benchmarks.
from megatron_ext.runtime.rounds import ratio_interval, rotated_order  # noqa: F401 (re-exported)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AA_SUFFIX = " (A/A)"


class _FirstArm:
    def __repr__(self) -> str:
        return "FIRST_ARM"


FIRST_ARM: Any = _FirstArm()
"""``interleave``'s default ``aa``: the first arm of the dict is the reference that gets an A/A copy."""


def aa_name(arm: str) -> str:
    return arm + AA_SUFFIX


@dataclass
class Interleaved:
    """What ``interleave`` measured: one sample per arm per round, and the order of each round."""

    samples: dict[str, list[float]]
    """arm name -> its samples, round by round (the A/A copy under ``aa_name(reference)``)."""
    orders: list[list[str]]
    """the order in which each round ran the arms."""
    reference: str | None
    """the arm that has an A/A copy (None: no A/A arm was run)."""


def interleave(arms: Mapping[str, Callable[[], float]], rounds: int, *, aa: str | None = FIRST_ARM,
               warmup: int = 0) -> Interleaved:
    """Run every arm once per round, in an order rotated by the round index, plus an A/A copy of
    arm ``aa`` (default: the first arm; None: no A/A copy) that calls the same callable.

    Each call's return value is its sample (seconds, tokens/s: whatever the arm measures). With
    ``warmup`` > 0, every arm is called that many times first and its results dropped. Rounds should
    be a multiple of the arm count (A/A copy included) for every arm to be first equally often.
    """
    if rounds < 1:
        raise ValueError(f"interleave: rounds must be >= 1, got {rounds}")
    if not arms:
        raise ValueError("interleave: no arms")
    if aa is FIRST_ARM:
        aa = next(iter(arms))
    if aa is not None and aa not in arms:
        raise ValueError(f"interleave: the A/A arm {aa!r} is not one of the arms {sorted(arms)}")
    calls: dict[str, Callable[[], float]] = dict(arms)
    if aa is not None:
        if aa_name(aa) in calls:
            raise ValueError(f"interleave: an arm is already named {aa_name(aa)!r}")
        calls[aa_name(aa)] = arms[aa]
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    orders = []
    for r in range(rounds):
        order = rotated_order(names, r)
        orders.append(order)
        for name in order:
            samples[name].append(float(calls[name]()))
    return Interleaved(samples=samples, orders=orders, reference=aa)


def compare(samples: Mapping[str, Sequence[float]], reference: str, *, higher_is_better: bool,
            level: float = 0.9, seed: int = 0) -> dict:
    """Every arm against ``reference``: its median, the median of its per-round ratios to the
    reference with an interval, and a verdict that takes the A/A noise floor into account.

    ``noise_floor`` is the A/A copy's ratio to the reference (when ``samples`` has one). An arm is
    "better" / "worse" only when its whole interval lies beyond both 1 and the A/A interval; else
    "within noise".
    """
    import numpy as np

    if reference not in samples:
        raise ValueError(f"compare: reference {reference!r} is not one of {sorted(samples)}")
    ref = samples[reference]
    floor = None
    if aa_name(reference) in samples:
        aa = ratio_interval(samples[aa_name(reference)], ref, level=level, seed=seed)
        floor = {"ratio": aa["median"], "interval": aa["interval"]}
    lo_floor, hi_floor = floor["interval"] if floor else (1.0, 1.0)
    arms = {}
    for name, values in samples.items():
        entry: dict[str, Any] = {"median": float(np.median(values))}
        if name != reference and not name.endswith(AA_SUFFIX):
            r = ratio_interval(values, ref, level=level, seed=seed)
            low, high = r["interval"]
            if low > max(1.0, hi_floor):
                verdict = "better" if higher_is_better else "worse"
            elif high < min(1.0, lo_floor):
                verdict = "worse" if higher_is_better else "better"
            else:
                verdict = "within noise"
            entry.update(ratio_vs_reference=r["median"], interval=r["interval"], verdict=verdict)
        arms[name] = entry
    return {"reference": reference, "higher_is_better": higher_is_better, "level": level, "arms": arms,
            "noise_floor": floor, "rounds": len(ref)}


def format_comparison(result: dict, unit: str = "") -> str:
    """``compare``'s result as a table: median, ratio to the reference, interval, verdict; the A/A
    floor on the last line."""
    pct = int(round(result["level"] * 100))
    head = f"{'arm':<28} {'median' + (f' {unit}' if unit else ''):>14} {'ratio':>8} {f'{pct} % interval':>20}  verdict"
    lines = [head]
    for name, e in result["arms"].items():
        if name.endswith(AA_SUFFIX):
            continue
        if name == result["reference"]:
            lines.append(f"{name:<28} {e['median']:>14.4g} {'1':>8} {'(reference)':>20}")
            continue
        lo, hi = e["interval"]
        lines.append(f"{name:<28} {e['median']:>14.4g} {e['ratio_vs_reference']:>8.4f} "
                     f"{f'[{lo:.4f}, {hi:.4f}]':>20}  {e['verdict']}")
    floor = result["noise_floor"]
    if floor:
        lo, hi = floor["interval"]
        lines.append(f"{aa_name(result['reference']):<28} {'':>14} {floor['ratio']:>8.4f} "
                     f"{f'[{lo:.4f}, {hi:.4f}]':>20}  noise floor (the reference against itself)")
    else:
        lines.append("no A/A arm: no noise floor measured")
    lines.append(f"({result['rounds']} interleaved rounds, order rotated each round; ratio = median of "
                 f"per-round ratios, {'higher' if result['higher_is_better'] else 'lower'} is better)")
    return "\n".join(lines)


def _git(*args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _command(argv: Sequence[str]) -> str:
    # A script inside the repository is named relative to it: the line is kept in docs/figures and
    # must read the same on every machine.
    args = list(argv)
    if args and os.path.isabs(args[0]) and args[0].startswith(ROOT + os.sep):
        args[0] = os.path.relpath(args[0], ROOT)
    return shlex.join(["python", *args])


def provenance(argv: Sequence[str] | None = None) -> dict:
    """``commit`` (git HEAD, None outside a git checkout), ``dirty`` (whether tracked files differ
    from it; None when unknown) and ``command`` (the command line, ``sys.argv`` by default)."""
    head = _git("rev-parse", "HEAD")
    commit = head.stdout.strip() if head is not None and head.returncode == 0 else None
    dirty = None
    if commit:
        st = _git("status", "--porcelain", "--untracked-files=no")
        if st is not None and st.returncode == 0:
            dirty = bool(st.stdout.strip())
    return {"commit": commit, "dirty": dirty, "command": _command(sys.argv if argv is None else argv)}


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


@dataclass
class Report:
    """A benchmark's output. Make it before measuring (load before), then ``emit`` once: the table,
    then ONE JSON line -- the figures, ``bench``, the provenance, ``load_before``, ``load_after``
    and the CPU count (what a load average is measured against)."""

    bench: str
    """the benchmark's name, its script's (``bench_parallel`` for tools/bench_parallel.py): the figures
    check derives the files a kept figure depends on from it (``figures.derive_bench_files``)."""
    argv: Sequence[str] | None = None
    """the command line to record (default ``sys.argv``)."""
    load_before: list[float] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.load_before = load_average()

    def line(self, figures: Mapping[str, Any]) -> dict:
        clash = sorted({"bench", "commit", "dirty", "command", "load_before", "load_after", "cpus"} & set(figures))
        if clash:
            raise ValueError(f"Report: figure keys {clash} are the harness's own; rename them")
        return {"bench": self.bench, **figures, **provenance(self.argv), "load_before": self.load_before,
                "load_after": load_average(), "cpus": os.cpu_count()}

    def emit(self, figures: Mapping[str, Any], table: str | None = None, *, file=None) -> dict:
        out = file or sys.stdout
        line = self.line(figures)
        if table:
            print(table, file=out)
        print(f"load average before {_fmt_load(self.load_before)}, after {_fmt_load(line['load_after'])} "
              f"on {line['cpus']} cpus; commit {(line['commit'] or 'unknown')[:12]}"
              f"{' (dirty tree)' if line['dirty'] else ''}", file=out)
        print(json.dumps(line), file=out)
        return line


def _fmt_load(load: list[float] | None) -> str:
    return "n/a" if load is None else "/".join(f"{x:.2f}" for x in load)

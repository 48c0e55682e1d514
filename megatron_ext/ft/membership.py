"""Who is in the job: exit reports, error reports, spares, and the rounds in which ranks agree.

Every key lives in the job's store (``ft/store.py``); no process group is used here, because the
process group may be the thing that is broken. A process is named by its launch rank (``member``)
and its ``incarnation`` (0 at launch, +1 each time the launcher starts it again after a loss), so a
rank that was lost, replaced and lost again is reported twice, each report about one process.

* **Exit reports** (``report_exit``, ``ExitWatch``): the launcher writes one the moment a rank's
  process ends; a rank that ends on its own exception writes its own first, naming the exception.
  The first report of a process wins (compare-and-set).
* **Process records** (``register_process``, ``ProcessProbe``): where no launcher reports exits
  (torchrun, whose agent stops the survivors within 0.1 s of a worker's death; srun), a rank finds a
  peer on its own host whose process is gone and reports that exit itself -- at once, not after the
  heartbeat timeout. A peer on another host is still named by the heartbeat.
* **Error reports** (``report_error``): an exception that ends a rank is counted by its signature
  (type and message). The same signature ending a second process is a deterministic bug, not a
  lost device: the job ends (``declare_end``).
* **The job's end** (``declare_end``, ``job_end``): exit code and one line, first writer wins;
  every rank and spare that reads it ends the same way. ``mark_done``: training finished.
* **Spares** (``register_spare``, ``waiting_spares``, ``invite``, ``wait_for_invite``): a process
  with no place in the current layout -- left out by a shrink, or started again by the launcher
  (``--ft-respawn``) -- waits to be invited into a round.
* **Rounds** (``join``, ``publish``, ``wait_decision``, ``barrier``): for round ``r`` the ranks
  write ``gen<r>/join/<member>``, wait until every expected member joined or is known lost, and
  the lowest joined member (the leader) publishes the decision every one of them follows.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Callable, Iterable, Mapping

from megatron_ext.ft import store as store_lib
from megatron_ext.ft.errors import RestartNeeded

GiveUp = Callable[[], bool]


def _never() -> bool:
    return False


def proc(member: int, incarnation: int) -> str:
    return f"{member}.{incarnation}"


# --- exit reports ---------------------------------------------------------------------------------

def report_exit(base: Any, member: int, incarnation: int, *, code: int | None, reason: str, by: str,
                silence: dict[str, Any] | None = None) -> bool:
    """Process (``member``, ``incarnation``) ended: ``code`` (negative: a signal; None: not known
    yet), ``reason`` in words, ``by`` "launcher", "self", "probe" or "heartbeat" (then ``silence``, the
    reporter's ``liveness.Silence`` as a dict, so that a rank that learns of the loss from this report
    names it as the reporter did). The first report wins; returns whether this one did."""
    keys = store_lib.job_keys(base, "exited")
    report: dict[str, Any] = {"code": code, "reason": reason, "by": by}
    if silence is not None:
        report["silence"] = silence
    value = json.dumps(report)
    won = keys.compare_set(proc(member, incarnation), "", value) == value.encode()
    if won:
        keys.add("count", 1)
    return won


def exit_report(base: Any, member: int, incarnation: int) -> dict[str, Any] | None:
    keys = store_lib.job_keys(base, "exited")
    key = proc(member, incarnation)
    return json.loads(keys.get(key)) if keys.check([key]) else None


class ExitWatch:
    """Rank side: which processes of ``members`` (member -> incarnation) have an exit report. One
    counter read per call while nothing new was reported."""

    def __init__(self, base: Any) -> None:
        self.keys = store_lib.job_keys(base, "exited")
        self._seen_count = -1
        self._known: dict[str, dict[str, Any]] = {}

    def exited(self, members: Mapping[int, int]) -> dict[int, dict[str, Any]]:
        count = self.keys.add("count", 0)
        if count != self._seen_count:
            self._seen_count = count
            for m, inc in members.items():
                key = proc(m, inc)
                if key not in self._known and self.keys.check([key]):
                    self._known[key] = json.loads(self.keys.get(key))
        return {m: self._known[proc(m, inc)] for m, inc in members.items() if proc(m, inc) in self._known}

    def known(self, member: int, incarnation: int) -> dict[str, Any] | None:
        """The report of (``member``, ``incarnation``) already read by ``exited`` (no store access)."""
        return self._known.get(proc(member, incarnation))


# --- process records: a peer on this host whose process is gone -------------------------------

PROBE_REASON = "process ended"
"""How a probed exit's reason starts (its exit code is its parent's to know, not ours)."""


def host_key() -> str:
    """The kernel and pid namespace of this process: two processes' pids compare only within one
    (empty where /proc does not tell)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (so a reused pid is not taken for the same process); None
    when it no longer runs (absent, or a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]  # state (field 3), starttime (field 22)


def register_process(base: Any, member: int, incarnation: int, pid: int | None = None) -> None:
    """Say where this process (or ``pid``, on this host) runs, so that a peer on the same host can
    tell when it is gone."""
    pid = os.getpid() if pid is None else pid
    store_lib.job_keys(base, "procs").set(
        proc(member, incarnation), json.dumps({"host": host_key(), "pid": pid, "start": _start_time(pid)}))


def note_stopped(base: Any, member: int, incarnation: int) -> None:
    """This process was told to stop (SIGTERM: the job is cancelled, or its launcher stops every
    worker): when it is gone, it was stopped, not lost. Written before it acts on the signal."""
    store_lib.job_keys(base, "procs").set(proc(member, incarnation) + "/stopped", "1")


class ProcessProbe:
    """Rank side, where no launcher reports exits: processes of ``members`` on this host that no
    longer run and were not told to stop (``note_stopped``: a cancelled job's ranks end one after
    the other, and none of them is lost). Each is reported as an exit (``by`` "probe"; the first
    report of a process wins), so the other ranks, those on other hosts included, learn it from
    the store."""

    def __init__(self, base: Any, member: int) -> None:
        self.keys = store_lib.job_keys(base, "procs")
        self.base = base
        self.member = member
        self.here = host_key()
        self._records: dict[str, dict[str, Any]] = {}

    def gone(self, members: Mapping[int, int]) -> dict[int, str]:
        """Members whose process on this host ended (reported now, or before by this probe)."""
        if not self.here or is_done(self.base):  # a rank that finished training and exited is not lost
            return {}
        out = {}
        for m, inc in members.items():
            key = proc(m, inc)
            if key not in self._records:
                if not self.keys.check([key]):
                    continue
                self._records[key] = json.loads(self.keys.get(key))
            rec = self._records[key]
            if rec["host"] != self.here or rec["pid"] == os.getpid() or _start_time(rec["pid"]) == rec["start"]:
                continue
            if self.keys.check([key + "/stopped"]):
                continue
            reason = f"{PROBE_REASON}, seen by rank {self.member} on the same host"
            report_exit(self.base, m, inc, code=None, reason=reason, by="probe")
            out[m] = reason
        return out


# --- error reports and the job's end ----------------------------------------------------------

def signature(exc: BaseException) -> str:
    """Type and message: two ranks ending on the same signature end on the same bug."""
    text = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"
    return hashlib.sha1(text.encode("utf-8", "replace")).hexdigest()[:16]


def report_error(base: Any, member: int, exc: BaseException, described: str) -> tuple[int, dict[str, Any]]:
    """Count this process's ending exception by its signature. Returns how many processes have
    ended on it so far (this one included) and the first one's report."""
    keys = store_lib.job_keys(base, "errors")
    sig = signature(exc)
    first = json.dumps({"member": member, "error": described})
    keys.compare_set(f"{sig}/first", "", first)
    count = keys.add(sig, 1)
    return count, json.loads(keys.get(f"{sig}/first"))


def error_count(base: Any, exc: BaseException) -> int:
    """How many processes have ended on ``exc``'s signature so far (``report_error``)."""
    return int(store_lib.job_keys(base, "errors").add(signature(exc), 0))


def declare_end(base: Any, *, code: int, message: str, by: int, lost: dict | None = None) -> dict[str, Any]:
    """End the job with ``code`` and one line (the first declaration wins). ``lost``: the lost
    processes that ended it (member -> what is known of the loss), so every rank that ends on it
    can report them. Returns the end in force."""
    keys = store_lib.job_keys(base, "job")
    value = json.dumps({"code": code, "message": message, "by": by, "lost": lost or {}})
    keys.compare_set("end", "", value)
    return json.loads(keys.get("end"))


def job_end(base: Any) -> dict[str, Any] | None:
    keys = store_lib.job_keys(base, "job")
    return json.loads(keys.get("end")) if keys.check(["end"]) else None


def mark_done(base: Any) -> None:
    """Training reached its last iteration: spares waiting for a place can go."""
    store_lib.job_keys(base, "job").set("done", "1")


def is_done(base: Any) -> bool:
    return store_lib.job_keys(base, "job").check(["done"])


# --- spares -------------------------------------------------------------------------------------

def register_spare(base: Any, member: int, incarnation: int, *, kind: str) -> int:
    """This process waits for a place. ``kind``: "respawn" (a new process: it may be worth growing
    the job for it) or "idle" (left out of a layout; invited when a loss or a growth needs it).
    Returns the round of the last invite this member had (0: none): an invite of an earlier process of
    the same member (a rank lost, respawned, taken in and lost again) is not this one's to take."""
    keys = store_lib.job_keys(base, "spares")
    stale = int(keys.get(f"invite/{member}")) if keys.check([f"invite/{member}"]) else 0
    keys.set(f"state/{member}", json.dumps({"incarnation": incarnation, "kind": kind, "state": "waiting"}))
    seq = keys.add("count", 1) - 1
    keys.set(f"seq/{seq}", str(member))
    if kind == "respawn":
        keys.add("arrivals", 1)
    return stale


def arrivals(base: Any) -> int:
    """How many respawned processes have registered so far (grows only)."""
    return store_lib.job_keys(base, "spares").add("arrivals", 0)


def waiting_spares(base: Any, *, exclude: Iterable[int] = ()) -> dict[int, int]:
    """Spares waiting now (member -> incarnation), minus those with an exit report and ``exclude``."""
    keys = store_lib.job_keys(base, "spares")
    count = keys.add("count", 0)
    exclude = set(exclude)
    out: dict[int, int] = {}
    for m in sorted({int(keys.get(f"seq/{i}")) for i in range(count) if keys.check([f"seq/{i}"])}):
        state = json.loads(keys.get(f"state/{m}"))
        if m in exclude or state["state"] != "waiting" or exit_report(base, m, state["incarnation"]) is not None:
            continue
        out[m] = int(state["incarnation"])
    return out


def spare_state(base: Any, member: int) -> str | None:
    """"waiting" (a spare now), "member" (a spare that was taken in), or None (never a spare)."""
    keys = store_lib.job_keys(base, "spares")
    key = f"state/{member}"
    return json.loads(keys.get(key))["state"] if keys.check([key]) else None


def invite(base: Any, member: int, round_: int) -> None:
    store_lib.job_keys(base, "spares").set(f"invite/{member}", str(round_))


def take_spare(base: Any, member: int, incarnation: int) -> None:
    """A spare has a place again (its state is no longer "waiting")."""
    keys = store_lib.job_keys(base, "spares")
    keys.set(f"state/{member}", json.dumps({"incarnation": incarnation, "kind": "member", "state": "member"}))


def wait_for_invite(base: Any, member: int, *, after_round: int, poll_s: float = 0.1,
                    give_up: GiveUp = _never) -> int | None:
    """Block until this spare is invited into a round later than ``after_round``; None when
    ``give_up()`` turns true first (the job ended)."""
    keys = store_lib.job_keys(base, "spares")
    key = f"invite/{member}"
    while True:
        if keys.check([key]):
            r = int(keys.get(key))
            if r > after_round:
                return r
        if give_up():
            return None
        time.sleep(poll_s)


# --- rounds ---------------------------------------------------------------------------------------

def join(base: Any, *, round_: int, member: int, info: dict[str, Any], expected: Iterable[int],
         lost: Callable[[], set[int]], timeout_s: float, give_up: GiveUp = _never) -> dict[int, dict[str, Any]]:
    """Rendezvous of round ``round_``: publish ``info``, wait until each of ``expected`` has joined
    or is known lost. Returns the joined members' info. Raises ``RestartNeeded`` after
    ``timeout_s``; returns early with what joined when ``give_up()`` turns true."""
    keys = store_lib.generation(base, round_, "join")
    keys.set(str(member), json.dumps(info))
    expected = sorted(set(expected))
    deadline = time.monotonic() + timeout_s
    joined: set[int] = set()
    while True:
        joined |= {m for m in expected if m not in joined and keys.check([str(m)])}
        gone = lost()
        missing = [m for m in expected if m not in joined and m not in gone]
        if not missing or give_up():
            break
        if time.monotonic() > deadline:
            raise RestartNeeded(f"rank(s) {', '.join(map(str, missing))} neither rejoined nor were named lost "
                                f"within {timeout_s:.0f} s")
        time.sleep(0.02)
    return {m: json.loads(keys.get(str(m))) for m in sorted(joined)}


def joined_info(base: Any, round_: int, member: int, *, timeout_s: float, give_up: GiveUp = _never
                ) -> dict[str, Any] | None:
    """The join info ``member`` wrote in ``round_`` (the leader reads an invited spare's)."""
    keys = store_lib.generation(base, round_, "join")
    value = store_lib.wait_for_key(keys, str(member), timeout_s=timeout_s, give_up=give_up)
    return json.loads(value) if value is not None else None


def publish(base: Any, *, round_: int, decision: dict[str, Any]) -> None:
    store_lib.generation(base, round_, "join").set("decision", json.dumps(decision))


def wait_decision(base: Any, *, round_: int, leader: int, lost: Callable[[], set[int]],
                  timeout_s: float, give_up: GiveUp = _never) -> dict[str, Any] | None:
    """The leader's decision for ``round_``. None when the leader was lost before publishing it or
    ``give_up()`` turned true (the caller starts the next round); ``RestartNeeded`` after
    ``timeout_s``."""
    keys = store_lib.generation(base, round_, "join")
    stop = lambda: leader in lost() or give_up()  # noqa: E731
    value = store_lib.wait_for_key(keys, "decision", timeout_s=timeout_s, give_up=stop)
    if value is None:
        value = store_lib.wait_for_key(keys, "decision", timeout_s=0.0)  # published just before it died?
    if value is None:
        if stop():
            return None
        raise RestartNeeded(f"rank {leader}, which plans the next layout, gave no layout within {timeout_s:.0f} s")
    return json.loads(value)


def barrier(base: Any, *, round_: int, name: str, member: int, members: Iterable[int],
            lost: Callable[[], set[int]], timeout_s: float) -> bool:
    """Every one of ``members`` arrives at ``name`` of round ``round_``. True when all did; False as
    soon as one of them is known lost (the round failed: start the next one); ``RestartNeeded``
    after ``timeout_s``."""
    keys = store_lib.generation(base, round_, f"barrier/{name}")
    keys.set(str(member), "1")
    members = sorted(set(members))
    deadline = time.monotonic() + timeout_s
    arrived: set[int] = set()
    while True:
        arrived |= {m for m in members if m not in arrived and keys.check([str(m)])}
        if len(arrived) == len(members):
            return True
        if lost() & (set(members) - arrived):
            return False
        if time.monotonic() > deadline:
            missing = sorted(set(members) - arrived)
            raise RestartNeeded(f"rank(s) {', '.join(map(str, missing))} did not reach {name} of round {round_} "
                                f"within {timeout_s:.0f} s")
        time.sleep(0.01)

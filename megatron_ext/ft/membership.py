"""Who is in the job: exit reports, error reports, spares, and the rounds in which ranks agree.

Every key lives in the job's store (``ft/store.py``); no process group is used here, because the
process group may be the thing that is broken. A process is named by its launch rank (``member``)
and its ``incarnation`` (0 at launch, +1 each time the launcher starts it again after a loss), so a
rank that was lost, replaced and lost again is reported twice, each report about one process.

* **Exit reports** (``report_exit``, ``ExitWatch``): the launcher writes one the moment a rank's
  process ends; a rank that ends on its own exception writes its own first, naming the exception.
  The first report of a process wins (compare-and-set).
* **Error reports** (``report_error``): an exception that ends a rank is counted by its signature
  (type and message). The same signature ending a second process is a deterministic bug, not a
  lost device: the job ends (``declare_end``).
* **The job's end** (``declare_end``, ``job_end``): exit code and one line, first writer wins;
  every rank and spare that reads it ends the same way. ``mark_done``: training finished.
* **Spares** (``register_spare``, ``waiting_spares``, ``invite``, ``wait_for_invite``): a process
  with no place in the current layout -- left out by a shrink, or started again by the launcher
  (``--resihp-respawn``) -- waits to be invited into a round.
* **Rounds** (``join``, ``publish``, ``wait_decision``, ``barrier``): for round ``r`` the ranks
  write ``gen<r>/join/<member>``, wait until every expected member joined or is known lost, and
  the lowest joined member (the leader) publishes the decision every one of them follows.
"""
from __future__ import annotations

import hashlib
import json
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

def report_exit(base: Any, member: int, incarnation: int, *, code: int | None, reason: str, by: str) -> bool:
    """Process (``member``, ``incarnation``) ended: ``code`` (negative: a signal; None: not known
    yet), ``reason`` in words, ``by`` "launcher" or "self". The first report wins; returns whether
    this one did."""
    keys = store_lib.job_keys(base, "exited")
    value = json.dumps({"code": code, "reason": reason, "by": by})
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

def register_spare(base: Any, member: int, incarnation: int, *, kind: str) -> None:
    """This process waits for a place. ``kind``: "respawn" (a new process: it may be worth growing
    the job for it) or "idle" (left out of a layout; invited when a loss or a growth needs it)."""
    keys = store_lib.job_keys(base, "spares")
    keys.set(f"state/{member}", json.dumps({"incarnation": incarnation, "kind": kind, "state": "waiting"}))
    seq = keys.add("count", 1) - 1
    keys.set(f"seq/{seq}", str(member))
    if kind == "respawn":
        keys.add("arrivals", 1)


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

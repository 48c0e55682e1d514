"""Continuing after a lost rank (``--resihp-on-stop continue``): the store protocol.

The trainer (``Trainer._continue_after_loss``) drives a recovery; this module holds the parts that
must agree across ranks, all through the rendezvous store that the launcher hosts
(``runtime/store.py``), never through a process group (which may be the thing that is broken):

* **Commit** (``CommitLedger``). An iteration counts as done only when every rank of the
  generation reached its optimizer step. Each rank adds one to the iteration's vote counter just
  before the update; the rank that completes the count writes ``commit``; a rank that learns of a
  lost rank first writes ``abort``. Both write with compare-and-set, so the first decision wins
  and every rank reads the same one. A rank that reads ``abort`` does not update, and the
  survivors roll the iteration back (gradients dropped, data position restored). After a commit
  the update itself is local; a rank that fails inside it leaves only its own copy stale, which
  the state move then takes from a replica.
* **Lost ranks** (``lost_members``). The launcher writes ``exited/<rank>`` the moment a rank dies
  (``runtime/launch.py``); the heartbeat (``resihp/heartbeat_store.py``) names a silent one after
  its timeout where no launcher tells.
* **Unblocking** (``abort_connections``). gloo cannot abort a collective, and a survivor can sit
  in one with a peer that has already left it. Shutting down this process's gloo sockets makes
  its own pending operations fail at once and its peers' too (their reads see the connection
  close), so every survivor gets out of the old generation in milliseconds; the collective
  timeout bounds the rest.
* **Membership** (``join``, ``publish``/``wait_decision``). Survivors write ``gen<g+1>/join/<rank>``;
  each waits until every old member has joined or is known lost; the lowest joined rank plans the
  survivors' layout and publishes it (or a restart message) for all.

Pure apart from the store and the sockets; no process group is used here.
"""
from __future__ import annotations

import json
import logging
import socket
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable

from megatron_ext.runtime import store as store_lib

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.runtime.distributed import DistContext
    from megatron_ext.runtime.loop import Trainer

logger = logging.getLogger(__name__)

RESTART_EXIT_CODE = 75
EXITED = f"{store_lib.PREFIX}/exited"


class RankLost(RuntimeError):
    """An iteration was abandoned because a rank of the job is gone."""


class RestartNeeded(RuntimeError):
    """The job cannot go on in these processes; the message says why and how to restart.
    ``report``: whether this rank says so (a decision every survivor read is said once)."""

    def __init__(self, message: str, *, report: bool = True) -> None:
        super().__init__(message)
        self.report = report


class LeftOut(Exception):
    """This rank has no place in the survivors' layout (it leaves as a spare)."""


# --- lost ranks -----------------------------------------------------------------------------

def mark_exited(base: Any, member: int, code: int) -> None:
    """Launcher side: rank ``member`` exited with ``code`` (negative: killed by a signal)."""
    base.set(f"{EXITED}/{member}", str(code))
    base.add(f"{EXITED}/count", 1)


class ExitWatch:
    """Rank side: which members the launcher saw exit (one counter read per call while none did)."""

    def __init__(self, base: Any) -> None:
        self.base = base
        self._seen_count = 0
        self._exited: set[int] = set()

    def exited(self, members: Iterable[int]) -> set[int]:
        members = list(members)
        count = self.base.add(f"{EXITED}/count", 0)
        if count != self._seen_count:
            self._seen_count = count
            self._exited |= {m for m in members if self.base.check([f"{EXITED}/{m}"])}
        return self._exited & set(members)


# --- unblocking -----------------------------------------------------------------------------

def abort_connections(store_addr: str | None) -> int:
    """Shut down every established TCP connection of this process except those to the store.

    In a training process these are the gloo pairs of the current process groups: their pending
    sends and receives fail at once here and at the other end. The file descriptors stay open
    (gloo owns them and closes them when its groups are destroyed). Returns how many were shut."""
    import psutil

    store_port = store_lib.parse_address(store_addr)[1] if store_addr else None
    shut = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.fd < 0 or not conn.raddr or conn.status != psutil.CONN_ESTABLISHED:
            continue
        if store_port is not None and store_port in (conn.raddr.port, conn.laddr.port):
            continue  # the store (its client side, or its server side where it lives here): how survivors meet
        try:
            sock = socket.socket(fileno=conn.fd)
        except OSError:
            continue  # closed since it was listed
        try:
            sock.shutdown(socket.SHUT_RDWR)
            shut += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return shut


# --- commit -----------------------------------------------------------------------------------

class CommitLedger:
    """Votes and decisions of one generation, on that generation's ``commit`` keys."""

    def __init__(self, store: Any, *, world_size: int, timeout_s: float, lost: Callable[[], bool]) -> None:
        self.store = store
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.lost = lost

    def _decide(self, iteration: int, decision: str) -> bool:
        return self.store.compare_set(f"decision/{iteration}", "", decision) == b"commit"

    def vote(self, iteration: int) -> None:
        """This rank is ready to update for ``iteration``. Returns when all ranks are; raises
        ``RankLost`` when the iteration is abandoned (a rank is gone, or the timeout passed)."""
        if self.store.add(f"votes/{iteration}", 1) >= self.world_size:
            self._decide(iteration, "commit")
        value = store_lib.wait_for_key(self.store, f"decision/{iteration}", timeout_s=self.timeout_s,
                                       give_up=self.lost)
        committed = value == b"commit" if value is not None else self._decide(iteration, "abort")
        if not committed:
            raise RankLost(f"iteration {iteration} abandoned before its update: a rank is gone")

    def settle(self, iteration: int) -> bool:
        """For a rank that never finished voting: close ``iteration`` (abort unless already
        committed) and say whether it committed."""
        return self._decide(iteration, "abort")


# --- membership -------------------------------------------------------------------------------

def join(base: Any, *, generation: int, member: int, info: dict[str, Any], expected: Iterable[int],
         lost: Callable[[], set[int]], timeout_s: float) -> dict[int, dict[str, Any]]:
    """Rendezvous of the survivors for ``generation``: publish ``info``, wait until each of
    ``expected`` (the old members) has joined or is known lost. Returns the joined members' info.
    Raises ``RestartNeeded`` after ``timeout_s``."""
    store = store_lib.generation(base, generation, "join")
    store.set(str(member), json.dumps(info))
    expected = sorted(set(expected))
    deadline = time.monotonic() + timeout_s
    joined: set[int] = set()
    while True:
        joined |= {m for m in expected if m not in joined and store.check([str(m)])}
        gone = lost()
        missing = [m for m in expected if m not in joined and m not in gone]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise RestartNeeded(f"rank(s) {', '.join(map(str, missing))} neither rejoined nor were named lost "
                                f"within {timeout_s:.0f} s")
        time.sleep(0.02)
    return {m: json.loads(store.get(str(m))) for m in sorted(joined)}


def publish(base: Any, *, generation: int, decision: dict[str, Any]) -> None:
    store_lib.generation(base, generation, "join").set("decision", json.dumps(decision))


def wait_decision(base: Any, *, generation: int, leader: int, lost: Callable[[], set[int]],
                  timeout_s: float) -> dict[str, Any]:
    """The leader's decision (a layout for the survivors, or ``{"restart": why}``)."""
    store = store_lib.generation(base, generation, "join")
    value = store_lib.wait_for_key(store, "decision", timeout_s=timeout_s, give_up=lambda: leader in lost())
    if value is None:
        value = store_lib.wait_for_key(store, "decision", timeout_s=0.0)  # published just before it died?
    if value is None:
        raise RestartNeeded(f"rank {leader}, which plans the survivors' layout, "
                            + ("was lost too" if leader in lost() else f"gave no layout within {timeout_s:.0f} s"))
    return json.loads(value)


def agree_iteration(joined: dict[int, dict[str, Any]]) -> tuple[int, int]:
    """(committed iteration, data position) of the survivors. Every survivor settled the same
    iteration through the ledger, so they agree; a disagreement is a bug in the protocol."""
    its = {(info["iteration"], info["consumed_samples"]) for info in joined.values()}
    if len(its) != 1:
        raise RestartNeeded(f"survivors disagree on the last committed iteration: {sorted(its)}")
    return its.pop()


# --- the trainer's handle ---------------------------------------------------------------------

Decide = Callable[["Trainer", list[int], list[int]], dict[str, Any]]
"""``(trainer, survivors, lost) -> decision``, on the leader: ``{"members": [launch ranks in new rank
order], "tp", "pp", "vpp", "stage_layers", "replica_microbatches", "plan": one line}`` or
``{"restart": why}``."""


class Failover:
    """What ``Trainer`` needs to continue after a lost rank; set as ``trainer.failover`` by the
    extension that detects losses (ResiHP). ``lost_by_heartbeat`` names lost launch ranks of the
    current generation; ``decide`` plans the survivors' layout; ``stop`` ends what the detector
    runs for a rank that leaves."""

    def __init__(self, *, lost_by_heartbeat: Callable[[], set[int]], decide: Decide, wait_for_loss_s: float,
                 stop: Callable[[], None] = lambda: None) -> None:
        self.lost_by_heartbeat = lost_by_heartbeat
        self.decide = decide
        self.wait_for_loss_s = wait_for_loss_s
        self.stop = stop
        self.phase = "training"   # "joining" while survivors meet, "regrouping" after they agreed
        self.handled: set[int] = set()   # losses the current recovery is about
        self.base: Any = None
        self.members: tuple[int, ...] = ()
        self.ledger: CommitLedger | None = None
        self._exits: ExitWatch | None = None

    def arm(self, ctx: "DistContext") -> "Failover":
        """Connect to the store for the generation ``ctx`` runs in (again after every regroup)."""
        if ctx.store_addr is None:
            raise RestartNeeded("continuing after a lost rank needs a store outside the ranks (runtime/store.py)")
        if self.base is None:
            self.base = store_lib.connect(ctx.store_addr, timeout_s=ctx.timeout_s)
            self._exits = ExitWatch(self.base)
        self.members = tuple(ctx.members)
        self.ledger = CommitLedger(store_lib.generation(self.base, ctx.generation, "commit"),
                                   world_size=ctx.world_size, timeout_s=ctx.timeout_s,
                                   lost=lambda: bool(self.lost()))
        return self

    def lost(self) -> set[int]:
        """Launch ranks of the current generation known to be gone."""
        return self._exits.exited(self.members) | (self.lost_by_heartbeat() & set(self.members))

    def wait_for_loss(self) -> set[int]:
        """After a failed collective: the lost ranks, once one is named (empty after
        ``wait_for_loss_s``: then the failure has another cause)."""
        deadline = time.monotonic() + self.wait_for_loss_s
        while True:
            lost = self.lost()
            if lost or time.monotonic() > deadline:
                return lost
            time.sleep(0.02)

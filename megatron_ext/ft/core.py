"""The fault-tolerance core: one object owns what happens when a rank dies, slows or comes back.

``FaultTolerance`` (one per process, torchft's ``Manager`` shape) holds the job's store client,
the layout generation this process is in, the commit ledger of that generation, who the members
are and which of them are lost, and the generation's liveness. The training loop meets it at three
points:

* ``start_step`` -- the start of each step: a loss already known ends the step before it starts
  (``RankLost``); a replacement that arrived is taken in (``grow``);
* ``vote`` -- right before the optimizer update: the commit vote (``ft/ledger.py``);
* ``on_failure`` -- any exception out of a step: the exception policy below, then ``recover``.

Planned changes (a fail-slow re-layout, a permutation by hand) come through ``change_layout``.
Every change -- planned, after a loss, or to take a replacement in -- is one ``LayoutTarget``
applied by the one transaction (``ft/transaction.py``); which target is not the core's business:
a ``chooser`` decides (ResiHP's planner, ``resihp/choose.py``, where ResiHP runs; else the core's own,
``ft/choose.py``: the same shape over the survivors). The core reaches the trainer only
through ``ft/protocol.py``.

**The exception policy** (under ``--ft-on-stop continue``), decided before anything is torn
down:

1. An exception of this rank's own (not a failed collective) while no rank is known lost ends this
   rank: it says so in the store (its exit report names the exception, so the others go on
   without it at once) and in one line, and exits 1 (``RankEnded``). The same exception (type and
   message) ending a second rank ends the job on every rank with that one line and exit 1
   (``JobFailed``): a deterministic bug is not a lost device. A rank that meets an exception some
   rank already ended on counts as that second rank even when it already sees the first one lost
   (ranks raising the same bug in the same iteration see each other's exit reports in any order),
   and such a loss does not stop the others' next step before it starts (``start_step``).
2. A failed collective (or an abandoned vote) waits up to ``wait_for_loss_s`` for a lost rank to
   be named (the launcher's exit report, a rank's own report, or the heartbeat). If one is, the
   survivors recover; if none is, the failure is the job's: it is raised as itself on this rank and
   as ``JobFailed`` naming it on every other, exit 1.
3. Only after a loss is known does a survivor shut its connections (``ft/unblock.py``), which
   frees the others from collectives with it.

Under ``abort`` a loss ends the job with exit 75 (restart from the last checkpoint) on every
survivor, and an exception of a rank's own ends it with exit 1; ``report`` only reports. Where no
launcher reports exits (torchrun, srun), a survivor finds a lost peer on its own host at once
(``membership.ProcessProbe``), also when torchrun's agent stops it (SIGTERM) for that loss; a peer
on another host is named by the heartbeat. The rank that declares the job's end writes it to
``--ft-exit-file`` (torchrun exits 1 whatever its workers' codes).

**Recovery** (``recover``): settle the interrupted iteration through the ledger (committed: keep
it; else roll it back), take what this rank holds (``HeldState``, every replica), then rounds:
join round ``r`` in the store with the other survivors, the leader invites waiting spares and
publishes the chooser's target, every member of the target applies it, and a store barrier
confirms it everywhere. A loss during a round -- while joining, deciding or inside the
transaction -- starts round ``r + 1`` from the same held state, for as long as the survivors can
still hold the model (``transport.move_state``: a replica, else the last checkpoint); only a shard
with no copy anywhere and no checkpoint ends the job with exit 75. A survivor the target leaves
out becomes a spare and waits to be invited again.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable

from megatron_ext.errors import EXIT_USER_ERROR, UserError, one_line
from megatron_ext.ft import membership as ms
from megatron_ext.ft import store as store_lib
from megatron_ext.ft.errors import (FAILED_EXIT_CODE, RESTART_EXIT_CODE, JobFailed, NotMember, RankEnded, RankLost,
                                    RestartNeeded)
from megatron_ext.ft.ledger import CommitLedger
from megatron_ext.ft.liveness import Hang, Heartbeat, Progress, Silence
from megatron_ext.ft.preflight import LAUNCHER_ENV
from megatron_ext.ft.choose import keep_shape
from megatron_ext.ft.target import LayoutTarget, check
from megatron_ext.ft.transaction import Change, HeldState, apply
from megatron_ext.ft.unblock import is_communication_error, unblock

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.ft.protocol import TrainerLike

logger = logging.getLogger(__name__)


def _say(line: str) -> None:
    """One line to stderr in one write: ``print`` writes the text and its newline apart, and the
    launcher's own messages on the same pipe can land between them (the line then runs on)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()

INCARNATION_ENV = "MEGATRON_EXT_INCARNATION"
"""Set by the launcher on a process it started again in place of a lost one (1, 2, ...)."""

Chooser = Callable[["TrainerLike", list[int], list[int], str], "LayoutTarget | str"]
"""``(trainer, devices, lost, cause) -> target or why not``: the layout for ``devices`` (launch
ranks available: survivors and invited spares), on the round's leader. A string is a reason the
job cannot continue (exit 75)."""

SAME_ERROR_GRACE_S = 1.0
"""How long a rank that ends on its own exception waits to learn that another rank ended on the
same one (then the job ends, one line), before it reports itself lost."""


@dataclasses.dataclass(frozen=True)
class FTConfig:
    on_stop: str = "abort"                 # abort | report | continue
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    timeout_s: float = 120.0               # every collective and every step of a round
    keep_newer: bool = False               # a lost shard without replica: only it from the checkpoint
    checkpoint: str | None = None          # where a shard with no copy left comes from
    exit_file: str | None = None           # the job's end as JSON, by the rank that declares it
    hang_timeout_s: float = 0.0            # no progress this long: hung (0: derived, ``liveness.Progress``)
    grace_s: float = 10.0                  # a decision not followed this long after: this process ends

    @property
    def wait_for_loss_s(self) -> float:
        """A failed collective waits this long for a lost rank to be named (the launcher's report
        comes sooner); after it the failure is not a lost rank's."""
        return self.heartbeat_timeout_s + 4 * self.heartbeat_interval_s + 1.0

    @classmethod
    def from_run(cls, cfg: Any) -> "FTConfig":
        from megatron_ext.ft.config import section_of

        s = section_of(cfg)
        return cls(on_stop=s.ft_on_stop, heartbeat_interval_s=s.ft_heartbeat_interval_s,
                   heartbeat_timeout_s=s.ft_heartbeat_timeout_s, timeout_s=s.ft_continue_timeout_s,
                   keep_newer=s.ft_keep_newer_stages,
                   checkpoint=cfg.checkpoint.save or cfg.checkpoint.load or None,
                   exit_file=s.ft_exit_file or None, hang_timeout_s=s.ft_hang_timeout_s, grace_s=s.ft_grace_s)

    def progress(self) -> Progress:
        """The hang watch of this configuration (``liveness.Progress``)."""
        return Progress(timeout_s=self.hang_timeout_s, long_s=self.timeout_s,
                        cap_s=0.75 * self.timeout_s if self.on_stop == "continue" else None)


@dataclasses.dataclass
class StepRecord:
    """The iteration between its start and its end, as a failure in the middle must settle it."""

    iteration: int
    consumed_samples: int
    committed: bool | None = None
    applied: bool = False
    scheduled: bool = False


@dataclasses.dataclass
class Loss:
    """A process of the job that is gone."""

    member: int
    incarnation: int
    iteration: int
    how: str        # "launcher" (its exit), "self" (its own exception), "heartbeat", "probe" (gone from its host),
                    # "hang" (alive, no progress: it named itself)
    why: str        # "killed by signal 9", "ValueError: boom", "silent for 4.2 s"


class SecondFault(Exception):
    """A round failed because another member was lost meanwhile: start the next round."""


class FaultTolerance:
    """One per process. ``member``: launch rank; ``incarnation``: 0 at launch, k for the k-th
    process the launcher started again in this place (the process then starts as a spare)."""

    def __init__(self, cfg: FTConfig, *, store_addr: str, member: int, incarnation: int = 0,
                 chooser: Chooser | None = None) -> None:
        self.cfg = cfg
        self.store_addr = store_addr
        self.member = member
        self.incarnation = incarnation
        self.chooser = chooser
        self.base = store_lib.connect(store_addr, timeout_s=cfg.timeout_s)
        self.watch_base = store_lib.connect(store_addr, timeout_s=cfg.timeout_s)  # the monitor thread's own
        self._exits = ms.ExitWatch(self.base)
        self._watch_exits = ms.ExitWatch(self.watch_base)
        self.members: dict[int, int] = {}      # member -> incarnation, of the current generation, in rank order
        self.stable: dict[int, int] = {}       # the members of the last generation every member completed
        self.round = 0                          # highest round (generation number) this process took part in
        self.arrivals_seen = 0
        self.ledger: CommitLedger | None = None
        self.heartbeat: Heartbeat | None = None
        self.silent: dict[int, Silence] = {}    # members named by the heartbeat
        self.losses: list[Loss] = []
        self.listeners: list[Callable[[Loss, Silence | None], None]] = []
        """Told of every loss once (on any thread): ResiHP's fail-stop verdicts."""
        self.phase = "spare" if incarnation > 0 else "training"
        self.step: StepRecord | None = None
        self._grow = False
        self._notified: set[tuple[int, int]] = set()
        # Reentrant: the SIGTERM handler runs on the main thread, which may hold it at that moment.
        self._lock = threading.RLock()
        self._iteration = 0
        self._retired: list[Heartbeat | None] = []
        self._aborting = False
        self.backend = "gloo"
        self.progress = cfg.progress()
        """The training thread's progress marks (``Trainer.mark_progress``), checked by the monitor."""
        self.hang: Hang | None = None            # this process named itself hung
        self._end_seen_s: float | None = None     # when the monitor first read the job's end
        ms.register_process(self.base, member, incarnation)
        # Without a launcher that reports exits, a survivor under abort looks for lost peers on its
        # own host: torchrun's agent stops it 0.1 s after a worker's death, long before a heartbeat
        # timeout could name the lost rank.
        self.probe = (ms.ProcessProbe(self.watch_base, member)
                      if cfg.on_stop == "abort" and os.environ.get(LAUNCHER_ENV) != "1" else None)
        if self.probe is not None:
            self._install_sigterm()

    @property
    def is_spare(self) -> bool:
        return self.phase == "spare"

    # --- arming -----------------------------------------------------------------------------------
    def arm(self, trainer: "TrainerLike") -> None:
        """Start the generation ``trainer.ctx`` runs in: its ledger and its liveness (again after
        every change of the default group)."""
        ctx = trainer.ctx
        self.progress.rearm()  # a (re)built layout compiles and warms up again
        if not self.members or list(self.members) != list(ctx.members):
            self.members = {m: self.members.get(m, 0) for m in ctx.members}
        if not self.stable:
            self.stable = dict(self.members)
        if ctx.generation == 0:  # the layout the job was launched with (a rejoin may go back to it)
            launch = ctx.layout
            store_lib.job_keys(self.base, "job").compare_set("launch", "", json.dumps(launch.to_dict()))
        self.round = max(self.round, ctx.generation)
        self.ledger = CommitLedger(store_lib.generation(self.base, ctx.generation, "commit"),
                                   world_size=ctx.world_size, timeout_s=ctx.timeout_s,
                                   lost=lambda: bool(self.lost()), arrivals=lambda: ms.arrivals(self.base),
                                   arrivals_seen=self.arrivals_seen)
        if self.heartbeat is not None and self.heartbeat.generation == ctx.generation:
            return  # same default group (an in-place re-layout): the same keys go on
        self._retired.append(self.heartbeat)
        self.silent = {}
        hb_store = store_lib.generation(store_lib.connect(self.store_addr, timeout_s=ctx.timeout_s), ctx.generation,
                                        "heartbeat")
        members = tuple(ctx.members)
        self.heartbeat = Heartbeat(hb_store, rank=ctx.rank, world_size=ctx.world_size,
                                   interval_s=self.cfg.heartbeat_interval_s, timeout_s=self.cfg.heartbeat_timeout_s,
                                   on_silent=lambda s, rep: self._on_silent(s, rep, members), watch=self._watch)
        self.heartbeat.generation = ctx.generation
        self.heartbeat.start()

    def stop_liveness(self) -> None:
        """Liveness of the old generation keeps watching through a change: a loss meanwhile must be
        named (it starts the next round). ``arm`` starts the new generation's, and the old one
        stops once every member runs the new one (``retire_liveness``), so that no member still in
        the change takes another that already left the old keys for silent."""

    def retire_liveness(self) -> None:
        for hb in self._retired:
            if hb is not None:
                hb.stop()
        self._retired = []

    def stop(self) -> None:
        self.retire_liveness()
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None

    def launch_target(self) -> LayoutTarget | None:
        """The layout the job was launched with (None before generation 0 armed)."""
        keys = store_lib.job_keys(self.base, "job")
        return LayoutTarget.from_dict(json.loads(keys.get("launch"))) if keys.check(["launch"]) else None

    # --- who is lost ----------------------------------------------------------------------------
    def lost(self, members: dict[int, int] | None = None) -> dict[int, str]:
        """Members (of the current generation, or ``members``) known gone, with why."""
        members = self.members if members is None else members
        out = {m: _exit_why(r) for m, r in self._exits.exited(members).items()}
        out.update({m: f"heartbeat silent for {s.silent_s:.1f} s" for m, s in self.silent.items()
                    if m in members and m not in out})
        return out

    def _record_losses(self, lost: dict[int, str], iteration: int) -> None:
        with self._lock:
            self._record_losses_locked(lost, iteration)

    def _record_losses_locked(self, lost: dict[int, str], iteration: int) -> None:
        known = {(x.member, x.incarnation) for x in self.losses}
        for m, why in sorted(lost.items()):
            inc = self.members.get(m, 0)
            if (m, inc) in known:
                continue
            how = ("self" if why_is_own_error(why) else "heartbeat" if why.startswith("heartbeat")
                   else "hang" if why.startswith(HUNG)
                   else "probe" if why.startswith(ms.PROBE_REASON) else "launcher")
            loss = Loss(member=m, incarnation=inc, iteration=iteration, how=how, why=why)
            self.losses.append(loss)
            silence = self.silent.get(m) or self._reported_silence(m, inc)
            for listener in self.listeners:
                listener(loss, silence)

    def _reported_silence(self, member: int, incarnation: int) -> Silence | None:
        """The silence another rank reported for ``member`` (this rank learnt of the loss from that
        report before its own heartbeat watch timed out)."""
        report = self._exits.known(member, incarnation) or self._watch_exits.known(member, incarnation)
        if report is None or report.get("by") != "heartbeat" or "silence" not in report:
            return None
        return Silence(**report["silence"])

    def _on_silent(self, silence: Silence, reporter: bool, members: tuple[int, ...]) -> None:
        """Monitor thread: a member of the heartbeat's generation (``members``, in rank order) stopped
        beating."""
        if silence.rank >= len(members) or members[silence.rank] not in self.members:
            return
        if self.hang is not None or self.progress.check() is not None:
            return  # this process is the stuck one: its peers going silent is not news of their loss
        m = members[silence.rank]
        self.silent[m] = silence
        why = f"heartbeat silent for {silence.silent_s:.1f} s"
        if reporter:
            print(f"ft: rank {m} of generation {self.round} is silent for {silence.silent_s:.1f} s "
                  f"(heartbeat timeout {silence.timeout_s:g} s): lost", file=sys.stderr, flush=True)
            # In the store, so that a launcher can stop the process if it still runs (a wedged one).
            ms.report_exit(self.watch_base, m, self.members.get(m, 0), code=None, reason=why, by="heartbeat",
                           silence=dataclasses.asdict(silence))
        self._record_losses({m: why}, silence.iteration)
        self._react({m: why})

    def _watch(self) -> None:
        """Monitor thread, every poll: this process hung, a new exit report of a member, the job's
        end; and a decision this process's training thread has not followed within the grace."""
        if self.phase == "training" and self.hang is None:
            hang = self.progress.check()
            if hang is not None:
                self._hung(hang)  # does not return
        end = ms.job_end(self.watch_base)
        if end is not None:
            now = time.monotonic()
            self._end_seen_s = self._end_seen_s or now
            if now - self._end_seen_s > self.cfg.grace_s:
                self._terminate(f"the job ended ({end['message']}) {self.cfg.grace_s:g} s ago", code=int(end["code"]))
        if end is not None and ("end", end["by"]) not in self._notified:
            self._notified.add(("end", end["by"]))
            self._ended(end)  # its losses reach the verdict file here, whatever the main thread does
            if self.phase in ("training", "changing"):
                unblock(self._backend, self.store_addr)
            return
        if self.probe is not None and end is None and self.phase != "spare":
            self.probe.gone(self.members)  # reported as exits: read back just below
        exited = dict(self._watch_exits.exited(self.members))
        mine = exited.pop(self.member, None)
        if mine is not None and mine.get("by") not in ("self", "hang") and self.phase != "spare":
            # The others named this process lost (its heartbeat went silent, say) and go on without it.
            self._terminate(f"the other ranks named it lost ({_exit_why(mine)}) and went on without it")
        new = {m: _exit_why(r) for m, r in exited.items() if (m, self.members.get(m, 0)) not in self._notified}
        if new:
            self._react(new)

    def _hung(self, hang: Hang) -> None:
        """Monitor thread: this process's training thread is hung. Name it (one line, the stack of
        every thread to this rank's log, the exit report the others act on), then end it: under
        ``abort`` the job ends with 75 naming this rank; otherwise the process is killed, as a
        lost rank is, and the survivors go on (``continue``) or fail (``report``) without it."""
        self.hang = hang
        why = hang.describe()
        print(f"ft: rank {self.member} {why}; the stack of each of its threads follows, then it is terminated",
              file=sys.stderr, flush=True)
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except Exception as exc:  # no usable stderr file descriptor (an in-process test's capture)
            logger.debug("faulthandler: %s", exc)
        ms.report_exit(self.watch_base, self.member, self.incarnation, code=None, reason=why, by="hang")
        if self.cfg.on_stop == "abort":
            self._abort({self.member: why}, store=self.watch_base)  # exits 75
        time.sleep(0.2)  # the line and the stack reach the log
        os.kill(os.getpid(), signal.SIGKILL)

    def _terminate(self, why: str, code: int | None = None) -> None:
        """Monitor thread: the training thread did not follow a decision (``why``) within the grace:
        end the process (``code``, else SIGKILL, as a lost process ends)."""
        _say(f"ft: rank {self.member} ends: {why}, and its training thread did not follow")
        if code is not None:
            os._exit(code)
        os.kill(os.getpid(), signal.SIGKILL)

    def _react(self, lost: dict[int, str]) -> None:
        """A loss is known (monitor thread): act on it by the policy."""
        with self._lock:
            new = {m: w for m, w in lost.items() if (m, self.members.get(m, 0)) not in self._notified}
            self._notified |= {(m, self.members.get(m, 0)) for m in new}
        if not new:
            return
        if self.cfg.on_stop == "abort":
            self._abort(new, store=self.watch_base)
        if self.cfg.on_stop == "report":
            return
        if self.phase in ("training", "changing"):
            unblock(self._backend, self.store_addr)

    def _ended(self, end: dict[str, Any]) -> JobFailed:
        """The job ended (``end``, by another rank): tell the listeners of the losses that ended it
        (this process may hold the detector's verdict file), then the exception to end on."""
        lost = end.get("lost") or {}
        for m, info in lost.items():
            if info.get("silence") is not None and int(m) not in self.silent:
                self.silent[int(m)] = Silence(**info["silence"])
        if lost:
            self._record_losses({int(m): info["why"] for m, info in lost.items()}, self._iteration)
        return JobFailed(end["message"], report=False, code=end["code"])

    def _abort(self, lost: dict[int, str], *, store: Any) -> None:
        """``--ft-on-stop abort``: the job ends on every survivor with exit 75 (restart from the
        last checkpoint), one line naming the lost rank(s)."""
        with self._lock:
            if self._aborting:  # the monitor thread and the main thread may both get here
                time.sleep(5.0)
            self._aborting = True
        what = ", ".join(f"{m} ({w})" for m, w in sorted(lost.items()))
        info = {str(m): {"why": w, "silence": dataclasses.asdict(self.silent[m]) if m in self.silent else None}
                for m, w in lost.items()}
        self._record_losses(lost, self._iteration)
        end = self._declare_end(store, code=RESTART_EXIT_CODE, message=f"rank(s) {what} gone", lost=info)
        if end["by"] == self.member:  # said once per job: by the survivor that declared the end
            where = self.cfg.checkpoint
            _say(f"resihp: aborting the job: rank(s) {what} gone; resume from the last checkpoint"
                 + (f" (--load {where})" if where else " (none was saved: --save DIR)"))
        # Linger a few polls: the other survivors should read it from the store before this goes.
        time.sleep(0.5)
        os._exit(end["code"])

    def _declare_end(self, store: Any, *, code: int, message: str, by: int | None = None,
                     lost: dict | None = None) -> dict[str, Any]:
        """``membership.declare_end``; the process that declared the end also writes it to
        ``--ft-exit-file``, for launchers whose own exit code does not carry it."""
        end = ms.declare_end(store, code=code, message=message, by=self.member if by is None else by, lost=lost)
        if end["by"] == self.member and self.cfg.exit_file:
            write_exit_file(self.cfg.exit_file, end)
        return end

    def _install_sigterm(self) -> None:
        """torchrun's agent stops every worker (SIGTERM) as soon as one dies. A survivor then ends
        the way the job does: on an end already declared with its code; on a lost process of the
        job on this host with the abort (exit 75, the one line); otherwise as SIGTERM ends a process
        (a job cancelled by its user is not one to restart)."""
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set a handler (an in-process test's thread, say)
        probe = ms.ProcessProbe(self.base, self.member)  # the main thread's own client

        def on_sigterm(signum: int, frame: Any) -> None:
            try:
                ms.note_stopped(self.base, self.member, self.incarnation)
                end = ms.job_end(self.base)
                if end is not None:
                    os._exit(int(end["code"]))
                if self.members and probe.gone(self.members):
                    self._abort(self.lost(), store=self.base)  # exits
            except Exception as exc:  # the store is gone: nothing to learn from it
                logger.debug("on SIGTERM: %s", exc)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_sigterm)

    @property
    def _backend(self) -> str:
        return self.backend

    # --- the loop's three meeting points ---------------------------------------------------------
    def start_step(self, trainer: "TrainerLike") -> StepRecord:
        """Before step ``trainer.iteration + 1``: a loss known now ends it before it starts; a
        replacement that arrived is taken in first. Returns the step's record.

        A rank that ended on its own exception is the exception: the step starts, so that a bug the
        others are about to meet too ends the job at once (``on_failure``: the same error on a second
        rank); if it does not, the step's first collective fails (the monitor thread has shut the
        connections) and the recovery runs from there, the step rolled back."""
        if self.cfg.on_stop == "continue":
            lost = self.lost()
            if lost and not all(why_is_own_error(w) for w in lost.values()):
                raise RankLost("a rank is gone")  # named between two iterations
        end = ms.job_end(self.base)
        if end is not None:
            raise self._ended(end)
        if self._grow:
            self._grow = False
            self.grow(trainer)
        self._iteration = trainer.iteration + 1
        if self.heartbeat is not None:
            self.heartbeat.set_iteration(self._iteration)
        self.step = StepRecord(iteration=trainer.iteration + 1, consumed_samples=trainer.train_stream.consumed_samples)
        return self.step

    def vote(self, iteration: int) -> None:
        """Right before this rank's optimizer update: no rank updates before every rank is ready to;
        raises ``RankLost`` when the iteration is abandoned."""
        if self.ledger is None or self.cfg.on_stop != "continue":
            return
        vote = self.ledger.vote(iteration)
        if self.step is not None:
            self.step.committed = True
        self._grow = self._grow or vote.grow

    def on_failure(self, trainer: "TrainerLike", exc: BaseException) -> bool:
        """The exception policy (module docstring). Returns True to go on training (recovered, or
        back from waiting as a spare), False when the job finished while this rank waited as a spare.
        Raises what ends this rank: ``RankEnded``, ``JobFailed``, ``RestartNeeded``, or ``exc``."""
        if isinstance(exc, UserError):
            # Bad input ends every rank with exit 2 (rank 0 says why): not a lost rank to restart for
            # when this rank's exit is seen before the others meet the same error.
            self._declare_end(self.base, code=EXIT_USER_ERROR, message=one_line(exc))
            raise exc
        if isinstance(exc, (RestartNeeded, JobFailed, RankEnded)) or not isinstance(exc, Exception):
            raise exc
        end = ms.job_end(self.base)
        if end is not None:
            raise self._ended(end) from exc
        lost = self.lost()
        if not isinstance(exc, RankLost) and not is_communication_error(exc) and (
                not lost or ms.error_count(self.base, exc) > 0):
            self._end_this_rank(trainer, exc)
        if self.cfg.on_stop == "report":
            raise exc
        lost = lost or self._wait_for_loss()
        if lost and self.cfg.on_stop == "abort":
            self._abort(lost, store=self.base)
        if lost and all(why_is_own_error(w) for w in lost.values()):
            # A rank that ended on its own exception may yet learn that another ended on the same one
            # (then the job ends): give it the time it takes to find out before recovering.
            deadline = time.monotonic() + SAME_ERROR_GRACE_S + 0.5
            while time.monotonic() < deadline:
                end = ms.job_end(self.base)
                if end is not None:
                    raise self._ended(end) from exc
                time.sleep(0.05)
        if not lost:
            message = (f"rank {self.member}: {type(exc).__name__}: {one_line(exc)[:300]} (no rank was lost, so "
                       "the job cannot continue past it)")
            end = self._declare_end(self.base, code=FAILED_EXIT_CODE, message=message)
            if end["by"] == self.member:
                raise JobFailed(end["message"], report=True, original=exc, code=end["code"]) from exc
            raise self._ended(end) from exc
        return self.recover(trainer, lost)

    # --- this rank's own exception ---------------------------------------------------------------
    def _end_this_rank(self, trainer: "TrainerLike", exc: BaseException) -> None:
        it = self.step.iteration if self.step is not None else trainer.iteration
        described = f"{type(exc).__name__}: {one_line(exc)[:300]}"
        # The error's count before the exit report: a rank that sees this one gone also sees its error.
        count, first = ms.report_error(self.base, self.member, exc, f"{described} (iteration {it})")
        ms.report_exit(self.base, self.member, self.incarnation, code=FAILED_EXIT_CODE, reason=described, by="self")
        deadline = time.monotonic() + SAME_ERROR_GRACE_S
        while count < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            count = ms.error_count(self.base, exc)
        if count >= 2 or self.cfg.on_stop != "continue":
            other = (f"; rank {first['member']} ended on the same error: a bug, not a lost device"
                     if count >= 2 and first["member"] != self.member else "")
            message = f"rank {self.member}: {described} (iteration {it}{other})"
            end = self._declare_end(self.base, code=FAILED_EXIT_CODE, message=message)
            raise JobFailed(end["message"], report=end["by"] == self.member, original=exc, code=end["code"]) from exc
        raise RankEnded(f"rank {self.member} lost: {described} (iteration {it}); the other ranks go on "
                        "without it", exc) from exc

    def _wait_for_loss(self) -> dict[int, str]:
        deadline = time.monotonic() + self.cfg.wait_for_loss_s
        while True:
            lost = self.lost()
            if lost:
                return lost
            end = ms.job_end(self.base)
            if end is not None:
                raise self._ended(end)
            if time.monotonic() > deadline:
                return {}
            time.sleep(0.02)

    # --- recovery --------------------------------------------------------------------------------
    def settle(self, trainer: "TrainerLike") -> tuple[HeldState, int | None]:
        """Close the iteration a failure interrupted: keep it when every rank had reached its update
        (the ledger's decision), else roll it back (gradients dropped, data position and iteration
        as before it). Returns what this rank holds at the last committed iteration, and the
        iteration rolled back (None if none)."""
        rec, self.step = self.step, None
        if rec is None:
            return HeldState.capture(trainer), None
        gbs = trainer.cfg.training.global_batch_at(rec.consumed_samples)   # the iteration's (--rampup-batch-size)
        committed = rec.committed if rec.committed is not None else self.ledger.settle(rec.iteration)
        if committed:
            if not rec.scheduled:
                trainer.scheduler.step(1)
            trainer.iteration = rec.iteration
            trainer.train_stream.consumed_samples = rec.consumed_samples + gbs
            # A rank whose update was interrupted holds a stale copy: its slices come from a replica.
            return HeldState.capture(trainer, valid=rec.applied), None
        trainer.iteration = rec.iteration - 1
        trainer.train_stream.consumed_samples = rec.consumed_samples
        trainer.drop_gradients()
        return HeldState.capture(trainer), rec.iteration

    def recover(self, trainer: "TrainerLike", lost: dict[int, str], held: HeldState | None = None,
                rolled_back: int | None = None) -> bool:
        """Collective over the survivors: go on without the lost rank(s), in these processes."""
        started = time.perf_counter()
        self.phase = "recovering"
        unblock(self._backend, self.store_addr)  # survivors still waiting on this rank get out now too
        if held is None:
            held, rolled_back = self.settle(trainer)
        saving, trainer.saving = getattr(trainer, "saving", False), False
        self._record_losses(lost, held.iteration + 1)
        try:
            while True:
                try:
                    self._round(trainer, cause="fail_stop", held=held, rolled_back=rolled_back, started=started)
                    break
                except SecondFault as fault:
                    logger.warning("round %d failed (%s): round %d starts from the state held before it",
                                   self.round, fault, self.round + 1)
        except NotMember as left:
            print(f" ft: rank {self.member} has no place in the next layout ({left}); it waits as a spare",
                  flush=True)
            return self.wait_as_spare(trainer, kind="idle")
        self.phase = "training"
        if saving and trainer.cfg.checkpoint.save and trainer.iteration == held.iteration:
            trainer.save_checkpoint()  # the save the loss interrupted, now by the survivors
        return True

    def grow(self, trainer: "TrainerLike") -> None:
        """Collective over the members, at an iteration boundary: take the replacements that
        arrived into the layout (the chooser decides how, or not at all)."""
        held = HeldState.capture(trainer)
        self.phase = "recovering"
        try:
            while True:
                try:
                    self._round(trainer, cause="grow", held=held, rolled_back=None, started=time.perf_counter())
                    break
                except SecondFault as fault:
                    logger.warning("round %d failed (%s): round %d starts from the state held before it",
                                   self.round, fault, self.round + 1)
        finally:
            self.phase = "training"

    def change_layout(self, trainer: "TrainerLike", target: LayoutTarget, *, reason: str) -> dict[str, Any]:
        """Collective: a planned change (fail-slow re-layout, a permutation) with every rank kept.
        A loss in the middle is recovered from the state held before it."""
        held = HeldState.capture(trainer)
        new_world = tuple(target.members) != tuple(self.members)
        change = planned_change(trainer, target, reason=reason, held=held,
                                generation=self.round + 1 if new_world else None, store_addr=self.store_addr)
        change.checkpoint, change.keep_newer = self.cfg.checkpoint, self.cfg.keep_newer
        self.phase = "changing"
        try:
            info = apply(trainer, change, held, liveness=self)
            if new_world:
                self.round = change.generation
                gone = lambda: set(self.lost())  # noqa: E731
                if not ms.barrier(self.base, round_=change.generation, name="done", member=self.member,
                                  members=target.members, lost=gone, timeout_s=self.cfg.timeout_s):
                    raise RankLost(f"rank(s) {sorted(gone())} lost before the re-layout was done")
                self.retire_liveness()
                self.stable = dict(self.members)
            return info
        except Exception as exc:
            lost = self.lost() or (self._wait_for_loss() if is_communication_error(exc) else {})
            if not lost:
                raise
            if new_world:
                self.round = change.generation
            self.recover(trainer, lost, held=held)
            return {"recovered": True}
        finally:
            if self.phase == "changing":
                self.phase = "training"


    def _round(self, trainer: "TrainerLike", *, cause: str, held: HeldState, rolled_back: int | None,
               started: float) -> None:
        """One round (module docstring). Raises ``SecondFault`` when a member is lost meanwhile,
        ``NotMember`` when this rank has no place in the target."""
        r = self.round + 1
        self.round = r
        expected = {m: inc for m, inc in self.members.items() if m not in self.lost()}
        info = {"incarnation": self.incarnation, "iteration": held.iteration, "consumed_samples": held.consumed_samples,
                "scheduler": held.scheduler, "holds": held.payload is not None, "spare": False,
                "rolled_back": rolled_back}
        lost_now = lambda: set(self.lost(expected)) | set(self.lost())  # noqa: E731
        joined = ms.join(self.base, round_=r, member=self.member, info=info, expected=expected,
                         lost=lost_now, timeout_s=self.cfg.timeout_s)
        survivors = sorted(m for m in joined if m not in lost_now())
        leader = min(survivors)
        if self.member == leader:
            ms.publish(self.base, round_=r, decision=self._decide(trainer, r, cause, joined, survivors, expected))
        decision = ms.wait_decision(self.base, round_=r, leader=leader, lost=lost_now, timeout_s=self.cfg.timeout_s,
                                    give_up=lambda: ms.job_end(self.base) is not None)
        self._apply_decision(trainer, r, decision, held=held, started=started, lost_now=lost_now)

    def _decide(self, trainer: "TrainerLike", r: int, cause: str, joined: dict[int, dict[str, Any]],
                survivors: list[int], expected: dict[int, int]) -> dict[str, Any]:
        """On the leader: invite the waiting spares, ask the chooser, write down the decision."""
        its = {(info["iteration"], info["consumed_samples"]) for m, info in joined.items() if m in survivors}
        if len(its) != 1:
            return {"restart": f"survivors disagree on the last committed iteration: {sorted(its)}",
                    "leader": self.member}
        base = next(info for m, info in joined.items() if m in survivors)
        spares: dict[int, int] = {}
        arrivals = ms.arrivals(self.base)
        for m, inc in ms.waiting_spares(self.base, exclude=survivors).items():
            ms.invite(self.base, m, r)
            got = ms.joined_info(self.base, r, m, timeout_s=self.cfg.timeout_s,
                                 give_up=lambda m=m, inc=inc: bool(self.lost({m: inc})))
            if got is not None and got.get("incarnation") == inc:
                spares[m] = inc
        # Lost since the last generation everybody completed (a failed round's losses included).
        lost = sorted(set(self.stable) - set(survivors))
        devices = survivors + sorted(spares)
        try:
            choice = (self.chooser or keep_shape)(trainer, devices, lost, cause)
        except Exception as exc:  # the planner failing is a bug, but the survivors must learn it
            logger.exception("the layout planner failed")
            choice = f"the layout planner failed: {one_line(exc)[:200]}"
        if isinstance(choice, str):
            return {"restart": choice, "lost": lost, "leader": self.member}
        target, plan = choice
        if cause == "grow" and tuple(target.members) == tuple(self.members) and \
                target.normalised() == trainer.ctx.layout.normalised():
            return {"unchanged": True, "arrivals_seen": arrivals, "plan": "the replacement does not improve the layout"}
        try:
            trainer.check_target(target)
            check(target, cfg=trainer.cfg, members=list(self.members), knobs=trainer.relayout_knobs,
                  membership_may_change=True, what="the next layout")
        except UserError as exc:
            return {"restart": f"the planned layout cannot run: {exc}", "lost": lost, "leader": self.member}
        incarnations = {**{m: expected.get(m, 0) for m in survivors}, **spares}
        rolled = [i.get("rolled_back") for m, i in joined.items() if m in survivors and i.get("rolled_back")]
        lay = trainer.ctx.layout
        wall = getattr(trainer, "wall", None)
        return {"target": target.to_dict(), "cause": cause, "plan": plan,
                "wall": wall.export() if wall is not None and spares else None,  # the job's time account
                "old_members": list(self.members), "old_tp": lay.tp, "old_pp": lay.pp,
                "old_name": trainer.layout_name(),
                "iteration": base["iteration"], "consumed_samples": base["consumed_samples"],
                "scheduler": base["scheduler"], "incarnations": {str(k): v for k, v in incarnations.items()},
                "lost": lost, "lost_why": {str(m): w for m, w in {**self.lost(self.stable), **self.lost()}.items()
                                           if m in lost},
                "joined": sorted(set(spares) & set(target.members)), "arrivals_seen": arrivals, "rolled_back": rolled[0] if rolled else None}

    def _apply_decision(self, trainer: "TrainerLike", r: int, decision: dict[str, Any] | None, *, held: HeldState | None,
                        started: float, lost_now: Callable[[], set[int]]) -> None:
        if decision is None:
            end = ms.job_end(self.base)
            if end is not None:
                raise self._ended(end)
            raise SecondFault("the round's leader was lost before it decided")
        if "restart" in decision:
            gone = ", ".join(map(str, decision.get("lost") or sorted(self.lost()))) or "none"
            # Spares waiting for a place and the launcher learn it from the store.
            end = self._declare_end(self.base, code=RESTART_EXIT_CODE,
                                    message=f"lost rank(s) {gone}: {decision['restart']}",
                                    by=decision.get("leader", self.member))
            if end["code"] != RESTART_EXIT_CODE:  # the job already ended for another reason
                raise self._ended(end)
            raise RestartNeeded(f"lost rank(s) {gone}: {decision['restart']}",
                                report=self.member == decision.get("leader", self.member))
        self.arrivals_seen = int(decision.get("arrivals_seen", self.arrivals_seen))
        if decision.get("unchanged"):
            if self.ledger is not None:
                self.ledger.arrivals_seen = self.arrivals_seen
            if self.phase == "spare":
                raise NotMember(decision["plan"])
            return
        target = LayoutTarget.from_dict(decision["target"])
        if self.member not in target.members:
            raise NotMember(f"{target.describe()}")
        incarnations = {int(k): int(v) for k, v in decision["incarnations"].items()}
        change = Change(target=target, cause=decision["cause"], reason=decision.get("plan", ""), generation=r,
                        store_addr=self.store_addr, old_members=tuple(decision["old_members"]),
                        old_name=decision["old_name"], old_tp=decision["old_tp"], old_pp=decision["old_pp"],
                        iteration=decision["iteration"], consumed_samples=decision["consumed_samples"],
                        scheduler=decision["scheduler"], lost=tuple(decision["lost"]),
                        lost_why={int(k): v for k, v in decision["lost_why"].items()},
                        joined=tuple(decision["joined"]), rolled_back=decision["rolled_back"],
                        checkpoint=self.cfg.checkpoint, keep_newer=self.cfg.keep_newer, started_s=started)
        gone = lambda: set(self.lost(incarnations))  # noqa: E731
        if not ms.barrier(self.base, round_=r, name="ready", member=self.member, members=target.members, lost=gone,
                          timeout_s=self.cfg.timeout_s):
            raise SecondFault(f"rank(s) {sorted(gone())} lost before round {r} began")
        self.phase = "changing"
        self.members = {m: incarnations[m] for m in target.members}
        if held is None and decision.get("wall") and getattr(trainer, "wall", None) is not None:
            trainer.wall.adopt(decision["wall"])  # a process joining the job takes the job's time account
        try:
            apply(trainer, change, held, liveness=self)
        except (RestartNeeded, JobFailed):
            raise
        except Exception as exc:
            from megatron_ext.runtime.reshard import CheckpointError

            if isinstance(exc, CheckpointError) and not gone():
                # Decided alike on every member from the gathered geometry: a shard with no copy
                # anywhere and no checkpoint. The one case a restart remains for.
                message = f"lost rank(s) {', '.join(map(str, decision['lost'])) or 'none'}: {exc}"
                end = self._declare_end(self.base, code=RESTART_EXIT_CODE, message=message)
                raise RestartNeeded(message, report=end["by"] == self.member) from exc
            if gone() or self._wait_for_loss_in(incarnations):
                raise SecondFault(f"rank(s) {', '.join(map(str, sorted(gone())))} lost during the change") from exc
            raise
        if not ms.barrier(self.base, round_=r, name="done", member=self.member, members=target.members, lost=gone,
                          timeout_s=self.cfg.timeout_s):
            raise SecondFault(f"rank(s) {sorted(gone())} lost before round {r} was done")
        self.retire_liveness()
        self.stable = dict(self.members)
        if self.ledger is not None:
            self.ledger.arrivals_seen = self.arrivals_seen
        self.phase = "training"

    def _wait_for_loss_in(self, members: dict[int, int]) -> bool:
        deadline = time.monotonic() + self.cfg.wait_for_loss_s
        while time.monotonic() < deadline:
            if self.lost(members):
                return True
            time.sleep(0.05)
        return False

    # --- spares ----------------------------------------------------------------------------------
    def wait_as_spare(self, trainer: "TrainerLike", *, kind: str = "respawn") -> bool:
        """This process has no place in the layout: wait until a round takes it in (True: training
        goes on here) or the job ends (False; a job that failed raises as it ended)."""
        self.phase = "spare"
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        trainer.drop_model()
        stale = ms.register_spare(self.base, self.member, self.incarnation, kind=kind)
        last = max(self.round, stale)
        while True:
            r = ms.wait_for_invite(self.base, self.member, after_round=last,
                                   give_up=lambda: ms.is_done(self.base) or ms.job_end(self.base) is not None)
            if r is None:
                end = ms.job_end(self.base)
                if end is not None:
                    raise self._ended(end)
                return False
            last = r
            self.round = r
            ms.join(self.base, round_=r, member=self.member, info={"incarnation": self.incarnation, "spare": True},
                    expected=[], lost=set, timeout_s=self.cfg.timeout_s)
            later = lambda: ms.wait_for_invite(self.base, self.member, after_round=r, poll_s=0.0,  # noqa: E731
                                               give_up=lambda: True) is not None
            keys = store_lib.generation(self.base, r, "join")
            value = store_lib.wait_for_key(keys, "decision", timeout_s=self.cfg.timeout_s,
                                           give_up=lambda: later() or ms.job_end(self.base) is not None)
            if value is None:
                continue
            try:
                self._apply_decision(trainer, r, json.loads(value), held=None, started=time.perf_counter(),
                                     lost_now=set)
            except (NotMember, SecondFault) as why:
                logger.info("spare %d stays a spare after round %d: %s", self.member, r, why)
                if trainer.model is not None:
                    trainer.drop_model()
                continue
            ms.take_spare(self.base, self.member, self.incarnation)
            return True

    def finish(self) -> None:
        """Training reached its last iteration on this rank."""
        ms.mark_done(self.base)
        self.stop()


def planned_change(trainer: "TrainerLike", target: LayoutTarget, *, reason: str, held: HeldState,
                   generation: int | None, store_addr: str | None) -> Change:
    """A planned re-layout of every rank (nobody lost or joining), from the layout in force."""
    lay = trainer.ctx.layout
    return Change(target=target, cause="relayout", reason=reason, generation=generation, store_addr=store_addr,
                  old_members=tuple(trainer.ctx.members), old_name=trainer.layout_name(), old_tp=lay.tp, old_pp=lay.pp,
                  iteration=held.iteration, consumed_samples=held.consumed_samples, scheduler=held.scheduler)


def why_is_own_error(why: str) -> bool:
    """Whether a loss's reason (``FaultTolerance.lost``) is a rank's own exception."""
    return not why.startswith(("killed by signal", "exited with code", "heartbeat", HUNG, ms.PROBE_REASON))


def write_exit_file(path: str, end: dict[str, Any]) -> None:
    """The job's end as one JSON object (code, message, lost ranks), replaced atomically."""
    record = {"code": int(end["code"]), "message": end["message"], "lost": sorted(int(m) for m in end.get("lost") or {})}
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
    os.replace(tmp, path)


HUNG = "hung"
"""How a hung process's loss reason starts (``liveness.Hang.describe``)."""


def _exit_why(report: dict[str, Any]) -> str:
    code = report.get("code")
    if report.get("by") in ("self", "hang", "heartbeat"):
        return report["reason"]
    if code is not None and code < 0:
        return f"killed by signal {-code}"
    return f"exited with code {code}" if code is not None else report.get("reason", "exited")


def print_traceback(exc: BaseException, header: str) -> None:
    """The one traceback worth reading (this rank's own exception), under its one-line header."""
    print(header, file=sys.stderr, flush=True)
    print("".join(traceback.format_exception(exc)).rstrip(), file=sys.stderr, flush=True)

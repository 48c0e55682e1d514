"""The commit ledger: an iteration counts only when every rank of the generation reached its update.

Each rank adds one to the iteration's vote counter in the store just before its optimizer update
(``vote``); the rank that completes the count writes the decision ``commit``; a rank that learns
of a lost rank first writes ``abort``. Both write with compare-and-set, so the first decision wins
and every rank reads the same one. A rank that reads ``abort`` does not update, and the survivors
roll the iteration back (gradients dropped, data position restored). After a commit the update
itself is local: a rank that fails inside it leaves only its own copy stale, which the state move
then takes from a replica.

The decision also carries the one other thing every rank must learn at the same iteration: that a
replacement process has arrived (``arrivals`` grew past what the generation has seen), so all of
them grow the job at the same iteration boundary (``Vote.grow``).

Pure apart from the store; no process group is used here.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

from megatron_ext.ft import store as store_lib
from megatron_ext.ft.errors import RankLost


@dataclasses.dataclass(frozen=True)
class Vote:
    """What every rank of the generation read for one iteration."""

    committed: bool
    grow: bool = False


class CommitLedger:
    """Votes and decisions of one generation, on that generation's ``commit`` keys.

    ``lost()``: whether a rank of the generation is known gone (then nobody waits for its vote);
    ``arrivals()``: how many replacement processes have registered in the job so far;
    ``arrivals_seen``: how many the generation already took into account."""

    def __init__(self, store: Any, *, world_size: int, timeout_s: float, lost: Callable[[], bool],
                 arrivals: Callable[[], int] = lambda: 0, arrivals_seen: int = 0) -> None:
        self.store = store
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.lost = lost
        self.arrivals = arrivals
        self.arrivals_seen = arrivals_seen

    def _decide(self, iteration: int, decision: dict[str, Any]) -> Vote:
        return _read(self.store.compare_set(f"decision/{iteration}", "", json.dumps(decision)))

    def vote(self, iteration: int) -> Vote:
        """This rank is ready to update for ``iteration``. Returns when all ranks are (with whether
        the job grows after it); raises ``RankLost`` when the iteration is abandoned (a rank is
        gone, or the timeout passed)."""
        if self.store.add(f"votes/{iteration}", 1) >= self.world_size:
            self._decide(iteration, {"commit": True, "grow": self.arrivals() > self.arrivals_seen})
        value = store_lib.wait_for_key(self.store, f"decision/{iteration}", timeout_s=self.timeout_s,
                                       give_up=self.lost)
        vote = _read(value) if value is not None else self._decide(iteration, {"commit": False})
        if not vote.committed:
            raise RankLost(f"iteration {iteration} abandoned before its update: a rank is gone")
        return vote

    def settle(self, iteration: int) -> bool:
        """For a rank that never finished voting: close ``iteration`` (abort unless already
        committed) and say whether it committed."""
        return self._decide(iteration, {"commit": False}).committed


def _read(value: bytes) -> Vote:
    decision = json.loads(value)
    return Vote(committed=decision["commit"], grow=decision.get("grow", False))

"""Point-to-point transport of model and optimizer state for a live re-layout.

A re-layout used to send every rank's shards to every rank (an all-gather of the whole state),
so each rank received the job's full state to keep the slices it needed. Here only the
geometry travels to everyone (the key, index, offset and shape of each shard held and of each
slice needed: a few hundred bytes per tensor); every rank derives the same transfer plan from it
(``plan_transfers``: pure), and each holder sends each new owner exactly the overlap boxes it
needs, one message per (sender, receiver) pair, in one global order that every rank walks. The
receiver then cuts and applies its slices with the checkpoint's own ``plan_reshard`` / ``assemble``
/ ``apply`` (the one resharding planner for files and peers), the pieces taking the place of the
saved shards.

A rank may hold replicas (``collect_payload(every_replica=True)``: its DP and TP replicas too),
so one slice can have several holders: the plan takes it from the new owner itself where it holds
it, else from the holder that has sent least so far. A slice nobody holds -- its only holders were
lost -- is found before anything moves (``missing``), on every rank alike; the caller then rolls
back to the last checkpoint, or fills just those slices from it (``move_state``).

Used by every layout change (``ft/transaction.py``): a planned re-layout, the survivors of a lost
rank, a rank that rejoins (it holds nothing and receives everything it needs).
"""
from __future__ import annotations

import types
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatron_ext.runtime import checkpoint as ckpt
from megatron_ext.runtime import reshard

GEOMETRY = ("key", "index", "offset", "shape", "global_shape")


def geometry(item: Any) -> dict[str, Any]:
    """The placement of a payload item or a ``ShardEntry``: what ``plan_reshard`` reads."""
    get = item.get if isinstance(item, dict) else lambda k: getattr(item, k)
    return {k: (get(k) if k == "key" else tuple(int(v) for v in get(k))) for k in GEOMETRY}


def _box_volume(lo: tuple, hi: tuple) -> int:
    n = 1
    for a, b in zip(lo, hi):
        n *= b - a
    return n


def plan_transfers(held: Sequence[Sequence[dict[str, Any]]], needed: Sequence[Sequence[dict[str, Any]]],
                   where: str = "live re-layout") -> dict[tuple[int, int], list[tuple[int, tuple, tuple]]]:
    """Who sends what to whom. ``held[r]``: the geometry of the shards rank r holds (replicas
    included: one slice may have several holders); ``needed[r]``: the slices rank r's new model has.
    Returns ``{(src, dst): [(k, lo, hi)]}``: rank ``src`` sends rank ``dst`` the box ``[lo, hi)``
    (in the unsharded tensor) of its ``k``-th held shard, for every overlap (``src == dst``: kept
    locally). Of several holders of one shard the receiver itself is taken, else the one that has
    sent the fewest elements so far (then the lowest rank). Pure and the same on every rank; raises
    ``CheckpointError`` naming ``where`` when a needed slice is not covered, on every rank alike,
    before anything moves."""
    holders: dict[tuple, list[tuple[int, int, dict[str, Any]]]] = {}
    for r, mine in enumerate(held):
        for k, g in enumerate(mine):
            holders.setdefault((g["key"], tuple(g["index"]), tuple(g["offset"]), tuple(g["shape"])), []).append((r, k, g))
    sent = [0] * len(held)
    out: dict[tuple[int, int], list[tuple[int, tuple, tuple]]] = {}
    for dst, slices in enumerate(needed):
        shards = []
        for options in holders.values():
            local = [o for o in options if o[0] == dst]
            r, k, g = local[0] if local else min(options, key=lambda o: (sent[o[0]], o[0]))
            shards.append({**g, "source": (r, k)})
        entries = [types.SimpleNamespace(**g) for g in slices]
        seen: set[tuple] = set()
        for _, parts in reshard.plan_reshard(entries, shards, where):
            for s, (lo, hi) in parts:
                src, k = s["source"]
                box = (k, tuple(lo), tuple(hi))
                if (src, box) not in seen:  # two slices of one rank over the same box take it once
                    seen.add((src, box))
                    out.setdefault((src, dst), []).append(box)
                    if src != dst:
                        sent[src] += _box_volume(lo, hi)
    return out


def missing(held: Sequence[Sequence[dict[str, Any]]], needed: Sequence[Sequence[dict[str, Any]]]
            ) -> list[list[int]]:
    """For each rank, the indices of its needed slices that no holder covers in full (pure)."""
    # Replicas count once: coverage is summed over the overlapping shards.
    shards = list({(g["key"], tuple(g["index"]), tuple(g["offset"]), tuple(g["shape"])): g
                   for mine in held for g in mine}.values())
    out = []
    for slices in needed:
        entries = [types.SimpleNamespace(**g) for g in slices]
        gone = {id(e) for e in reshard.uncovered(entries, shards)}
        out.append([i for i, e in enumerate(entries) if id(e) in gone])
    return out


def cut(item: dict[str, Any], lo: tuple, hi: tuple) -> dict[str, Any]:
    """The box ``[lo, hi)`` of a payload item, as an item of its own (weight, master, moments, step)."""
    src = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, item["offset"]))
    piece = {"key": item["key"], "index": tuple(item["index"]), "offset": tuple(lo),
             "shape": tuple(b - a for a, b in zip(lo, hi)), "global_shape": tuple(item["global_shape"]),
             "tensor": item["tensor"][src].clone(), "optim": {k: v[src].clone() for k, v in item["optim"].items()},
             "step": item["step"]}
    if "main" in item:
        piece["main"] = item["main"][src].clone()
    return piece


def _bytes(pieces: list[dict[str, Any]]) -> int:
    n = 0
    for p in pieces:
        for t in [p["tensor"], p.get("main"), *p["optim"].values()]:
            if isinstance(t, torch.Tensor):
                n += t.numel() * t.element_size()
    return n


def move_state(payload: list[dict[str, Any]] | None, *, model: Any, optimizer: Any,
               checkpoint: str | None = None, keep_newer: bool = False) -> dict[str, Any]:
    """Collective over the current (new) default group. ``payload``: what this process's
    ``collect_payload`` returned under the old layout, at the iteration every rank agreed on (None:
    nothing usable here: a rank that rejoins, or whose copy went stale). Fills ``model`` and
    ``optimizer`` of the new layout, moving only the boxes each rank needs from their holders.

    Where a slice has no holder left (every copy was lost): with ``keep_newer`` just those slices
    come from the checkpoint at ``checkpoint`` while the rest keep their live state; otherwise
    nothing moves and the report says ``rollback`` (the caller loads the whole checkpoint, so the
    model is one iteration's model). Without a checkpoint that is ``CheckpointError``, on every rank.

    Returns this rank's ``{"sent_bytes", "received_bytes", "messages", "held_bytes", "rollback",
    "missing" (slices without a holder, over all ranks), "from_checkpoint" (keys),
    "checkpoint_iteration"}`` (state bytes: weights, masters, moments; ``held_bytes``: this rank's
    whole payload, what an all-gather would have sent to every other rank)."""
    payload = payload or []
    entries = reshard.local_entries(model, main_only=False)
    mine = ([geometry(p) for p in payload], [geometry(e) for e in entries])
    if dist.is_initialized() and dist.get_world_size() > 1:
        rank, world = dist.get_rank(), dist.get_world_size()
        both: list[Any] = [None] * world
        dist.all_gather_object(both, mine)
    else:
        rank, world, both = 0, 1, [mine]
    held, needed = [b[0] for b in both], [b[1] for b in both]
    gone = missing(held, needed)
    report: dict[str, Any] = {"sent_bytes": 0, "received_bytes": 0, "messages": 0, "held_bytes": _bytes(payload),
                              "rollback": False, "missing": sum(map(len, gone)), "from_checkpoint": [],
                              "checkpoint_iteration": None}
    if report["missing"]:
        keys = sorted({needed[r][i]["key"] for r in range(world) for i in gone[r]})
        if checkpoint is None:
            raise reshard.CheckpointError(f"no copy of {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''} is left "
                                       "in memory and there is no checkpoint (--save) to take it from")
        if not keep_newer:
            return {**report, "rollback": True, "from_checkpoint": keys}
    covered = [[g for i, g in enumerate(needed[r]) if i not in set(gone[r])] for r in range(world)]
    plan = plan_transfers(held, covered)
    pieces: list[tuple[int, dict[str, Any]]] = [(rank, cut(payload[k], lo, hi)) for k, lo, hi in plan.get((rank, rank), [])]
    # One global order of the pairs that every rank walks: each message involves two ranks, so the
    # earliest pending one always has both ready (no deadlock), whatever the plan.
    for src in range(world):
        for dst in range(world):
            boxes = plan.get((src, dst))
            if src == dst or not boxes or rank not in (src, dst):
                continue
            if rank == src:
                out = [cut(payload[k], lo, hi) for k, lo, hi in boxes]
                dist.send_object_list([out], dst=dst)
                report["sent_bytes"] += _bytes(out)
            else:
                box: list[Any] = [None]
                dist.recv_object_list(box, src=src)
                pieces += [(src, p) for p in box[0]]
                report["received_bytes"] += _bytes(box[0])
            report["messages"] += 1
    shards, lookup = [], {}
    for src, p in pieces:
        shards.append({**geometry(p), "source": src})
        lookup[reshard.shard_id(src, p)] = p
    lost_here = [entries[i] for i in gone[rank]]
    live = [e for e in entries if all(e is not m for m in lost_here)]
    staged = reshard.assemble(reshard.plan_reshard(live, shards, "live re-layout"), lookup, "live re-layout")
    if report["missing"]:
        if lost_here:
            from_files, meta = ckpt.assemble_from_checkpoint(lost_here, checkpoint)
            staged += from_files
            report["from_checkpoint"] = sorted({e.key for e in lost_here})
        report["checkpoint_iteration"] = ckpt.iteration_of(checkpoint)
    reshard.apply(staged, optimizer)
    return report

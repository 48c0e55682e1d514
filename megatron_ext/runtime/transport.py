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

Used by ``Trainer.relayout`` (runtime/relayout.py). A fail-stop regroup still gathers every
survivor's replicas (``checkpoint.reshard_from_peers``): there a slice may have several holders,
or none (then the checkpoint fills it).
"""
from __future__ import annotations

import types
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatron_ext.runtime import checkpoint as ckpt

GEOMETRY = ("key", "index", "offset", "shape", "global_shape")


def geometry(item: Any) -> dict[str, Any]:
    """The placement of a payload item or a ``ShardEntry``: what ``plan_reshard`` reads."""
    get = item.get if isinstance(item, dict) else lambda k: getattr(item, k)
    return {k: (get(k) if k == "key" else tuple(int(v) for v in get(k))) for k in GEOMETRY}


def plan_transfers(held: Sequence[Sequence[dict[str, Any]]], needed: Sequence[Sequence[dict[str, Any]]],
                   where: str = "live re-layout") -> dict[tuple[int, int], list[tuple[int, tuple, tuple]]]:
    """Who sends what to whom. ``held[r]``: the geometry of the shards rank r holds (main replicas:
    each slice has one holder); ``needed[r]``: the slices rank r's new model has. Returns
    ``{(src, dst): [(k, lo, hi)]}``: rank ``src`` sends rank ``dst`` the box ``[lo, hi)`` (in the
    unsharded tensor) of its ``k``-th held shard, for every overlap (``src == dst``: kept locally).
    Pure and the same on every rank; raises ``CheckpointError`` naming ``where`` when a needed
    slice is not covered, on every rank alike, before anything moves."""
    shards = [{**g, "source": (r, k)} for r, mine in enumerate(held) for k, g in enumerate(mine)]
    out: dict[tuple[int, int], list[tuple[int, tuple, tuple]]] = {}
    for dst, slices in enumerate(needed):
        entries = [types.SimpleNamespace(**g) for g in slices]
        seen: set[tuple] = set()
        for _, parts in ckpt.plan_reshard(entries, shards, where):
            for s, (lo, hi) in parts:
                src, k = s["source"]
                box = (k, tuple(lo), tuple(hi))
                if (src, box) not in seen:  # two slices of one rank over the same box take it once
                    seen.add((src, box))
                    out.setdefault((src, dst), []).append(box)
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


def reshard_between_ranks(payload: list[dict[str, Any]], *, model: Any, optimizer: Any) -> dict[str, Any]:
    """Collective over the current (new) default group. ``payload``: what this process's
    ``collect_payload`` returned under the old layout. Fills ``model`` and ``optimizer`` of the new
    layout, moving only the boxes each rank needs from their holders. Returns this rank's
    ``{"sent_bytes", "received_bytes", "messages", "held_bytes"}`` (state bytes: weights, masters,
    moments; ``held_bytes``: this rank's whole payload, what an all-gather would have sent to every
    other rank)."""
    entries = ckpt._local_entries(model, main_only=False)
    mine = ([geometry(p) for p in payload], [geometry(e) for e in entries])
    if dist.is_initialized() and dist.get_world_size() > 1:
        rank, world = dist.get_rank(), dist.get_world_size()
        both: list[Any] = [None] * world
        dist.all_gather_object(both, mine)
    else:
        rank, world, both = 0, 1, [mine]
    plan = plan_transfers([b[0] for b in both], [b[1] for b in both])
    pieces: list[tuple[int, dict[str, Any]]] = [(rank, cut(payload[k], lo, hi)) for k, lo, hi in plan.get((rank, rank), [])]
    sent = received = messages = 0
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
                sent += _bytes(out)
            else:
                box: list[Any] = [None]
                dist.recv_object_list(box, src=src)
                pieces += [(src, p) for p in box[0]]
                received += _bytes(box[0])
            messages += 1
    shards, lookup = [], {}
    for src, p in pieces:
        shards.append({**geometry(p), "source": src})
        lookup[ckpt._shard_id(src, p)] = p
    staged = ckpt.assemble(ckpt.plan_reshard(entries, shards, "live re-layout"), lookup, "live re-layout")
    ckpt.apply(staged, optimizer)
    return {"sent_bytes": sent, "received_bytes": received, "messages": messages,
            "held_bytes": _bytes(payload)}

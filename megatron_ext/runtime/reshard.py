"""Resharding: the geometry of a model's shards, and cutting any layout's slices out of any other's.

Every tensor is described by megatron's ``sharded_state_dict`` geometry (``ShardEntry``: key, global
layer or expert index, offset and shape in the unsharded tensor), so a checkpoint written under one
TP/PP/DP/EP layout, or the shards held by the ranks of a running job, can fill a model of another
layout: ``plan_reshard`` says which saved shard covers which part of each local slice, ``assemble``
cuts the slices (touching no model), ``apply`` copies them into the model and the optimizer. The one
planner for the two sources: the checkpoint's files (``checkpoint.load``) and peers
(``transport.move_state``). ``collect_payload`` is what a rank holds, in the same terms.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from megatron_ext.errors import UserError
from megatron_ext.runtime.model import ModelBundle, iter_sharded_tensors, shard_slices, unwrap
from megatron_ext.runtime.optimizer import MOMENT_KEYS, collect_param_states, restore_param_states

OPT_KEYS = MOMENT_KEYS


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used; the message names the directory and the reason."""


@dataclasses.dataclass
class TrainState:
    """Everything besides model and optimizer tensors that a resume needs (either checkpoint format)."""

    iteration: int
    consumed_samples: int
    scheduler: dict[str, Any]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def is_main_replica(st: Any) -> bool:
    rid = st.replica_id
    return all(r == 0 for r in rid) if isinstance(rid, tuple) else rid == 0


@dataclasses.dataclass
class ShardEntry:
    """One local tensor and where it sits in its unsharded tensor.

    ``key`` + ``index`` name the unsharded tensor (``index``: positions along stacked axes such as
    the global layer); ``offset``/``shape`` locate this shard in it; ``main`` marks the one replica
    that is written (DP and TP replicas of the same slice are not)."""

    key: str
    index: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    param: torch.Tensor
    main: bool


def megatron_shard_entries(model: ModelBundle) -> list[ShardEntry]:
    """Shard entries of megatron model chunks, from their ``sharded_state_dict()`` geometry."""
    entries = []
    seen: set[int] = set()
    for chunk in model.chunks:
        for st in iter_sharded_tensors(unwrap(chunk).sharded_state_dict()):
            if not isinstance(st.data, torch.Tensor) or id(st.data) in seen:
                continue
            seen.add(id(st.data))
            index, slices = shard_slices(st)
            entries.append(ShardEntry(key=st.key, index=index, offset=tuple(s.start for s in slices),
                                      shape=tuple(st.data.shape),
                                      global_shape=tuple(st.global_shape[st.prepend_axis_num:]),
                                      param=st.data, main=is_main_replica(st)))
    return entries


def local_entries(model: Any, *, main_only: bool) -> list[ShardEntry]:
    """``model`` is a megatron ModelBundle or anything with ``shard_entries()`` (the DeepSpeed engine)."""
    entries = model.shard_entries() if hasattr(model, "shard_entries") else megatron_shard_entries(model)
    return [e for e in entries if e.main or not main_only]


def state_is_sharded(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or a part of a chained one) is megatron's DistributedOptimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opt = getattr(optimizer, "megatron_optimizer", optimizer)
    return any(isinstance(p, DistributedOptimizer) for p in getattr(opt, "chained_optimizers", [opt]))


def collect_payload(model: Any, optimizer: Any, *, every_replica: bool = False) -> list[dict[str, Any]]:
    """Collective. This rank's main-replica shards: weight, fp32 master, Adam moments and step, each
    with its place in the unsharded tensor. What a checkpoint file holds, and what a live re-layout
    sends to the new owners.

    ``every_replica``: also the shards this rank holds as a DP or TP replica, and without any
    collective (after a fail-stop the groups are broken, and a lost main replica's state lives on
    in its replicas). Refused for the distributed optimizer, whose state exists only sharded."""
    if every_replica and state_is_sharded(optimizer):
        raise CheckpointError("the distributed optimizer's state is sharded over data-parallel ranks: "
                              "it has no replica to collect without a collective")
    payload = []
    # Only main replicas are kept. The distributed optimizer's state is gathered over the
    # data-parallel group, a collective every replica joins for every entry; other optimizers
    # hold whole local state, and copying it off the device is needed for main replicas only.
    entries = local_entries(model, main_only=not every_replica and not state_is_sharded(optimizer))
    states = collect_param_states(optimizer, [e.param for e in entries])
    for e, ostate in zip(entries, states):
        if not e.main and not every_replica:
            continue
        item = {
            "key": e.key, "index": e.index, "offset": e.offset, "shape": e.shape, "global_shape": e.global_shape,
            "tensor": e.param.detach().cpu().clone(),
            "optim": {k: ostate[k] for k in OPT_KEYS if k in ostate},
            "step": ostate.get("step"),
        }
        if "main" in ostate:  # fp32 master weights of a mixed-precision optimizer
            item["main"] = ostate["main"]
        payload.append(item)
    return payload


def _overlap(a_off, a_shape, b_off, b_shape):
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a_off, a_shape, b_off, b_shape)]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, hi


def plan_reshard(entries: list[ShardEntry], shards: list[dict[str, Any]], where: str) -> list[tuple]:
    """For each local entry, the saved shards that overlap it and where: ``[(entry, [(shard, (lo, hi))])]``.

    ``shards`` is the index of what was saved (``meta.json``'s "shards": key, index, offset, shape,
    global shape and a ``source``, a file or a peer rank). Pure; raises CheckpointError naming
    ``where`` when a local slice is not covered or a shape differs."""
    by_key: dict[tuple, list[dict[str, Any]]] = {}
    for s in shards:
        by_key.setdefault((s["key"], tuple(s["index"])), []).append(s)
    plan = []
    for e in entries:
        saved = by_key.get((e.key, tuple(e.index)))
        if not saved:
            raise CheckpointError(f"{where}: no tensor {e.key}{list(e.index) or ''} in the checkpoint "
                                  "(model shape differs from the saved run?)")
        if tuple(saved[0]["global_shape"]) != tuple(e.global_shape):
            raise CheckpointError(f"{where}: {e.key} has shape {saved[0]['global_shape']} in the checkpoint, "
                                  f"{list(e.global_shape)} in this model")
        parts = []
        covered = 0
        for s in saved:
            ov = _overlap(e.offset, e.shape, s["offset"], s["shape"])
            if ov is not None:
                parts.append((s, ov))
                covered += int(np.prod([h - l for l, h in zip(*ov)]))
        if covered != int(np.prod(e.shape)):
            raise CheckpointError(f"{where}: saved shards of {e.key} do not cover this rank's slice")
        plan.append((e, parts))
    return plan


def shard_id(source: Any, item: dict[str, Any]) -> tuple:
    return (source, item["key"], tuple(item["index"]), tuple(item["offset"]))


def assemble(plan: list[tuple], lookup: dict[tuple, dict[str, Any]], where: str) -> list[tuple]:
    """Cut every local slice out of the saved shards (``lookup``: ``_shard_id`` -> payload item).
    Touches no model: ``[(entry, value, optimizer state)]`` to hand to ``apply``."""
    staged = []
    for e, parts in plan:
        value = torch.empty(e.shape, dtype=e.param.dtype)
        # The master copy: saved fp32 "main" where the saving run had one, else the saved weight
        # itself (an fp32 run's weight is its master; its exact value, not a bf16 rounding).
        main = torch.empty(e.shape, dtype=torch.float32)
        optim = {k: torch.empty(e.shape, dtype=torch.float32) for k in OPT_KEYS}
        step = None
        have_optim = True
        for s, (lo, hi) in parts:
            p = lookup[shard_id(s["source"], s)]
            dst = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, e.offset))
            src = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, s["offset"]))
            master = (p["main"] if "main" in p else p["tensor"])[src]
            main[dst] = master.float()
            # From the master: an fp32 run resuming a bf16 checkpoint gets the full-precision value;
            # for a bf16 model this is the saved weight (the optimizer rounds master -> weight).
            value[dst] = master.to(value.dtype)
            if all(k in p["optim"] for k in OPT_KEYS) and p["step"] is not None:
                for k in OPT_KEYS:
                    optim[k][dst] = p["optim"][k][src]
                if step is not None and step != p["step"]:
                    raise CheckpointError(f"{where}: shards of {e.key} disagree on the step count "
                                          f"({step} vs {p['step']})")
                step = p["step"]
            else:
                have_optim = False
        state = {"main": main}
        if have_optim and step is not None:
            state.update(optim, step=step)
        staged.append((e, value, state))
    return staged


def apply(staged: list[tuple], optimizer: Any, *, load_optim: bool = True) -> None:
    """Copy assembled slices into the model's parameters and the optimizer's state."""
    with torch.no_grad():
        for e, value, _ in staged:
            e.param.copy_(value.to(e.param.device))
    restore_param_states(optimizer, [e.param for e, _, _ in staged], [st for _, _, st in staged],
                         load_moments=load_optim)


def uncovered(entries: list[ShardEntry], shards: list[dict[str, Any]]) -> list[ShardEntry]:
    """The entries whose slice ``shards`` (geometry dicts) do not cover in full."""
    by_key: dict[tuple, list[dict[str, Any]]] = {}
    for s in shards:
        by_key.setdefault((s["key"], tuple(s["index"])), []).append(s)
    out = []
    for e in entries:
        try:
            plan_reshard([e], by_key.get((e.key, tuple(e.index)), []), "")
        except CheckpointError:
            out.append(e)
    return out

"""Sharded, atomic, integrity-checked checkpoints that reshard on load.

Layout of a save directory::

    latest                      text: name of the newest complete checkpoint (atomic replace)
    iter_0000020/
      meta.json                 iteration, data position, scheduler, layout, config, files + sha256
      shards_rank00003.pt       main-replica model shards and their optimizer tensors of rank 3:
                                fp32 master copy (mixed precision), Adam moments, step count
      rng_rank00003.pt          RNG states of rank 3

Every tensor is stored with its megatron ``sharded_state_dict`` geometry (key, global shape, global
offset), so a checkpoint saved under one TP/PP/DP layout loads under another: each rank cuts what
it needs out of the saved shards. Ranks write into ``iter_N.partial``; rank 0 renames it and then
updates ``latest`` only after every file is written and hashed, so a crash mid-save leaves the
previous checkpoint the newest loadable one. Loading verifies sizes and hashes and assembles all
tensors before touching the model: a corrupt or truncated checkpoint is refused, never half-loaded.

Why not megatron's ``dist_checkpointing``: its async filesystem writer starts a multiprocessing
manager on every save (a fresh megatron import per save on CPU), and it cannot describe the state of
a plain torch optimizer, which the CPU runtime uses.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist

from megatron_ext.errors import UserError
from megatron_ext.runtime.model import ModelBundle, iter_sharded_tensors, shard_slices, unwrap
from megatron_ext.runtime.optimizer import MOMENT_KEYS, collect_param_states, restore_param_states

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
LATEST = "latest"
OPT_KEYS = MOMENT_KEYS


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used; the message names the directory and the reason."""


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_main_replica(st: Any) -> bool:
    rid = st.replica_id
    return all(r == 0 for r in rid) if isinstance(rid, tuple) else rid == 0


@dataclasses.dataclass
class TrainState:
    """Everything besides model and optimizer tensors that a resume needs."""

    iteration: int
    consumed_samples: int
    scheduler: dict[str, Any]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state["tracker"]:  # empty when saved by an engine without megatron's tracker (--engine deepspeed)
        get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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
                                      param=st.data, main=_is_main_replica(st)))
    return entries


def _local_entries(model: Any, *, main_only: bool) -> list[ShardEntry]:
    """``model`` is a megatron ModelBundle or anything with ``shard_entries()`` (the DeepSpeed engine)."""
    entries = model.shard_entries() if hasattr(model, "shard_entries") else megatron_shard_entries(model)
    return [e for e in entries if e.main or not main_only]


def _state_is_sharded(optimizer: Any) -> bool:
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
    if every_replica and _state_is_sharded(optimizer):
        raise CheckpointError("the distributed optimizer's state is sharded over data-parallel ranks: "
                              "it has no replica to collect without a collective")
    payload = []
    # Only main replicas are kept. The distributed optimizer's state is gathered over the
    # data-parallel group, a collective every replica joins for every entry; other optimizers
    # hold whole local state, and copying it off the device is needed for main replicas only.
    entries = _local_entries(model, main_only=not every_replica and not _state_is_sharded(optimizer))
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


def save(save_dir: str, *, model: Any, optimizer: Any, state: TrainState, config: dict[str, Any],
         layout: dict[str, int], keep_last: int = 0, on_written: Callable[[], None] | None = None) -> str:
    """Collective: every rank calls it. Returns the checkpoint directory. ``on_written`` runs
    after this rank's files are written, before the ranks agree on the index (fault injection
    kills a rank there)."""
    rank, world = _rank_world()
    name = iter_dir_name(state.iteration)
    final = os.path.join(save_dir, name)
    partial = final + ".partial"
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        if os.path.exists(partial):
            shutil.rmtree(partial)
        os.makedirs(partial)
    _barrier()
    payload = collect_payload(model, optimizer)
    shard_file = f"shards_rank{rank:05d}.pt"
    rng_file = f"rng_rank{rank:05d}.pt"
    torch.save(payload, os.path.join(partial, shard_file))
    torch.save(_rng_state(), os.path.join(partial, rng_file))
    if on_written is not None:
        on_written()
    mine = {}
    for f in (shard_file, rng_file):
        path = os.path.join(partial, f)
        mine[f] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
    index = [{"key": p["key"], "index": list(p["index"]), "offset": list(p["offset"]), "shape": list(p["shape"]),
              "global_shape": list(p["global_shape"]), "file": shard_file} for p in payload]
    gathered: list[Any] = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(gathered, (mine, index))
    else:
        gathered = [(mine, index)]
    if rank == 0:
        files: dict[str, Any] = {}
        shards: list[dict[str, Any]] = []
        for f, idx in gathered:
            files.update(f)
            shards.extend(idx)
        meta = {
            "format_version": FORMAT_VERSION,
            "iteration": state.iteration,
            "consumed_samples": state.consumed_samples,
            "scheduler": state.scheduler,
            "extra": state.extra,
            "layout": layout,
            "world_size": world,
            "config": config,
            "files": files,
            "shards": shards,
        }
        _atomic_write_text(os.path.join(partial, "meta.json"), json.dumps(meta, indent=1, default=str))
        _fsync_dir(partial)
        if os.path.exists(final):  # re-saving the same iteration: replace atomically enough
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_dir(save_dir)
        _atomic_write_text(os.path.join(save_dir, LATEST), name + "\n")
        if keep_last > 0:
            _prune(save_dir, keep_last)
        logger.info("saved checkpoint %s", final)
    _barrier()
    return final


def _prune(save_dir: str, keep_last: int) -> None:
    done = sorted(d for d in os.listdir(save_dir) if d.startswith("iter_") and not d.endswith(".partial"))
    for old in done[:-keep_last]:
        shutil.rmtree(os.path.join(save_dir, old), ignore_errors=True)


def resolve(load_dir: str) -> str:
    """The checkpoint directory ``load_dir`` points at: itself if it is one, else its ``latest``."""
    if os.path.isfile(os.path.join(load_dir, "meta.json")):
        return load_dir
    latest = os.path.join(load_dir, LATEST)
    if not os.path.isfile(latest):
        raise CheckpointError(f"{load_dir}: no '{LATEST}' file and no meta.json: not a checkpoint directory")
    name = open(latest, encoding="utf-8").read().strip()
    path = os.path.join(load_dir, name)
    if not os.path.isdir(path):
        raise CheckpointError(f"{load_dir}: '{LATEST}' names {name}, which does not exist")
    return path


def read_meta(ckpt: str) -> dict[str, Any]:
    path = os.path.join(ckpt, "meta.json")
    try:
        with open(path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt}: meta.json missing: the checkpoint is incomplete") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{ckpt}: meta.json is corrupt ({exc.msg})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{ckpt}: format version {meta.get('format_version')} is not {FORMAT_VERSION}")
    return meta


def verify(ckpt: str, meta: dict[str, Any], files: list[str] | None = None) -> None:
    """Check presence, size and hash of ``files`` (default: all) against meta.json."""
    for f in files if files is not None else meta["files"]:
        info = meta["files"].get(f)
        if info is None:
            raise CheckpointError(f"{ckpt}: {f} is not listed in meta.json")
        path = os.path.join(ckpt, f)
        if not os.path.isfile(path):
            raise CheckpointError(f"{ckpt}: {f} is missing")
        size = os.path.getsize(path)
        if size != info["bytes"]:
            raise CheckpointError(f"{ckpt}: {f} is truncated or altered ({size} bytes, expected {info['bytes']})")
        if _sha256(path) != info["sha256"]:
            raise CheckpointError(f"{ckpt}: {f} is corrupt (sha256 mismatch)")


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


def _shard_id(source: Any, item: dict[str, Any]) -> tuple:
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
            p = lookup[_shard_id(s["source"], s)]
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


def load(load_dir: str, *, model: Any, optimizer: Any, layout: dict[str, int],
         load_optim: bool = True, load_rng: bool = True) -> TrainState:
    """Collective. Verifies, assembles every needed tensor, then copies into model and optimizer."""
    rank, world = _rank_world()
    ckpt = resolve(load_dir)
    meta = read_meta(ckpt)
    shards = [{**s, "source": s["file"]} for s in meta["shards"]]
    plan = plan_reshard(_local_entries(model, main_only=False), shards, ckpt)
    needed_files = {s["source"] for _, parts in plan for s, _ in parts}
    rng_file = f"rng_rank{rank:05d}.pt"
    same_layout = meta["layout"] == layout and meta["world_size"] == world
    want_rng = load_rng and same_layout and rng_file in meta["files"]
    verify(ckpt, meta, sorted(needed_files) + ([rng_file] if want_rng else []))

    staged = assemble(plan, _read_shards(ckpt, needed_files), ckpt)
    rng = torch.load(os.path.join(ckpt, rng_file), map_location="cpu", weights_only=False) if want_rng else None

    # Nothing above touched the model: a bad checkpoint raised before this point.
    apply(staged, optimizer, load_optim=load_optim)
    if rng is not None:
        _set_rng_state(rng)
    elif load_rng and not same_layout and rank == 0:
        logger.info("layout changed (%s -> %s): RNG states not restored", meta["layout"], layout)
    return TrainState(iteration=meta["iteration"], consumed_samples=meta["consumed_samples"],
                      scheduler=meta["scheduler"], extra=meta.get("extra", {}))


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


def assemble_from_checkpoint(entries: list[ShardEntry], load_dir: str) -> tuple[list[tuple], dict[str, Any]]:
    """Cut ``entries`` (some of this rank's slices) from the checkpoint at ``load_dir`` (a save
    directory or one ``iter_N``), verified first. Touches no model: ``(staged for apply, meta)``."""
    ckpt = resolve(load_dir)
    meta = read_meta(ckpt)
    saved = [{**s, "source": s["file"]} for s in meta["shards"]]
    plan = plan_reshard(entries, saved, ckpt)
    files = sorted({s["source"] for _, parts in plan for s, _ in parts})
    verify(ckpt, meta, files)
    return assemble(plan, _read_shards(ckpt, files), ckpt), {**meta, "path": ckpt}


def _read_shards(ckpt: str, files: Iterable[str]) -> dict[tuple, dict[str, Any]]:
    """Every shard of ``files`` (verified before), by ``_shard_id``."""
    lookup = {}
    for f in files:
        for p in torch.load(os.path.join(ckpt, f), map_location="cpu", weights_only=False):
            lookup[_shard_id(f, p)] = p
    return lookup

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
it needs out of the saved shards (``runtime/reshard.py``: the planner for files and peers alike;
this module is the file format). Ranks write into ``iter_N.partial``; rank 0 renames it and then
updates ``latest`` only after every file is written and hashed, so a crash mid-save leaves the
previous checkpoint the newest loadable one. Loading verifies sizes and hashes and assembles all
tensors before touching the model: a corrupt or truncated checkpoint is refused, never half-loaded.

Why not megatron's ``dist_checkpointing``: its async filesystem writer starts a multiprocessing
manager on every save (a fresh megatron import per save on CPU), and it cannot describe the state of
a plain torch optimizer, which the CPU runtime uses.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from megatron_ext.runtime.dist_ckpt import (fsync_dir, iter_dir_name, megatron_rng, rank_world, set_megatron_rng,
                                            sha256_of, start_save, write_text_atomic)
from megatron_ext.runtime.reshard import (CheckpointError, ShardEntry, TrainState, apply, assemble, collect_payload,
                                          local_entries, plan_reshard, shard_id)

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
LATEST = "latest"
OWN = "megatron_ext"
"""``--ckpt-format`` of this file's format; ``runtime/dist_ckpt.py`` is Megatron-LM's ``torch_dist``."""
FORMATS = ("torch_dist", OWN)


def deepspeed_tag(path: str) -> str | None:
    """The ``global_stepN`` a DeepSpeed (or Megatron-DeepSpeed) save directory's ``latest`` names."""
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        tag = open(latest, encoding="utf-8").read().strip()
        if tag.startswith("global_step"):
            return tag
    if os.path.basename(os.path.normpath(path)).startswith("global_step"):
        return os.path.basename(os.path.normpath(path))
    return None


def format_of(path: str) -> str | None:
    """The checkpoint format ``path`` (a save directory or one checkpoint) holds, or None.
    Raises CheckpointError for formats this runtime does not read, saying what to do."""
    from megatron_ext.runtime import dist_ckpt

    if not os.path.isdir(path):
        return None
    if dist_ckpt.holds(path):
        return dist_ckpt.FORMAT
    tag = deepspeed_tag(path)
    if tag is not None:
        raise CheckpointError(f"{path}: a DeepSpeed checkpoint ({tag}/: DeepSpeed's own layout, as DeepSpeed and "
                              "Megatron-DeepSpeed write it), which only --engine deepspeed reads (--deepspeed): resume it "
                              "there, or convert its weights with DeepSpeed's zero_to_fp32.py and "
                              "tools/convert_checkpoint.py import")
    if os.path.isfile(os.path.join(path, "meta.json")) or os.path.isfile(os.path.join(path, LATEST)):
        return OWN
    if any(d.startswith("mp_rank_") for d in os.listdir(path)):
        raise CheckpointError(f"{path}: a Megatron-LM checkpoint in its legacy 'torch' format (mp_rank_*/"
                              "model_optim_rng.pt), which this runtime does not read: convert it to torch_dist with "
                              "Megatron-LM (--ckpt-convert-format torch_dist) and load that")
    return None


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(save_dir: str, *, model: Any, optimizer: Any, state: TrainState, config: dict[str, Any],
         layout: dict[str, int], keep_last: int = 0, on_written: Callable[[], None] | None = None,
         ckpt_format: str = OWN, samples_per_step: int = 1) -> str:
    """Collective: every rank calls it. Returns the checkpoint directory. ``on_written`` runs
    after this rank's files are written, before the ranks agree on the index (fault injection
    kills a rank there). ``ckpt_format`` torch_dist writes Megatron-LM's format (dist_ckpt.py)."""
    if ckpt_format != OWN:
        from megatron_ext.runtime import dist_ckpt

        return dist_ckpt.save(save_dir, model=model, optimizer=optimizer, state=state, config=config, layout=layout,
                              keep_last=keep_last, on_written=on_written, samples_per_step=samples_per_step)
    rank, world = rank_world()
    name = iter_dir_name(state.iteration)
    final, partial = start_save(save_dir, state.iteration)
    payload = collect_payload(model, optimizer)
    shard_file = f"shards_rank{rank:05d}.pt"
    rng_file = f"rng_rank{rank:05d}.pt"
    torch.save(payload, os.path.join(partial, shard_file))
    torch.save(megatron_rng(), os.path.join(partial, rng_file))
    if on_written is not None:
        on_written()
    mine = {}
    for f in (shard_file, rng_file):
        path = os.path.join(partial, f)
        mine[f] = {"bytes": os.path.getsize(path), "sha256": sha256_of(path)}
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
        write_text_atomic(os.path.join(partial, "meta.json"), json.dumps(meta, indent=1, default=str))
        fsync_dir(partial)
        if os.path.exists(final):  # re-saving the same iteration: replace atomically enough
            shutil.rmtree(final)
        os.replace(partial, final)
        fsync_dir(save_dir)
        write_text_atomic(os.path.join(save_dir, LATEST), name + "\n")
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
        raise CheckpointError(f"{load_dir}: not a checkpoint directory (no latest_checkpointed_iteration.txt, no "
                              f"'{LATEST}' file, no meta.json)")
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


def exists(load_dir: str) -> bool:
    """``load_dir`` is a checkpoint directory or holds one (its ``latest``, or Megatron-LM's tracker)."""
    try:
        fmt = format_of(load_dir)
        if fmt == OWN:
            resolve(load_dir)
    except CheckpointError:
        return False
    return fmt is not None


def iteration_of(load_dir: str) -> int:
    """The iteration of the checkpoint ``load_dir`` points at, in either format."""
    if format_of(load_dir) == OWN:
        return int(read_meta(resolve(load_dir))["iteration"])
    from megatron_ext.runtime import dist_ckpt

    return int(dist_ckpt.read_common(dist_ckpt.resolve(load_dir))["iteration"])


def saved_config(load_dir: str) -> dict[str, Any] | None:
    """``config_of`` the checkpoint ``load_dir`` holds, None where it holds none yet (the reader
    ``parse_run_config`` takes for --use-checkpoint-args)."""
    return config_of(load_dir) if exists(load_dir) else None


def config_of(load_dir: str) -> dict[str, Any]:
    """The saving run's flat config (Megatron-LM's args for a checkpoint Megatron-LM wrote)."""
    if format_of(load_dir) == OWN:
        return dict(read_meta(resolve(load_dir)).get("config") or {})
    from megatron_ext.runtime import dist_ckpt

    return dist_ckpt.config_of(dist_ckpt.resolve(load_dir))


def embedding_rows(load_dir: str | None) -> int | None:
    """The rows of the word embedding in the checkpoint ``load_dir`` points at (its padded vocabulary),
    None where there is no checkpoint yet or no embedding: loading it is what reports a bad one."""
    if not load_dir:
        return None
    try:
        if format_of(load_dir) == "torch_dist":
            from megatron_ext.runtime import dist_ckpt

            return dist_ckpt.embedding_rows(load_dir)
        meta = read_meta(resolve(load_dir))
    except CheckpointError:
        return None
    rows = [s["global_shape"][0] for s in meta.get("shards", []) if s.get("key") == "embedding.word_embeddings.weight"]
    return int(rows[0]) if rows else None


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
        if sha256_of(path) != info["sha256"]:
            raise CheckpointError(f"{ckpt}: {f} is corrupt (sha256 mismatch)")


def load(load_dir: str, *, model: Any, optimizer: Any, layout: dict[str, int],
         load_optim: bool = True, load_rng: bool = True, step: int | None = None,
         samples_per_step: int = 1) -> TrainState:
    """Collective. Verifies, assembles every needed tensor, then copies into model and optimizer.
    Reads either format (the directory says which); ``step``: that iteration of a save directory
    (Megatron-LM's --ckpt-step)."""
    fmt = format_of(load_dir)
    if fmt is None:
        if not os.path.isdir(load_dir):
            raise CheckpointError(f"{load_dir} does not exist")
        resolve(load_dir)  # raises naming what is missing
    if fmt == "torch_dist":
        from megatron_ext.runtime import dist_ckpt

        return dist_ckpt.load(load_dir, model=model, optimizer=optimizer, layout=layout, load_optim=load_optim,
                              load_rng=load_rng, step=step, samples_per_step=samples_per_step)
    if step is not None:
        load_dir = os.path.join(load_dir, iter_dir_name(step)) if not os.path.isfile(
            os.path.join(load_dir, "meta.json")) else load_dir
    rank, world = rank_world()
    ckpt = resolve(load_dir)
    meta = read_meta(ckpt)
    shards = [{**s, "source": s["file"]} for s in meta["shards"]]
    plan = plan_reshard(local_entries(model, main_only=False), shards, ckpt)
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
        set_megatron_rng(rng)
    elif load_rng and not same_layout and rank == 0:
        logger.info("layout changed (%s -> %s): RNG states not restored", meta["layout"], layout)
    return TrainState(iteration=meta["iteration"], consumed_samples=meta["consumed_samples"],
                      scheduler=meta["scheduler"], extra=meta.get("extra", {}))


def assemble_from_checkpoint(entries: list[ShardEntry], load_dir: str) -> tuple[list[tuple], dict[str, Any]]:
    """Cut ``entries`` (some of this rank's slices) from the checkpoint at ``load_dir`` (a save
    directory or one ``iter_N``), verified first. Touches no model: ``(staged for apply, meta)``;
    ``meta`` has the checkpoint's ``iteration`` and ``path`` in either format."""
    if format_of(load_dir) == "torch_dist":
        from megatron_ext.runtime import dist_ckpt

        where = dist_ckpt.resolve(load_dir)
        staged, common = dist_ckpt.assemble(where, entries, with_optim=True)
        return staged, {"iteration": int(common["iteration"]), "path": where}
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
            lookup[shard_id(f, p)] = p
    return lookup

"""Megatron-LM's checkpoint format (``--ckpt-format torch_dist``), written and read through
``megatron.core.dist_checkpointing``.

Layout of a save directory, as Megatron-LM ``core_v0.16.1`` writes it::

    latest_checkpointed_iteration.txt   the newest complete iteration, a number (Megatron-LM's tracker)
    iter_0000020/
      __0_0.distcp ...                  tensors, torch.distributed.checkpoint files (one or more per rank)
      .metadata                         torch.distributed.checkpoint's index of every tensor chunk
      metadata.json                     dist_checkpointing's format marker
      common.pt                         rank 0's non-tensor state: args, iteration, checkpoint_version,
                                        opt_param_scheduler, num_floating_point_operations_so_far, and
                                        ``megatron_ext`` (data position, layout, config, optimizer steps)
      megatron_ext_files.json           size and sha256 of every file above (ours; written last)

Tensors sit under megatron's ``sharded_state_dict()`` keys and geometry (layers stacked on a prepended
axis, TP shards at their offsets), so Megatron-LM loads them into its own ``GPTModel`` in any layout.
The optimizer state is saved as sharded tensors next to the weights, under the keys of megatron's
non-distributed optimizers: ``optimizer.state.fp32_param.<key>`` (the fp32 master),
``optimizer.state.exp_avg.<key>``, ``optimizer.state.exp_avg_sq.<key>``; the step counts go into the
common state. RNG states are megatron's ``rng_state`` object (one per pipeline x tensor rank, listing
every data-parallel rank's states), or one per rank where megatron's parallel state is not set up
(the DeepSpeed engine).

Saving is megatron's synchronous ``torch_dist`` strategy (its asynchronous writer starts a process per
save). Ranks write into ``iter_N.partial/``; rank 0 writes the file list, renames the directory and
only then rewrites the tracker, so a save killed at any point leaves the tracker on a complete
checkpoint. Reading cuts each rank's slices out of the saved chunks with
``torch.distributed.checkpoint`` and no collective (a recovering rank reads alone); what was read is
handed to ``reshard.apply`` as for the project's own format.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from megatron_ext.runtime.reshard import (OPT_KEYS, CheckpointError, ShardEntry, TrainState, apply, collect_payload,
                                          local_entries)

logger = logging.getLogger(__name__)

FORMAT = "torch_dist"
TRACKER = "latest_checkpointed_iteration.txt"
FILES = "megatron_ext_files.json"
EXT = "megatron_ext"
EXT_VERSION = 1
MASTER = "fp32_param"  # megatron's name of the fp32 master weight in optimizer state keys
OWN_RNG = "megatron_ext.rng_state"


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def optimizer_key(kind: str, key: str) -> str:
    """The sharded key of an optimizer tensor (``kind``: exp_avg, exp_avg_sq, or ``main``)."""
    return f"optimizer.state.{MASTER if kind == 'main' else kind}.{key}"


def rank_world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without a process group. These helpers serve both formats."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_text_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- what a directory holds ------------------------------------------------------------------

def is_checkpoint(path: str) -> bool:
    """``path`` is one torch_dist checkpoint (an ``iter_N`` directory)."""
    return os.path.isfile(os.path.join(path, "metadata.json")) and os.path.isfile(os.path.join(path, ".metadata"))


def holds(load_dir: str) -> bool:
    """``load_dir`` is a torch_dist checkpoint or a save directory with Megatron-LM's tracker."""
    return os.path.isfile(os.path.join(load_dir, TRACKER)) or is_checkpoint(load_dir)


def read_tracker(load_dir: str) -> int | str:
    """The tracker's iteration (or ``"release"``), as Megatron-LM reads it."""
    path = os.path.join(load_dir, TRACKER)
    text = open(path, encoding="utf-8").read().strip()
    if text == "release":
        return text
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path}: holds {text!r}, not an iteration number or 'release'") from None


def _candidates(load_dir: str) -> list[str]:
    """Complete-looking iteration directories of ``load_dir``, newest first."""
    names = [d for d in os.listdir(load_dir) if d.startswith("iter_") and "." not in d
             and os.path.isdir(os.path.join(load_dir, d))]
    return [os.path.join(load_dir, d) for d in sorted(names, reverse=True)]


def problem(ckpt: str, *, hashes: bool = True) -> str | None:
    """Why ``ckpt`` cannot be loaded (a missing or truncated file, a hash mismatch, unreadable
    metadata), or None. A checkpoint without our file list (written by Megatron-LM) is checked for
    the files torch.distributed.checkpoint's index names and their sizes."""
    if not os.path.isdir(ckpt):
        return f"{ckpt} does not exist"
    for name in ("metadata.json", ".metadata", "common.pt"):
        if not os.path.isfile(os.path.join(ckpt, name)):
            return f"{ckpt}: {name} is missing (an incomplete save)"
    listed = os.path.join(ckpt, FILES)
    if os.path.isfile(listed):
        try:
            files = json.load(open(listed, encoding="utf-8"))["files"]
        except (ValueError, KeyError):
            return f"{ckpt}: {FILES} is corrupt"
        for name, info in files.items():
            path = os.path.join(ckpt, name)
            if not os.path.isfile(path):
                return f"{ckpt}: {name} is missing"
            if os.path.getsize(path) != info["bytes"]:
                return f"{ckpt}: {name} is truncated or altered ({os.path.getsize(path)} bytes, expected {info['bytes']})"
        if hashes:
            for name, info in files.items():
                if sha256_of(os.path.join(ckpt, name)) != info["sha256"]:
                    return f"{ckpt}: {name} is corrupt (sha256 mismatch)"
        return None
    try:
        md = _reader(ckpt).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unreadable index is the same verdict
        return f"{ckpt}: .metadata is unreadable ({type(exc).__name__})"
    ends: dict[str, int] = {}
    for info in md.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = os.path.join(ckpt, name)
        if not os.path.isfile(path):
            return f"{ckpt}: {name} is missing"
        if os.path.getsize(path) < end:
            return f"{ckpt}: {name} is truncated ({os.path.getsize(path)} bytes, its index reaches {end})"
    return None


def resolve(load_dir: str, *, step: int | None = None, check: bool = True) -> str:
    """The checkpoint directory to load. ``load_dir`` may be one ``iter_N`` (used as named) or a
    save directory: its tracker's iteration, or ``step`` (Megatron-LM's --ckpt-step), else the
    newest. An explicitly named checkpoint (``iter_N`` or ``step``) that fails its check is refused;
    where the tracker's newest fails, the newest complete one before it is taken, in one line."""
    if is_checkpoint(load_dir) or (step is None and os.path.basename(os.path.normpath(load_dir)).startswith("iter_")):
        if check and (why := problem(load_dir)):
            raise CheckpointError(why)
        return load_dir
    if step is not None:
        path = os.path.join(load_dir, iter_dir_name(step))
        if check and (why := problem(path)):
            raise CheckpointError(f"--ckpt-step {step}: {why}")
        return path
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"{load_dir} does not exist")
    tracked = read_tracker(load_dir) if os.path.isfile(os.path.join(load_dir, TRACKER)) else None
    if tracked == "release":
        path = os.path.join(load_dir, "release")
        if check and (why := problem(path)):
            raise CheckpointError(why)
        return path
    newest = os.path.join(load_dir, iter_dir_name(tracked)) if tracked is not None else None
    if newest is None:
        raise CheckpointError(f"{load_dir}: no {TRACKER}: not a Megatron-LM checkpoint directory")
    if not check:
        return newest
    why = problem(newest)
    if why is None:
        return newest
    for older in _candidates(load_dir):
        if int(os.path.basename(older)[5:]) < int(tracked) and problem(older) is None:
            if rank_world()[0] == 0:  # every rank takes the same decision; one says it
                logger.warning("%s; loading the newest complete checkpoint before it, %s", why, older)
            return older
    raise CheckpointError(f"{why}, and no complete checkpoint before it in {load_dir}")


def _reader(ckpt: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(ckpt)


def read_common(ckpt: str) -> dict[str, Any]:
    """The non-tensor state (rank 0's ``common.pt``): args, iteration, scheduler, ``megatron_ext``."""
    path = os.path.join(ckpt, "common.pt")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt}: common.pt is missing (an incomplete save)") from None
    except Exception as exc:  # noqa: BLE001 - a truncated pickle raises many types
        raise CheckpointError(f"{ckpt}: common.pt is unreadable ({type(exc).__name__}: {exc})") from None


def tensor_dtypes(ckpt: str) -> dict[str, torch.dtype]:
    """Every saved tensor's key and dtype (the index only)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = _reader(ckpt).read_metadata()
    return {k: v.properties.dtype for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def tensor_shapes(ckpt: str) -> dict[str, tuple[int, ...]]:
    """Every saved tensor's key and global shape (the index only; no tensor is read)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = _reader(ckpt).read_metadata()
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


# --- saving -----------------------------------------------------------------------------------

def _stacked_sizes(payload: list[dict[str, Any]]) -> dict[str, tuple[int, ...]]:
    """The global sizes of each key's prepended axes (layers, experts): one past the largest index
    any rank holds (collective)."""
    mine: dict[str, tuple[int, ...]] = {}
    for p in payload:
        idx = tuple(int(i) + 1 for i in p["index"])
        old = mine.get(p["key"])
        mine[p["key"]] = idx if old is None else tuple(max(a, b) for a, b in zip(old, idx))
    gathered: list[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    out: dict[str, tuple[int, ...]] = {}
    for part in gathered:
        for k, v in part.items():
            out[k] = v if k not in out else tuple(max(a, b) for a, b in zip(out[k], v))
    return out


def _sharded(key: str, tensor: torch.Tensor, *, index: tuple[int, ...], offset: tuple[int, ...],
             global_shape: tuple[int, ...], stacked: tuple[int, ...], replica_id: int = 0) -> Any:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    shape = tuple(tensor.shape)
    frag = tuple(stacked) + tuple(max(1, g // max(1, n)) for g, n in zip(global_shape, shape))
    return ShardedTensor(key, tensor, tensor.dtype, shape, tuple(stacked) + tuple(global_shape),
                         tuple(index) + tuple(offset), frag, replica_id=replica_id, prepend_axis_num=len(index))


def megatron_rng() -> dict[str, Any]:
    """This process's RNG states under Megatron-LM's names (either format saves this)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


FORMER_RNG_NAMES = {"torch": "torch_rng_state", "numpy": "np_rng_state", "python": "random_rng_state",
                    "tracker": "rng_tracker_states", "cuda": "cuda_rng_state"}
"""The names megatron_ext-format checkpoints saved RNG states under before they took Megatron-LM's."""


def set_megatron_rng(state: dict[str, Any]) -> None:
    """Restore ``megatron_rng``'s states (or a former megatron_ext checkpoint's, by their names)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {FORMER_RNG_NAMES.get(k, k): v for k, v in state.items()}
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if state.get("rng_tracker_states"):  # empty from an engine without megatron's tracker
        get_cuda_rng_tracker().set_states(state["rng_tracker_states"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])


@dataclasses.dataclass(frozen=True)
class _RngSlot:
    """Where this rank's RNG states sit: megatron's ``rng_state`` object (shape, offset, replica,
    position in its list) or, without megatron's parallel state, one object per rank."""

    key: str
    shape: tuple[int, ...]
    offset: tuple[int, ...]
    replica: int
    position: int
    group: Any = None
    group_size: int = 1

    def unique_key(self) -> str:
        return f"{self.key}/shard_{'.'.join(map(str, self.offset))}_{'.'.join(map(str, self.shape))}"


def _rng_slot() -> _RngSlot:
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        pp, pps = mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size()
        tp, tps = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
        dp = mpu.get_data_parallel_rank(with_context_parallel=True)
        dps = mpu.get_data_parallel_world_size(with_context_parallel=True)
        if mpu.get_expert_model_parallel_world_size() > 1:
            return _RngSlot("rng_state", (pps, tps, dps), (pp, tp, dp), 0, 0)
        return _RngSlot("rng_state", (pps, tps), (pp, tp), dp, dp,
                        group=mpu.get_data_parallel_group(with_context_parallel=True), group_size=dps)
    rank, world = rank_world()
    return _RngSlot(OWN_RNG, (world,), (rank,), 0, 0)


def _rng_object(slot: _RngSlot) -> Any:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = megatron_rng()
    states = [state]
    if slot.group_size > 1:
        states = [None] * slot.group_size
        dist.all_gather_object(states, state, group=slot.group)
    return ShardedObject(slot.key, states, slot.shape, slot.offset, replica_id=slot.replica)


def _module_objects(model: Any) -> dict[str, Any]:
    """The non-tensor entries of megatron model chunks' ``sharded_state_dict()`` (each layer's
    ``_extra_state``): Megatron-LM saves them, and its loader expects them."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_ext.runtime.model import unwrap

    if hasattr(model, "shard_entries") or not hasattr(model, "chunks"):
        return {}  # the DeepSpeed engine's modules have no megatron extra state
    out = {}
    for i, chunk in enumerate(model.chunks):
        for k, v in unwrap(chunk).sharded_state_dict().items():
            if isinstance(v, ShardedObject):
                out[f"{i}/{k}"] = v
    return out


def megatron_args(config: dict[str, Any], *, layout: dict[str, int], world: int, padded_vocab_size: int | None,
                  iteration: int, consumed_samples: int) -> argparse.Namespace:
    """The ``args`` Megatron-LM keeps in a checkpoint: the run's flags under their Megatron-LM names
    (config keys are those names), with the layout and the values Megatron-LM derives."""
    values = {k: v for k, v in config.items() if isinstance(v, (bool, int, float, str, list, tuple, type(None)))}
    values.update(tensor_model_parallel_size=layout["tp"], pipeline_model_parallel_size=layout["pp"],
                  data_parallel_size=layout["dp"], world_size=world, iteration=iteration,
                  consumed_train_samples=consumed_samples, ckpt_format=FORMAT, use_dist_ckpt=True,
                  add_bias_linear=not config.get("disable_bias_linear", False))
    if padded_vocab_size is not None:
        values["padded_vocab_size"] = padded_vocab_size
    return argparse.Namespace(**values)


SCHEDULE_LENGTHS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")


def scheduler_in_samples(scheduler: dict[str, Any], samples_per_step: int) -> dict[str, Any]:
    """The scheduler's state as Megatron-LM saves it: lengths in samples (Megatron-LM steps its
    scheduler by the global batch); ``samples_per_step`` is the run's global batch where its own
    scheduler counts iterations, 1 where it counts samples."""
    return {k: (v * samples_per_step if k in SCHEDULE_LENGTHS and isinstance(v, (int, float)) else v)
            for k, v in scheduler.items()}


def scheduler_in_steps(scheduler: dict[str, Any], samples_per_step: int, where: str) -> dict[str, Any]:
    """The inverse of ``scheduler_in_samples`` for this run's scheduler."""
    out = {}
    for k, v in scheduler.items():
        if k in SCHEDULE_LENGTHS and isinstance(v, (int, float)) and samples_per_step > 1:
            if v % samples_per_step and k == "num_steps":
                raise CheckpointError(f"{where}: its schedule stands at {v} samples, not a whole number of this "
                                      f"run's global batches of {samples_per_step}: resume with the global batch "
                                      "size it trained with, or give --override-opt-param-scheduler")
            v = v // samples_per_step if isinstance(v, int) else v / samples_per_step
        out[k] = v
    return out


def start_save(save_dir: str, iteration: int) -> tuple[str, str]:
    """Collective, both formats: rank 0 makes ``iter_N.partial/`` afresh (a save killed before left
    one) and every rank waits for it. Returns (the final directory, the partial one)."""
    final = os.path.join(save_dir, iter_dir_name(iteration))
    partial = final + ".partial"
    if rank_world()[0] == 0:
        os.makedirs(save_dir, exist_ok=True)
        if os.path.exists(partial):
            shutil.rmtree(partial)
        os.makedirs(partial)
    if dist.is_initialized():
        dist.barrier()
    return final, partial


def save(save_dir: str, *, model: Any, optimizer: Any, state: Any, config: dict[str, Any],
         layout: dict[str, int], keep_last: int = 0, on_written: Callable[[], None] | None = None,
         flops_so_far: float = 0.0, samples_per_step: int = 1) -> str:
    """Collective: every rank calls it. Returns the checkpoint directory. ``samples_per_step``: see
    ``scheduler_in_samples``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    if not torch.cuda.is_available():
        from megatron_ext.compat import megatron_cpu

        megatron_cpu.apply_for_checkpoints()
    rank, world = rank_world()
    final, partial = start_save(save_dir, state.iteration)
    payload = collect_payload(model, optimizer)
    stacked = _stacked_sizes(payload)
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    steps: dict[str, Any] = {}
    vocab = None
    for i, p in enumerate(payload):
        geo = dict(index=tuple(p["index"]), offset=tuple(p["offset"]), global_shape=tuple(p["global_shape"]),
                   stacked=stacked[p["key"]])
        model_sd[str(i)] = _sharded(p["key"], p["tensor"], **geo)
        if p["key"] == "embedding.word_embeddings.weight":
            vocab = int(p["global_shape"][0])
        if "main" in p:
            optim_sd[f"main/{i}"] = _sharded(optimizer_key("main", p["key"]), p["main"], **geo)
        for k in OPT_KEYS:
            if k in p["optim"]:
                optim_sd[f"{k}/{i}"] = _sharded(optimizer_key(k, p["key"]), p["optim"][k], **geo)
        if p["step"] is not None:
            steps[f"{p['key']}@{','.join(map(str, p['index']))}"] = float(p["step"])
    gathered: list[Any] = [(steps, vocab)]
    if dist.is_initialized() and world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, (steps, vocab))
    all_steps = {k: v for part, _ in gathered for k, v in part.items()}
    vocab = next((v for _, v in gathered if v is not None), None)
    model_sd.update(_module_objects(model))
    sd: dict[str, Any] = {
        "model": model_sd,
        "rng_state": _rng_object(_rng_slot()),
        "args": megatron_args(config, layout=layout, world=world, padded_vocab_size=vocab,
                              iteration=state.iteration, consumed_samples=state.consumed_samples),
        "checkpoint_version": 3.0,
        "iteration": state.iteration,
        "opt_param_scheduler": scheduler_in_samples(state.scheduler, samples_per_step),
        "num_floating_point_operations_so_far": flops_so_far,
        EXT: {"version": EXT_VERSION, "consumed_samples": state.consumed_samples, "extra": state.extra,
              "layout": layout, "world_size": world, "config": config, "optimizer_steps": all_steps,
              "stacked": {k: len(v) for k, v in stacked.items()}},
    }
    if optim_sd:
        sd["optimizer"] = optim_sd
    dist_checkpointing.save(sd, partial, get_default_save_sharded_strategy(FORMAT), validate_access_integrity=True)
    if on_written is not None:
        on_written()
    mine = {f: {"bytes": os.path.getsize(os.path.join(partial, f)), "sha256": sha256_of(os.path.join(partial, f))}
            for f in sorted(os.listdir(partial)) if f.startswith(f"__{rank}_")}
    listed: list[Any] = [mine]
    if dist.is_initialized() and world > 1:
        listed = [None] * world
        dist.all_gather_object(listed, mine)
    if rank == 0:
        files = {k: v for part in listed for k, v in part.items()}
        for f in ("common.pt", "metadata.json", ".metadata"):
            path = os.path.join(partial, f)
            files[f] = {"bytes": os.path.getsize(path), "sha256": sha256_of(path)}
        write_text_atomic(os.path.join(partial, FILES), json.dumps({"files": files}, indent=1))
        fsync_dir(partial)
        if os.path.exists(final):  # re-saving the same iteration
            shutil.rmtree(final)
        os.replace(partial, final)
        fsync_dir(save_dir)
        write_text_atomic(os.path.join(save_dir, TRACKER), str(state.iteration))
        if keep_last > 0:
            done = sorted(d for d in os.listdir(save_dir) if d.startswith("iter_") and "." not in d)
            for old in done[:-keep_last]:
                shutil.rmtree(os.path.join(save_dir, old), ignore_errors=True)
        logger.info("saved checkpoint %s (torch_dist)", final)
    if dist.is_initialized():
        dist.barrier()
    return final


# --- reading ----------------------------------------------------------------------------------

def _slice_planner(wants: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]], objects: dict[str, list[Any]]) -> Any:
    """A torch.distributed.checkpoint load planner that fills ``wants`` (key -> [(global offset,
    buffer)]) from whatever chunks were saved, and unpickles the byte items ``objects`` names."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SlicePlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            self.metadata = metadata
            self.buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

        def create_local_plan(self):
            items = []
            for key, pieces in wants.items():
                md = self.metadata.state_dict_metadata[key]
                for i, (offset, buf) in enumerate(pieces):
                    chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=buf.shape)
                    for item in create_read_items_for_chunk_list(key, md, [chunk]):
                        items.append(dataclasses.replace(item, dest_index=MetadataIndex(key, torch.Size(offset), i)))
                    self.buffers[(key, tuple(offset))] = buf
            for key in objects:
                from torch.distributed.checkpoint.planner_helpers import _create_read_item_for_byteio

                items.append(_create_read_item_for_byteio(MetadataIndex(key), 0, MetadataIndex(key), 0, 0))
            return LoadPlan(items)

        def create_global_plan(self, global_plan):
            return global_plan

        def finish_plan(self, central_plan):
            return central_plan

        def load_bytes(self, read_item, value):
            value.seek(0)
            # megatron saves the data of every local object of one unique key as a list: one here
            objects[read_item.dest_index.fqn].append(torch.load(value, map_location="cpu", weights_only=False)[0])

        def resolve_tensor(self, read_item):
            buf = self.buffers[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
            for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                buf = buf.narrow(dim, start, length)
            return buf

        def commit_tensor(self, read_item, tensor):
            pass

    return SlicePlanner()


def read_slices(ckpt: str, wants: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]],
                objects: tuple[str, ...] = ()) -> dict[str, Any]:
    """Fill each buffer of ``wants`` with its slice of the saved tensor, and read the pickled
    objects ``objects`` (unique keys). No collective. Returns the objects by key."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    got: dict[str, list[Any]] = {k: [] for k in objects}
    if not wants and not objects:
        return {}
    _load_state_dict({}, _reader(ckpt), planner=_slice_planner(wants, got), no_dist=True)
    return {k: v[0] if v else None for k, v in got.items()}


def _check_shapes(ckpt: str, entries: list[ShardEntry], shapes: dict[str, tuple[int, ...]]) -> None:
    for e in entries:
        saved = shapes.get(e.key)
        n = len(e.index)
        if saved is None:
            raise CheckpointError(f"{ckpt}: no tensor {e.key} in the checkpoint (a model of another shape or "
                                  "kind saved it?)")
        if tuple(saved[n:]) != tuple(e.global_shape) or len(saved) != n + len(e.global_shape):
            raise CheckpointError(f"{ckpt}: {e.key} has shape {list(saved[n:])} in the checkpoint, "
                                  f"{list(e.global_shape)} in this model")
        for axis, (i, size) in enumerate(zip(e.index, saved[:n])):
            if i >= size:
                what = "layers" if axis == 0 else "experts"
                raise CheckpointError(f"{ckpt}: {e.key} holds {size} {what} in the checkpoint; this model needs "
                                      f"index {i} (more {what} than the saved run)")


def optimizer_state_in(ckpt: str, shapes: dict[str, tuple[int, ...]], common: dict[str, Any],
                       entries: list[ShardEntry]) -> str | None:
    """None where the checkpoint holds this run's optimizer state for every entry, else why not."""
    if not common.get(EXT, {}).get("optimizer_steps"):
        if any(k.startswith("optimizer.distributed.") for k in shapes):
            return ("it holds megatron's distributed-optimizer state (its dp_reshardable buffers), which this run's "
                    "optimizer does not read")
        return "it holds no optimizer state this run reads (no step counts)"
    missing = [e.key for e in entries if not all(optimizer_key(k, e.key) in shapes for k in OPT_KEYS)]
    if missing:
        return f"it holds no Adam moments for {missing[0]}"
    return None


def assemble(ckpt: str, entries: list[ShardEntry], *, with_optim: bool, common: dict[str, Any] | None = None,
             shapes: dict[str, tuple[int, ...]] | None = None) -> tuple[list[tuple], dict[str, Any]]:
    """Read every entry's slice (and its optimizer state) from ``ckpt``: ``(staged for
    reshard.apply, common state)``. Touches no model. ``common`` / ``shapes``: already read."""
    common = read_common(ckpt) if common is None else common
    shapes = tensor_shapes(ckpt) if shapes is None else shapes
    dtypes = tensor_dtypes(ckpt)
    _check_shapes(ckpt, entries, shapes)
    steps = common.get(EXT, {}).get("optimizer_steps", {})
    wants: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
    rows = []
    for e in entries:
        at = tuple(e.index) + tuple(e.offset)
        local = (1,) * len(e.index) + tuple(e.shape)
        has_main = optimizer_key("main", e.key) in shapes
        main = torch.empty(local, dtype=torch.float32)
        value = None
        if has_main:
            wants.setdefault(optimizer_key("main", e.key), []).append((at, main))
        else:  # no master saved (an fp32 run, or Megatron-LM's model only): the weight is the master
            value = torch.empty(local, dtype=dtypes.get(e.key, torch.float32))
            wants.setdefault(e.key, []).append((at, value))
        optim = {}
        if with_optim:
            for k in OPT_KEYS:
                optim[k] = torch.empty(local, dtype=torch.float32)
                wants.setdefault(optimizer_key(k, e.key), []).append((at, optim[k]))
        rows.append((e, main, value, optim))
    read_slices(ckpt, wants)
    staged = []
    for e, main, value, optim in rows:
        master = (main if value is None else value).reshape(e.shape).float()
        state: dict[str, Any] = {"main": master}
        if with_optim:
            step = steps.get(f"{e.key}@{','.join(map(str, e.index))}")
            if step is None:
                raise CheckpointError(f"{ckpt}: no optimizer step count for {e.key}")
            state.update({k: t.reshape(e.shape) for k, t in optim.items()}, step=step)
        staged.append((e, master.to(e.param.dtype), state))
    return staged, common


def stacked_axes(common: dict[str, Any], keys: Any = ()) -> dict[str, int]:
    """How many leading axes of each saved tensor stack layers (and experts): as saved by us, else
    by megatron's naming (a ``decoder.layers.`` key stacks its layers, an expert's also its experts)."""
    ext = common.get(EXT)
    if ext and "stacked" in ext:
        return dict(ext["stacked"])
    return {k: (k.startswith("decoder.layers.") + (".experts." in k)) for k in keys}


def saved_layout(common: dict[str, Any]) -> dict[str, int] | None:
    ext = common.get(EXT)
    if ext:
        return dict(ext["layout"])
    args = common.get("args")
    if args is None:
        return None
    return {"tp": getattr(args, "tensor_model_parallel_size", 1), "pp": getattr(args, "pipeline_model_parallel_size", 1),
            "dp": getattr(args, "data_parallel_size", 0) or 0,
            "vpp": getattr(args, "virtual_pipeline_model_parallel_size", None) or 1}


def load(load_dir: str, *, model: Any, optimizer: Any, layout: dict[str, int], load_optim: bool = True,
         load_rng: bool = True, step: int | None = None, samples_per_step: int = 1) -> Any:
    """Read this rank's slices (and, when asked and present, optimizer state and RNG), then copy them
    into model and optimizer."""
    rank, world = rank_world()
    ckpt = resolve(load_dir, step=step)
    entries = local_entries(model, main_only=False)
    common, shapes = read_common(ckpt), tensor_shapes(ckpt)
    why_fresh = optimizer_state_in(ckpt, shapes, common, entries) if load_optim else None
    if why_fresh and rank == 0:
        logger.warning("%s: the optimizer starts fresh: %s", ckpt, why_fresh)
    staged, common = assemble(ckpt, entries, with_optim=load_optim and why_fresh is None, common=common,
                              shapes=shapes)
    saved = saved_layout(common)
    same = saved is not None and saved == layout and common.get(EXT, {}).get("world_size", world) == world
    rng = None
    if load_rng and same:
        slot = _rng_slot()
        # Saved under the same grid by the same kind of engine (megatron's rng_state object, or one
        # per rank where megatron's parallel state was not set up), else not restored.
        if slot.unique_key() in _reader(ckpt).read_metadata().state_dict_metadata:
            got = read_slices(ckpt, {}, (slot.unique_key(),)).get(slot.unique_key())
            if got is not None and len(got) > slot.position:
                rng = got[slot.position]
        same = rng is not None
    apply(staged, optimizer, load_optim=load_optim and why_fresh is None)
    if rng is not None:
        set_megatron_rng(rng)
    elif load_rng and not same and rank == 0:
        logger.info("layout or engine changed (%s -> %s): RNG states not restored", saved, layout)
    ext = common.get(EXT, {})
    args = common.get("args")
    consumed = ext.get("consumed_samples", getattr(args, "consumed_train_samples", 0))
    return TrainState(iteration=int(common.get("iteration", 0)), consumed_samples=int(consumed),
                      scheduler=scheduler_in_steps(common.get("opt_param_scheduler") or {}, samples_per_step, ckpt),
                      extra=ext.get("extra", {}))


def embedding_rows(load_dir: str) -> int | None:
    try:
        shapes = tensor_shapes(resolve(load_dir, check=False))
    except (CheckpointError, OSError, ValueError):
        return None
    shape = shapes.get("embedding.word_embeddings.weight")
    return int(shape[0]) if shape else None


def config_of(ckpt: str) -> dict[str, Any]:
    """The saving run's flags: ours where we saved it, else Megatron-LM's args."""
    common = read_common(ckpt)
    if EXT in common:
        return dict(common[EXT]["config"])
    args = common.get("args")
    return dict(vars(args)) if args is not None else {}

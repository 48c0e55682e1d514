"""One run per output directory: a new run never mixes with, or overwrites, an earlier one.

A run writes checkpoints (``--save``), metrics lines (``--metrics-file``) and TensorBoard events
(``--tensorboard-dir``). When any of them already holds a run, the new run is refused with what to
do, unless it resumes (``--load``): then the metrics lines and TensorBoard events written after the
resumed checkpoint (by a run that crashed later) are dropped, so the resumed curve continues the
saved one without duplicates.
"""
from __future__ import annotations

import glob
import json
import logging
import os
from typing import Any

from megatron_ext.config.base import ConfigError

logger = logging.getLogger(__name__)


def _same(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _checkpoint_in(save_dir: str) -> str | None:
    """Name of the latest checkpoint in ``save_dir``, or None when it holds none."""
    for tracker in ("latest", "latest_checkpointed_iteration.txt"):
        path = os.path.join(save_dir, tracker)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                name = fh.read().strip() or tracker
            # Megatron-LM's tracker holds the iteration: name its directory
            return f"iter_{int(name):07d}" if name.isdigit() else name
    done = sorted(d for d in os.listdir(save_dir) if d.startswith("iter_") and not d.endswith(".partial")) \
        if os.path.isdir(save_dir) else []
    return done[-1] if done else None


def _format_in(save_dir: str) -> str | None:
    if os.path.isfile(os.path.join(save_dir, "latest_checkpointed_iteration.txt")):
        return "torch_dist"
    latest = os.path.join(save_dir, "latest")
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8") as fh:
            return "deepspeed" if fh.read().strip().startswith("global_step") else "megatron_ext"
    return None


def fresh_start(*, save: str | None, load: str | None) -> bool:
    """Megatron-LM's first launch of a requeue-able job: ``--save X --load X`` with no checkpoint in
    ``X`` yet (or no ``X`` at all) starts from scratch instead of failing; every later launch of the
    same line resumes. A ``--load`` other than ``--save`` must hold a checkpoint."""
    return load is not None and save is not None and _same(load, save) and (
        not os.path.isdir(load) or _checkpoint_in(load) is None)


def check_outputs(*, save: str | None, load: str | None, metrics_file: str | None,
                  tensorboard_dir: str | None, clean_hint: str = "", ckpt_format: str | None = None) -> None:
    """Refuse a new (not resuming) run whose outputs already hold a run, and a --save that holds
    checkpoints of another format than --ckpt-format. Raises ConfigError."""
    hint = f", or remove it{clean_hint}" if clean_hint else ", or remove it"
    if save is not None and ckpt_format is not None and os.path.isdir(save):
        held = _format_in(save)
        # torch_dist may follow megatron_ext checkpoints (an import, an older run): its tracker wins on load
        # torch_dist is also the default of a DeepSpeed run whose ZeRO optimizer writes DeepSpeed's format
        if held is not None and held != ckpt_format and not (held in ("megatron_ext", "deepspeed")
                                                             and ckpt_format == "torch_dist"):
            raise ConfigError(f"--save {save} holds {held} checkpoints and this run writes --ckpt-format {ckpt_format}: "
                              f"give --ckpt-format {held} to keep one format there, or save elsewhere")
    if save is not None:
        name = _checkpoint_in(save)
        if name is not None and (load is None or not _same(load, save)):
            raise ConfigError(f"--save {save} already holds a run (checkpoint {name}): resume it with "
                              f"--load {save}, save elsewhere{hint}")
    if load is not None:
        # A resume continues its metrics and events (trimmed to the checkpoint in setup); so does a
        # fresh start of --save X --load X (trimmed to nothing: a launch before any save).
        return
    if metrics_file is not None and os.path.isfile(metrics_file) and os.path.getsize(metrics_file) > 0:
        raise ConfigError(f"--metrics-file {metrics_file} already holds another run's metrics: resume that run "
                          f"with --load, write elsewhere{hint}")
    if tensorboard_dir is not None and glob.glob(os.path.join(tensorboard_dir, "events.out.tfevents.*")):
        raise ConfigError(f"--tensorboard-dir {tensorboard_dir} already holds another run's events: resume that "
                          f"run with --load, write elsewhere{hint}")


def truncate_metrics(path: str, iteration: int, kinds: tuple[str, ...] | None = None) -> int:
    """Keep the rows of ``path`` up to ``iteration`` (what the resumed checkpoint had seen); drop
    later rows (only those of ``kinds`` when given) and a torn last line. Atomic: a crash here
    leaves the old file. Returns rows dropped."""
    if not os.path.isfile(path):
        return 0
    kept: list[str] = []
    dropped = 0
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                row: dict[str, Any] = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1
                continue
            if int(row.get("iteration", 0)) <= iteration or (kinds is not None and row.get("kind") not in kinds):
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(kept)
        os.replace(tmp, path)
        logger.info("%s: dropped %d rows written after iteration %d (resuming from there)", path, dropped, iteration)
    return dropped

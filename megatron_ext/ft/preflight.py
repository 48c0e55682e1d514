"""What the fault-tolerance core refuses before any rank starts (one line, exit 2).

``--ft-on-stop continue`` needs a store that outlives every rank, optimizer state that has a
copy outside the lost rank, and a backend whose collectives a survivor can be freed from;
``--ft-respawn`` needs a launcher that can start a process again. Each refusal says what to do
instead.
"""
from __future__ import annotations

import os
from typing import Any

from megatron_ext.compat.devices import resolve_backend, resolve_device
from megatron_ext.config.base import ConfigError
from megatron_ext.ft.store import STORE_ENV

LAUNCHER_ENV = "MEGATRON_EXT_LAUNCHER"
"""Set to 1 by the project's launcher (``ft/launch.py``) in every rank it starts."""

STORE_NEEDED = (
    "--ft-on-stop continue needs a rendezvous store that outlives every rank: start the job with "
    "`python pretrain_gpt.py --nproc-per-node N ...` (its launcher hosts the store), or host one with "
    "`python -m megatron_ext.ft.store` and export its MEGATRON_EXT_STORE=host:port line to every "
    "rank (e.g. under srun); torchrun's agent stops every rank when one dies, and its store lives in rank 0")

NCCL_UNTRIED = (
    "--ft-on-stop continue on NCCL frees a survivor with the process group's abort, which has not run on a "
    "machine with two GPUs yet (make gpu-check has the section): add --ft-continue-experimental-nccl to try "
    "it, use --distributed-backend gloo, or --ft-on-stop abort and resume with --load")


def check(cfg: Any, world_size: int, *, launcher: bool) -> None:
    """Refuse ``continue`` and ``--ft-respawn`` where they cannot work. ``launcher``: the ranks
    are about to be started by ``pretrain_gpt.py --nproc-per-node``, which hosts the store."""
    from megatron_ext.ft.config import section_of

    ft = section_of(cfg)
    launcher = launcher or os.environ.get(LAUNCHER_ENV) == "1"
    if ft.ft_respawn and ft.ft_on_stop != "continue":
        raise ConfigError("--ft-respawn needs --ft-on-stop continue (a replacement joins a job that went on "
                          "without the lost rank)")
    if ft.ft_on_stop != "continue":
        return
    if cfg.parallel.use_distributed_optimizer:
        raise ConfigError("--ft-on-stop continue cannot be used with --use-distributed-optimizer: its optimizer "
                          "state is sharded over the data-parallel ranks, so a lost rank's part has no copy in "
                          "memory; drop the flag, or use --ft-on-stop abort and resume with --load")
    par = cfg.parallel
    nccl = resolve_backend(par.distributed_backend, resolve_device(par.device)) == "nccl"
    if nccl and not ft.ft_continue_experimental_nccl:
        raise ConfigError(NCCL_UNTRIED)
    if world_size > 1 and not launcher and not os.environ.get(STORE_ENV):
        raise ConfigError(STORE_NEEDED)
    if ft.ft_respawn and not launcher:
        raise ConfigError("--ft-respawn needs the project's launcher (python pretrain_gpt.py --nproc-per-node N): "
                          "under srun or torchrun nothing starts a lost rank's process again")

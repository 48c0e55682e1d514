"""Start N ranks of a script directly, as srun does (no torchrun agent in between).

Used where the launcher must not react to a dying worker by itself — fail-stop tests and the live
detector benchmark — and handy for quick local runs. Rank 0 hosts the rendezvous store.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

from megatron_ext.runtime.distributed import free_port


@dataclasses.dataclass
class RankResult:
    rank: int
    returncode: int
    output: str


def launch_ranks(script_args: list[str], nproc: int, *, cwd: str | None = None, env: dict[str, str] | None = None,
                 timeout_s: float = 900.0) -> list[RankResult]:
    port = str(free_port())
    procs = []
    for rank in range(nproc):
        rank_env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **(env or {}),
                    "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen([sys.executable, *script_args], cwd=cwd, env=rank_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    try:
        for rank, p in enumerate(procs):
            out, _ = p.communicate(timeout=timeout_s)
            results.append(RankResult(rank, p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results

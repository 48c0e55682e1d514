"""Shared test setup: one corpus/index cache per test session, and the torchrun launcher."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _one_thread():
    # One intra-op thread per test process: deterministic, and on a shared box with few cores two
    # threads make small models 20-100x slower (OpenMP workers spin while other processes hold
    # the cores). Ranks the tests launch get OMP_NUM_THREADS=1 for the same reason.
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    # Respect a cache the caller set up (CI keeps one across steps); else one per session.
    if "MEGATRON_EXT_CACHE" not in os.environ:
        os.environ["MEGATRON_EXT_CACHE"] = str(tmp_path_factory.mktemp("megatron_ext_cache"))
    yield


def _child_env(extra: dict) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **extra}
    # An in-process single-rank test (tests/runtime/test_checkpoint.py) leaves the MASTER_ADDR/PORT
    # it picked in os.environ, and its store may still hold that port: a child picks its own.
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if key not in extra:
            env.pop(key, None)
    return env


def run_torchrun(script: str, *args: str, nproc: int = 4, timeout: int = 900, env: dict | None = None
                 ) -> subprocess.CompletedProcess:
    """Launch ``script`` on ``nproc`` gloo ranks; fails the test with the output tail on error.

    Through tests/warm_run.py: torch's elastic agent forks the ranks after the imports they would
    each repeat (same rendezvous, same environment per rank as torchrun); with
    MEGATRON_EXT_TEST_TORCHRUN=1, plain ``python -m torch.distributed.run --standalone``."""
    if os.environ.get("MEGATRON_EXT_TEST_TORCHRUN") == "1":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               script, *args]
    else:
        cmd = [sys.executable, os.path.join("tests", "warm_run.py"), str(nproc), script, *args]
    full_env = _child_env({"OMP_NUM_THREADS": "1", **(env or {})})
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return proc


def run_python(*args: str, timeout: int = 600, env: dict | None = None, check: bool = True
               ) -> subprocess.CompletedProcess:
    full_env = _child_env(env or {})
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        pytest.fail(f"python {' '.join(args)} exited {proc.returncode}:\n{tail}")
    return proc


_CPU_LOG = os.environ.get("MEGATRON_EXT_TEST_CPU_LOG")


if _CPU_LOG:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        """With MEGATRON_EXT_TEST_CPU_LOG=FILE: one line per test -- its id, the CPU seconds of the
        processes it started (ranks, launchers) and of the test process, and wall seconds, set-up
        and tear-down included (where the suite's time goes, not just its wall time)."""
        import resource
        import time

        def cpu(who):
            r = resource.getrusage(who)
            return r.ru_utime + r.ru_stime

        c0, s0, t0 = cpu(resource.RUSAGE_CHILDREN), cpu(resource.RUSAGE_SELF), time.monotonic()
        yield
        with open(_CPU_LOG, "a", encoding="utf-8") as fh:
            fh.write(f"{item.nodeid}\t{cpu(resource.RUSAGE_CHILDREN) - c0:.1f}\t{cpu(resource.RUSAGE_SELF) - s0:.1f}\t"
                     f"{time.monotonic() - t0:.1f}\n")

"""Shared test setup: one corpus/index cache per test session, and the torchrun launcher."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

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


FORKED = os.path.join("tests", "forked.py")
_forked_cpu = [0.0]
"""CPU seconds of the forked launches so far (their parent is the zygote: this process's
RUSAGE_CHILDREN misses them); read by the MEGATRON_EXT_TEST_CPU_LOG hook."""


def _reaped_cpu(pid: int) -> float:
    """CPU seconds of the children ``pid`` has waited for (cutime + cstime of /proc/PID/stat): a
    forked launch's, ranks included, once the zygote has reaped it."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def launch_python(argv: list[str], env: dict, timeout: float, merge: bool) -> subprocess.CompletedProcess:
    """``python ARGV`` in the repository root: a fork of this test process's preloaded zygote
    (megatron_ext/ft/zygote.py: torch and megatron-core imported once per test process instead of
    once per launch, some 7 CPU-seconds each) through tests/forked.py, else a new interpreter
    (MEGATRON_EXT_LAUNCH_START=spawn, or the zygote cannot fork). ``merge``: stderr goes with stdout
    (the result's stderr is empty), as the launches' readers take them together. A launch that
    runs past ``timeout`` is killed with every process it started, and TimeoutExpired raised."""
    cmd = [sys.executable, *argv]

    def spawned() -> subprocess.CompletedProcess:
        with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, process_group=0,
                              stderr=subprocess.STDOUT if merge else subprocess.PIPE) as p:
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)      # its own group, as a forked launch's
                out, err = p.communicate()
                raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
        return subprocess.CompletedProcess(cmd, p.returncode, out, err or "")

    from megatron_ext.ft import zygote as zg

    z = zg.zygote_for(env)
    if z is None:
        return spawned()
    with tempfile.TemporaryDirectory(prefix="megatron-ext-test-") as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        cpu0 = _reaped_cpu(z.proc.pid)
        try:
            child = z.start([FORKED, "-" if merge else err, *argv], env=env, cwd=ROOT, out=out)
        except RuntimeError:  # the zygote cannot fork (it says why): a new interpreter instead
            return spawned()

        def read(path: str) -> str:
            if not os.path.exists(path):
                return ""
            with open(path, encoding="utf-8", errors="replace") as fh:
                return fh.read()

        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(child.pid, signal.SIGKILL)  # its own group (tests/forked.py), ranks included
            except ProcessLookupError:
                child.kill()                          # killed before it made the group
            child.wait(60)
            raise subprocess.TimeoutExpired(cmd, timeout, output=read(out), stderr=read(err)) from None
        finally:
            _forked_cpu[0] += _reaped_cpu(z.proc.pid) - cpu0
        return subprocess.CompletedProcess(cmd, code, read(out), "" if merge else read(err))


def run_torchrun(script: str, *args: str, nproc: int = 4, timeout: int = 900, env: dict | None = None
                 ) -> subprocess.CompletedProcess:
    """Launch ``script`` on ``nproc`` gloo ranks; fails the test with the output tail on error.
    The output is the result's ``stdout``, stderr included (``stderr`` is empty).

    Through tests/warm_run.py: torch's elastic agent forks the ranks after the imports they would
    each repeat (same rendezvous, same environment per rank as torchrun), and the agent's process is
    itself a fork of this test process's zygote (``launch_python``); with MEGATRON_EXT_TEST_TORCHRUN=1, plain
    ``python -m torch.distributed.run --standalone``."""
    if os.environ.get("MEGATRON_EXT_TEST_TORCHRUN") == "1":
        argv = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]
    else:
        argv = [os.path.join("tests", "warm_run.py"), str(nproc), script, *args]
    proc = launch_python(argv, _child_env({"OMP_NUM_THREADS": "1", **(env or {})}), timeout, merge=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-60:])
        pytest.fail(f"{' '.join(proc.args)} exited {proc.returncode}:\n{tail}")
    return proc


def run_python(*args: str, timeout: int = 600, env: dict | None = None, check: bool = True
               ) -> subprocess.CompletedProcess:
    """``python ARGS`` in the repository root (a fork of this test process's zygote: ``launch_python``), stdout
    and stderr apart; with ``check``, a non-zero exit fails the test with the output tail."""
    proc = launch_python(list(args), _child_env(env or {}), timeout, merge=False)
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

        c0, s0, t0 = cpu(resource.RUSAGE_CHILDREN) + _forked_cpu[0], cpu(resource.RUSAGE_SELF), time.monotonic()
        yield
        with open(_CPU_LOG, "a", encoding="utf-8") as fh:
            fh.write(f"{item.nodeid}\t{cpu(resource.RUSAGE_CHILDREN) + _forked_cpu[0] - c0:.1f}\t{cpu(resource.RUSAGE_SELF) - s0:.1f}\t"
                     f"{time.monotonic() - t0:.1f}\n")


class FakeTime:
    """A stand-in for a module's ``time`` (``monkeypatch.setattr(module, "time", FakeTime())``):
    ``perf_counter`` returns ``now``, which moves only when the test moves it; ``sleep`` records
    what it was asked to hold and returns at once."""

    def __init__(self, now: float = 0.0) -> None:
        self.now, self.slept = now, []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)

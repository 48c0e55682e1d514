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


# What differs between launches and tests but not in what a preloaded module computed at import:
# left out of a zygote's key (each forked child still gets its whole environment). pytest sets
# PYTEST_CURRENT_TEST anew for every test; keyed on it, every test would start its own zygote.
_NOT_KEYED = ("PYTEST_CURRENT_TEST", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT")
_MAX_ZYGOTES = 2
"""Zygotes kept at once per test process (each holds torch and megatron-core, some 0.4 GB): the
least recently used one beyond this is closed."""
FORKED = os.path.join("tests", "forked.py")
_zygotes: dict[tuple, object] = {}
_forked_cpu = [0.0]
"""CPU seconds of the forked launches so far (their parent is the zygote: this process's
RUSAGE_CHILDREN misses them); read by the MEGATRON_EXT_TEST_CPU_LOG hook."""


def _zygote(env: dict):
    """This test process's zygote for ``env`` (megatron_ext/ft/zygote.py), started on first use;
    None with MEGATRON_EXT_LAUNCH_START=spawn."""
    from megatron_ext.ft import zygote as zg

    if os.environ.get(zg.START_ENV, "fork") == "spawn":
        return None
    key = tuple(sorted((k, v) for k, v in env.items() if k not in _NOT_KEYED))
    z = _zygotes.pop(key, None)
    if z is None or not z.alive():
        z = zg.Zygote({k: v for k, v in env.items() if k not in _NOT_KEYED})
    _zygotes[key] = z                       # the most recently used last
    while len(_zygotes) > _MAX_ZYGOTES:
        _zygotes.pop(next(iter(_zygotes))).close()
    return z


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
        if merge:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=timeout)
            return subprocess.CompletedProcess(cmd, proc.returncode, proc.stdout, "")
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)

    z = _zygote(env)
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
    itself a fork of the session's zygote (``launch_python``); with MEGATRON_EXT_TEST_TORCHRUN=1, plain
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
    """``python ARGS`` in the repository root (a fork of the session's zygote: ``launch_python``), stdout
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

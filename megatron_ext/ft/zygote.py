"""A preloaded parent for rank processes: torch and megatron-core are imported once, and each rank
is a fork of that process instead of a fresh interpreter.

A rank's Python start (torch, megatron-core, torch._dynamo, the project's runtime) costs about 3 s
of CPU on this project's CPU hosts, and ``ft/launch.py`` starts every rank of a job, and again each
respawned one. The zygote pays that once per launcher and environment; a fork then costs tens of
milliseconds. It is the idea of multiprocessing's ``forkserver``, with what a rank needs of a real
interpreter start: the script run as ``__main__`` with its own ``sys.argv``, ``sys.path[0]``,
working directory and environment, its stdout and stderr where the launcher wants them, its exit
code as ``Popen`` would report it (negative: the signal that killed it), and the interpreter's exit
steps (non-daemon threads joined, ``atexit`` handlers run, streams flushed).

Safe to fork: after its imports the zygote has one thread (checked: it refuses to fork otherwise)
and it never touches an accelerator or a process group. What a fork shares that a fresh start would
not: modules already imported (their import-time state was computed under the zygote's environment,
which is the ranks' minus the per-rank variables: ``launch.py`` keeps one zygote per such
environment) and numpy's global random state (the project seeds every generator it uses; Python's
``random`` reseeds itself in a forked child).

``MEGATRON_EXT_LAUNCH_START=spawn`` turns it off (every rank a fresh ``python``); arguments that are
not a script path or ``-c CODE`` always spawn.

Protocol (one JSON object per line): the launcher writes ``{"id", "argv", "env", "cwd", "out"}`` on
the zygote's stdin; the zygote answers ``{"id", "pid"}`` (or ``{"id", "error"}``) on the reply pipe,
then ``{"exit": pid, "code": c}`` when that child ends. End of stdin ends the zygote.
"""
from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import traceback

START_ENV = "MEGATRON_EXT_LAUNCH_START"
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "numpy", "megatron.core", "megatron.core.parallel_state",
           "megatron.core.tensor_parallel", "megatron.core.models.gpt", "megatron.core.pipeline_parallel",
           "megatron.core.optimizer", "megatron.core.distributed", "megatron_ext.config.run",
           "megatron_ext.runtime.loop", "megatron_ext.ft.core", "megatron_ext.engines")
"""What a rank of ``pretrain_gpt.py`` imports that costs (``python -X importtime``); a module that
fails to import is left to the rank, which then reports it as it would have."""


def forkable(argv: list[str]) -> bool:
    """Whether a rank with these interpreter arguments can be a fork: a script path, or ``-c CODE``."""
    if not argv:
        return False
    if argv[0] == "-c":
        return len(argv) >= 2
    return not argv[0].startswith("-") and argv[0].endswith(".py")


# ---------------------------------------------------------------------------- the zygote's side

def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _run_child(req: dict) -> None:
    """In the forked child: become the rank, run it, exit as an interpreter would. Never returns."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(req["env"])
        if req.get("cwd"):
            os.chdir(req["cwd"])
        if req.get("out"):
            fd = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
        if req["env"].get("PYTHONUNBUFFERED"):
            sys.stdout.reconfigure(write_through=True)
        argv = list(req["argv"])
        if argv[0] == "-c":
            sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
            code_obj, path = compile(argv[1], "<string>", "exec"), None
        else:
            path = os.path.abspath(argv[0])
            sys.argv, sys.path[0] = argv, os.path.dirname(path)
        import __main__
        main = vars(__main__)
        main.clear()
        main.update({"__name__": "__main__", "__builtins__": __builtins__, "__doc__": None, "__package__": None,
                     "__spec__": None, "__loader__": None, "__cached__": None})
        try:
            if path is None:
                exec(code_obj, main)
            else:
                main["__file__"] = path
                with open(path, "rb") as f:
                    source = f.read()
                exec(compile(source, path, "exec"), main)
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            traceback.print_exc()
            code = 128 + signal.SIGINT
        except BaseException:
            traceback.print_exc()
            code = 1
        # What the interpreter does at its end: wait for non-daemon threads, run atexit handlers.
        try:
            threading._shutdown()
        except BaseException:
            traceback.print_exc()
        atexit._run_exitfuncs()
    except BaseException:
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code & 0xFF if code >= 0 else 1)


def serve(reply_fd: int) -> None:
    """The zygote's loop: preload, then fork a child per request and report each child's exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the launcher decides; Ctrl-C reaches the ranks
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:
            pass
    reply = os.fdopen(reply_fd, "w", buffering=1)
    stdin = sys.stdin.buffer
    children: set[int] = set()
    pending = b""
    open_ = True

    def say(obj: dict) -> None:
        reply.write(json.dumps(obj) + "\n")

    while open_ or children:
        if open_:
            ready, _, _ = select.select([stdin], [], [], 0.05)
            if ready:
                chunk = os.read(stdin.fileno(), 1 << 16)
                if not chunk:
                    open_ = False
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    req = json.loads(line)
                    if threading.active_count() > 1 or len(os.listdir("/proc/self/task")) > 1:
                        say({"id": req["id"], "error": "the zygote has more than one thread; not forking"})
                        continue
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        reply.close()
                        null = os.open(os.devnull, os.O_RDONLY)   # stdin: not the zygote's control pipe
                        os.dup2(null, 0)
                        os.close(null)
                        _run_child(req)
                    children.add(pid)
                    say({"id": req["id"], "pid": pid})
        else:
            select.select([], [], [], 0.05)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            say({"exit": pid, "code": _exit_code(status)})


# ---------------------------------------------------------------------------- the launcher's side

class ForkedRank:
    """A rank forked by a zygote, with the part of ``subprocess.Popen``'s interface the launcher
    uses (``pid``, ``poll``, ``wait``, ``communicate``, ``terminate``, ``kill``, ``returncode``); its output, when
    captured, is in the file ``out``."""

    def __init__(self, pid: int, out: str | None):
        self.pid, self.out, self.returncode = pid, out, None
        self._done = threading.Event()

    def _ended(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout)
        return self.returncode

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def _signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def communicate(self) -> tuple[str | None, None]:
        """As ``Popen.communicate``: wait for the end, then the captured output (None when not
        captured)."""
        self.wait()
        return (self.output() if self.out is not None else None), None

    def output(self) -> str:
        if self.out is None:
            return ""
        with open(self.out, errors="replace") as f:
            return f.read()


class Zygote:
    """The launcher's handle on one zygote process. Thread-safe: launches on several threads share it."""

    def __init__(self, env: dict[str, str]):
        r, w = os.pipe()
        # Not ``-m megatron_ext.ft.zygote``: a forked rank replaces ``__main__``'s namespace, which
        # must then not be this module's.
        self.proc = subprocess.Popen([sys.executable, "-c", "from megatron_ext.ft.zygote import main; main()",
                                      "--reply-fd", str(w)],
                                     stdin=subprocess.PIPE, env=env, pass_fds=(w,))
        os.close(w)
        self._replies = os.fdopen(r, "r")
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: dict[int, list] = {}      # request id -> [event, reply]
        self._ranks: dict[int, ForkedRank] = {}
        self._early: dict[int, int] = {}          # exits reported before their pid reply was read
        self._reader = threading.Thread(target=self._read, daemon=True, name="zygote-replies")
        self._reader.start()

    def _read(self) -> None:
        for line in self._replies:
            msg = json.loads(line)
            with self._lock:
                if "exit" in msg:
                    rank = self._ranks.pop(msg["exit"], None)
                    if rank is None:
                        self._early[msg["exit"]] = msg["code"]
                    else:
                        rank._ended(msg["code"])
                    continue
                slot = self._waiting.pop(msg["id"], None)
            if slot is not None:
                slot[1] = msg
                slot[0].set()
        # The zygote is gone: every rank it still owed an exit code is reported lost.
        with self._lock:
            ranks, self._ranks = list(self._ranks.values()), {}
            slots, self._waiting = list(self._waiting.values()), {}
        for rank in ranks:
            rank._ended(-signal.SIGKILL)
        for slot in slots:
            slot[1] = {"error": "the zygote ended"}
            slot[0].set()

    def alive(self) -> bool:
        return self.proc.poll() is None and self._reader.is_alive()

    def start(self, argv: list[str], env: dict[str, str], cwd: str | None, out: str | None,
              timeout_s: float = 120.0) -> ForkedRank:
        """Fork one rank. Raises ``RuntimeError`` when the zygote cannot (the caller spawns instead)."""
        event = threading.Event()
        with self._lock:
            rid, self._next = self._next, self._next + 1
            slot = self._waiting[rid] = [event, None]
            try:
                self.proc.stdin.write((json.dumps({"id": rid, "argv": argv, "env": env, "cwd": cwd, "out": out})
                                       + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError) as e:
                self._waiting.pop(rid, None)
                raise RuntimeError(f"the zygote is gone ({e})") from e
        if not event.wait(timeout_s):
            raise RuntimeError(f"the zygote did not answer within {timeout_s:.0f} s")
        msg = slot[1]
        if "pid" not in msg:
            raise RuntimeError(msg.get("error", "no pid"))
        rank = ForkedRank(msg["pid"], out)
        with self._lock:
            early = self._early.pop(rank.pid, None)
            if early is None:
                self._ranks[rank.pid] = rank
        if early is not None:
            rank._ended(early)
        return rank

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass


NOT_KEYED = ("PYTEST_CURRENT_TEST", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT")
"""Variables that differ between launches (or, under pytest, between tests) but not in what a
preloaded module computes at import: left out of a zygote's environment and key (each forked child
still gets its whole environment). Keyed on PYTEST_CURRENT_TEST, every test would start a zygote."""
MAX_ZYGOTES = 2
"""Zygotes kept at once per process (each holds torch and megatron-core, some 0.4 GB): starting one
more closes the least recently used (it ends once its last child has)."""
_zygotes: dict[tuple, Zygote] = {}
_zygotes_lock = threading.Lock()


def zygote_for(env: dict[str, str]) -> Zygote | None:
    """This process's zygote for ``env`` less ``NOT_KEYED``, started on first use; None when turned
    off (``MEGATRON_EXT_LAUNCH_START=spawn``)."""
    if os.environ.get(START_ENV, "fork") == "spawn":
        return None
    kept = {k: v for k, v in env.items() if k not in NOT_KEYED}
    key = tuple(sorted(kept.items()))
    with _zygotes_lock:
        z = _zygotes.pop(key, None)
        if z is None or not z.alive():
            z = Zygote(kept)
        _zygotes[key] = z                       # the most recently used last
        while len(_zygotes) > MAX_ZYGOTES:
            _zygotes.pop(next(iter(_zygotes))).close()
        return z


@atexit.register
def _close_all() -> None:
    for z in list(_zygotes.values()):
        z.close()


def main() -> None:
    ap = argparse.ArgumentParser(description="the rank-process zygote of megatron_ext.ft.launch (not for direct use)")
    ap.add_argument("--reply-fd", type=int, required=True)
    serve(ap.parse_args().reply_fd)


if __name__ == "__main__":
    main()

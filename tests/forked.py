"""``python ARGV...`` as run by the tests' launch helpers (tests/conftest.py ``run_python``,
``run_torchrun``) in a process forked from a preloaded zygote (``megatron_ext/ft/zygote.py``):

    python tests/forked.py ERR_FILE ARGV...

ARGV is what would follow ``python``: a script path, ``-c CODE`` or ``-m MODULE``, then its
arguments. Around it, what a fresh interpreter gives the test and a fork would not by itself:

- its own process group (``os.setpgid``; the session stays the test's, so the kernel's per-session
  scheduling groups treat it as a spawned launch), so a test that times out can stop the whole
  launch -- a launcher and the ranks it started -- with one ``killpg``;
- stderr in ERR_FILE (``-``: left where the zygote put it, with stdout), so the tests that read
  stderr apart from stdout still can.
"""
from __future__ import annotations

import os
import runpy
import sys
import types


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: python tests/forked.py ERR_FILE ARGV...")
    err_file, target = argv[0], argv[1:]
    os.setpgid(0, 0)
    if err_file != "-":
        sys.stderr.flush()
        fd = os.open(err_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    if target[0] == "-c":
        sys.argv, sys.path[0] = ["-c", *target[2:]], ""
        main_module = sys.modules["__main__"] = types.ModuleType("__main__")  # not this file's names
        exec(compile(target[1], "<string>", "exec"), vars(main_module))
    elif target[0] == "-m":
        sys.argv, sys.path[0] = [target[1], *target[2:]], os.getcwd()
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv, sys.path[0] = target, os.path.dirname(os.path.abspath(target[0]))
        runpy.run_path(target[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])

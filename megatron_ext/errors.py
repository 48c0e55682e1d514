"""User errors: bad flags, YAML, layouts, data, checkpoints or traces.

Every entry point reports a ``UserError`` the same way: one line ``program: error: <what and where>``
on stderr, printed once (by one rank in a multi-rank job), and exit code 2 on every rank. A
traceback is for bugs; a user error is not one, so it never shows one.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import TextIO

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad input from the user. The message says what was wrong, where, and what to do."""


class ConfigError(UserError, ValueError):
    """Bad configuration: the message names the key, the file or flag, and what to do.

    Defined here, below every package, so that the pure descriptions the config reads (the engine
    registry, the model families) raise it without importing the config; ``config.base`` re-exports it."""


def one_line(message: object) -> str:
    """The message on one line (a multi-line message would break 'program: error: ...' parsing)."""
    return " ".join(str(message).split())


def report(program: str, exc: BaseException | str, *, stream: TextIO | None = None) -> int:
    """Print ``program: error: message`` once and return the exit code for a user error."""
    print(f"{program}: error: {one_line(exc)}", file=stream or sys.stderr, flush=True)
    return EXIT_USER_ERROR


def exit_quietly_after_reporter(grace_s: float = 3.0) -> None:
    """On a rank that does not print the error: give the reporting rank time to print first.

    A launcher such as torchrun stops every other rank (SIGTERM) as soon as one exits non-zero, so
    a non-reporting rank that exits at once can get rank 0 killed before its message is out. This
    rank waits a moment instead, and if the launcher stops it meanwhile it still exits with the
    user-error code, not as 'killed by a signal'."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    signal.signal(signal.SIGTERM, lambda *_: os._exit(EXIT_USER_ERROR))
    time.sleep(grace_s)

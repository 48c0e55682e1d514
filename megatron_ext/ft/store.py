"""The job's rendezvous store, hosted where no rank can take it down.

torchrun's and ``init_process_group``'s default store lives in rank 0, so when rank 0 dies the
survivors lose the one channel they could agree on a new world through. For ``--ft-on-stop
continue`` the launcher process hosts a ``TCPStore`` (``host``), every rank connects to it as a
client (``connect``), and each layout generation keeps its keys under its own prefix
(``generation``): a new default process group after a fail-stop rendezvouses on fresh keys, as
torchft does per quorum. ``MEGATRON_EXT_STORE=host:port`` tells a rank where the store is.
Everything of the fault-tolerance core that must agree across ranks goes through this store,
never through a process group (which may be the thing that is broken).

    python -m megatron_ext.ft.store [--host 0.0.0.0] [--port 29400]
    python -m megatron_ext.ft.store --exit-code HOST:PORT

hosts one by itself and prints the ``MEGATRON_EXT_STORE=...`` line, for launchers that do not
(srun: start it in the batch script, export the line, then srun the ranks). ``--exit-code`` asks a
running store how the job ended (0: training finished, whoever was lost on the way; else the code
the job ended with) and prints one line: what a batch script exits with, since srun's own code
counts every lost rank as a failure.
"""
from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import sys
import threading
import time

import torch.distributed as dist

STORE_ENV = "MEGATRON_EXT_STORE"
PREFIX = "megatron_ext"


def host(bind: str = "127.0.0.1", port: int = 0) -> tuple[dist.TCPStore, str]:
    """Start a store server in this process; returns it and its ``host:port`` address."""
    store = dist.TCPStore(bind, port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    name = bind if bind not in ("0.0.0.0", "::") else socket.gethostname()
    return store, f"{name}:{store.port}"


def parse_address(addr: str, where: str = STORE_ENV) -> tuple[str, int]:
    hostname, _, port = addr.rpartition(":")
    if not hostname or not port.isdigit():
        raise ValueError(f"{where}={addr!r}: expected HOST:PORT")
    return hostname, int(port)


def connect(addr: str, *, timeout_s: float) -> dist.TCPStore:
    """A new client connection to the store at ``addr``. Each user that may block (the commit
    vote, the heartbeat threads) gets its own: a client serialises its operations."""
    hostname, port = parse_address(addr)
    return dist.TCPStore(hostname, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def address_from_env() -> str | None:
    return os.environ.get(STORE_ENV) or None


def job_keys(base: dist.Store, part: str) -> dist.PrefixStore:
    """The keys of the whole job for one purpose (exit reports, errors, spares, the job's end).
    Under torchrun's agent store, which outlives a restart of the workers (``--max-restarts``),
    each restart gets its own keys: a restarted job must not read the last one's."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    attempt = f"/restart{restart}" if restart not in ("", "0") else ""
    return dist.PrefixStore(f"{PREFIX}{attempt}/{part}", base)


def generation(base: dist.Store, gen: int, part: str) -> dist.PrefixStore:
    """The keys of layout generation ``gen`` for one purpose (``pg``, ``heartbeat``, ``commit``,
    ``join``, ...): a new generation never meets the last one's keys."""
    return job_keys(base, f"gen{gen}/{part}")


def wait_for_key(store: dist.Store, key: str, *, timeout_s: float, poll_s: float = 0.05,
                 give_up=None) -> bytes | None:
    """The value of ``key`` once it exists, polling (a timed-out ``store.wait`` logs C++ warnings);
    None after ``timeout_s`` or as soon as ``give_up()`` returns true."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while True:
        if store.check([key]):
            return store.get(key)
        if time.monotonic() >= deadline or (give_up is not None and give_up()):
            return None
        time.sleep(delay)
        delay = min(2 * delay, poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_ext.ft.store",
                                     description="Host the job's rendezvous store until stopped.")
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default: all)")
    parser.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    parser.add_argument("--exit-code", metavar="HOST:PORT", help="print how the job of the store at HOST:PORT ended "
                        "and exit with its code")
    args = parser.parse_args(argv)
    if args.exit_code:
        return job_exit_code(args.exit_code)
    _, addr = host(args.host, args.port)
    print(f"{STORE_ENV}={addr}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    return 0


def job_exit_code(addr: str) -> int:
    """How the job of the store at ``addr`` ended, as an exit code (one line on stdout)."""
    base = connect(addr, timeout_s=30)
    keys = job_keys(base, "job")
    if keys.check(["end"]):
        import json

        end = json.loads(keys.get("end"))
        print(f"job ended (exit {end['code']}): {end['message']}", flush=True)
        return int(end["code"])
    if keys.check(["done"]):
        print("job finished training", flush=True)
        return 0
    print("job did not finish training and did not say why (every rank lost?)", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())

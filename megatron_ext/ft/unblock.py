"""Getting a survivor out of a collective with a lost peer, once the loss is known.

Called only after the core has decided that a rank is lost (never to find out whether one is):
shutting every connection first would turn an ordinary error on one rank into connection resets
on all of them.

* **gloo** cannot abort a collective (``ProcessGroup.abort`` does not unblock its pending
  operations), and a survivor can sit in one with a peer that has already left it or is itself
  blocked. Shutting down this process's gloo sockets (every established TCP connection except
  those to the job's store) makes its own pending operations fail at once and its peers' too
  (their reads see the connection close), so every survivor gets out of the old generation within
  milliseconds, transitively. The file descriptors stay open: gloo owns them and closes them when
  its groups are destroyed.
* **NCCL** has torch's own API: ``ProcessGroup.abort()`` on every group of the generation (which
  ends their pending kernels and communicators). ``torch.distributed.shrink_group(...,
  SHRINK_ABORT)`` would keep the surviving communicators instead of forming new ones; the core
  forms a new default group per generation on both backends, which needs only the abort. This path
  has not run on a machine with two GPUs yet (``--ft-continue-experimental-nccl``).
"""
from __future__ import annotations

import logging
import socket

from megatron_ext.ft import store as store_lib

logger = logging.getLogger(__name__)


def abort_connections(store_addr: str | None) -> int:
    """Shut down every established TCP connection of this process except those to the store.
    Returns how many were shut."""
    import psutil

    store_port = store_lib.parse_address(store_addr)[1] if store_addr else None
    shut = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.fd < 0 or not conn.raddr or conn.status != psutil.CONN_ESTABLISHED:
            continue
        if store_port is not None and store_port in (conn.raddr.port, conn.laddr.port):
            continue  # the store (its client side, or its server side where it lives here): how survivors meet
        try:
            sock = socket.socket(fileno=conn.fd)
        except OSError:
            continue  # closed since it was listed
        try:
            sock.shutdown(socket.SHUT_RDWR)
            shut += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return shut


def abort_process_groups() -> int:
    """NCCL: ``abort()`` every process group this process holds (the default one included).
    Returns how many were aborted."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0
    aborted = 0
    for group in list(dist.distributed_c10d._world.pg_map):
        try:
            group.abort()
            aborted += 1
        except Exception as exc:  # already aborted, or a backend without abort
            logger.debug("abort of a process group failed: %s", exc)
    return aborted


def unblock(backend: str, store_addr: str | None) -> int:
    """Free this process's main thread from any collective of the current generation."""
    if backend == "nccl":
        return abort_process_groups()
    return abort_connections(store_addr)


COMM_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "timed out",
                "timeout", "socket", "transport", "peer", "process group", "processgroup", "store")


def is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective or the store failing (a peer gone, a connection shut
    down, a timeout) rather than this rank's own computation failing. Conservative: a survivor
    must never take a failed collective for an error of its own (it would declare itself lost)."""
    import torch.distributed as dist

    if isinstance(exc, (dist.DistError, ConnectionError, TimeoutError)):
        return True
    if type(exc) is RuntimeError or isinstance(exc, OSError):
        text = str(exc).lower()
        return any(m in text for m in COMM_MARKERS)
    return False

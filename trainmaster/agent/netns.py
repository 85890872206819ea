"""Move the calling process into a named network namespace (``setns(2)``): a testbed host's.

For the node agent daemon of a testbed host (``--netns``) and for processes forked from a Python
parent (the aggregation benchmark's workers): after ``enter`` every socket the process opens
lives on that host. ``setns`` moves only the calling thread, so it must be called before any
thread is started, which is the case right after a fork or at a daemon's start.
"""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"


def enter(namespace: str) -> None:
    """Join the named network namespace (as ``ip netns exec`` does, without a new process)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, namespace), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {namespace!r}: {os.strerror(err)}")
    finally:
        os.close(fd)

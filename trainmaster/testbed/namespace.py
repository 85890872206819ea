"""Move the calling process into a testbed host's network namespace (``setns(2)``).

For processes forked from a Python parent (the benchmark's workers): after ``enter`` every
socket the process opens lives on that host. ``setns`` moves only the calling thread, so it
must be called before any thread is started, which is the case right after a fork.
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

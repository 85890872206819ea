"""The c10d rendezvous store of an elastic PyTorch job (the ``rendezvous`` role).

torchrun's elastic agents meet in a ``TCPStore``; upstream, the first agent hosts it, and the
group is lost with that node. Here the controller runs it as its own one-instance role on the
instance's first port (``TM_PORT``), restarted if it ends, so any node may die and be replaced.
It serves until it is stopped (the job ends, or it is cancelled).
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def main() -> int:
    from datetime import timedelta

    import torch.distributed as dist

    port = int(os.environ.get("TM_PORT") or 0)
    if not port:
        print("rendezvous: no TM_PORT (the role needs a port)", file=sys.stderr)
        return 2
    host = os.environ.get("TM_HOST") or "0.0.0.0"
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    print(f"rendezvous: c10d store serving on {host}:{port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    del store
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

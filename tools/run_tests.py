"""Run pytest and end the process with pytest's verdict, without the interpreter's teardown.

Why: CI's run of stop 43 printed "1446 passed" and then the pytest process died of SIGABRT while
the interpreter tore itself down, so `make test` failed on a suite that had passed. The suite
loads native libraries in its own process (torch, Ray's gRPC core, the Kubernetes client's
thread pool) whose threads may still be alive at the end; CPython ends a daemon thread that wakes
during finalization with ``pthread_exit``, and a thread with C++ frames on its stack aborts the
whole process when that happens. Three local runs of the same commit did not reproduce it, so
which thread it was is not known. The verdict is pytest's once it has printed its summary; what
this skips is only the teardown after it (every fixture, temporary folder and cluster is already
cleaned up by then). Threads still alive are named on stderr, so a test that leaks one can be
found, and ``faulthandler`` prints every thread's stack if the process does die before that.

    .venv/bin/python tools/run_tests.py -q tests/controller     # the arguments are pytest's
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading

sys.path[0] = os.getcwd()  # as `python -m pytest` has it: the repository root, not tools/

import pytest  # noqa: E402


def main(argv: list[str]) -> int:
    faulthandler.enable()
    code = int(pytest.main(argv))
    alive = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    if alive:
        print(f"note: {len(alive)} thread(s) still running after the suite: {', '.join(alive)}", file=sys.stderr)
    return code


if __name__ == "__main__":
    status = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

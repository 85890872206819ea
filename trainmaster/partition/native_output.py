"""Keep what native libraries print off our stdout.

METIS's C library writes diagnostics such as ``***Cannot bisect a graph with 0 vertices!`` with
printf, straight to file descriptor 1, where they would corrupt ``--json`` output. Python's
``contextlib.redirect_stdout`` cannot see them (it only swaps ``sys.stdout``), so the descriptor
itself is pointed at a temporary file around the call, C's stdio buffers are flushed before it is
restored, and the text is handed to the caller, who logs it as a warning on stderr.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger("trainmaster.partition")


@dataclass
class CapturedOutput:
    """What the native code wrote to stdout while captured ("" until the block ends)."""

    text: str = ""


def _flush_c_stdio() -> None:
    try:
        ctypes.CDLL(None).fflush(None)  # fflush(NULL): every C stdio stream of this process
    except (OSError, AttributeError):  # no C runtime reachable this way: nothing buffered to lose
        pass


@contextmanager
def captured_stdout() -> Iterator[CapturedOutput]:
    """Redirect file descriptor 1 to a temporary file for the block; the text lands in the result."""
    captured = CapturedOutput()
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        try:
            yield captured
        finally:
            _flush_c_stdio()
            os.dup2(saved, 1)
            os.close(saved)
            sink.seek(0)
            captured.text = sink.read().decode("utf-8", "replace")


@contextmanager
def native_noise_as_warning(library: str) -> Iterator[None]:
    """Run a native call with its stdout captured; report any text as one warning on stderr."""
    with captured_stdout() as captured:
        yield
    lines = sorted({line.strip() for line in captured.text.splitlines() if line.strip()})
    if lines:
        log.warning(
            "warning: %s printed (not an error of this run; the partition is still checked): %s",
            library,
            " | ".join(lines),
        )

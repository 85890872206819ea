"""The gateway's spool of a streamed result it is relaying (cut-through)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

from trainmaster.gateway.crypto.envelope import EnvelopeError


class LiveSpool:
    """A streamed result the gateway is still relaying (cut-through): the relay appends
    re-encrypted frames to the spool file and readers (``/v1/results``) tail it as it grows, so the
    initiator downloads while the party still uploads. The spool file is the buffer between the
    hops (bounded memory whatever the speeds), and it stays for a later fetch or a resume.

    The final frame is *released* to readers only by :meth:`end` with ``ok=True``, which the relay
    calls after the spool is fsynced and the leg's outcome recorded: an initiator that holds a
    complete, checked stream knows the gateway has recorded it too. A relay that fails ends with
    ``ok=False``; readers stop before the final frame, so the initiator sees a truncated stream and
    asks for the leg's recorded outcome.
    """

    def __init__(self, path: Path, envelope_json: str):
        self.path = path
        """Where the spool file is now (``.part`` while relaying, renamed when complete)."""
        self.envelope_json = envelope_json
        """The leg's outcome as a live stream (sealed to the task's owner, not final)."""
        self.written = 0
        self.released = 0
        self.state = "running"
        self._changed = asyncio.Event()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def wrote(self, nbytes: int, final: bool) -> None:
        """``nbytes`` more of whole frames are in the file; all but the final one go to readers now."""
        self.written += nbytes
        if not final:
            self.released = self.written
            self._wake()

    def end(self, ok: bool) -> None:
        if ok:
            self.released = self.written
        self.state = "done" if ok else "failed"
        self._wake()

    def open(self) -> BinaryIO:
        """The spool file opened for reading: called synchronously right after looking the spool
        up, so the relay cannot rename it in between (an open file survives the rename)."""
        return self.path.open("rb")

    async def tail(self, fh: BinaryIO, idle_timeout_s: float, block: int = 1 << 20) -> AsyncIterator[bytes]:
        """The released frames as they arrive; ends when the relay ends (after the final frame if it
        succeeded) or when nothing new arrived for ``idle_timeout_s`` (the party stalled)."""
        sent = 0
        try:
            while True:
                changed = self._changed
                if sent < self.released:
                    data = fh.read(min(block, self.released - sent))
                    if not data:
                        raise EnvelopeError(500, "spool file shorter than what the relay wrote")
                    sent += len(data)
                    yield data
                    continue
                if self.state != "running":
                    return
                try:
                    await asyncio.wait_for(changed.wait(), timeout=idle_timeout_s)
                except TimeoutError:
                    return  # the reader sees a truncated stream and asks again
        finally:
            fh.close()

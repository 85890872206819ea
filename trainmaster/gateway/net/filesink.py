"""Where a received stream's plaintext goes: a file, hashed and written behind the receiving thread.

The receiver of a stream (a party taking a leg's input, an initiator fetching a result) does four
things per chunk: TLS and the chunk AEAD (the receiving thread), then SHA-256 and the write into
the page cache, and, for an input, a group commit (``fdatasync`` and the committed offset recorded)
every ``commit_every`` bytes. Done in one thread the socket is not read while the chunk is hashed
and written, and not for the whole of a commit: a 64 MiB ``fdatasync`` holds a 4 GiB upload up for
as long as the disk takes, 64 times. Here the hashing and writing run in a writer thread and the
commits in a committer thread (``hashlib``, ``os.write`` and ``os.fdatasync`` release the GIL),
so the three overlap.

Memory stays bounded: the receiver decrypts into one of ``depth`` chunk buffers it takes from the
sink (:meth:`FileSink.buffer`, which waits while all are queued for writing), so at most
``depth`` chunks are held whatever the size. A commit records only an offset the writer had
written before its ``fdatasync`` began, so a recorded offset is always durable.

Where the file system takes it, whole chunks are written with ``O_DIRECT`` from page-aligned
buffers: measured here (``perf``), copying a received 4 GiB into the page cache was the largest
single cost of the receiving process, and a model-sized payload gains nothing from being cached
by its receiver. The last, shorter chunk is written through the page cache (``O_DIRECT`` needs
aligned lengths), and a file system that refuses ``O_DIRECT`` (tmpfs) gets every chunk that way.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

READ_BLOCK = 1 << 20
DEPTH = 4
ALIGN = 4096
"""What ``O_DIRECT`` needs of offsets and lengths (a page covers every block size in use)."""
"""Chunk buffers per sink: the most a receiver holds ahead of its disk (4 x 1 MiB by default)."""


class SinkError(OSError):
    """The writer or committer thread failed (a full disk, an I/O error): the stream must end."""


def rehash_prefix(fd: int, size: int, digest: Any, what: str) -> None:
    """Feed the first ``size`` bytes of ``fd`` to ``digest`` (a resumed stream's prefix, read back
    once); raises :class:`SinkError` when the file is shorter (``what`` names it)."""
    os.lseek(fd, 0, os.SEEK_SET)
    left = size
    while left:
        block = os.read(fd, min(READ_BLOCK, left))
        if not block:
            raise SinkError(f"{what} is shorter than it was recorded to be")
        digest.update(block)
        left -= len(block)


class FileSink:
    """Hashes and writes chunks to ``fd`` from its current position in a writer thread, and
    commits (``fdatasync``, then ``on_commit(offset)``) every ``commit_every`` bytes in a committer
    thread (``commit_every=0``: no group commits, the caller syncs at the end).

    Use: ``buf = sink.buffer()``, fill ``buf[:n]``, ``sink.put(buf, n)``; at the end
    :meth:`close`, which waits for every queued chunk and commit and returns the offset written.
    """

    def __init__(
        self,
        fd: int,
        digest: Any,
        chunk_bytes: int,
        offset: int,
        commit_every: int = 0,
        on_commit: Callable[[int], None] | None = None,
        depth: int = DEPTH,
    ):
        self._fd, self._digest = fd, digest
        self._commit_every, self._on_commit = commit_every, on_commit
        self._free: queue.Queue[mmap.mmap] = queue.Queue()
        for _ in range(depth):
            self._free.put(mmap.mmap(-1, chunk_bytes))  # page-aligned, as O_DIRECT needs
        self._full: queue.Queue[tuple[mmap.mmap, int] | None] = queue.Queue()
        self._flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        self._direct = False
        if hasattr(os, "O_DIRECT") and chunk_bytes % ALIGN == 0 and offset % ALIGN == 0:
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, self._flags | os.O_DIRECT)
                self._direct = True
            except OSError:  # tmpfs and a few others: through the page cache
                pass
        self.written = offset
        self._committed = offset
        self._want = offset
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._closing = False
        self._writer = threading.Thread(target=self._write_loop, name="stream-writer", daemon=True)
        self._committer = threading.Thread(target=self._commit_loop, name="stream-committer", daemon=True)
        self._writer.start()
        if commit_every:
            self._committer.start()

    def _check(self) -> None:
        if self._error is not None:
            raise SinkError(f"writing the stream failed: {type(self._error).__name__}: {self._error}")

    def buffer(self) -> mmap.mmap:
        """A free chunk buffer (waits while every buffer is queued for the writer)."""
        while True:
            self._check()
            try:
                return self._free.get(timeout=0.5)
            except queue.Empty:
                continue

    def put(self, buf: mmap.mmap, n: int) -> None:
        """Queue ``buf[:n]`` to be hashed and written (``buf`` returns to the pool after)."""
        self._check()
        self._full.put((buf, n))

    def _write_loop(self) -> None:
        while (item := self._full.get()) is not None:
            buf, n = item
            try:
                if self._error is None:
                    view = memoryview(buf)[:n]
                    self._digest.update(view)
                    if self._direct and n % ALIGN:
                        self._buffered()
                    while view:
                        view = view[os.write(self._fd, view) :]
                    self.written += n
                    if self._commit_every and self.written - self._want >= self._commit_every:
                        with self._cond:
                            self._want = self.written
                            self._cond.notify()
            except BaseException as exc:  # noqa: BLE001 - handed to the receiving thread
                self._error = exc
            finally:
                self._free.put(buf)

    def _buffered(self) -> None:
        fcntl.fcntl(self._fd, fcntl.F_SETFL, self._flags)
        self._direct = False

    def _commit_loop(self) -> None:
        while True:
            with self._cond:
                while self._want <= self._committed and not self._closing:
                    self._cond.wait()
                if self._want <= self._committed:
                    return
                target = self._want  # written before this fdatasync starts: durable after it
            try:
                os.fdatasync(self._fd)
                if self._on_commit is not None:
                    self._on_commit(target)
            except BaseException as exc:  # noqa: BLE001 - handed to the receiving thread
                self._error = exc
                return
            self._committed = target

    def close(self) -> int:
        """Wait for every queued chunk and commit; the offset written. Raises :class:`SinkError` if
        the writer or committer failed. Call it once, also when the stream broke (the chunks
        already received are checked, so they stay, and a resumed stream starts after them)."""
        self._full.put(None)
        self._writer.join()
        if self._direct:
            self._buffered()
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._commit_every:
            self._committer.join()
        self._check()
        return self.written

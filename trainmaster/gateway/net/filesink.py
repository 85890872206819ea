"""A stream's file ends: where a received stream's plaintext goes (:class:`FileSink`: hashed and
written behind the receiving thread) and where a sent stream's plaintext comes from
(:class:`FileSource`: read ahead of the sending thread).

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
"""Chunk buffers per sink or source: the most a receiver holds ahead of its disk, or a sender
reads ahead of its socket (4 x 1 MiB by default)."""
ALIGN = 4096
"""What ``O_DIRECT`` needs of offsets and lengths (a page covers every block size in use)."""


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


class FileSource:
    """Reads ``size`` bytes of a file from ``offset`` in a reader thread, a chunk per page-aligned
    buffer, at most ``depth`` chunks ahead of the sending thread (which seals and sends them).

    Why a thread and why ``O_DIRECT``: a stored result written by a sandboxed executor is mostly
    not in the page cache (its memory cgroup reclaims what it writes), so reading it is a disk
    wait and, through the page cache, a page allocated and copied per 4 KiB: ``perf`` showed that
    copy (``filemap_read``) as the sending party's largest cost, about 1 ms per MB, more than
    sealing the chunk. So a chunk whose pages are all in the page cache (``mincore``) is copied
    from it, and any other is read with ``O_DIRECT`` straight into the aligned buffer (no page
    allocated, no copy), in this thread, while the sender seals and sends the chunk before. (A
    read with ``RWF_NOWAIT`` cannot probe the cache: it starts readahead into it.) A file system
    that refuses ``O_DIRECT`` (tmpfs) is read through the cache.

    Use: ``buf, n = src.next()``, send ``buf[:n]``, ``src.release(buf)``; :meth:`close` at the end.
    """

    def __init__(self, path: str | os.PathLike[str], offset: int, size: int, chunk_bytes: int, depth: int = DEPTH):
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._direct: int | None = None
        if hasattr(os, "O_DIRECT") and chunk_bytes % ALIGN == 0:
            try:
                self._direct = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
            except OSError:  # tmpfs and a few others: through the page cache
                pass
        self._chunk, self._pos, self._end = chunk_bytes, offset, offset + size
        self._free: queue.Queue[mmap.mmap] = queue.Queue()
        for _ in range(depth):
            self._free.put(mmap.mmap(-1, chunk_bytes))
        self._full: queue.Queue[tuple[mmap.mmap, int] | BaseException] = queue.Queue()
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name="stream-reader", daemon=True)
        self._reader.start()

    def _read_chunk(self, buf: mmap.mmap, pos: int, want: int) -> int:
        view, got = memoryview(buf), 0
        if self._direct is not None and pos % ALIGN == 0 and not _cached(self._fd, pos, want):
            span = -(-want // ALIGN) * ALIGN
            got = min(os.preadv(self._direct, [view[:span]], pos), want)
        while got < want:  # cached, or the file's end came early
            n = os.preadv(self._fd, [view[got:want]], pos + got)
            if n <= 0:
                raise SinkError("the file is shorter than it was recorded to be")
            got += n
        return got

    def _read_loop(self) -> None:
        try:
            while self._pos < self._end and not self._stop.is_set():
                buf = self._free.get()
                if self._stop.is_set():
                    return
                n = self._read_chunk(buf, self._pos, min(self._chunk, self._end - self._pos))
                self._pos += n
                self._full.put((buf, n))
        except BaseException as exc:  # noqa: BLE001 - handed to the sending thread
            self._full.put(exc)

    def next(self) -> tuple[mmap.mmap, int]:
        """The next chunk's buffer and length (waits for the reader); raises what the reader hit."""
        item = self._full.get()
        if isinstance(item, BaseException):
            raise SinkError(f"reading the stream's file failed: {type(item).__name__}: {item}") from item
        return item

    def release(self, buf: mmap.mmap) -> None:
        """Give a sent chunk's buffer back to the reader."""
        self._free.put(buf)

    def close(self) -> None:
        """Stop the reader (also mid-file, when the stream broke) and close the file."""
        self._stop.set()
        self._free.put(mmap.mmap(-1, ALIGN))  # wakes a reader waiting for a buffer
        self._reader.join(timeout=30)
        for fd in (self._fd, self._direct):
            if fd is not None:
                os.close(fd)


def _libc() -> Any:
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return libc


_LIBC: Any = None
_MAP_FAILED = 2**64 - 1


def _cached(fd: int, pos: int, length: int) -> bool:
    """Whether every page of ``fd``'s ``[pos, pos + length)`` is in the page cache (``mincore`` of
    a mapping that is never touched, so nothing is read). ``pos`` is page-aligned. True where it
    cannot tell (then the caller reads through the cache, as it would without this check)."""
    global _LIBC
    try:
        if _LIBC is None:
            _LIBC = _libc()
        addr = _LIBC.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, pos)
        if addr is None or addr == _MAP_FAILED:
            return True
        try:
            pages = -(-length // mmap.PAGESIZE)
            vec = bytes(pages)
            if _LIBC.mincore(addr, length, vec) != 0:
                return True
            return all(b & 1 for b in vec)
        finally:
            _LIBC.munmap(addr, length)
    except (OSError, AttributeError):
        return True

"""The sending end of a stream (issue 36: a model-sized result read with bounded memory, without
paying the page cache for what is not in it): ``net.filesink.FileSource``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainmaster.gateway.net.filesink import FileSource, SinkError, _cached

MB = 1 << 20


def _read_all(src: FileSource, size: int) -> bytes:
    out = bytearray()
    while len(out) < size:
        buf, n = src.next()
        out += buf[:n]
        src.release(buf)
    src.close()
    return bytes(out)


def _drop_from_cache(path: Path) -> None:
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("offset", [0, MB])
def test_file_source_reads_every_byte_from_an_offset_cached_or_not(tmp_path: Path, cached: bool, offset: int) -> None:
    """Issue 36 (streaming results, bounded memory): the reader thread yields the file's bytes from a
    chunk-aligned offset in chunks, whether its pages are in the page cache (copied) or not (read
    with O_DIRECT where the file system takes it), including a last chunk shorter than a page."""
    path = tmp_path / "result"
    data = os.urandom(3 * MB + 12345)
    path.write_bytes(data)
    if not cached:
        _drop_from_cache(path)
    assert _read_all(FileSource(path, offset, len(data) - offset, MB, depth=2), len(data) - offset) == data[offset:]


def test_uncached_file_is_read_without_filling_the_page_cache(tmp_path: Path) -> None:
    """Issue 36 (download throughput): a result not in the page cache is read around it, so reading
    it allocates and copies no cache pages (what ``perf`` showed as the sending party's largest cost)."""
    path = tmp_path / "result"
    path.write_bytes(os.urandom(4 * MB))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _cached(fd, 0, MB)
        _drop_from_cache(path)
        if _cached(fd, 0, MB):
            pytest.skip("this file system keeps the file's pages whatever is asked (tmpfs)")
        src = FileSource(path, 0, 4 * MB, MB)
        if src._direct is None:
            src.close()
            pytest.skip(f"{tmp_path} does not take O_DIRECT")
        assert len(_read_all(src, 4 * MB)) == 4 * MB
        assert not _cached(fd, 0, MB) and not _cached(fd, 3 * MB, MB)
    finally:
        os.close(fd)


def test_a_file_shorter_than_recorded_is_an_error_not_a_hang(tmp_path: Path) -> None:
    """A stored result cut short on disk ends the stream with a reason."""
    path = tmp_path / "result"
    path.write_bytes(os.urandom(MB + 10))
    src = FileSource(path, 0, 3 * MB, MB)
    buf, n = src.next()
    assert n == MB
    src.release(buf)
    with pytest.raises(SinkError, match="shorter"):
        src.next()
    src.close()


def test_closing_mid_file_stops_the_reader(tmp_path: Path) -> None:
    """A broken stream closes its source after a chunk or two: the reader thread ends, nothing leaks."""
    path = tmp_path / "result"
    path.write_bytes(os.urandom(8 * MB))
    src = FileSource(path, 0, 8 * MB, MB, depth=2)
    src.next()
    src.close()
    assert not src._reader.is_alive()

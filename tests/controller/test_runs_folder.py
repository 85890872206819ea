"""Mechanism: the runs folder spreads its job folders over the filesystem (issue 31, the drain of
1,000 ``true`` jobs): a reconciling controller marks it as the top of directory hierarchies
(ext2/3/4's ``FS_TOPDIR_FL``, ``chattr +T``), so ext4 places each job folder in a block group
of its choosing rather than every one in the runs folder's group, where each new inode skips
past every inode freed in the last minute. Where the filesystem refuses the hint (tmpfs) the
controller works as before."""

from __future__ import annotations

import fcntl
import os
import struct
import tempfile
from pathlib import Path

import pytest

from controller_harness import Harness
from trainmaster.controller import Controller
from trainmaster.controller.controller import FS_IOC_GETFLAGS, FS_TOPDIR_FL


def inode_flags(folder: Path) -> int | None:
    """The folder's ext2/3/4 inode flags, or None where the filesystem has none."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, FS_IOC_GETFLAGS, bytes(4)))[0])
    except OSError:
        return None
    finally:
        os.close(fd)


def test_a_reconciling_controller_marks_its_runs_folder_as_a_top_folder(harness: Harness, tmp_path: Path) -> None:
    if inode_flags(tmp_path) is None:
        pytest.skip(f"{tmp_path} is on a filesystem without inode flags (not ext2/3/4)")
    runs = tmp_path / "deeper" / "runs"
    Controller(harness.sessions, harness.backend, harness.url, runs_dir=runs)
    flags = inode_flags(runs)
    assert flags is not None and flags & FS_TOPDIR_FL, f"runs folder flags {flags}"
    # an existing runs folder (made before this controller) is marked too
    plain = tmp_path / "plain"
    plain.mkdir()
    assert not (inode_flags(plain) or 0) & FS_TOPDIR_FL
    Controller(harness.sessions, harness.backend, harness.url, runs_dir=plain)
    assert (inode_flags(plain) or 0) & FS_TOPDIR_FL


def test_a_runs_folder_where_the_hint_is_refused_works_and_a_reader_makes_none(
    harness: Harness, tmp_path: Path
) -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm (tmpfs) here")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        runs = Path(shm) / "runs"
        Controller(harness.sessions, harness.backend, harness.url, runs_dir=runs)
        assert runs.is_dir()
    reader = tmp_path / "reader-runs"
    Controller(harness.sessions, harness.backend, harness.url, runs_dir=reader, reconciles=False)
    assert not reader.exists()  # the API process of `trainmaster server` makes no job folders

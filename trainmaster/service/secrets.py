"""Secrets of the controller service at rest and in its process: token files, the store's file,
and the server's own environment.

- A token comes from a file (``--token-file``) or the environment (``TRAINMASTER_TOKEN``), never
  from the command line: every user of the machine reads ``/proc/PID/cmdline``.
- Files holding a secret (a token, a SQLite store) are written ``0600`` in ``0700`` folders, and
  a token file others may read is refused, as ssh refuses such a key.
- Once the server has read its token and store URL from the environment, it removes them from
  its environment *and* overwrites them in the block the kernel shows as
  ``/proc/PID/environ`` (removing a variable from ``os.environ`` alone leaves that block as it
  was), so neither another process of the user nor anything the server starts finds them there.
"""

from __future__ import annotations

import ctypes
import os
import stat
from pathlib import Path

from trainmaster.errors import UserError

TOKEN_FILE_NAME = "server.token"  # a generated token, in the Trainmaster home


def private_folder(path: Path) -> Path:
    """``path`` as a folder only its owner can enter (created ``0700``; an existing one is
    narrowed to that when this user owns it)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid == os.getuid() and info.st_mode & 0o077:
        path.chmod(stat.S_IMODE(info.st_mode) & 0o700)
    return path


def write_secret(path: Path, value: str) -> Path:
    """Write ``value`` to ``path`` readable by its owner only (``0600`` from its creation: there is
    no moment it is readable by others), in a private folder."""
    private_folder(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (value + "\n").encode())
    finally:
        os.close(fd)
    return path


def read_token_file(path: Path) -> str:
    """The token in ``path`` (its first line), refusing a file others may read or an empty one."""
    try:
        info = path.stat()
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"--token-file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UserError(f"--token-file {path}: not a text file") from None
    if info.st_mode & 0o077:
        raise UserError(
            f"--token-file {path} may be read by other users (mode {stat.S_IMODE(info.st_mode):o}); "
            f"make it private: chmod 600 {path}"
        )
    token = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not token:
        raise UserError(f"--token-file {path} is empty")
    return token


def scrub_environment(names: tuple[str, ...]) -> None:
    """Remove ``names`` from this process's environment, including the copy the kernel shows in
    ``/proc/self/environ`` (the environment block on the stack, which ``unsetenv`` leaves alone):
    each ``NAME=value`` there has its value overwritten with NUL bytes."""
    present = [name for name in names if name in os.environ]
    for name in present:
        del os.environ[name]
    if not present:
        return
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end: fields 50 and 51 (the list starts at 3)
    except (OSError, IndexError, ValueError):
        return
    if not 0 < start < end:
        return
    block = ctypes.string_at(start, end - start)
    for name in present:
        key = name.encode() + b"="
        position = 0
        while True:
            found = block.find(key, position)
            if found < 0:
                break
            if found == 0 or block[found - 1] == 0:  # the start of an entry, not the inside of one
                value_at = found + len(key)
                value_end = block.find(b"\0", value_at)
                value_end = len(block) if value_end < 0 else value_end
                ctypes.memset(start + value_at, 0, value_end - value_at)
            position = found + len(key)

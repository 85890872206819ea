"""Starting an instance's main process with ``posix_spawn(3)``, the interpreter lock released.

Why not ``subprocess.Popen``: it spends about 0.2 ms of the agent's CPU per child in Python
(its argument and environment conversion, its error pipe) and holds the interpreter lock while
the child is created, so the agent's spawning threads take turns however many cores there are.
``posix_spawn`` through libc (``ctypes`` releases the interpreter lock for the call) creates the
child with ``CLONE_VM | CLONE_VFORK``: nothing of the agent is copied, and the threads of a
start batch spawn side by side, one per core.

What holds as with ``Popen``: the child is created by the calling thread, so it is born in that
thread's cgroups (:mod:`trainmaster.agent.warm` puts the thread there first); it gets its own
session (``POSIX_SPAWN_SETSID``), an empty signal mask and default dispositions for the signals
Python ignores (SIGPIPE, SIGXFSZ); stdin is ``/dev/null``, stdout and stderr the instance's log,
the notify pipe descriptor 3; nothing else of the agent reaches it, since the agent opens every
descriptor close-on-exec (Python's default). The attributes are made once and shared by every
spawning thread (``posix_spawn`` only reads them), and the calls that fill a spawn's file
actions keep the interpreter lock (``ctypes.PyDLL``): only ``posix_spawn`` itself lets it go, so
the threads of a batch hand the lock over once per spawn, not a dozen times. Not ``posix_spawn_file_actions_addclosefrom_np``:
with it glibc 2.36 starts the child with every signal blocked (SIGTERM included), which would
leave only SIGKILL to stop an instance. The working directory is changed in the child
(``posix_spawn_file_actions_addchdir_np``, glibc 2.29). An error (no such program, no working
directory, no permission) is the ``OSError`` ``Popen`` would raise, naming the same file. Where
libc lacks these functions, :func:`spawn` is ``None`` and the agent uses ``Popen``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from typing import Callable

#: glibc's flags (spawn.h)
POSIX_SPAWN_SETSIGDEF = 0x04
POSIX_SPAWN_SETSIGMASK = 0x08
POSIX_SPAWN_SETSID = 0x80
NOTIFY_FD = 3  # where the child finds the notify pipe's write end
_OPAQUE = 1024  # bytes for posix_spawnattr_t / posix_spawn_file_actions_t / sigset_t (glibc: 336, 80, 128)


def _libc(kind: type[ctypes.CDLL] = ctypes.CDLL) -> ctypes.CDLL | None:
    try:
        libc = kind(None, use_errno=True)
    except OSError:
        return None
    needed = (
        "posix_spawn",
        "posix_spawnattr_init",
        "posix_spawnattr_setflags",
        "posix_spawnattr_setsigmask",
        "posix_spawnattr_setsigdefault",
        "posix_spawnattr_destroy",
        "posix_spawn_file_actions_init",
        "posix_spawn_file_actions_adddup2",
        "posix_spawn_file_actions_addopen",
        "posix_spawn_file_actions_addchdir_np",
        "posix_spawn_file_actions_destroy",
        "sigemptyset",
        "sigfillset",
    )
    return libc if all(hasattr(libc, name) for name in needed) else None


def _check(result: int, what: str) -> None:
    if result != 0:
        raise OSError(result, f"{what}: {os.strerror(result)}")


_LIBC = _libc()
# The same functions called with the interpreter lock held: the bookkeeping calls around the
# spawn only fill memory, and a lock released and taken again for each of them lets the other
# spawning threads of a batch take it in between: a dozen handovers per spawn, each a wakeup.
_HELD = _libc(ctypes.PyDLL) if _LIBC is not None else None


class _Attributes:
    """The spawn attributes every child gets (its own session, an empty signal mask, the default
    disposition of every signal), made once: ``posix_spawn`` only reads them, so every spawning
    thread shares one. Every signal, not only the two Python ignores (SIGPIPE, SIGXFSZ): an
    agent started under ``nohup`` or from a non-interactive shell's ``&`` ignores SIGHUP, SIGINT
    and SIGQUIT, and an ignored disposition survives ``exec``, so the job's processes would too."""

    def __init__(self, libc: ctypes.CDLL):
        self.attr = ctypes.create_string_buffer(_OPAQUE)
        self._mask, self._defaults = ctypes.create_string_buffer(_OPAQUE), ctypes.create_string_buffer(_OPAQUE)
        _check(libc.posix_spawnattr_init(self.attr), "posix_spawnattr_init")
        libc.sigemptyset(self._mask)
        libc.sigfillset(self._defaults)
        _check(libc.posix_spawnattr_setsigmask(self.attr, self._mask), "posix_spawnattr_setsigmask")
        _check(libc.posix_spawnattr_setsigdefault(self.attr, self._defaults), "posix_spawnattr_setsigdefault")
        flags = POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF
        _check(libc.posix_spawnattr_setflags(self.attr, ctypes.c_short(flags)), "posix_spawnattr_setflags")


def _attributes() -> _Attributes | None:
    try:
        return _Attributes(_HELD) if _HELD is not None else None
    except OSError:  # then the agent spawns with Popen
        return None


_ATTRIBUTES = _attributes()
_DEV_NULL = b"/dev/null"
_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()


def executable(program: str, env: dict[str, str]) -> str:
    """The file ``program`` names, searched on the child's ``PATH`` as ``Popen`` does; the
    ``OSError`` ``Popen`` raises when there is none (or none that may be executed)."""
    if os.sep in program:
        return program
    denied: str | None = None
    for folder in os.get_exec_path(env):
        candidate = os.path.join(folder, program)
        if os.path.isfile(candidate):
            if os.access(candidate, os.X_OK):
                return candidate
            denied = denied or candidate
    if denied is not None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)


def _strings(items: list[bytes]) -> ctypes.Array[ctypes.c_char_p]:
    return (ctypes.c_char_p * (len(items) + 1))(*items, None)


def posix_spawn(argv: list[str], env: dict[str, str], cwd: str | None, log_fd: int, notify_fd: int | None) -> int:
    """Start ``argv`` (the pid) as described in the module's docstring."""
    assert _LIBC is not None and _HELD is not None and _ATTRIBUTES is not None
    held = _HELD
    if not argv:
        raise ValueError("no program to run")
    path = executable(argv[0], env)
    if cwd is not None and not os.path.isdir(cwd):  # named as Popen names it (the agent says which)
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), cwd)
    # as os.fsencode encodes, one str.encode per string (fsencode is Python code: a few
    # dozen calls of it were a fifth of a spawn's CPU)
    encoded_env = [f"{k}={v}".encode(_FS_ENCODING, _FS_ERRORS) for k, v in env.items()]
    args, environment = _strings([a.encode(_FS_ENCODING, _FS_ERRORS) for a in argv]), _strings(encoded_env)
    actions = ctypes.create_string_buffer(_OPAQUE)
    _check(held.posix_spawn_file_actions_init(actions), "posix_spawn_file_actions_init")
    try:
        _check(held.posix_spawn_file_actions_addopen(actions, 0, _DEV_NULL, os.O_RDONLY, 0), "addopen")
        _check(held.posix_spawn_file_actions_adddup2(actions, log_fd, 1), "adddup2")
        _check(held.posix_spawn_file_actions_adddup2(actions, log_fd, 2), "adddup2")
        if notify_fd is not None:
            _check(held.posix_spawn_file_actions_adddup2(actions, notify_fd, NOTIFY_FD), "adddup2")
        if cwd is not None:
            _check(held.posix_spawn_file_actions_addchdir_np(actions, os.fsencode(cwd)), "addchdir_np")
        pid = ctypes.c_int(0)
        # the interpreter lock is released for this call only: other threads spawn meanwhile
        result = _LIBC.posix_spawn(ctypes.byref(pid), os.fsencode(path), actions, _ATTRIBUTES.attr, args, environment)
    finally:
        held.posix_spawn_file_actions_destroy(actions)
    if result != 0:
        raise OSError(result, os.strerror(result), argv[0])
    return pid.value


#: ``posix_spawn`` where libc has what it needs, else None (the agent spawns with ``Popen``).
spawn: Callable[[list[str], dict[str, str], str | None, int, int | None], int] | None = (
    posix_spawn if _ATTRIBUTES is not None else None
)

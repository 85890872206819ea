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
descriptor close-on-exec (Python's default). Not ``posix_spawn_file_actions_addclosefrom_np``:
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
import signal
from typing import Callable

#: glibc's flags (spawn.h)
POSIX_SPAWN_SETSIGDEF = 0x04
POSIX_SPAWN_SETSIGMASK = 0x08
POSIX_SPAWN_SETSID = 0x80
NOTIFY_FD = 3  # where the child finds the notify pipe's write end
_OPAQUE = 1024  # bytes for posix_spawnattr_t / posix_spawn_file_actions_t / sigset_t (glibc: 336, 80, 128)
_DEFAULT_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)  # Python ignores them; a program expects the default


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
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
        "sigaddset",
    )
    return libc if all(hasattr(libc, name) for name in needed) else None


_LIBC = _libc()


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


def _check(result: int, what: str) -> None:
    if result != 0:
        raise OSError(result, f"{what}: {os.strerror(result)}")


def posix_spawn(argv: list[str], env: dict[str, str], cwd: str | None, log_fd: int, notify_fd: int | None) -> int:
    """Start ``argv`` (the pid) as described in the module's docstring."""
    assert _LIBC is not None
    libc = _LIBC
    if not argv:
        raise ValueError("no program to run")
    path = executable(argv[0], env)
    if cwd is not None and not os.path.isdir(cwd):  # named as Popen names it (the agent says which)
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), cwd)
    encoded_env = [os.fsencode(k) + b"=" + os.fsencode(v) for k, v in env.items()]
    args, environment = _strings([os.fsencode(a) for a in argv]), _strings(encoded_env)
    attr = ctypes.create_string_buffer(_OPAQUE)
    actions = ctypes.create_string_buffer(_OPAQUE)
    mask, defaults = ctypes.create_string_buffer(_OPAQUE), ctypes.create_string_buffer(_OPAQUE)
    _check(libc.posix_spawnattr_init(attr), "posix_spawnattr_init")
    _check(libc.posix_spawn_file_actions_init(actions), "posix_spawn_file_actions_init")
    try:
        libc.sigemptyset(mask)
        libc.sigemptyset(defaults)
        for sig in _DEFAULT_SIGNALS:
            libc.sigaddset(defaults, int(sig))
        _check(libc.posix_spawnattr_setsigmask(attr, mask), "posix_spawnattr_setsigmask")
        _check(libc.posix_spawnattr_setsigdefault(attr, defaults), "posix_spawnattr_setsigdefault")
        flags = POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF
        _check(libc.posix_spawnattr_setflags(attr, ctypes.c_short(flags)), "posix_spawnattr_setflags")
        _check(libc.posix_spawn_file_actions_addopen(actions, 0, b"/dev/null", os.O_RDONLY, 0), "addopen")
        _check(libc.posix_spawn_file_actions_adddup2(actions, log_fd, 1), "adddup2")
        _check(libc.posix_spawn_file_actions_adddup2(actions, log_fd, 2), "adddup2")
        if notify_fd is not None:
            _check(libc.posix_spawn_file_actions_adddup2(actions, notify_fd, NOTIFY_FD), "adddup2")
        if cwd is not None:
            _check(libc.posix_spawn_file_actions_addchdir_np(actions, os.fsencode(cwd)), "addchdir_np")
        pid = ctypes.c_int(0)
        # the interpreter lock is released for the call: other threads spawn meanwhile
        result = libc.posix_spawn(ctypes.byref(pid), os.fsencode(path), actions, attr, args, environment)
    finally:
        libc.posix_spawn_file_actions_destroy(actions)
        libc.posix_spawnattr_destroy(attr)
    if result != 0:
        raise OSError(result, os.strerror(result), argv[0])
    return pid.value


#: ``posix_spawn`` where libc has what it needs, else None (the agent spawns with ``Popen``).
spawn: Callable[[list[str], dict[str, str], str | None, int, int | None], int] | None = (
    posix_spawn if _LIBC is not None else None
)

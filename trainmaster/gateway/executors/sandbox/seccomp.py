"""The executor sandbox's syscall filter, as the classic-BPF program bubblewrap's ``--seccomp FD`` loads.

Why build the BPF here rather than with libseccomp: the filter is a short deny list, the program is
a few dozen fixed instructions, and writing it out keeps the sandbox free of a native dependency
whose Python bindings are not on PyPI for every platform. The syscall numbers are x86_64's
(checked against the kernel headers by the sandbox tests); on any other architecture
:func:`deny_list_program` raises and the sandbox is reported unavailable rather than run unfiltered.

What the program does, in order: a syscall from any other ABI (i386 via ``int 0x80``, or x32) is
killed or refused, so the deny list cannot be bypassed by switching ABI; each denied syscall fails
with ``EPERM``; ``clone`` with any namespace flag fails with ``EPERM`` (creating namespaces is how a
process would undo the sandbox); ``clone3`` fails with ``ENOSYS`` because its flags sit behind a
pointer BPF cannot read, and glibc then falls back to ``clone``; everything else is allowed.
"""

from __future__ import annotations

import errno
import platform
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000

# Syscalls an executor never needs and a sandbox escape or host attack would: tracing other
# processes, mounts and namespaces, kernel keyrings, BPF, modules, kexec, reboot, clocks, swap,
# perf, io_uring (its operations bypass this filter), handle-based opens that step around mounts.
DENIED_X86_64: dict[str, int] = {
    "ptrace": 101,
    "syslog": 103,
    "personality": 135,
    "vhangup": 153,
    "pivot_root": 155,
    "adjtimex": 159,
    "chroot": 161,
    "acct": 163,
    "settimeofday": 164,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "sethostname": 170,
    "setdomainname": 171,
    "iopl": 172,
    "ioperm": 173,
    "init_module": 175,
    "delete_module": 176,
    "quotactl": 179,
    "nfsservctl": 180,
    "lookup_dcookie": 212,
    "clock_settime": 227,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "clock_adjtime": 305,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kcmp": 312,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "pidfd_getfd": 438,
    "mount_setattr": 442,
}
CLONE_X86_64, CLONE3_X86_64 = 56, 435
CLONE_NAMESPACE_FLAGS = (
    0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00000080
)  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME

# Classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h).
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16


class SeccompUnavailable(RuntimeError):
    """No filter for this machine's architecture: the sandbox must not start without one."""


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def deny_list_program(machine: str | None = None) -> bytes:
    """The filter as ``struct sock_filter`` instructions, ready to hand to bubblewrap."""
    machine = machine or platform.machine()
    if machine not in ("x86_64", "amd64", "AMD64"):
        raise SeccompUnavailable(f"no seccomp filter for architecture {machine!r} (only x86_64 is defined)")
    eperm, enosys = _RET_ERRNO | errno.EPERM, _RET_ERRNO | errno.ENOSYS
    prog = [
        _insn(_LD_W_ABS, 0, 0, _OFF_ARCH),
        _insn(_JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        _insn(_RET_K, 0, 0, _RET_KILL_PROCESS),
        _insn(_LD_W_ABS, 0, 0, _OFF_NR),
        _insn(_JGE_K, 0, 1, X32_SYSCALL_BIT),
        _insn(_RET_K, 0, 0, eperm),
    ]
    for nr in sorted(DENIED_X86_64.values()):
        prog += [_insn(_JEQ_K, 0, 1, nr), _insn(_RET_K, 0, 0, eperm)]
    prog += [
        _insn(_JEQ_K, 0, 1, CLONE3_X86_64),
        _insn(_RET_K, 0, 0, enosys),
        _insn(_JEQ_K, 0, 3, CLONE_X86_64),
        _insn(_LD_W_ABS, 0, 0, _OFF_ARG0),  # low 32 bits of the flags (little endian)
        _insn(_JSET_K, 0, 1, CLONE_NAMESPACE_FLAGS),
        _insn(_RET_K, 0, 0, eperm),
        _insn(_RET_K, 0, 0, _RET_ALLOW),
    ]
    return b"".join(prog)

"""How ``mpirun`` starts ranks inside the worker instances of an ``mpi`` job.

The MPI operator runs an SSH server in every worker pod and points ``mpirun`` at it through
its remote-shell agent (``OMPI_MCA_plm_rsh_agent``, or ``kubectl exec`` in its first version).
Here each worker instance runs a *rank host* (``python -m trainmaster.frameworks.mpi_rsh
serve``) that listens on the instance's port, and the launcher's agent (``python -m
trainmaster.frameworks.mpi_rsh HOST COMMAND...``, invoked by ``mpirun`` exactly as it would
invoke ``ssh``) asks the rank host of HOST to run COMMAND (``/bin/sh -c``, as sshd and the
operator's ``kubexec.sh`` do). The command (OpenMPI's ``orted``, Hydra's ``hydra_pmi_proxy``)
then runs as a child of the worker instance: in its process tree and cgroups, with its
environment and working directory, so the ranks it starts are the worker's and die with it.

Protocol (one TCP connection per command): the agent sends one JSON line ``{"key", "command"}``;
the rank host answers with frames ``<stream byte><4-byte length><payload>``: stream 1 stdout,
2 stderr, 0 the exit status (ASCII). The key is the job's own secret (a file in the job's
``mpi`` folder, readable only by the user running it), so no other local user can run commands
in the instance. If the agent goes away (``mpirun`` ended or killed it), the command's process
group is killed.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

KEY_FILE = "mpi-rank-host.key"
HOSTS_VARIABLE = "TM_MPI_HOSTS"  # "name=host:port,..." the launcher's agent resolves names with
KEY_VARIABLE = "TM_MPI_KEY"
CONNECT_TIMEOUT_VARIABLE = "TM_MPI_CONNECT_TIMEOUT"
STDOUT, STDERR, STATUS = 1, 2, 0
_HEADER = struct.Struct("!BI")
MAX_REQUEST = 1 << 20


def job_key(output_dir: str) -> str:
    """The job's rank-host secret: created once (0600) in the job's ``mpi`` folder (beside its
    output folder, whose files are copied out on success), then read."""
    path = Path(output_dir).parent / "mpi" / KEY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        for _ in range(50):  # another instance is writing it this very moment
            text = path.read_text().strip()
            if text:
                return text
            time.sleep(0.01)
        raise RuntimeError(f"{path} stays empty") from None
    key = secrets.token_hex(32)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    return key


# ---- the rank host (a worker instance) --------------------------------------------------------
def serve(host: str, port: int, key: str) -> None:
    """Accept commands until killed (the job's end stops the worker instance).

    The commands get a private temporary folder for OpenMPI's session directory and shared
    memory segments: every worker of a local job has the same host name, and OpenMPI names
    those files after the host, so two workers' ranks would otherwise share them."""
    import shutil
    import tempfile

    scratch = tempfile.mkdtemp(prefix="tm-mpi-")  # short: OpenMPI puts Unix sockets in it
    os.environ.update(
        {"OMPI_MCA_orte_tmpdir_base": scratch, "OMPI_MCA_btl_vader_backing_directory": scratch, "TMPDIR": scratch}
    )

    def stop(signum: int, _frame: object) -> None:
        shutil.rmtree(scratch, ignore_errors=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server = socket.create_server((host, port), backlog=64)
    print(f"[trainmaster] rank host listening on {host}:{port}", flush=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_handle, args=(conn, key), daemon=True).start()


def _send(conn: socket.socket, lock: threading.Lock, stream: int, data: bytes) -> None:
    with lock:
        conn.sendall(_HEADER.pack(stream, len(data)) + data)


def _handle(conn: socket.socket, key: str) -> None:
    with conn:
        request = _read_request(conn)
        if request is None or not hmac.compare_digest(str(request.get("key", "")), key):
            message = b"trainmaster rank host: refused: not this job's key\n"
            conn.sendall(_HEADER.pack(STDERR, len(message)) + message + _HEADER.pack(STATUS, 3) + b"255")
            return
        command = str(request.get("command", ""))
        print(f"[trainmaster] rank host runs: {command[:500]}", flush=True)
        child = subprocess.Popen(
            ["/bin/sh", "-c", command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        lock = threading.Lock()
        gone = threading.Event()

        def pump(pipe: object, stream: int) -> None:
            assert hasattr(pipe, "read1")
            while chunk := pipe.read1(65536):
                try:
                    _send(conn, lock, stream, chunk)
                except OSError:
                    gone.set()
                    return

        def watch_agent() -> None:  # the agent closing its side means: stop the command
            try:
                while conn.recv(4096):
                    pass
            except OSError:
                pass
            gone.set()

        pumps = [
            threading.Thread(target=pump, args=(child.stdout, STDOUT), daemon=True),
            threading.Thread(target=pump, args=(child.stderr, STDERR), daemon=True),
        ]
        for thread in pumps:
            thread.start()
        threading.Thread(target=watch_agent, daemon=True).start()
        while child.poll() is None:
            if gone.wait(0.2):
                _kill_group(child.pid)
                child.wait()
                return
        for thread in pumps:
            thread.join(5)
        try:
            _send(
                conn, lock, STATUS, str(child.returncode if child.returncode >= 0 else 128 - child.returncode).encode()
            )
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read_request(conn: socket.socket) -> dict[str, object] | None:
    conn.settimeout(30)
    data = b""
    while b"\n" not in data and len(data) < MAX_REQUEST:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    conn.settimeout(None)
    try:
        request = json.loads(data.partition(b"\n")[0])
    except ValueError:
        return None
    return request if isinstance(request, dict) else None


# ---- the agent (mpirun's remote shell, in the launcher) --------------------------------------
def hosts_from_environment() -> dict[str, str]:
    entries = [e for e in os.environ.get(HOSTS_VARIABLE, "").split(",") if "=" in e]
    return dict(e.split("=", 1) for e in entries)


def run_remote(host: str, command: str) -> int:
    """Run ``command`` in the rank host of ``host``; relay its output; its exit status."""
    hosts = hosts_from_environment()
    if host not in hosts:
        print(
            f"trainmaster mpi_rsh: unknown host '{host}' (the job's workers: {', '.join(hosts) or 'none'})",
            file=sys.stderr,
        )
        return 255
    address, _, port = hosts[host].rpartition(":")
    timeout = float(os.environ.get(CONNECT_TIMEOUT_VARIABLE, "60"))
    deadline, delay = time.monotonic() + timeout, 0.05
    while True:  # the worker is running; its rank host may not be listening yet
        try:
            conn = socket.create_connection((address, int(port)), timeout=10)
            break
        except OSError as exc:
            if time.monotonic() >= deadline:
                print(
                    f"trainmaster mpi_rsh: the rank host of '{host}' ({hosts[host]}) did not accept a "
                    f"connection within {timeout:g}s: {exc}",
                    file=sys.stderr,
                )
                return 255
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
    conn.settimeout(None)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # closing the socket stops the command
        signal.signal(sig, lambda *_: os._exit(255))
    with conn:
        conn.sendall(json.dumps({"key": os.environ.get(KEY_VARIABLE, ""), "command": command}).encode() + b"\n")
        reader = conn.makefile("rb")
        while True:
            header = reader.read(_HEADER.size)
            if len(header) < _HEADER.size:
                print(f"trainmaster mpi_rsh: the rank host of '{host}' closed the connection", file=sys.stderr)
                return 255
            stream, length = _HEADER.unpack(header)
            payload = reader.read(length)
            if stream == STATUS:
                return int(payload)
            out = sys.stdout.buffer if stream == STDOUT else sys.stderr.buffer
            out.write(payload)
            out.flush()


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        host = os.environ.get("TM_HOST", "127.0.0.1")
        port = int(os.environ["TM_PORT"])
        serve(host, port, os.environ[KEY_VARIABLE])
        return 0
    args = list(argv)
    while args and args[0].startswith("-"):  # ssh-style options mpirun may add (-x, -n): none apply
        args.pop(0)
    if len(args) < 2:
        print("usage: python -m trainmaster.frameworks.mpi_rsh HOST COMMAND... | serve", file=sys.stderr)
        return 2
    return run_remote(args[0], " ".join(args[1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

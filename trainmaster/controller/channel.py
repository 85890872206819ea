"""The instance channel: the one way a job's code reaches its controller.

An instance is handed no store URL and no server token. It gets ``TM_CHANNEL`` (where to ask)
and ``TM_CHANNEL_TOKEN`` (who it is), as a Kubernetes pod gets its service account's token, and
the token lets it do exactly three things, each for its own job and instance only:

- ``GET /v1/dependencies``: the addresses of the roles *its role* depends on (the wait step);
- ``POST /v1/metrics``: report one metric point of its own attempt (``trainmaster.report``),
  checked as ``report()`` checks it, at most :data:`MAX_POINTS` per attempt;
- ``POST /v1/views/<kind>``: publish one capability record into its job's views
  (``trainmaster.publish``), checked, at most :data:`MAX_VIEW_BYTES` per kind and job.

A token is ``tm1.<claims>.<mac>``: the claims name the job's uid, the role, the replica index and
the attempt; the MAC is an HMAC-SHA256 under a key kept in the store (:mod:`trainmaster.store.keys`),
so every controller of the store (a restarted server, a ``trainmaster run``, a standby taking
over) honours the tokens of instances it did not start, and no token can be forged or widened.
A token is only good while its attempt is the instance's current one and the job exists.

The channel is served by whichever controller process runs (``trainmaster run`` or
``trainmaster server``), over HTTP on a Unix socket that every process of this machine reaches
whatever its network namespace (local agent, testbed hosts, containers, which get the socket
mounted), and, for backends whose instances run elsewhere (Ray nodes, Kubernetes pods), on a TCP
port. Both addresses are derived from the store, so they stay the same when the controller is
killed and restarted: instances retry until it is back (:mod:`trainmaster.runtime.channel`).
Several controller processes of one store on one machine take turns: one serves, the others
wait to take over (an ``flock``), so the socket never goes unserved while one of them lives.
"""

from __future__ import annotations

import atexit
import base64
import fcntl
import hashlib
import hmac
import json
import logging
import os
import socket
import socketserver
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from trainmaster.errors import UserError
from trainmaster.runtime.report import check_point
from trainmaster.runtime.views import check_record, views_dir
from trainmaster.store.db import sqlite_path
from trainmaster.store.keys import shared_key
from trainmaster.store.models import InstanceRow, JobRow, MetricRow, RegistryRow

log = logging.getLogger("trainmaster.channel")

TOKEN_PREFIX = "tm1"
KEY_NAME = "channel"
MAX_BODY = 512 * 1024  # one metric point or one view record (publish refuses records over 256 KiB)
MAX_POINTS = 100_000  # metric points per attempt: a point a second for a day
MAX_COUNTED = 10_000  # attempts whose points this process counts in memory (the store has them all)
MAX_VIEW_BYTES = 8 * 1024 * 1024  # per kind and job; the dashboard reads at most the last 512 KiB
LIVE = ("starting", "running", "unknown", "terminating")
RETRY_BIND_S = 1.0  # a controller waiting to serve the channel looks again this often


@dataclass(frozen=True)
class Claims:
    """Who a token speaks for: one attempt of one instance of one job."""

    job_uid: str
    role: str
    index: int
    attempt: int


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def mint(key: bytes, claims: Claims) -> str:
    body = _b64(json.dumps([claims.job_uid, claims.role, claims.index, claims.attempt]).encode())
    # hmac.digest: the one-shot form (OpenSSL's, no HMAC object): once per replica of a gang start
    mac = hmac.digest(key, f"{TOKEN_PREFIX}.{body}".encode(), "sha256")
    return f"{TOKEN_PREFIX}.{body}.{_b64(mac)}"


def verify(key: bytes, token: str) -> Claims | None:
    """The claims of a genuine token, None for anything else."""
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX or len(token) > 1024:
        return None
    try:
        expected = hmac.digest(key, f"{parts[0]}.{parts[1]}".encode(), "sha256")
        if not hmac.compare_digest(expected, _unb64(parts[2])):
            return None
        uid, role, index, attempt = json.loads(_unb64(parts[1]))
    except (ValueError, TypeError):
        return None
    if not (isinstance(uid, str) and isinstance(role, str) and isinstance(index, int) and isinstance(attempt, int)):
        return None
    return Claims(uid, role, index, attempt)


def store_digest(db_url: str) -> str:
    """A short name for a store, the same in every process that opens it."""
    return hashlib.sha256(db_url.encode()).hexdigest()[:16]


def socket_path(db_url: str) -> Path:
    """Where this machine's controllers of the store serve the channel: short (a Unix socket
    path has at most 107 bytes) and the same for every controller of the store."""
    folder = Path(os.environ.get("TRAINMASTER_RUNTIME_DIR") or f"/tmp/trainmaster-{os.getuid()}")
    return folder / f"channel-{store_digest(db_url)}.sock"


def default_tcp_port(db_url: str) -> int:
    """The channel's TCP port for the store (``TRAINMASTER_CHANNEL_PORT`` overrides it)."""
    configured = os.environ.get("TRAINMASTER_CHANNEL_PORT")
    if configured:
        return int(configured)
    return 20000 + int(store_digest(db_url), 16) % 10000


def default_tcp_host() -> str:
    """The address instances on other machines reach this one at (``TRAINMASTER_CHANNEL_HOST``
    overrides it): the address of the interface the default route leaves by."""
    configured = os.environ.get("TRAINMASTER_CHANNEL_HOST")
    if configured:
        return configured
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent, the kernel picks a route
        return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


class ChannelError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class ChannelService:
    """What the channel answers; the transport (:class:`_Handler`) only carries it."""

    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions
        self.key = shared_key(sessions, KEY_NAME)
        self._points: dict[Claims, int] = {}
        self._lock = threading.Lock()
        self._view_locks: dict[str, threading.Lock] = {}

    def token(self, claims: Claims) -> str:
        return mint(self.key, claims)

    # ---- who asks ------------------------------------------------------------------------------
    def authenticate(self, authorization: str) -> Claims:
        token = authorization.removeprefix("Bearer ").strip() if authorization.startswith("Bearer ") else ""
        claims = verify(self.key, token) if token else None
        if claims is None:
            raise ChannelError(401, "missing or wrong instance token (TM_CHANNEL_TOKEN)")
        return claims

    def _instance(self, session: Session, claims: Claims) -> tuple[JobRow, InstanceRow]:
        job = session.scalar(select(JobRow).where(JobRow.uid == claims.job_uid))
        if job is None:
            raise ChannelError(404, "this instance's job no longer exists")
        inst = session.scalar(
            select(InstanceRow).where(
                InstanceRow.job_id == job.id, InstanceRow.role == claims.role, InstanceRow.index == claims.index
            )
        )
        if inst is None or inst.attempt != claims.attempt or inst.state not in LIVE:
            raise ChannelError(403, "this token's attempt is not the instance's live attempt any more")
        return job, inst

    # ---- what it may do ------------------------------------------------------------------------
    def dependencies(self, claims: Claims) -> dict[str, Any]:
        """Each dependency of the instance's role: the addresses recorded so far and how many
        instances meet its condition (the wait step's question)."""
        with self.sessions() as session:
            job, _ = self._instance(session, claims)
            answers = []
            for dep in _depends_on(job.spec, claims.role):
                role, condition = dep["role"], dep["condition"]
                if condition == "Placed":  # an address, whatever the instance waits for
                    rows = session.execute(
                        select(InstanceRow.index, InstanceRow.address).where(
                            InstanceRow.job_id == job.id,
                            InstanceRow.role == role,
                            InstanceRow.state.in_(("starting", "running", "unknown", "succeeded")),
                            InstanceRow.address.is_not(None),
                            InstanceRow.address != "",
                        )
                    ).all()
                else:
                    rows = session.execute(
                        select(RegistryRow.index, RegistryRow.address).where(
                            RegistryRow.job_id == job.id, RegistryRow.role == role
                        )
                    ).all()
                addresses = {int(index): str(address or "") for index, address in rows}
                done = len(addresses)
                if condition == "Succeeded":
                    done = (
                        session.scalar(
                            select(func.count(InstanceRow.id)).where(
                                InstanceRow.job_id == job.id, InstanceRow.role == role, InstanceRow.state == "succeeded"
                            )
                        )
                        or 0
                    )
                answers.append(
                    {
                        "role": role,
                        "condition": condition,
                        "done": done,
                        "addresses": [addresses[i] for i in sorted(addresses)],
                    }
                )
            return {"dependencies": answers}

    def report(self, claims: Claims, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ChannelError(400, "a metric point is a JSON object")
        metrics = body.get("values")
        if not isinstance(metrics, dict):
            raise ChannelError(400, "a metric point needs 'values': {name: number}")
        try:
            values = check_point(body.get("step"), body.get("epoch"), body.get("total"), metrics)
        except UserError as exc:
            raise ChannelError(400, exc.message) from None
        with self.sessions() as session:
            job, _ = self._instance(session, claims)
            with self._lock:
                if len(self._points) > MAX_COUNTED:  # counts of attempts long ended: re-read when needed
                    self._points.clear()
                used = self._points.get(claims)
                if used is None:
                    used = (
                        session.scalar(
                            select(func.count(MetricRow.id)).where(
                                MetricRow.job_id == job.id,
                                MetricRow.role == claims.role,
                                MetricRow.index == claims.index,
                                MetricRow.attempt == claims.attempt,
                            )
                        )
                        or 0
                    )
                if used >= MAX_POINTS:
                    raise ChannelError(
                        429,
                        f"this attempt reported {MAX_POINTS:,} points already, the most one attempt may; "
                        "report less often",
                    )
                self._points[claims] = used + 1
            session.add(
                MetricRow(
                    job_id=job.id,
                    role=claims.role,
                    index=claims.index,
                    attempt=claims.attempt,
                    step=body.get("step"),
                    epoch=body.get("epoch"),
                    total=body.get("total"),
                    values=values,
                )
            )
            session.commit()
        return {"stored": True}

    def publish(self, claims: Claims, kind: str, body: Any) -> dict[str, Any]:
        try:
            line = check_record(kind, body)
        except UserError as exc:
            raise ChannelError(400, exc.message) from None
        with self.sessions() as session:
            job, _ = self._instance(session, claims)
            run_dir = job.run_dir
        if not run_dir:
            raise ChannelError(409, "the job has no folder yet")
        folder = views_dir(Path(run_dir) / "output")
        path = folder / f"{kind}.jsonl"
        data = line.encode()
        with self._lock:
            lock = self._view_locks.setdefault(str(path), threading.Lock())
        with lock:
            folder.mkdir(parents=True, exist_ok=True)
            size = path.stat().st_size if path.exists() else 0
            if size + len(data) > MAX_VIEW_BYTES:
                raise ChannelError(
                    413,
                    f"the job's {kind} view holds {size:,} bytes; a job may publish at most "
                    f"{MAX_VIEW_BYTES // (1024 * 1024)} MiB of each kind (publish less often, or smaller records)",
                )
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        return {"stored": True}

    def answer(self, method: str, path: str, authorization: str, body: bytes) -> tuple[int, dict[str, Any]]:
        """One request: ``(status, JSON answer)``."""
        try:
            claims = self.authenticate(authorization)
            if method == "GET" and path == "/v1/dependencies":
                return 200, self.dependencies(claims)
            if method == "POST" and path == "/v1/metrics":
                return 200, self.report(claims, _json(body))
            if method == "POST" and path.startswith("/v1/views/"):
                return 200, self.publish(claims, path.removeprefix("/v1/views/"), _json(body))
            raise ChannelError(404, f"no such channel call: {method} {path[:100]}")
        except ChannelError as exc:
            return exc.status, {"error": exc.message}


def _json(body: bytes) -> Any:
    try:
        return json.loads(body or b"null")
    except ValueError:
        raise ChannelError(400, "the body is not JSON") from None


def _depends_on(spec: dict[str, Any], role: str) -> list[dict[str, str]]:
    """The role's dependencies in the stored (defaulted) job document."""
    roles = (spec.get("spec") or {}).get("roles") or []
    for entry in roles:
        if entry.get("name") == role:
            return [
                {"role": str(d.get("role")), "condition": str(d.get("condition") or "Running")}
                for d in entry.get("dependsOn") or []
            ]
    return []


class _Handler(BaseHTTPRequestHandler):
    server: Any
    protocol_version = "HTTP/1.1"
    timeout = 30

    def _answer(self, method: str) -> None:
        length = self.headers.get("Content-Length") or "0"
        if not length.isdigit() or int(length) > MAX_BODY:
            self._send(413, {"error": f"a channel request is at most {MAX_BODY} bytes"})
            return
        body = self.rfile.read(int(length)) if int(length) else b""
        try:
            status, answer = self.server.service.answer(
                method, self.path.split("?", 1)[0], self.headers.get("Authorization", ""), body
            )
        except Exception:  # the store is away or a bug: the instance retries, the log says why
            log.exception("instance channel: %s %s failed", method, self.path[:100])
            status, answer = 503, {"error": "the controller cannot answer right now; retry"}
        self._send(status, answer)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._answer("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._answer("POST")

    def _send(self, status: int, answer: dict[str, Any]) -> None:
        payload = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass  # one line per report would drown the server's log

    def address_string(self) -> str:
        return "instance"


class _TcpHandler(_Handler):
    """Over TCP, Nagle's algorithm off (``TCP_NODELAY``): an answer is written as its headers and
    then its body, and the body would otherwise wait for the instance's delayed ACK of the
    headers (up to 40 ms a request). Not for the Unix socket, which has no such option."""

    disable_nagle_algorithm = True


class _QuietErrors(socketserver.BaseServer):
    """An instance that dies or is killed mid-request resets its connection: that is the
    instance's story (its exit is recorded), not the controller's, so it is a debug line. Any
    other handler failure goes to the log, never as socketserver's traceback on stderr, which
    ends up in the output of `trainmaster run`."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            log.debug("instance channel: a peer went away mid-request: %s", error)
        else:
            log.exception("instance channel: a request failed")


class _UnixServer(socketserver.ThreadingMixIn, _QuietErrors, socketserver.UnixStreamServer):
    daemon_threads = True
    allow_reuse_address = False


class _TcpServer(socketserver.ThreadingMixIn, _QuietErrors, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Tcp6Server(_TcpServer):
    address_family = socket.AF_INET6


class InstanceChannel:
    """This process's channel for one store: serves it (or waits to, while another process of
    the store does) from :meth:`start` on, in daemon threads."""

    def __init__(self, sessions: sessionmaker[Session], db_url: str, tcp_port: int | None = None):
        """``tcp_port``: where TCP instances reach it (default: :func:`default_tcp_port` of the
        store); a caller whose successive stores stand for one state of record (the operator's
        leaders) gives one that stays, so instances started under one store reach the next."""
        self.service = ChannelService(sessions)
        self.unix_path = socket_path(db_url)
        store_file = sqlite_path(db_url)
        # who serves the socket: an flock beside the store (or the socket), cleaned with it
        self.lock_path = Path(f"{store_file or self.unix_path}.channel.lock")
        self.tcp_port = tcp_port or default_tcp_port(db_url)
        self._tcp_host: str | None = None
        self._started: set[str] = set()
        self._lock = threading.Lock()
        self._servers: list[socketserver.BaseServer] = []
        self._closed = threading.Event()

    def url(self, reach: str) -> str:
        """What an instance puts in ``TM_CHANNEL``: the Unix socket (``reach`` "unix") or the
        TCP address (``reach`` "tcp"); starts serving that transport on first use."""
        self.start(reach)
        if reach == "tcp":
            return f"http://{_bracketed(self.tcp_host)}:{self.tcp_port}"
        return f"unix://{self.unix_path}"

    @property
    def tcp_host(self) -> str:
        if self._tcp_host is None:
            self._tcp_host = default_tcp_host()
        return self._tcp_host

    def start(self, reach: str = "unix") -> None:
        with self._lock:
            if reach in self._started:
                return
            self._started.add(reach)
        target = self._serve_unix if reach == "unix" else self._serve_tcp
        threading.Thread(target=target, name=f"instance-channel-{reach}", daemon=True).start()

    def _serve_unix(self) -> None:
        folder = self.unix_path.parent
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if folder.stat().st_uid == os.getuid():
            folder.chmod(0o700)
        lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        while True:  # another process of this store serves: take over when it ends
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if self._closed.wait(RETRY_BIND_S):
                    os.close(lock_fd)
                    return
        try:
            self.unix_path.unlink()  # the socket of a controller that died
        except FileNotFoundError:
            pass
        server = _UnixServer(str(self.unix_path), _Handler)
        server.service = self.service  # type: ignore[attr-defined]
        os.chmod(self.unix_path, 0o600)
        atexit.register(_remove, self.unix_path)
        self._serve(server)
        os.close(lock_fd)

    def _serve_tcp(self) -> None:
        kind = _Tcp6Server if ":" in self.tcp_host else _TcpServer
        said = False
        while True:
            try:
                server = kind((self.tcp_host, self.tcp_port), _TcpHandler)
                break
            except OSError as exc:  # another controller of the store serves the port: take over later
                if not said:
                    log.warning(
                        "instance channel: %s:%d is taken (%s); serving it once it is free "
                        "(TRAINMASTER_CHANNEL_HOST/_PORT choose another)",
                        self.tcp_host,
                        self.tcp_port,
                        exc.strerror or exc,
                    )
                    said = True
                if self._closed.wait(RETRY_BIND_S):
                    return
        server.service = self.service  # type: ignore[attr-defined]
        self._serve(server)

    def _serve(self, server: socketserver.BaseServer) -> None:
        with self._lock:
            self._servers.append(server)
            closed = self._closed.is_set()
        if not closed:
            server.serve_forever(poll_interval=0.2)
        server.server_close()

    def close(self) -> None:
        """Stop serving (the port and the socket are free for the next server); waits for the
        serving threads' loops to end."""
        self._closed.set()
        with self._lock:
            servers, self._servers = self._servers, []
        for server in servers:
            server.shutdown()


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


_channels: dict[str, InstanceChannel] = {}
_channels_lock = threading.Lock()


def channel_for(sessions: sessionmaker[Session], db_url: str) -> InstanceChannel:
    """The one channel of this process for the store at ``db_url`` (every controller of the
    process shares it)."""
    with _channels_lock:
        channel = _channels.get(db_url)
        if channel is None:
            channel = _channels[db_url] = InstanceChannel(sessions, db_url)
        return channel


def close_channels() -> None:
    """Stop serving every channel of this process (their sockets and ports are free after):
    for a process that is done with its controllers, such as a test session between tests,
    whose stores each got a channel of their own that would otherwise serve until exit."""
    with _channels_lock:
        channels = list(_channels.values())
        _channels.clear()
    for channel in channels:
        channel.close()

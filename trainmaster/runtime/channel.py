"""An instance's side of the instance channel (:mod:`trainmaster.controller.channel`).

Standard library only: the wait step and ``trainmaster.report`` run it in every instance. The
controller may be away for a while (killed and restarted, a standby taking over): a call retries
with a growing pause until its deadline, then fails with a message that says what it waited
for, where, and what to do. After such a failure the process's next calls fail at once but for
a brief try every few seconds (:data:`AWAY_RETRY_S`), until one gets through, so code that
reports every step runs on at its own pace while no controller listens.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

CHANNEL_VARIABLE = "TM_CHANNEL"
TOKEN_VARIABLE = "TM_CHANNEL_TOKEN"
TIMEOUT_VARIABLE = "TM_CHANNEL_TIMEOUT"
DEFAULT_TIMEOUT = 60.0  # seconds a call waits for an absent controller (a restart takes a few)


class ChannelUnavailable(RuntimeError):
    """The controller did not answer within the call's deadline."""


class ChannelRefused(RuntimeError):
    """The controller answered, and refused (the message says why)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


#: Once a call found the controller away for its whole timeout, the next calls of this process
#: (those without their own deadline) fail at once, except one every AWAY_RETRY_S that tries for
#: AWAY_TRY_S: a training loop reporting every step must not wait a minute per step while nobody
#: listens. The first call that gets through ends it.
AWAY_TRY_S = 1.0
AWAY_RETRY_S = 5.0
_away_retry_at: float | None = None  # monotonic time of the next try while away; None: not away


@dataclass(frozen=True)
class Channel:
    url: str  # unix:///path/to.sock or http://host:port
    token: str
    timeout: float = DEFAULT_TIMEOUT

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> Channel | None:
        """This instance's channel, None outside an instance."""
        env = os.environ if environ is None else environ
        url, token = env.get(CHANNEL_VARIABLE), env.get(TOKEN_VARIABLE)
        if not url or not token:
            return None
        try:
            timeout = float(env.get(TIMEOUT_VARIABLE) or DEFAULT_TIMEOUT)
        except ValueError:
            timeout = DEFAULT_TIMEOUT
        return cls(url, token, timeout)

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        parts = urlsplit(self.url)
        if parts.scheme == "unix":
            return _UnixConnection(parts.path, timeout)
        if parts.scheme == "http" and parts.hostname:
            return http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
        raise ChannelRefused(0, f"{CHANNEL_VARIABLE}={self.url!r} is not a channel address")

    def call(self, method: str, path: str, body: Any = None, deadline: float | None = None) -> Any:
        """One call, retried while the controller is away until ``deadline`` (monotonic; default
        :attr:`timeout` from now). :class:`ChannelRefused` when it answers with a refusal."""
        global _away_retry_at
        begun = time.monotonic()
        if deadline is None and _away_retry_at is not None:
            if begun < _away_retry_at:
                raise ChannelUnavailable(f"the controller at {self.url} is still away (it did not answer earlier)")
            deadline = begun + AWAY_TRY_S
        elif deadline is None:
            deadline = begun + self.timeout
        payload = None if body is None else json.dumps(body, allow_nan=False).encode()
        pause, why = 0.05, ""
        while True:
            left = deadline - time.monotonic()
            try:
                connection = self._connection(max(1.0, min(left, 30.0)))
                try:
                    headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
                    connection.request(method, path, body=payload, headers=headers)
                    response = connection.getresponse()
                    status, data = response.status, response.read()
                finally:
                    connection.close()
                if status == 503:
                    why = "it answered 503 (its store is away)"
                else:
                    answer = json.loads(data or b"{}")
                    _away_retry_at = None
                    if status >= 400:
                        raise ChannelRefused(status, str(answer.get("error") or f"HTTP {status}"))
                    return answer
            except (OSError, http.client.HTTPException, ValueError) as exc:
                why = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                _away_retry_at = time.monotonic() + AWAY_RETRY_S
                raise ChannelUnavailable(
                    f"the controller did not answer at {self.url} for {time.monotonic() - begun:.1f} s ({why}); it may have "
                    "been stopped: a restarted `trainmaster server`, or `trainmaster job resume JOB`, serves "
                    "its instances again"
                )
            time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
            pause = min(pause * 2, 1.0)

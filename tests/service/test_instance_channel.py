"""A job's code cannot act as the controller (issue 39, item 7): an instance is handed neither the
store nor the server's token, finds neither in its environment, in the server's or the node
agent's ``/proc/PID/environ`` or in its job's files, and reaches the controller only through its
instance channel, whose token speaks for that one attempt alone.

Mechanisms: the wait step ("a dependent role's instances first run an injected wait step that
watches the address registry"), now answered by the controller over the channel, and status
("states and counts are stored so that a user can query them at any time"), with the metrics the
roles report; fault tolerance across a controller killed -9 and restarted."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_process import ServerProcess
from trainmaster.runtime.channel import Channel, ChannelRefused, ChannelUnavailable

pytestmark = pytest.mark.timeout(240)

ADMIN_TOKEN = "admin-token-0123456789abcdef"

SNOOP = r"""
import json, os, sys, urllib.request
import trainmaster
from trainmaster.runtime.channel import Channel, ChannelRefused

out = os.path.join(os.environ["TM_OUTPUT_DIR"], "found.json")
found = {"env": dict(os.environ), "proc": {}, "files": {}, "calls": {}}
for name, pid in (("server", os.environ["SERVER_PID"]), ("agent", open(os.environ["AGENT_PID_FILE"]).read().split()[0])):
    try:
        found["proc"][name] = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
    except OSError as exc:
        found["proc"][name] = f"unreadable: {exc}"
run_dir = os.path.dirname(os.environ["TM_OUTPUT_DIR"])
for folder, _, files in os.walk(run_dir):
    for name in files:
        path = os.path.join(folder, name)
        if name != "found.json":
            found["files"][path] = open(path, "rb").read(1 << 20).decode(errors="replace")
channel = Channel.from_environment()
found["calls"]["report"] = trainmaster.report(step=1, loss=0.5)
found["calls"]["dependencies"] = channel.call("GET", "/v1/dependencies")
for label, token in (("tampered", os.environ["FORGED_TOKEN"]), ("admin", os.environ["ADMIN_GUESS"])):
    try:
        Channel(channel.url, token, 5).call("POST", "/v1/metrics", {"values": {"loss": 9.0}})
        found["calls"][label] = "accepted"
    except ChannelRefused as exc:
        found["calls"][label] = exc.status
request = urllib.request.Request(os.environ["API"] + "/api/v1/jobs", headers={"Authorization": "Bearer " + os.environ["TM_CHANNEL_TOKEN"]})
try:
    urllib.request.urlopen(request, timeout=10)
    found["calls"]["rest"] = 200
except urllib.error.HTTPError as exc:
    found["calls"]["rest"] = exc.code
found["channel"] = [channel.url, channel.token]
json.dump(found, open(out, "w"))
"""


@pytest.fixture
def server(tmp_path: Path) -> ServerProcess:
    srv = ServerProcess(tmp_path, env={"TRAINMASTER_TOKEN": ADMIN_TOKEN})
    srv.token = ADMIN_TOKEN
    yield srv
    srv.stop()


def wait_end(server: ServerProcess, job: int | str, timeout: float = 120) -> dict:
    return server.wait_state(job, {"succeeded", "failed", "cancelled"}, timeout=timeout)


def test_an_instance_finds_neither_store_nor_token_and_its_token_speaks_for_itself(
    server: ServerProcess, tmp_path: Path
) -> None:
    victim = server.submit(
        {
            "apiVersion": "trainmaster/v1",
            "kind": "Job",
            "metadata": {"name": "victim"},
            "spec": {"roles": [{"name": "main", "command": [sys.executable, "-c", "import time; time.sleep(30)"]}]},
        }
    )
    victim_uid = server.status(victim)["uid"]
    db_url = server.env["TRAINMASTER_DB"]
    home = Path(server.env["TRAINMASTER_HOME"])
    # FORGED_TOKEN: the snoop's own token with the victim's job in its claims (made as it starts)
    snoop_role = {
        "name": "snoop",
        "command": [sys.executable, "-c", "import os, sys\n" + "exec(open(os.environ['SNOOP_FILE']).read())"],
        "dependsOn": [{"role": "first"}],
        "env": {
            "SERVER_PID": str(server.proc.pid),
            "AGENT_PID_FILE": str(home / "agent" / "agent.pid"),
            "API": server.url,
            "SNOOP_FILE": str(tmp_path / "snoop.py"),
            "ADMIN_GUESS": "admin-token-guessed",
        },
    }
    (tmp_path / "snoop.py").write_text(
        "import os, json, base64\n"
        "p, c, m = os.environ['TM_CHANNEL_TOKEN'].split('.')\n"
        "claims = json.loads(base64.urlsafe_b64decode(c + '=' * (-len(c) % 4)))\n"
        f"claims[0] = {victim_uid!r}\n"
        "os.environ['FORGED_TOKEN'] = p + '.' + base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b'=')"
        ".decode() + '.' + m\n" + SNOOP
    )
    first = {"name": "first", "ports": 1, "command": [sys.executable, "-c", "import time; time.sleep(20)"]}
    snoop_job = server.submit(
        {
            "apiVersion": "trainmaster/v1",
            "kind": "Job",
            "metadata": {"name": "snoop"},
            "spec": {"roles": [first, snoop_role]},
        }
    )
    deadline = time.monotonic() + 120
    found_file = None
    while found_file is None or not found_file.exists():
        assert time.monotonic() < deadline, server.status(snoop_job)["events"][-5:]
        time.sleep(0.5)
        found_file = Path(server.status(snoop_job)["runDir"]) / "output" / "found.json"
    time.sleep(0.5)
    found = json.loads(found_file.read_text())

    # nothing handed over: no store URL, no token, in its environment or its job's files
    for name in ("TM_DB_URL", "TRAINMASTER_DB", "TRAINMASTER_TOKEN", "TRAINMASTER_TOKEN_FILE", "TRAINMASTER_HOME"):
        assert name not in found["env"], name
    everything = json.dumps(found["env"]) + json.dumps(found["files"])
    assert ADMIN_TOKEN not in everything and db_url not in everything
    assert any(path.endswith("launch_spec.json") for path in found["files"])  # the wait step's file was read
    # the server's and the node agent's /proc/PID/environ (readable here: all of it runs as root)
    for name, environ in found["proc"].items():
        assert ADMIN_TOKEN not in environ and db_url not in environ, name
    assert "TRAINMASTER_TOKEN=" + ADMIN_TOKEN not in found["proc"]["server"]
    # its channel token does its own instance's business, and nothing else
    assert found["calls"]["report"] is True
    assert found["calls"]["dependencies"]["dependencies"][0]["role"] == "first"
    assert found["calls"]["tampered"] == 401  # the victim's job in the claims: the MAC no longer holds
    assert found["calls"]["admin"] == 401
    assert found["calls"]["rest"] == 401  # the channel token is not a token of the API
    status = wait_end(server, snoop_job)
    assert status["state"] == "succeeded", status["events"][-5:]
    snooped = next(i for i in status["instances"] if i["role"] == "snoop")
    assert snooped["metrics"]["values"] == {"loss": 0.5}  # its own point, for its own instance
    assert server.status(victim)["instances"][0]["metrics"] is None  # nothing reached the victim
    # a token whose attempt has ended is good for nothing any more
    url, token = found["channel"]
    with pytest.raises(ChannelRefused) as ended:
        Channel(url, token, 5).call("POST", "/v1/metrics", {"values": {"loss": 1.0}})
    assert ended.value.status == 403
    httpx.post(f"{server.url}/api/v1/jobs/{victim}/cancel", json={}, headers=server.auth(), timeout=30)


def test_reports_wait_out_a_controller_killed_and_restarted(server: ServerProcess) -> None:
    """An instance reporting while its controller is killed -9 and restarted: the calls retry
    until it is back, and no point is lost."""
    code = (
        "import time, trainmaster\n"
        "for step in range(1, 31):\n"
        "    assert trainmaster.report(step=step, total=30, loss=1.0 / step)\n"
        "    time.sleep(0.2)\n"
    )
    job = server.submit(
        {
            "apiVersion": "trainmaster/v1",
            "kind": "Job",
            "metadata": {"name": "reporter"},
            "spec": {"roles": [{"name": "main", "command": [sys.executable, "-c", code]}]},
        }
    )
    deadline = time.monotonic() + 60
    while (server.status(job)["instances"] or [{}])[0].get("metrics") is None:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    server.kill9()
    time.sleep(3)  # the instance keeps reporting into the void meanwhile, and waits
    server.start()
    status = wait_end(server, job)
    assert status["state"] == "succeeded", status["events"][-5:]
    assert status["instances"][0]["metrics"]["step"] == 30
    assert status["instances"][0]["attempt"] == 1


def test_an_absent_controller_is_said_clearly_after_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nobody serves the channel: report() says so once on stderr after TM_CHANNEL_TIMEOUT and
    training goes on at its own pace (the next reports fail at once, but for a brief try every
    few seconds); a call with its own deadline raises with where it asked and what to do."""
    import trainmaster
    from trainmaster.runtime import channel as instance_channel

    monkeypatch.setattr(instance_channel, "_away_retry_at", None)  # this process's memory of an absence
    monkeypatch.setenv("TM_CHANNEL", f"unix://{tmp_path / 'nobody.sock'}")
    monkeypatch.setenv("TM_CHANNEL_TOKEN", "tm1.x.y")
    monkeypatch.setenv("TM_CHANNEL_TIMEOUT", "1.5")
    started = time.monotonic()
    assert trainmaster.report(step=1, loss=0.1) is False
    assert 1.0 < time.monotonic() - started < 10
    started = time.monotonic()
    assert all(trainmaster.report(step=s, loss=0.1) is False for s in range(2, 50))
    assert time.monotonic() - started < 1.5  # away: no step waits for it
    channel = Channel.from_environment()
    assert channel is not None and os.environ["TM_CHANNEL_TIMEOUT"] == "1.5"
    with pytest.raises(ChannelUnavailable, match="nobody.sock.*resume"):
        channel.call("GET", "/v1/dependencies", deadline=time.monotonic() + 0.5)


def test_an_instance_that_resets_its_connection_leaves_no_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    """An instance killed mid-request resets the channel's connection; the controller's stderr
    (which `trainmaster run` shows the user) stays free of socketserver's traceback (CI saw one
    fail a corpus run)."""
    import socket
    import struct
    import threading

    from trainmaster.controller.channel import _Handler, _TcpServer

    server = _TcpServer(("127.0.0.1", 0), _Handler)
    server.service = None  # type: ignore[attr-defined]  # never reached: no request line arrives
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        for _ in range(5):
            peer = socket.create_connection(server.server_address, timeout=5)
            peer.sendall(b"GET /v1/depend")  # half a request line, then a reset
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            peer.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and threading.active_count() > 2:
            time.sleep(0.05)  # the handler threads meet the resets
        time.sleep(0.2)
    finally:
        server.shutdown()
        server.server_close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err


def test_the_tcp_channel_answers_with_nagles_algorithm_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The channel over TCP (instances on other hosts, in containers, in pods) sets
    ``TCP_NODELAY`` on every accepted connection: the handler writes an answer's headers and its
    body apart, and with Nagle's algorithm on the body waited for the instance's delayed ACK of
    the headers (up to 40 ms a report). Fails on a channel served with the plain handler."""
    import socket

    from trainmaster.controller import channel as module
    from trainmaster.store.db import make_engine, session_factory

    seen: list[int] = []
    setup = module._TcpHandler.setup

    def recording_setup(handler: module._TcpHandler) -> None:
        setup(handler)
        seen.append(handler.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    monkeypatch.setattr(module._TcpHandler, "setup", recording_setup)
    monkeypatch.setenv("TRAINMASTER_CHANNEL_HOST", "127.0.0.1")
    monkeypatch.setenv("TRAINMASTER_RUNTIME_DIR", str(tmp_path / "run"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"sqlite:///{tmp_path / 'store.db'}"
    served = module.InstanceChannel(session_factory(make_engine(url)), url, tcp_port=port)
    try:
        address = served.url("tcp")
        deadline = time.monotonic() + 10
        answer = None
        while answer is None:  # the serving thread binds the port after url() returns
            try:
                answer = httpx.get(address + "/v1/dependencies", headers={"Authorization": "Bearer x"}, timeout=5)
            except httpx.ConnectError:
                assert time.monotonic() < deadline, f"the channel did not serve {address} within 10 s"
                time.sleep(0.05)
        assert answer.status_code == 401, answer.text
    finally:
        served.close()
    assert seen and all(seen), seen

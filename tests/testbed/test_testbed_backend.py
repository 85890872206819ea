"""The testbed backend: the controller places a job's instances on testbed hosts, each with its
host's address in TM_HOST, and its roles talk to each other across the capped links."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller_harness import Harness, job, py
from trainmaster.backends.base import PlacementRequest
from trainmaster.backends.testbed import TestbedBackend
from trainmaster.errors import UserError

SERVER = """
import json, os, socket
host, port = os.environ["TM_HOST"], int(os.environ["TM_PORT"])
with socket.create_server((host, port)) as srv:
    srv.settimeout(60)
    conn, peer = srv.accept()
    with conn:
        data = conn.recv(100)
        conn.sendall(data.upper())
out = os.path.join(os.environ["TM_OUTPUT_DIR"], "server.json")
json.dump({"bound": host, "peer": peer[0], "got": data.decode()}, open(out, "w"))
"""

CLIENT = """
import json, os, socket, time
host, port = os.environ["TM_SERVICE_SERVER"].split(",")[0].rsplit(":", 1)
deadline = time.monotonic() + 30
while True:  # the server's address is known before it listens: retry until it does
    try:
        sock = socket.create_connection((host, int(port)), timeout=5)
        break
    except ConnectionRefusedError:
        if time.monotonic() > deadline:
            raise SystemExit("server did not listen within 30 s")
        time.sleep(0.2)
with sock:
    sock.sendall(b"hello across the link")
    reply = sock.recv(100).decode()
out = os.path.join(os.environ["TM_OUTPUT_DIR"], "client.json")
json.dump({"host": os.environ["TM_HOST"], "reply": reply}, open(out, "w"))
"""


def _two_role_job(annotations: dict[str, str]) -> dict:
    doc = job(
        "across",
        [
            {"name": "server", "command": py(SERVER)},
            {"name": "client", "command": py(CLIENT), "depends_on": [{"role": "server"}]},
        ],
    )
    doc["metadata"]["annotations"] = annotations
    return doc


@pytest.mark.parametrize("pin", [None, "sw"])
def test_two_role_job_talks_across_testbed_hosts(make_testbed, tmp_path: Path, pin: str | None):
    """Round robin puts server and client on h1 and h2 (or the server pinned to the switch
    host by ``testbed/server: sw``); the client reaches the server's TM_HOST:TM_PORT through
    the links, and the server sees the client's host address as the peer."""
    bed = make_testbed(hosts=3, link_rate=100_000_000)
    before = bed.counters()
    harness = Harness(tmp_path, backend=TestbedBackend(bed))
    try:
        state, status = harness.run(_two_role_job({"testbed/server": pin} if pin else {}))
    finally:
        harness.backend.close()
    assert state == "succeeded", status
    output = next((tmp_path / "runs").glob("*/output"))
    server = json.loads((output / "server.json").read_text())
    client = json.loads((output / "client.json").read_text())
    server_host = pin or "h1"
    client_host = "h1" if pin else "h2"
    assert server == {
        "bound": bed.address(server_host),
        "peer": bed.address(client_host),
        "got": "hello across the link",
    }
    assert client == {"host": bed.address(client_host), "reply": "HELLO ACROSS THE LINK"}
    after = bed.counters()
    assert after[client_host].up_bytes > before[client_host].up_bytes


def test_pin_to_an_unknown_host_is_refused_clearly(make_testbed):
    bed = make_testbed(hosts=2, link_rate=None)
    backend = TestbedBackend(bed)
    with pytest.raises(UserError, match="no host 'h9'"):
        backend.place(PlacementRequest("server", 1, annotations={"testbed/server": "h9"}))
    first = backend.place(PlacementRequest("server", 2, annotations={"testbed/server": "sw"}))
    assert first.host == bed.address("sw") and len(set(first.ports)) == 2
    assert backend.place(PlacementRequest("a", 1)).host == bed.address("h1")
    assert backend.place(PlacementRequest("a", 1)).host == bed.address("h2")


def test_cli_runs_a_job_on_the_testbed_that_is_up(make_testbed, tmp_path: Path, monkeypatch):
    """``trainmaster run JOB --backend testbed`` uses the testbed recorded on disk (the one
    ``$TRAINMASTER_TESTBED`` names) and the job's ``testbed/<role>`` pin."""
    import subprocess
    import sys

    import yaml

    bed = make_testbed(hosts=2, link_rate=None)
    monkeypatch.setenv("TRAINMASTER_TESTBED", bed.options.prefix)
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(_two_role_job({"testbed/server": "sw"})))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainmaster",
            "run",
            str(job_file),
            "--backend",
            "testbed",
            "--db",
            f"sqlite:///{tmp_path / 'cli.db'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    server = json.loads(next(tmp_path.rglob("output/server.json")).read_text())
    assert server["bound"] == bed.address("sw") and server["peer"] == bed.address("h1")


def test_handle_refound_after_a_controller_crash_carries_its_ports(make_testbed, tmp_path: Path):
    """A controller that died between starting an instance and storing its handle re-finds it
    through the host agents (``recover``): the handle names the host and the ports the
    instance was given there, and adopting it holds them, so no new instance on that host is
    given a port the adopted one listens on."""
    import sys

    from trainmaster.contract import LaunchSpec
    from trainmaster.backends.base import LaunchRequest

    bed = make_testbed(hosts=2, link_rate=None)
    first = TestbedBackend(bed)
    placement = first.place(PlacementRequest("server", 2, annotations={"testbed/server": "h2"}))
    spec = LaunchSpec(
        instance_id=f"{tmp_path.name}/server-0/1",
        job_id=1,
        job_name="t",
        role="server",
        index=0,
        attempt=1,
        argv=[sys.executable, "-c", "import time; time.sleep(60)"],
        env={"PATH": "/usr/bin:/bin"},
        cwd=None,
        log_path=str(tmp_path / "server.log"),
        instance_dir=str(tmp_path / "server-0"),
        host=placement.host,
        ports=placement.ports,
    )
    request = LaunchRequest(placement=placement, spec=spec)
    [handle] = first.start([request])
    first.close()  # the controller crashed before storing the handle
    second = TestbedBackend(bed)
    try:
        found = second.recover(spec.instance_id, spec.instance_dir)
        assert found is not None
        assert (found.node, found.ports) == ("h2", placement.ports)
        assert second.adopt(found)
        again = second.place(PlacementRequest("other", 2, annotations={"testbed/other": "h2"}))
        assert not set(again.ports) & set(placement.ports), (again.ports, placement.ports)
    finally:
        second.stop([handle], grace=1.0)
        second.close()

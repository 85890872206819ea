"""Mechanism: the instance-level backend interface (create/place, start, observe, stop, address,
adopt, recover), the same behavioural suite for every backend, local, testbed (a node agent per
network-namespace host), Ray and Kubernetes (instances as pods; controller spec, 'Our product
decisions'). The Ray backend joins one local Ray cluster per test session (started on first use);
the Kubernetes backend the session's cluster (tests/cluster_fixtures.py: built here, run last)."""

import json
import os
import secrets
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest

from controller_harness import PY, RAY_NODE_IP, pids_alive
from trainmaster.contract import InstanceHandle, InstancePhase as Phase, LaunchSpec
from trainmaster.backends.base import Backend, LaunchRequest, PlacementRequest, StartFailure
from trainmaster.backends.local import LocalBackend
from trainmaster.backends.testbed import TestbedBackend
from trainmaster.testbed import Testbed, TestbedOptions, remove


def ray_backend() -> Backend:
    pytest.importorskip("ray", reason="the optional ray extra (trainmaster[ray]) is not installed")
    from trainmaster.backends.ray import RayBackend

    return RayBackend(node_ip=RAY_NODE_IP)  # the first one starts the session's local cluster


class SuiteTestbedBackend(TestbedBackend):
    """The testbed backend over the testbed ``$TRAINMASTER_TESTBED`` names, built with no
    arguments as a new controller would build it (the suite's ``type(backend)()``)."""

    def __init__(self) -> None:
        super().__init__(Testbed.load(os.environ["TRAINMASTER_TESTBED"]))


def make_testbed_backend() -> Backend:
    """A 2-host testbed of the test's own (removed by the fixture, even when the test fails);
    every instance runs through its host's node agent."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("the testbed backend needs root and iproute2 (network namespaces)")
    prefix = f"s{secrets.token_hex(3)}"
    os.environ["TRAINMASTER_TESTBED"] = prefix
    try:
        Testbed.up(TestbedOptions(prefix=prefix, hosts=2, link_rate=None))
    except Exception as exc:  # a machine whose kernel refuses namespaces
        remove(prefix)
        pytest.skip(f"network namespaces cannot be created here: {exc}")
    return SuiteTestbedBackend()


def make_kubernetes_backend(cluster, monkeypatch) -> Backend:
    """The session's cluster (tests/cluster_fixtures.py); a backend built with no arguments (the
    suite's ``type(backend)()``) finds it through ``$KUBECONFIG``, and runs image-less roles as
    this machine's software in pods (its nodes are this machine)."""
    pytest.importorskip("kubernetes", reason="the optional kubernetes extra (trainmaster[kubernetes]) is not installed")
    from trainmaster.backends.kubernetes import HOST_RUNTIME_ENV, KubernetesBackend

    monkeypatch.setenv("KUBECONFIG", str(cluster.layout.kubeconfig))
    monkeypatch.setenv(HOST_RUNTIME_ENV, "1")
    return KubernetesBackend()


def backends() -> list:
    return [
        pytest.param(LocalBackend, id="local"),
        pytest.param(make_testbed_backend, id="testbed"),
        pytest.param(ray_backend, id="ray", marks=[pytest.mark.ray, pytest.mark.timeout(120)]),
        pytest.param(
            make_kubernetes_backend, id="kubernetes", marks=[pytest.mark.kubernetes, pytest.mark.timeout(180)]
        ),
    ]


@pytest.fixture(params=backends())
def backend(request, monkeypatch) -> Backend:
    monkeypatch.delenv("TRAINMASTER_TESTBED", raising=False)  # restored (or removed) afterwards
    try:
        if request.param is make_kubernetes_backend:
            b = make_kubernetes_backend(request.getfixturevalue("k8s_cluster"), monkeypatch)
        else:
            b = request.param()
    except BaseException:
        if "TRAINMASTER_TESTBED" in os.environ:
            remove(os.environ["TRAINMASTER_TESTBED"])
        raise
    try:
        yield b
    finally:
        b.close()
        if isinstance(b, TestbedBackend):
            remove(b.testbed.options.prefix)


def launch(backend: Backend, tmp_path: Path, code: str, name: str = "r", ports: int = 1) -> InstanceHandle:
    [handle] = backend.start([launch_request(backend, tmp_path, code, name, ports)])
    assert isinstance(handle, InstanceHandle), handle
    return handle


def launch_request(
    backend: Backend,
    tmp_path: Path,
    code: str,
    name: str = "r",
    ports: int = 1,
    cwd: str | None = None,
    argv: list[str] | None = None,
) -> LaunchRequest:
    """One attempt of a one-replica role ``name`` running ``python -c code`` (or ``argv``), as the
    controller would hand it over: placed, with its environment and the inputs to resolve it again
    on another node (the Ray agents do)."""
    placement = backend.place(PlacementRequest(name, ports))
    argv, env = argv or [PY, "-c", code], {"PATH": "/usr/bin:/bin"}
    context = {
        "job_name": "t",
        "role": name,
        "index": 0,
        "replicas": 1,
        "role_replicas": {name: 1},
        "host": placement.host,
        "ports": placement.ports,
        "params": {},
        "output_dir": str(tmp_path / "output"),
    }
    spec = LaunchSpec(
        instance_id=f"{tmp_path.name}/{name}-0/1",
        job_id=1,
        job_name="t",
        role=name,
        index=0,
        attempt=1,
        argv=argv,
        env=env,
        cwd=cwd,
        log_path=str(tmp_path / f"{name}.log"),
        instance_dir=str(tmp_path / name),
        host=placement.host,
        ports=placement.ports,
        env_inputs={"framework": "command", "context": context, "role_env": {}},
    )
    return LaunchRequest(placement=placement, spec=spec)


def runtime_pid(handle: InstanceHandle) -> int:
    """The instance's pid: in the handle (local), or in the attempt record its Ray node agent (or,
    on Kubernetes, its pod's first process) wrote."""
    if handle.pid is not None:
        return handle.pid
    if handle.node == "kubernetes":
        from trainmaster.backends.kubernetes_objects import ATTEMPT_RECORD as POD_RECORD

        record = Path(handle.instance_dir) / POD_RECORD
        deadline = time.monotonic() + 20
        while not record.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return json.loads(record.read_text())["pid"]
    from trainmaster.backends.ray import ATTEMPT_RECORD

    return json.loads((Path(handle.instance_dir) / ATTEMPT_RECORD).read_text())["pid"]


def wait_phase(backend: Backend, handle: InstanceHandle, phases: set, timeout: float = 20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        [obs] = backend.observe([handle])
        if obs.phase in phases:
            return obs
        time.sleep(0.05)
    raise AssertionError(f"still {obs.phase}")


def test_exit_codes_are_observed(backend: Backend, tmp_path: Path) -> None:
    ok = launch(backend, tmp_path, "print('hi')", "ok")
    bad = launch(backend, tmp_path, "raise SystemExit(7)", "bad")
    assert wait_phase(backend, ok, {Phase.EXITED}).exit_code == 0
    assert wait_phase(backend, bad, {Phase.EXITED}).exit_code == 7
    assert "hi" in (tmp_path / "ok.log").read_text()


def test_placement_reserves_distinct_ports(backend: Backend) -> None:
    placements = [backend.place(PlacementRequest("r", 3)) for _ in range(10)]
    ports = [(pl.host, p) for pl in placements for p in pl.ports]  # a port is taken on one host
    assert len(ports) == len(set(ports)) == 30
    assert placements[0].address == f"{placements[0].host}:{placements[0].ports[0]}"


def ended_soon(pids: list[int], after_grace: float) -> list[int]:
    """The pids still alive once a stop had time to finish: at once for a backend whose ``stop``
    returns when it is done, within 15 s past the grace for one whose ``stop`` returns when the
    stop is durably under way (Kubernetes: the kubelet sends SIGTERM, then SIGKILL)."""
    deadline = time.monotonic() + after_grace + 15
    while (alive := pids_alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def test_stop_terminates_the_whole_process_group(backend: Backend, tmp_path: Path) -> None:
    code = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open('{tmp_path}/child', 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    handle = launch(backend, tmp_path, code)
    wait_phase(backend, handle, {Phase.RUNNING})
    deadline = time.monotonic() + 10
    while not (tmp_path / "child").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int((tmp_path / "child").read_text())
    backend.stop([handle], grace=2)
    wait_phase(backend, handle, {Phase.EXITED, Phase.LOST}, timeout=2 + 15)  # at once unless stop is confirmed later
    assert ended_soon([runtime_pid(handle), child], after_grace=2) == []


def test_stop_escalates_to_sigkill(backend: Backend, tmp_path: Path) -> None:
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n"
    handle = launch(backend, tmp_path, code)
    wait_phase(backend, handle, {Phase.RUNNING})
    time.sleep(0.3)  # let it install its handler
    pid = runtime_pid(handle)
    backend.stop([handle], grace=0.5)
    assert ended_soon([pid], after_grace=0.5) == []


def test_a_new_backend_adopts_a_live_instance_by_its_identity(backend: Backend, tmp_path: Path) -> None:
    """A new controller's backend adopts a live attempt by its handle (local: the node agent's
    instance id, through the same agent; Ray: the actor name), never a forged one."""
    handle = launch(backend, tmp_path, "import time; time.sleep(1)")
    wait_phase(backend, handle, {Phase.RUNNING})
    successor = type(backend)()  # as after a controller crash: not our child any more
    assert successor.adopt(handle)
    # an attempt its node's agent never started must not be adopted
    forged = replace(handle, instance_id=handle.instance_id + "-elsewhere")
    assert not successor.adopt(forged)
    obs = wait_phase(successor, handle, {Phase.EXITED})
    assert obs.exit_code == 0  # learnt from the agent's journal (local) or the runtime's exit record (Ray)
    backend.observe([handle])  # reap


def test_recover_finds_an_attempt_whose_handle_was_never_saved(backend: Backend, tmp_path: Path) -> None:
    """After a crash between starting an instance and saving its handle, the attempt's instance
    id (every backend: its node agent's journal) and its folder (Ray: the attempt record its
    agent wrote) are all a new controller knows: the backend recovers the attempt from them, and
    nothing for an attempt that never started. An ended attempt is recovered too: its exit is
    known, and the restart policy acts on it."""
    handle = launch(backend, tmp_path, "import time; time.sleep(30)", "found")
    wait_phase(backend, handle, {Phase.RUNNING})
    successor = type(backend)()
    found = successor.recover(handle.instance_id, handle.instance_dir or str(tmp_path / "found"))
    assert found is not None and found.instance_id == handle.instance_id and found.node == handle.node
    assert found.pid == runtime_pid(handle)
    assert successor.recover(f"{tmp_path.name}/never-started/1", str(tmp_path / "never-started")) is None
    if backend.name == "ray":  # an id no agent journaled: found by the record in its folder
        by_folder = successor.recover(f"{tmp_path.name}/unknown/1", handle.instance_dir)
        assert by_folder is not None and runtime_pid(by_folder) == runtime_pid(handle)
        assert by_folder.ports == handle.ports
    backend.stop([handle], grace=1)
    assert wait_phase(successor, found, {Phase.EXITED}).phase == Phase.EXITED


def test_start_starts_every_request_and_reports_a_refused_one(backend: Backend, tmp_path: Path) -> None:
    """Start: a batch starts every instance; one whose working directory is missing is refused
    (a StartFailure from start, or an exit with reason StartFailed when the backend learns it
    later, as Ray does) without stopping the others."""
    good = [launch_request(backend, tmp_path, "print('hi')", name=f"ok{n}") for n in range(3)]
    bad = launch_request(backend, tmp_path, "pass", name="bad", cwd=str(tmp_path / "missing"))
    results = list(backend.start([good[0], bad, *good[1:]]))
    refused = results.pop(1)
    for handle in results:
        assert not isinstance(handle, StartFailure)
        assert wait_phase(backend, handle, {Phase.EXITED}, timeout=60).exit_code == 0
    if not isinstance(refused, StartFailure):
        obs = wait_phase(backend, refused, {Phase.EXITED, Phase.LOST}, timeout=60)
        assert obs.reason == "StartFailed" and "missing" in obs.message
    else:
        assert "missing" in refused.message and "python" in refused.message  # names the program and the path


def test_cpu_seconds_and_peak_rss_of_the_whole_tree_are_observed(backend: Backend, tmp_path: Path) -> None:
    """Per-instance usage (issue 14 part 1) through the same node agent on both backends: the exit
    carries the CPU seconds and peak RSS of the instance's tree, a child's included."""
    code = (
        "import subprocess, sys\n"
        "subprocess.run([sys.executable, '-c', 'b = bytearray(48 << 20); sum(range(3_000_000))'], check=True)\n"
    )
    obs = wait_phase(backend, launch(backend, tmp_path, code, "burn"), {Phase.EXITED}, timeout=60)
    assert obs.exit_code == 0, obs
    assert obs.cpu_seconds > 0.02 and obs.peak_rss >= 48 << 20, obs


def test_stop_leaves_no_detached_daemon(backend: Backend, tmp_path: Path) -> None:
    """An instance's ``setsid`` double-forked daemon leaves its process group and session, and is
    gone after ``stop`` on both backends all the same (the node agent's cgroup or marker tree,
    not the process group, is what it stops)."""
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        open('{tmp_path}/daemon', 'w').write(str(os.getpid()))\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "time.sleep(60)\n"
    )
    handle = launch(backend, tmp_path, code, "d")
    wait_phase(backend, handle, {Phase.RUNNING})
    deadline = time.monotonic() + 20
    while not (tmp_path / "daemon").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    daemon = int((tmp_path / "daemon").read_text())
    assert pids_alive([daemon]) == [daemon]
    backend.stop([handle], grace=2)
    wait_phase(backend, handle, {Phase.EXITED})
    assert pids_alive([daemon]) == []

"""Client selection for FL frameworks: the framework-free JobSelector and JointScheduler, the node
arbiter's HTTP API, and (where flwr is installed: `make test` runs this file in .venv-flower)
concurrent runs on Flower's deployment runtime, a SuperLink and SuperNodes, leased by the arbiter."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from trainmaster.flsched.model import Device, Job, ProblemError
from trainmaster.flsched.selector import DevicePool, JobSelector

# flwr pins older fastapi, starlette, uvicorn, typer, rich, protobuf and ray than the rest of
# Trainmaster uses, so it lives in its own environment (.venv-flower, made by `make flower-env`,
# which `make test` runs these tests in); the main environment skips them with this reason.
NEEDS_FLWR = pytest.mark.skipif(
    importlib.util.find_spec("flwr") is None,
    reason="flwr is not in this environment: `make test` runs these tests in "
    ".venv-flower (flwr pins older fastapi/typer/rich/protobuf; see docs/flsched.md)",
)


def _devices(n: int) -> list[Device]:
    rng = np.random.default_rng(0)
    return [Device(id=f"d{k}", a=float(rng.uniform(0.001, 0.03)), mu=50.0, bandwidth=1e7) for k in range(n)]


def _job(name: str, devices: list[Device], skip: set[str] = frozenset()) -> Job:
    return Job(id=name, tau=1.0, model_bytes=1e6, per_round=3, data={d.id: 100 for d in devices if d.id not in skip})


def test_selector_respects_constraints_and_keeps_history():
    """Scheduler interface behind a framework: n distinct clients holding the job's data each round,
    participation history kept per device so that fairness spreads rounds over all devices."""
    devs = _devices(8)
    sel = JobSelector(_job("j", devs, skip={"d0"}), devs, seed=0, weights={"time": 1.0, "fairness": 1e4})
    clients = [f"c{k}" for k in range(8)]  # bound to d0..d7 in sorted order
    for _ in range(7):
        chosen = sel.select(clients, 3)
        assert len(set(chosen)) == 3 and "c0" not in chosen
    counts = np.array([sel.history.get(f"d{k}", 0) for k in range(1, 8)])
    assert counts.sum() == 21 and counts.max() - counts.min() <= 1  # heavy fairness weight: balanced


def test_shared_pool_gives_a_device_to_one_job_at_a_time():
    """Multi-job constraint through a shared pool: a device leased by one job's round is not
    offered to another job until that round is released."""
    devs = _devices(6)
    pool = DevicePool()
    a = JobSelector(_job("a", devs), devs, seed=1, pool=pool)
    b = JobSelector(_job("b", devs), devs, seed=2, pool=pool)
    clients = [f"c{k}" for k in range(6)]
    first = a.select(clients, 3)
    second = b.select(clients, 3)
    assert not set(first) & set(second)
    with pytest.raises(ProblemError, match="only 0 idle clients"):
        JobSelector(_job("c", devs), devs, pool=pool).select(clients, 1)
    a.release()
    assert len(JobSelector(_job("c", devs), devs, pool=pool).select(clients, 3)) == 3


def _never_double_booked(log) -> bool:
    """No client in two jobs' leases whose time intervals overlap (an open lease lasts forever)."""
    rows = [
        (x.job, x.client, x.start, x.end) if hasattr(x, "job") else (x["job"], x["client"], x["start"], x["end"])
        for x in log
    ]
    inf = float("inf")
    for i, (ja, ca, sa, ea) in enumerate(rows):
        for jb, cb, sb, eb in rows[i + 1 :]:
            if ca == cb and ja != jb and sa < (eb if eb is not None else inf) and sb < (ea if ea is not None else inf):
                return False
    return True


def test_joint_service_schedules_jobs_together_and_never_double_books():
    """Flower, jointly: one scheduling service that every job's server asks. Two jobs asking at
    the same time are scheduled in one problem (disjoint clients), and over many concurrent
    rounds with releases (threads standing in for two Flower strategies) no client is ever
    leased to two jobs at once."""
    import threading
    import time

    from trainmaster.flsched.selector import JointJob, JointScheduler

    devs = _devices(8)
    service = JointScheduler([_job("a", devs), _job("b", devs)], devs, seed=0, gather_s=2.0)
    clients = [f"c{k}" for k in range(8)]
    picks: dict[str, list[list[str]]] = {"a": [], "b": []}
    errors: list[BaseException] = []

    def strategy(job_id: str, rounds: int) -> None:
        handle = JointJob(service, job_id)
        try:
            for _ in range(rounds):
                picks[job_id].append(handle.select(clients, 3))
                time.sleep(0.01)  # the round's training
                handle.release()
        except BaseException as exc:  # reported below, not swallowed
            errors.append(exc)

    threads = [threading.Thread(target=strategy, args=(j, 6)) for j in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and all(not t.is_alive() for t in threads)
    assert len(picks["a"]) == len(picks["b"]) == 6
    assert all(len(set(p)) == 3 for p in picks["a"] + picks["b"])
    assert not set(picks["a"][0]) & set(picks["b"][0])  # the first round was scheduled jointly
    assert _never_double_booked(service.leases_log)
    assert len(service.leases_log) == 12 * 3


def test_joint_service_infeasible_round_fails_clearly_and_the_run_continues():
    """Flower, jointly: a round that cannot be had (the other job leases most clients) raises a
    ProblemError naming the job; after the lease ends the next round is scheduled; a job that
    never releases loses its lease after lease_s."""
    from trainmaster.flsched.selector import JointScheduler

    devs = _devices(6)
    service = JointScheduler([_job("a", devs), _job("b", devs)], devs, seed=0, gather_s=0.05, lease_s=2.0)
    clients = [f"c{k}" for k in range(6)]
    held = service.select("a", clients, 5)
    with pytest.raises(ProblemError, match="round of job 'b' cannot be scheduled now") as info:
        service.select("b", clients, 3)
    assert any("only 1 available" in d or "only 1 available devices" in d for d in info.value.details), (
        info.value.details
    )
    service.release("a")
    got = service.select("b", clients, 3)
    assert len(got) == 3
    import time

    time.sleep(2.1)  # b never releases: its lease expires
    again = service.select("a", clients, 5)
    assert len(again) == 5 and len(held) == 5
    assert _never_double_booked(service.leases_log)
    with pytest.raises(ProblemError, match="unknown job"):
        service.select("zz", clients, 1)


def test_joint_service_releases_a_vanished_client_and_admits_runs_as_they_come():
    """Node lease, a node that disappears: a client missing from the connected clients a job
    reports is released at once (lease ended 'vanished') and not offered again; a job released
    by client keeps its other clients; jobs register and leave while others run."""
    from trainmaster.flsched.selector import JointScheduler

    devs = _devices(8)
    profiles = {f"c{k}": d for k, d in enumerate(devs)}
    service = JointScheduler(devices=profiles, seed=0, gather_s=0.05)
    service.add_job(_job("a", devs))
    clients = sorted(profiles)
    held = service.select("a", clients, 3)
    service.add_job(_job("b", devs))  # a second run starts while a's round is out
    gone = held[0]
    got = service.select("b", [c for c in clients if c != gone], 3)  # b's view: `gone` disconnected
    assert gone not in got and not set(got) & set(held)
    lease = next(x for x in service.leases_log if x.client == gone)
    assert lease.end is not None and lease.why == "vanished"
    assert service.holders()[held[1]] == "a"  # a keeps its other clients
    service.release("a", [held[1]])
    assert held[1] not in service.holders() and service.holders()[held[2]] == "a"
    service.remove_job("a")  # the run ends: its last lease ends, it no longer holds up gathering
    assert all(j == "b" for j in service.holders().values())
    with pytest.raises(ProblemError, match="unknown job 'a'"):
        service.select("a", clients, 1)
    assert _never_double_booked(service.leases_log)


def _arbiter_client():
    from fastapi.testclient import TestClient

    from trainmaster.flsched.arbiter import arbiter_app
    from trainmaster.flsched.selector import JointScheduler

    service = JointScheduler(seed=0, gather_s=0.05, weights={"time": 1.0, "fairness": 100.0})
    return service, TestClient(arbiter_app(service))


def _enrol(http, n: int) -> list[str]:
    devs = _devices(n)
    profiles = [
        {"node": str(1000 + k), "device": d.id, "a": d.a, "mu": d.mu, "bandwidth": d.bandwidth}
        for k, d in enumerate(devs)
    ]
    assert http.put("/v1/devices", json={"profiles": profiles}).status_code == 200
    return [p["node"] for p in profiles]


def _spec(n: int, per_round: int = 3) -> dict:
    return {"tau": 1.0, "model_bytes": 1e6, "per_round": per_round, "data": {f"d{k}": 100 for k in range(n)}}


def test_arbiter_leases_nodes_to_runs_over_http():
    """Node arbiter (HTTP): nodes enrol, runs register, each round leases per_round distinct
    connected nodes and releases them; a round that cannot be had is 409 with the reasons; a run
    that leaves frees its nodes; GET /v1/leases shows every lease."""
    service, http = _arbiter_client()
    nodes = _enrol(http, 8)
    for run in ("r1", "r2"):
        assert http.put(f"/v1/runs/{run}", json=_spec(8)).status_code == 200
    a = http.post("/v1/runs/r1/lease", json={"online": nodes, "n": 3}).json()["nodes"]
    b = http.post("/v1/runs/r2/lease", json={"online": nodes, "n": 3}).json()["nodes"]
    assert len(set(a)) == len(set(b)) == 3 and not set(a) & set(b)
    refused = http.post("/v1/runs/r2/lease", json={"online": nodes, "n": 6})  # r1 holds 3 of 8
    assert refused.status_code == 409 and "cannot be scheduled now" in refused.json()["error"]
    assert refused.json()["details"]
    assert http.post("/v1/runs/r1/release", json={}).status_code == 200
    assert len(http.post("/v1/runs/r2/lease", json={"online": nodes, "n": 6}).json()["nodes"]) == 6
    assert http.delete("/v1/runs/r2").status_code == 200
    seen = http.get("/v1/leases").json()
    assert seen["holders"] == {} and len(seen["leases"]) == 12
    assert _never_double_booked(seen["leases"])


def test_arbiter_client_is_a_selector():
    """Node arbiter client (a run's side): register, select among the connected nodes, release,
    report a vanished node (its lease ends at once, 'vanished'), refusals as ProblemError, finish."""
    from trainmaster.flsched.arbiter import ArbiterClient, NodeProfile, RunSpec

    service, http = _arbiter_client()
    a, b = ArbiterClient("http://arbiter", "ra"), ArbiterClient("http://arbiter", "rb")
    a.http = b.http = http  # the HTTP API in-process
    devs = _devices(6)
    a.enrol([NodeProfile(node=f"n{k}", device=d.id, a=d.a, mu=d.mu, bandwidth=d.bandwidth) for k, d in enumerate(devs)])
    spec = RunSpec(tau=1.0, model_bytes=1e6, per_round=2, data={d.id: 50 for d in devs})
    a.register(spec)
    b.register(spec)
    online = [f"n{k}" for k in range(6)]
    mine = a.select(online, 2)
    b.forget([mine[0]])  # another run saw it go
    why = {x["client"]: x["why"] for x in a.leases()["leases"]}
    assert why[mine[0]] == "vanished" and a.leases()["holders"] == {mine[1]: "ra"}
    with pytest.raises(ProblemError, match="cannot be scheduled now"):
        b.select(online, 6)
    a.release()
    assert len(b.select(online, 5)) == 5
    b.finish()
    a.finish()
    assert a.leases()["holders"] == {}


def test_arbiter_refuses_bad_input_with_the_field():
    """Input validation at the arbiter's boundary: unknown fields, negative counts, bad ids,
    non-positive speeds and unknown runs are refused (422 naming the field, 409 for the run),
    never a 500."""
    _, http = _arbiter_client()
    bad = [
        ("put", "/v1/devices", {"profiles": [{"node": "1", "device": "d", "a": -1, "mu": 1, "bandwidth": 1}]}, "a"),
        (
            "put",
            "/v1/devices",
            {"profiles": [{"node": "1", "device": "d", "a": 1, "mu": 1, "bandwidth": 1, "x": 1}]},
            "x",
        ),
        ("put", "/v1/runs/r", {**_spec(3), "per_round": 0}, "per_round"),
        ("put", "/v1/runs/r", {**_spec(3), "data": {"d0": -5}}, "data"),
        ("put", "/v1/runs/bad%20id", _spec(3), "run_id"),
        ("post", "/v1/runs/r/lease", {"online": ["1"], "n": 0}, "n"),
        ("post", "/v1/runs/r/lease", {"online": "1", "n": 1}, "online"),
    ]
    for method, path, body, field in bad:
        reply = getattr(http, method)(path, json=body)
        assert reply.status_code == 422, (path, body, reply.text)
        assert field in reply.text
    unknown = http.post("/v1/runs/nope/lease", json={"online": ["1"], "n": 1})
    assert unknown.status_code == 409 and "unknown job 'nope'" in unknown.json()["error"]


def test_arbiter_never_leases_a_node_to_two_runs_at_once():
    """Node-lease invariant under concurrency: four runs lease and release rounds from threads
    through the HTTP API, a node drops out midway; at no moment is a node held by two runs (the
    lease log's intervals per node never overlap across runs), and every round got its nodes."""
    import threading
    import time

    service, http = _arbiter_client()
    nodes = _enrol(http, 12)
    for run in ("r0", "r1", "r2", "r3"):
        http.put(f"/v1/runs/{run}", json=_spec(12, per_round=2))
    online = list(nodes)
    got: dict[str, list[list[str]]] = {r: [] for r in ("r0", "r1", "r2", "r3")}
    errors: list[str] = []

    def run(name: str) -> None:
        for i in range(8):
            if name == "r0" and i == 4:
                online.remove(nodes[0])  # a node disappears
            reply = http.post(f"/v1/runs/{name}/lease", json={"online": list(online), "n": 2})
            if reply.status_code != 200:
                errors.append(reply.text)
                continue
            got[name].append(reply.json()["nodes"])
            time.sleep(0.005)
            http.post(f"/v1/runs/{name}/release", json={})

    threads = [threading.Thread(target=run, args=(r,)) for r in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and all(len(v) == 8 for v in got.values())
    log = http.get("/v1/leases").json()["leases"]
    assert _never_double_booked(log)
    assert len(log) == 4 * 8 * 2 and all(x["end"] is not None for x in log)
    for name in got:  # the node that went is not offered again
        assert nodes[0] not in http.post(f"/v1/runs/{name}/lease", json={"online": online, "n": 2}).json()["nodes"]


class _QueryGrid:
    """A Flower Grid stand-in for enrolment: ``nodes`` connected nodes, each answering a query
    with its profile; records how many queries each send carried."""

    def __init__(self, nodes: int) -> None:
        self.nodes = list(range(101, 101 + nodes))
        self.sends: list[int] = []

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def send_and_receive(self, messages, timeout=None):
        from flwr.app import ConfigRecord, Message, RecordDict

        self.sends.append(len(messages))
        out = []
        for m in messages:
            node = m.metadata.dst_node_id
            profile = ConfigRecord({"device": f"d{node - 101}", "a": 0.01, "mu": 50.0, "bandwidth": 1e7})
            reply = Message(RecordDict({"profile": profile}), reply_to=m)
            out.append(reply)
        return out


@NEEDS_FLWR
def test_enrolment_queries_nodes_a_batch_at_a_time(monkeypatch):
    """Flower deployment engine, enrolment: every connected node is enrolled with the arbiter, but
    at most ``ENROL_BATCH`` (6) ClientApp processes are started at once. Flower gives a ClientApp
    30 s to claim its task and starts it again if it misses that; 30 queries at once on two busy
    cores missed it and the restarts fed each other (load over 700)."""
    from flwr.supercore.task_identity import TaskIdentity

    from trainmaster.flsched import flower
    from trainmaster.flsched.arbiter import ArbiterClient

    monkeypatch.setattr(TaskIdentity, "_run_id", 7)  # as in a ServerApp process of run 7
    monkeypatch.setattr(TaskIdentity, "_node_id", 1)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    service, http = _arbiter_client()
    real_init = ArbiterClient.__init__

    def in_process(self, url, run, *args, **kwargs):
        real_init(self, url, run, *args, **kwargs)
        self.http = http

    monkeypatch.setattr(ArbiterClient, "__init__", in_process)
    monkeypatch.setattr(ArbiterClient, "close", lambda self: None)  # the in-process client stays open
    grid = _QueryGrid(30)
    assert flower.enrol_nodes(grid, "http://arbiter", expected=30, timeout=30) == 30
    assert sum(grid.sends) == 30 and max(grid.sends) <= 6  # ENROL_BATCH
    assert len(http.get("/v1/leases").json()["holders"]) == 0
    assert sorted(service.pool.profiles) == sorted(str(n) for n in grid.nodes)
    with pytest.raises(ValueError, match="batch must be at least 1"):
        flower.enrol_nodes(grid, "http://arbiter", expected=30, timeout=30, batch=0)


# ----------------------------------------------------------------- Flower's deployment runtime
@pytest.fixture(scope="module")
def federation():
    """One SuperLink, six SuperNodes (two of them 10x slower) and the arbiter, on loopback."""
    from trainmaster.flsched.federation import FederationOptions, LocalFederation

    options = FederationOptions(nodes=6, seed=3, speedup=40.0, stragglers=1 / 3, fairness_weight=600.0)
    with LocalFederation(options) as fed:
        fed.enrol(timeout=600)
        yield fed


def _rounds_clash(rows: list[dict]) -> list[tuple]:
    """Pairs of rounds of different runs that overlap in time and share a node."""
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1 :]:
            if (
                a["run"] != b["run"]
                and a["start"] < b["end"]
                and b["start"] < a["end"]
                and set(a["nodes"]) & set(b["nodes"])
            ):
                out.append((a["run"], a["round"], b["run"], b["round"]))
    return out


@NEEDS_FLWR
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_concurrent_flower_runs_lease_their_nodes_from_the_arbiter(federation):
    """Flower deployment engine (SuperLink, SuperNodes, ClientApp processes) with the arbiter:
    three concurrent runs each train two rounds of FedAvg with per_round 2 on six nodes; every
    round's nodes were leased to it, no node is in two runs' rounds at once (the runs' own round
    records and the arbiter's lease log agree), and every round trained its nodes."""
    from trainmaster.flsched.federation import JOBS

    runs = []
    for dataset, (tau, target) in JOBS.items():
        runs.append(
            federation.submit(
                dataset=dataset, target=1.01, tau=tau, per_round=2, max_rounds=2, selection="flsched",
                run_name=f"ci-{dataset}", seed=3,
            )
        )  # fmt: skip
    statuses = federation.wait(runs, timeout=1200)
    assert set(statuses.values()) == {"finished:completed"}, statuses
    rows = [r for d in JOBS for r in federation.rounds(f"ci-{d}") if r["event"] == "round"]
    assert len(rows) == 6
    assert all(len(r["nodes"]) == 2 and sorted(r["trained"]) == sorted(r["nodes"]) for r in rows)
    assert _rounds_clash(rows) == []
    import httpx

    leases = httpx.get(federation.arbiter_url + "/v1/leases", timeout=30).json()
    assert _never_double_booked(leases["leases"]) and leases["holders"] == {}
    leased = {(x["job"], x["client"]) for x in leases["leases"]}
    assert all((r["run"], str(n)) in leased for r in rows for n in r["nodes"])


@NEEDS_FLWR
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_flower_node_that_disappears_is_released(federation):
    """A node that disappears is released: while a run's round is out on two nodes, one of its
    SuperNodes stops; its lease ends (the run gets Flower's node-unavailable error and releases,
    or another round's connected nodes lack it), it is never leased again, and the run finishes
    its rounds on the nodes left."""
    import signal
    import time

    import httpx

    run = federation.submit(
        dataset="digits",
        target=1.01,
        tau=2,
        per_round=2,
        max_rounds=3,
        selection="flsched",
        run_name="ci-vanish",
        seed=4,
    )
    deadline = time.monotonic() + 600
    victim = None
    while victim is None and time.monotonic() < deadline:
        holders = httpx.get(federation.arbiter_url + "/v1/leases", timeout=30).json()["holders"]
        victim = next((node for node, job in holders.items() if job == "ci-vanish"), None)
        time.sleep(0.2)
    assert victim is not None, "the run never held a node"
    k = _node_index(federation, victim)
    stopped = time.monotonic()
    federation.stop_node(k, signal.SIGTERM)
    status = federation.wait([run], timeout=1200)[run]
    assert status == "finished:completed", status
    log = httpx.get(federation.arbiter_url + "/v1/leases", timeout=30).json()["leases"]
    mine = [x for x in log if x["client"] == victim]  # the arbiter's clock is the machine's monotonic clock too
    assert mine and all(x["end"] is not None for x in mine)
    held = [x for x in mine if x["start"] <= stopped]
    assert held and held[-1]["end"] - stopped < 180  # released within Flower's node-unavailable report
    assert not [x for x in mine if x["start"] > stopped]  # never leased again
    rows = [r for r in federation.rounds("ci-vanish") if r["event"] == "round"]
    assert len(rows) == 3 and all(int(victim) not in r["nodes"] for r in rows[1:])


def _node_index(fed, node_id: str) -> int:
    """Which SuperNode (by our index) has this Flower node id (from its log)."""
    for k in range(fed.options.nodes):
        if f"SuperNode ID: {node_id}" in (fed.logs / f"node{k}.log").read_text(errors="replace"):
            return k
    raise AssertionError(f"no SuperNode logged id {node_id}")


def test_arbiter_killed_mid_round_resumes_its_leases(tmp_path):
    """Node arbiter killed -9 (kill and restart): a real arbiter process with a state file
    leases nodes to a run and is killed mid-round; restarted on the same file it still holds
    those nodes for that run (another run cannot get them), knows the enrolled profiles and
    the runs, and frees them when the run releases. A client meanwhile gets ProblemError (the
    round is skipped), not a crash."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx

    from trainmaster.flsched.arbiter import ArbiterClient, NodeProfile, RunSpec

    state = tmp_path / "arbiter.json"

    def start() -> tuple[subprocess.Popen, str]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainmaster", "flsched", "arbiter", "--port", str(port), "--state", str(state),
             "--gather-s", "0.05"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                time.sleep(0.1)
        proc.kill()
        raise AssertionError("the arbiter did not start within 60 s")

    proc, url = start()
    try:
        devs = _devices(6)
        a = ArbiterClient(url, "ra", retry_s=0.0)
        a.enrol(
            [NodeProfile(node=f"n{k}", device=d.id, a=d.a, mu=d.mu, bandwidth=d.bandwidth) for k, d in enumerate(devs)]
        )
        spec = RunSpec(tau=1.0, model_bytes=1e6, per_round=4, data={d.id: 50 for d in devs})
        a.register(spec)
        online = [f"n{k}" for k in range(6)]
        held = a.select(online, 4)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        with pytest.raises(ProblemError, match="cannot be reached"):
            a.select(online, 4)
        proc, url = start()
        b = ArbiterClient(url, "rb", retry_s=0.0)
        b.register(RunSpec(tau=1.0, model_bytes=1e6, per_round=3, data={d.id: 50 for d in devs}))
        with pytest.raises(ProblemError, match="cannot be scheduled now"):  # 4 of 6 still out with ra
            b.select(online, 3)
        a = ArbiterClient(url, "ra", retry_s=0.0)
        assert httpx.get(url + "/v1/leases").json()["holders"] == {n: "ra" for n in held}
        a.release()
        assert len(b.select(online, 3)) == 3
    finally:
        proc.kill()
        proc.wait(timeout=30)


@NEEDS_FLWR
@pytest.mark.timeout(120)
def test_a_federation_ends_the_processes_orphaned_under_it(tmp_path):
    """Nothing is left behind: a process of the federation whose parent died before it was seen
    (as a SuperNode's SuperExec, started in its own session, outlives a crashed SuperNode) is
    still ended when the federation closes: it is found by the federation's environment mark."""
    import os
    import sys
    import time

    from trainmaster.flsched.federation import LocalFederation

    pid_file = tmp_path / "orphan.pid"
    fed = LocalFederation(workdir=tmp_path / "fed")
    orphaner = fed._spawn(
        "orphaner",
        [
            sys.executable,
            "-c",
            "import subprocess, sys; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))",
        ],
    )
    orphaner.wait(timeout=60)
    orphan = int(pid_file.read_text())
    assert os.path.exists(f"/proc/{orphan}"), "the orphan should be running before close()"
    fed.close()
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{orphan}") and time.monotonic() < deadline:
        time.sleep(0.1)
    state = open(f"/proc/{orphan}/stat").read().split()[2] if os.path.exists(f"/proc/{orphan}") else "gone"
    assert state in ("gone", "Z"), f"orphan {orphan} is still {state} after the federation closed"

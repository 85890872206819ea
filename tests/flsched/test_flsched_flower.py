"""Client selection for FL frameworks: the framework-free JobSelector, and the Flower strategy
under Flower's own simulation (skipped where flwr is not installed: it is not a dependency)."""

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
    ".venv-flower (flwr pins older fastapi/typer/ray; see docs/flsched.md)",
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


@NEEDS_FLWR
def test_flower_simulation_trains_with_our_client_selection(monkeypatch):
    """Flower adapter: FedAvg under flwr's simulation, training clients chosen by our sa scheduler;
    every round trains exactly per_round distinct clients and FedAvg aggregates their updates."""
    import flwr
    from flwr.client import NumPyClient
    from flwr.server import ServerConfig

    from trainmaster.flsched.flower import FlschedFedAvg

    # Ray kills workers when the whole node is above 95% memory, which a shared CI machine can be
    # for reasons unrelated to this test; the workers here need about 100 MB each.
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")
    n_clients, per_round, rounds = 6, 2, 4
    devs = _devices(n_clients)
    selector = JobSelector(_job("toy", devs), devs, seed=0)

    class Toy(NumPyClient):
        def __init__(self, target: float) -> None:
            self.target = target

        def fit(self, parameters, config):
            w = parameters[0]
            return [w + 0.5 * (self.target - w)], 10, {}

        def evaluate(self, parameters, config):
            return float(abs(parameters[0][0] - self.target)), 10, {}

    def client_fn(context):
        return Toy(float(context.node_config["partition-id"])).to_client()

    aggregated: list[float] = []

    class Recording(FlschedFedAvg):
        def aggregate_fit(self, server_round, results, failures):
            params, metrics = super().aggregate_fit(server_round, results, failures)
            aggregated.append(float(flwr.common.parameters_to_ndarrays(params)[0][0]))
            return params, metrics

    strategy = Recording(
        selector,
        per_round,
        fraction_evaluate=0.0,
        min_available_clients=n_clients,
        initial_parameters=flwr.common.ndarrays_to_parameters([np.zeros(1)]),
    )
    history = flwr.simulation.start_simulation(
        client_fn=client_fn,
        num_clients=n_clients,
        config=ServerConfig(num_rounds=rounds),
        strategy=strategy,
        client_resources={"num_cpus": 1, "num_gpus": 0.0},
        ray_init_args={"num_cpus": 2, "include_dashboard": False, "ignore_reinit_error": True},
    )
    assert len(selector.rounds) == rounds
    assert all(len(set(r)) == per_round for r in selector.rounds)
    assert sum(selector.history.values()) == rounds * per_round
    assert history is not None
    # FedAvg of clients pulled halfway to targets 0..5 from 0: the model moves into that range
    assert len(aggregated) == rounds and 0.0 < aggregated[-1] <= 5.0


def _never_double_booked(log) -> bool:
    """No client in two leases whose time intervals overlap (an open lease lasts forever)."""
    for i, (job_a, ca, sa, ea) in enumerate(log):
        for job_b, cb, sb, eb in log[i + 1 :]:
            overlap = sa < (eb if eb is not None else float("inf")) and sb < (ea if ea is not None else float("inf"))
            if overlap and set(ca) & set(cb):
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
    assert len(service.leases_log) == 12


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


@NEEDS_FLWR
def test_flower_two_jobs_sharing_a_pool_never_double_book():
    """Flower, jointly, under real flwr: two Flower servers (Flower's own round loop and FedAvg),
    each with a FlschedFedAvg on one shared JointScheduler, train two jobs concurrently over the
    same 8 in-process clients; no client is ever leased to both jobs at once, one client that
    fails every fit is handled as Flower's failure, and both jobs finish all rounds."""
    import threading

    import flwr
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import Server
    from flwr.server.client_manager import SimpleClientManager
    from flwr.server.client_proxy import ClientProxy

    from trainmaster.flsched.flower import FlschedFedAvg
    from trainmaster.flsched.selector import JointJob, JointScheduler

    devs = _devices(8)
    service = JointScheduler([_job("a", devs), _job("b", devs)], devs, seed=0, gather_s=1.0)
    busy: dict[str, str] = {}
    lock = threading.Lock()
    clashes: list[str] = []
    dropped: list[str] = []

    class Proxy(ClientProxy):
        """An in-process client: 'fit' moves the model halfway to its target; c7 always fails."""

        def __init__(self, cid: str, target: float) -> None:
            super().__init__(cid)
            self.target = target

        def fit(self, ins, timeout, group_id):
            job = ins.config["job"]
            with lock:
                if self.cid in busy:
                    clashes.append(f"{self.cid}: {busy[self.cid]} and {job}")
                busy[self.cid] = job
            try:
                if self.cid == "c7":
                    dropped.append(job)
                    raise RuntimeError("device dropped mid-round")
                w = parameters_to_ndarrays(ins.parameters)[0]
                return FitRes(Status(Code.OK, ""), ndarrays_to_parameters([w + 0.5 * (self.target - w)]), 10, {})
            finally:
                with lock:
                    busy.pop(self.cid, None)

        def evaluate(self, ins, timeout, group_id):
            raise NotImplementedError

        def get_properties(self, ins, timeout, group_id):
            raise NotImplementedError

        def get_parameters(self, ins, timeout, group_id):
            raise NotImplementedError

        def reconnect(self, ins, timeout, group_id):
            raise NotImplementedError

    proxies = [Proxy(f"c{k}", float(k)) for k in range(8)]
    results: dict[str, object] = {}

    def run(job_id: str) -> None:
        manager = SimpleClientManager()
        for p in proxies:
            manager.register(p)
        strategy = FlschedFedAvg(
            JointJob(service, job_id),
            per_round=3,
            fraction_evaluate=0.0,
            min_available_clients=8,
            on_fit_config_fn=lambda r: {"job": job_id},
            initial_parameters=ndarrays_to_parameters([np.zeros(1)]),
        )
        history, _ = Server(client_manager=manager, strategy=strategy).fit(num_rounds=5, timeout=30)
        results[job_id] = history

    threads = [threading.Thread(target=run, args=(j,)) for j in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(not t.is_alive() for t in threads)
    assert set(results) == {"a", "b"}
    assert clashes == []
    assert _never_double_booked(service.leases_log)
    per_job = {j: [c for job, c, _, _ in service.leases_log if job == j] for j in ("a", "b")}
    assert len(per_job["a"]) == len(per_job["b"]) == 5
    assert dropped  # the failing client was chosen, and its round still completed
    leases = service.leases_log
    assert any(
        ja != jb and sa < eb and sb < ea  # the two jobs really trained at the same time
        for ja, _, sa, ea in leases
        for jb, _, sb, eb in leases
    )
    assert flwr is not None


@NEEDS_FLWR
def test_flower_infeasible_round_fails_clearly_and_the_run_continues(caplog):
    """Flower, jointly, under real flwr: while another job leases 6 of the 8 clients, this job's
    round 1 (3 clients wanted) cannot be scheduled: it is skipped with a warning that names the
    job and the numbers, Flower's round loop goes on, and rounds 2 and 3 (after the other job's
    release) train on 3 distinct clients each."""
    import logging

    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import Server
    from flwr.server.client_manager import SimpleClientManager
    from flwr.server.client_proxy import ClientProxy

    from trainmaster.flsched.flower import FlschedFedAvg
    from trainmaster.flsched.selector import JointJob, JointScheduler

    devs = _devices(8)
    service = JointScheduler([_job("a", devs), _job("b", devs)], devs, seed=0, gather_s=0.2)
    clients = [f"c{k}" for k in range(8)]
    fits: list[tuple[int, str]] = []

    class Proxy(ClientProxy):
        def fit(self, ins, timeout, group_id):
            fits.append((int(ins.config["round"]), self.cid))
            w = parameters_to_ndarrays(ins.parameters)[0]
            return FitRes(Status(Code.OK, ""), ndarrays_to_parameters([w + 1.0]), 10, {})

        def evaluate(self, ins, timeout, group_id):
            raise NotImplementedError

        def get_properties(self, ins, timeout, group_id):
            raise NotImplementedError

        def get_parameters(self, ins, timeout, group_id):
            raise NotImplementedError

        def reconnect(self, ins, timeout, group_id):
            raise NotImplementedError

    manager = SimpleClientManager()
    for cid in clients:
        manager.register(Proxy(cid))
    held = service.select("a", clients, 6)  # the other job's server holds 6 clients

    def fit_config(server_round: int) -> dict:
        if server_round == 2:
            service.release("a")  # the other job's round ends before this job's round 2
        return {"round": server_round}

    strategy = FlschedFedAvg(
        JointJob(service, "b"),
        per_round=3,
        fraction_evaluate=0.0,
        min_available_clients=8,
        on_fit_config_fn=fit_config,
        initial_parameters=ndarrays_to_parameters([np.zeros(1)]),
    )
    with caplog.at_level(logging.WARNING, logger="trainmaster.flsched.flower"):
        history, _ = Server(client_manager=manager, strategy=strategy).fit(num_rounds=3, timeout=30)
    assert len(held) == 6
    skipped = [r.getMessage() for r in caplog.records if "round 1 skipped" in r.getMessage()]
    assert skipped and "round of job 'b' cannot be scheduled now" in skipped[0] and "only" in skipped[0], skipped
    assert sorted({r for r, _ in fits}) == [2, 3]
    for rnd in (2, 3):
        assert len({c for r, c in fits if r == rnd}) == 3
    assert [job for job, *_ in service.leases_log] == ["a", "b", "b"]
    assert _never_double_booked(service.leases_log)
    assert history is not None

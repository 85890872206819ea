"""A real multi-job FL runtime: several jobs truly train (PyTorch, CPU) over one device pool.

Each job is a scikit-learn dataset that ships inside the package (digits, wine, breast-cancer),
split non-IID over the devices the classic way (sorted by label, cut into 2K shards, two shards
per device, so a device sees about two classes). Every round the scheduler picks devices for all
unfinished jobs at once (a device serves one job per round); each chosen device runs ``tau``
local epochs of SGD on its shard; the server averages the surviving updates weighted by sample
count (FedAvg). Device delays are drawn from the shifted-exponential model with the shard size
(emulated: the clock is simulated, so runs stay short); a device may drop out mid-round, its
update is then lost but its time still counts. Accuracy is measured on each job's held-out test
set, against simulated wall time.

Simplification (documented): jobs advance in lock-step global rounds (all unfinished jobs are
scheduled together), each with its own clock; devices train in-process, one after another.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from trainmaster.flsched.model import Job, Problem
from trainmaster.flsched.schedulers import Scheduler
from trainmaster.flsched.synthetic import make_pool

DATASETS = {"digits": "load_digits", "wine": "load_wine", "breast-cancer": "load_breast_cancer"}


@dataclass(frozen=True, kw_only=True)
class PoolOptions:
    """The device pool and the cost weights of a run of the three real FL jobs: what the
    simulated-clock runtime (``MultiJobOptions``) and the wall-clock one
    (``wallclock.WallClockOptions``) share, with the same defaults."""

    num_devices: int = 20
    per_round: int = 3  # devices per job per round
    seed: int = 0  # of the data split, the pool, the draws
    availability: float = 0.9  # chance a device is reachable at a decision
    fairness_weight: float = 30.0  # weight of the participation variance (time weight is 1)

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"num_devices must be at least 1, got {self.num_devices}")
        if self.per_round < 1:
            raise ValueError(f"per_round must be at least 1, got {self.per_round}")
        if not 0.0 <= self.availability <= 1.0:
            raise ValueError(f"availability is a probability (0 to 1), got {self.availability}")
        if self.fairness_weight < 0.0:
            raise ValueError(f"fairness_weight must not be negative, got {self.fairness_weight}")


@dataclass(frozen=True, kw_only=True)
class MultiJobOptions(PoolOptions):
    """How ``run_multijob`` runs: ``rounds`` at most per job, ``dropout`` the chance a chosen
    device drops mid-round, ``targets`` overriding the jobs' target accuracies by name."""

    rounds: int = 40
    dropout: float = 0.1
    targets: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {self.rounds}")
        if not 0.0 <= self.dropout <= 1.0:
            raise ValueError(f"dropout is a probability (0 to 1), got {self.dropout}")
        unknown = sorted(set(self.targets) - set(DATASETS))
        if unknown:
            raise ValueError(f"targets for unknown jobs {unknown}; the jobs are {', '.join(DATASETS)}")


@dataclass
class FLJob:
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    shards: list[np.ndarray]  # per device, indices into the training set
    classes: int
    target: float
    tau: int = 1
    lr: float = 0.1
    curve: list[tuple[float, float]] = field(default_factory=list)  # (simulated time, accuracy)
    clock: float = 0.0
    time_to_target: float | None = None


def load_job(name: str, num_devices: int, seed: int, target: float, tau: int = 1) -> FLJob:
    """Standardised features, 75/25 split, label-sorted shards (non-IID, ~2 classes per device)."""
    import sklearn.datasets as ds
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    data = getattr(ds, DATASETS[name])()
    x_tr, x_te, y_tr, y_te = train_test_split(
        data.data, data.target, test_size=0.25, random_state=seed, stratify=data.target
    )
    scaler = StandardScaler().fit(x_tr)
    x_tr, x_te = scaler.transform(x_tr).astype(np.float32), scaler.transform(x_te).astype(np.float32)
    rng = np.random.default_rng(seed)
    order = np.argsort(y_tr, kind="stable")
    pieces = np.array_split(order, 2 * num_devices)
    perm = rng.permutation(2 * num_devices)
    shards = [np.concatenate([pieces[perm[2 * k]], pieces[perm[2 * k + 1]]]) for k in range(num_devices)]
    return FLJob(
        name=name,
        x_train=x_tr,
        y_train=y_tr.astype(np.int64),
        x_test=x_te,
        y_test=y_te.astype(np.int64),
        shards=shards,
        classes=int(y_tr.max()) + 1,
        target=target,
        tau=tau,
    )


def _model(features: int, classes: int):
    import torch

    return torch.nn.Sequential(torch.nn.Linear(features, 32), torch.nn.ReLU(), torch.nn.Linear(32, classes))


def _local_update(global_state: dict, job: FLJob, idx: np.ndarray, seed: int) -> dict:
    """tau epochs of minibatch SGD on one device's shard, starting from the global model."""
    import torch

    torch.manual_seed(seed)
    model = _model(job.x_train.shape[1], job.classes)
    model.load_state_dict(global_state)
    opt = torch.optim.SGD(model.parameters(), lr=job.lr)
    x = torch.from_numpy(job.x_train[idx])
    y = torch.from_numpy(job.y_train[idx])
    for _ in range(job.tau):
        for batch in torch.randperm(len(idx)).split(16):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _accuracy(state: dict, job: FLJob) -> float:
    import torch

    model = _model(job.x_train.shape[1], job.classes)
    model.load_state_dict(state)
    with torch.no_grad():
        pred = model(torch.from_numpy(job.x_test)).argmax(dim=1).numpy()
    return float((pred == job.y_test).mean())


def fl_problem(jobs: list[FLJob], devices: list, per_round: int, fairness_weight: float) -> Problem:
    """The scheduling problem of real FL jobs over a device pool: each device's samples of a job
    are its shard of that job (scaled to a realistic count), one model size for every job. The
    simulated runtime, the wall-clock runtime and the federated framework's server share it."""
    specs = [
        Job(
            id=j.name,
            tau=float(j.tau),
            model_bytes=4.0e6,
            per_round=per_round,
            data={d.id: int(len(j.shards[k])) * 20 for k, d in enumerate(devices)},
        )
        for j in jobs
    ]
    return Problem.build(devices, specs, weights={"time": 1.0, "fairness": fairness_weight})


def run_multijob(scheduler: Scheduler, options: MultiJobOptions | None = None) -> list[FLJob]:
    """Train digits, wine and breast-cancer concurrently until each hits its target (or
    ``options.rounds``)."""
    import torch

    opts = options or MultiJobOptions()
    num_devices, seed, rounds, dropout = opts.num_devices, opts.seed, opts.rounds, opts.dropout
    torch.set_num_threads(1)
    targets = {"digits": 0.85, "wine": 0.92, "breast-cancer": 0.93, **opts.targets}
    jobs = [
        load_job(n, num_devices, seed, targets[n], tau=t) for n, t in (("digits", 2), ("wine", 1), ("breast-cancer", 1))
    ]
    devices = make_pool(num_devices, seed)
    base = fl_problem(jobs, devices, opts.per_round, opts.fairness_weight)
    rng = np.random.default_rng(seed)
    states = []
    for j in jobs:
        torch.manual_seed(seed)
        states.append({k: v.clone() for k, v in _model(j.x_train.shape[1], j.classes).state_dict().items()})
    history = np.zeros_like(base.history)
    for r in range(rounds):
        active = [m for m, j in enumerate(jobs) if j.time_to_target is None]
        if not active:
            break
        avail = rng.random(num_devices) < opts.availability
        state = base.subset_jobs(active).with_history(history[active], avail)
        try:
            from trainmaster.flsched.model import check_feasible

            check_feasible(state)
        except Exception:  # too few devices reachable this round: everyone waits a second
            for m in active:
                jobs[m].clock += 1.0
            continue
        assignment = scheduler.schedule(state)
        for row, m in enumerate(active):
            job, devs = jobs[m], np.asarray(assignment[row], dtype=int)
            x = rng.exponential(1.0, len(devs))
            work = base.tau[m] * base.samples[m, devs]
            delays = work * (base.a[devs] + x / base.mu[devs]) + base.model_bytes[m] / base.bandwidth[devs]
            job.clock += float(delays.max())
            history[m, devs] += 1
            survivors = devs[rng.random(len(devs)) >= dropout]
            updates, weights = [], []
            for k in survivors:
                updates.append(_local_update(states[m], job, job.shards[k], seed * 1000 + r * 31 + int(k)))
                weights.append(len(job.shards[k]))
            if updates:  # FedAvg over surviving devices, weighted by their sample counts
                w = np.array(weights, float) / sum(weights)
                states[m] = {key: sum(float(wi) * u[key] for wi, u in zip(w, updates)) for key in states[m]}
            acc = _accuracy(states[m], job)
            job.curve.append((job.clock, acc))
            if acc >= job.target and job.time_to_target is None:
                job.time_to_target = job.clock
    return jobs

"""The real multi-job FL runtime: non-IID splits, FedAvg, dropout, accuracy against time."""

import numpy as np
import pytest

from trainmaster.flsched import make_scheduler
from trainmaster.flsched.runtime import MultiJobOptions, load_job, run_multijob


def test_non_iid_split_gives_each_device_few_classes():
    """Non-IID split: label-sorted shards, two per device, so most devices see at most ~2-3 classes."""
    job = load_job("digits", 20, seed=0, target=0.9)
    assert sum(len(s) for s in job.shards) == len(job.y_train)
    classes = [len(np.unique(job.y_train[s])) for s in job.shards]
    assert np.median(classes) <= 3


@pytest.mark.timeout(180)
def test_fedavg_training_improves_accuracy_with_dropout():
    """FedAvg over surviving devices: three jobs really train (accuracy well above chance) even
    with 30% of chosen devices dropping mid-round; the simulated clock only moves forward."""
    options = MultiJobOptions(
        num_devices=12,
        per_round=3,
        rounds=8,
        seed=0,
        dropout=0.3,
        targets={"digits": 1.1, "wine": 1.1, "breast-cancer": 1.1},
    )
    jobs = run_multijob(make_scheduler("random", seed=0), options)
    chance = {"digits": 0.1, "wine": 0.4, "breast-cancer": 0.63}
    for job in jobs:
        assert 4 <= len(job.curve) <= 8  # a round is skipped when too few devices are reachable
        times = [t for t, _ in job.curve]
        assert all(b > a for a, b in zip(times, times[1:]))
        assert max(a for _, a in job.curve) > chance[job.name] + 0.2


def test_run_options_reject_values_that_cannot_run():
    """Options objects of the real runtimes (MultiJobOptions, WallClockOptions): a value no run
    can use is refused when the options are made, with the field named."""
    from trainmaster.flsched.wallclock import WallClockOptions

    assert MultiJobOptions().rounds == 40 and WallClockOptions().max_rounds == 60  # the former defaults
    for bad, field in [
        (lambda: MultiJobOptions(per_round=0), "per_round"),
        (lambda: MultiJobOptions(dropout=1.5), "dropout"),
        (lambda: MultiJobOptions(targets={"mnist": 0.9}), "unknown jobs"),
        (lambda: WallClockOptions(availability=-0.1), "availability"),
        (lambda: WallClockOptions(speedup=0.0), "speedup"),
        (lambda: WallClockOptions(time_limit=-1.0), "time_limit"),
    ]:
        with pytest.raises(ValueError, match=field):
            bad()

"""The wall-clock runtime: token-bucket links and device processes that take their drawn time."""

import multiprocessing as mp
import time

import pytest

from trainmaster.flsched import make_scheduler
from trainmaster.flsched.wallclock import TokenBucket, WallClockOptions, run_wallclock


def test_token_bucket_never_lets_more_than_its_rate_through():
    """Rate limiter in the transport: after the burst, n bytes take at least n / rate seconds
    (a lower bound only: an upper bound would flake on a loaded machine)."""
    bucket = TokenBucket(rate=200_000.0, burst=10_000.0)
    started = time.monotonic()
    for _ in range(10):
        bucket.take(10_000.0)
    assert time.monotonic() - started >= (100_000.0 - 10_000.0) / 200_000.0 - 1e-3


def test_wallclock_run_trains_real_jobs_and_leaves_no_process_behind():
    """Wall-clock runtime: device processes train the three jobs for real (accuracy recorded
    against wall time, increasing times, at most max_rounds rounds per job), and every device
    process is gone when the run returns."""
    pytest.importorskip("torch")
    options = WallClockOptions(num_devices=8, per_round=2, max_rounds=2, seed=0, speedup=200.0, time_limit=60.0)
    res = run_wallclock(make_scheduler("random", seed=0), options)
    assert [j.name for j in res.jobs] == ["digits", "wine", "breast-cancer"]
    for job in res.jobs:
        assert 1 <= job.rounds <= 2
        times = [t for t, _ in job.curve]
        assert times == sorted(times) and times[0] > 0.0
        assert all(0.0 <= acc <= 1.0 for _, acc in job.curve)
    assert mp.active_children() == []


def test_straggler_pool_slows_a_share_of_the_devices():
    """Wall-clock setup (slow tail): make_straggler_pool makes exactly share x K devices factor
    times slower in compute shift, spread and link, and leaves the others as make_pool draws them."""
    from trainmaster.flsched.synthetic import make_pool, make_straggler_pool

    base, slow = make_pool(20, 7), make_straggler_pool(20, 7, share=0.25, factor=10.0)
    changed = [k for k in range(20) if slow[k] != base[k]]
    assert len(changed) == 5
    for k in changed:
        assert slow[k].a == pytest.approx(10.0 * base[k].a)
        assert slow[k].mu == pytest.approx(base[k].mu / 10.0)
        assert slow[k].bandwidth == pytest.approx(base[k].bandwidth / 10.0)
    assert make_straggler_pool(20, 7, share=0.25, factor=10.0) == slow  # deterministic in the seed
    with pytest.raises(ValueError, match="straggler share"):
        make_straggler_pool(20, 7, share=1.5)

"""Schedulers behind one interface, resolved by name: sa, greedy, random, roundrobin, genetic,
fedcs, oort, exact."""

from trainmaster.flsched.schedulers import annealing, baselines, exact, genetic  # noqa: F401  (registration)
from trainmaster.flsched.schedulers.base import Scheduler, make_scheduler, metropolis_accept, names, register

__all__ = ["Scheduler", "make_scheduler", "metropolis_accept", "names", "register"]

"""Slot-id collision rates with many tenants: the spec's hash of (job, slice index) against the
former ``hash(job) + index`` rule.

Model: ``tenants`` jobs (random 31-bit ids, as the ``ina`` framework derives them from job
names) share one forwarding node of ``pool`` slots; each has ``window`` slices in flight at
once (slices ``round * window .. round * window + window - 1`` of its tensor). A slice
*collides* when another in-flight slice (of any job, itself included) maps to its slot; the
forwarding node then diverts it to the parameter node. Reported per rule: the mean fraction of
slices that collide, the 99th percentile over tenants of each tenant's fraction (how unlucky one
job can be), and the fraction of a job's own slices that collide with each other.

    .venv/bin/python bench/aggregation_slots.py [--tenants 4,16,64] [--pool 64] [--window 8]
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from dataclasses import asdict, dataclass

from trainmaster.aggregation.protocol import legacy_slot_id, slot_id

RULES = {"hash(job, index)": slot_id, "hash(job) + index": legacy_slot_id}


@dataclass(frozen=True)
class CollisionRate:
    rule: str
    tenants: int
    pool: int
    window: int
    mean: float  # fraction of in-flight slices that share their slot with another slice
    p99_tenant: float  # 99th percentile over tenants of a tenant's colliding fraction
    self_collisions: float  # fraction of slices colliding with a slice of their own job


def measure(rule: str, tenants: int, pool: int, window: int, trials: int, seed: int) -> CollisionRate:
    rng = random.Random(seed)
    fn = RULES[rule]
    collided = slices = own = 0
    per_tenant: list[float] = []
    for _ in range(trials):
        jobs = rng.sample(range(1, 2**31), tenants)
        rnd = rng.randrange(1000)
        placed = {job: [fn(job, rnd * window + i) % pool for i in range(window)] for job in jobs}
        load = Counter(s for slots in placed.values() for s in slots)
        for slots in placed.values():
            mine = Counter(slots)
            hit = sum(1 for s in slots if load[s] > 1)
            own += sum(1 for s in slots if mine[s] > 1)
            collided += hit
            slices += len(slots)
            per_tenant.append(hit / len(slots))
    per_tenant.sort()
    return CollisionRate(
        rule, tenants, pool, window, collided / slices, per_tenant[int(0.99 * (len(per_tenant) - 1))], own / slices
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", default="2,4,8,16,64")
    ap.add_argument("--pool", type=int, default=64)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--trials", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [
        measure(rule, int(t), args.pool, args.window, args.trials, args.seed)
        for t in args.tenants.split(",")
        for rule in RULES
    ]
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
        return
    print(f"pool {args.pool} slots, window {args.window} slices per tenant, {args.trials} trials")
    print("| tenants | rule | mean colliding | p99 of a tenant | own-window collisions |")
    print("|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r.tenants} | {r.rule} | {r.mean:.3f} | {r.p99_tenant:.3f} | {r.self_collisions:.3f} |")


if __name__ == "__main__":
    main()

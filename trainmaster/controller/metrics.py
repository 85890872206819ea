"""Prometheus metrics of the controller (served at ``/metrics`` by the controller service)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

JOBS = Gauge("trainmaster_jobs", "Jobs in the store by state", ["state"], registry=REGISTRY)
LAUNCH_LATENCY = Histogram("trainmaster_instance_launch_seconds",
                           "Time from starting an instance to it running (dependency wait included)",
                           registry=REGISTRY, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
RECONCILE = Histogram("trainmaster_reconcile_seconds", "Duration of one reconcile pass over all jobs",
                      registry=REGISTRY, buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
RESTARTS = Counter("trainmaster_instance_restarts", "Instance restarts by restart policy", ["role"],
                   registry=REGISTRY)
REPORTED = Gauge("trainmaster_reported_metric", "Latest value each running instance reported with trainmaster.report()",
                 ["job", "role", "index", "metric"], registry=REGISTRY)
LEADING = Gauge("trainmaster_leading", "1 while this server leads the controller (reconciles), 0 on a standby",
                registry=REGISTRY)

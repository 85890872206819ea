"""Prometheus metrics of the controller (served at ``/metrics`` by the controller service)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

JOBS = Gauge("trainmaster_jobs", "Jobs in the store by state", ["state"], registry=REGISTRY)
LAUNCH_LATENCY = Histogram(
    "trainmaster_instance_launch_seconds",
    "Time from starting an instance to it running (dependency wait included)",
    registry=REGISTRY,
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
RECONCILE = Histogram(
    "trainmaster_reconcile_seconds",
    "Duration of one reconcile pass over all jobs",
    registry=REGISTRY,
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
RESTARTS = Counter("trainmaster_instance_restarts", "Instance restarts by restart policy", ["role"], registry=REGISTRY)
REPORTED = Gauge(
    "trainmaster_reported_metric",
    "Latest value each running instance reported with trainmaster.report()",
    ["job", "role", "index", "metric"],
    registry=REGISTRY,
)
LEADING = Gauge(
    "trainmaster_leading", "1 while this server leads the controller (reconciles), 0 on a standby", registry=REGISTRY
)
INSTANCE_CPU = Gauge(
    "trainmaster_instance_cpu_seconds",
    "CPU seconds (user + system) of an instance's whole process tree, as its node agent last reported",
    ["job", "role", "index"],
    registry=REGISTRY,
)
INSTANCE_PEAK_RSS = Gauge(
    "trainmaster_instance_peak_rss_bytes",
    "Peak memory of an instance's whole process tree",
    ["job", "role", "index"],
    registry=REGISTRY,
)


def observe_instance(job: str, role: str, index: int, cpu_seconds: float, peak_rss: int) -> None:
    """Export what a node agent reported of one instance."""
    INSTANCE_CPU.labels(job=job, role=role, index=str(index)).set(cpu_seconds)
    INSTANCE_PEAK_RSS.labels(job=job, role=role, index=str(index)).set(peak_rss)

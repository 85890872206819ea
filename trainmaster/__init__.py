"""Trainmaster: one controller for every distributed and federated ML training framework."""

__version__ = "0.1.0"


def report(**kwargs):  # type: ignore[no-untyped-def]
    """Report a role's progress and metrics; see :func:`trainmaster.runtime.report.report`."""
    from trainmaster.runtime.report import report as _report

    return _report(**kwargs)


def publish(kind, record):  # type: ignore[no-untyped-def]
    """Publish a capability's record for the dashboard; see :func:`trainmaster.runtime.views.publish`."""
    from trainmaster.runtime.views import publish as _publish

    return _publish(kind, record)

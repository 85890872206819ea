"""Roles report metrics with ``trainmaster.report``: points are stored per instance with the job,
and ``status`` returns each instance's latest point (controller.md: states and counts stored so a
user can query them at any time, extended to what the roles report)."""

from __future__ import annotations

import pytest

from controller_harness import Harness, job, py
from trainmaster.errors import UserError
from trainmaster.runtime.report import check_point, report


def test_reported_metric_reaches_status(harness: Harness) -> None:
    code = (
        "import trainmaster\n"
        "for s in range(1, 4):\n"
        "    assert trainmaster.report(step=s, total=3, loss=1.0 / s, accuracy=0.5 + s / 10)\n"
    )
    state, status = harness.run(job("reporter", [{"name": "main", "replicas": 2, "command": py(code)}]))
    assert state == "succeeded"
    for inst in status["instances"]:
        assert inst["metrics"]["step"] == 3 and inst["metrics"]["total"] == 3
        assert inst["metrics"]["values"] == {"loss": pytest.approx(1 / 3), "accuracy": pytest.approx(0.8)}


def test_report_outside_an_instance_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TM_CHANNEL", "TM_CHANNEL_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    assert report(step=1, loss=0.1) is False


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"loss": float("nan")}, "finite"),
        ({"loss": "low"}, "finite"),
        ({"step": -1}, "step"),
        ({"epoch": 1.5}, "epoch"),
        ({"bad name": 1.0}, "identifier"),
        ({f"m{i}": 1.0 for i in range(33)}, "at most 32"),
    ],
)
def test_report_refuses_bad_points(kwargs: dict, fragment: str) -> None:
    with pytest.raises(UserError, match=fragment):
        check_point(kwargs.pop("step", None), kwargs.pop("epoch", None), None, kwargs)

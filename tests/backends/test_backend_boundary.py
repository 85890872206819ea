"""Mechanism: the typed backend boundary (controller spec, 'Our product decisions': one
controller, pluggable engines). Backends are found by name, third-party ones through the
entry-point group ``trainmaster.backends`` as frameworks are; an attempt's phase has one
vocabulary mapped onto the instance states in one place; a handle is typed everywhere and
becomes JSON only in the store's column (rows written before it was typed read back too)."""

from __future__ import annotations

import json
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from sqlalchemy import text

from trainmaster.backends import registry
from trainmaster.backends.base import BackendOptions, Resources
from trainmaster.backends.local import LocalBackend
from trainmaster.contract import InstanceHandle, InstancePhase, InstanceStatus
from trainmaster.errors import UserError
from trainmaster.spec.states import InstanceState, observed_state
from trainmaster.store.db import make_engine, session_factory
from trainmaster.store.models import InstanceRow, JobRow


def test_a_backend_is_found_by_name_and_an_unknown_one_is_refused_clearly() -> None:
    local = registry.make_backend("local", BackendOptions(cpus=1.5))
    try:
        assert isinstance(local, LocalBackend) and local.capacity().cpu == 1.5
    finally:
        local.close()
    with pytest.raises(
        UserError, match=r"unknown backend 'elsewhere' \(available: hollow, kubernetes, local, ray, testbed\)"
    ):
        registry.make_backend("elsewhere")


def test_a_third_party_backend_plugs_in_through_its_entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package names a factory in ``trainmaster.backends``; ``--backend <name>`` then builds it
    with the run's options, and only then is its module imported."""
    (tmp_path / "tm_probe_backend.py").write_text(
        "from trainmaster.backends.local import LocalBackend\n"
        "class Probe(LocalBackend):\n"
        "    name = 'probe'\n"
        "def create(options):\n"
        "    return Probe(capacity=__import__('trainmaster.backends.base').backends.base.Resources(cpu=options.cpus))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    found = [EntryPoint("probe", "tm_probe_backend:create", registry.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(registry, "entry_points", lambda group: found if group == registry.ENTRY_POINT_GROUP else [])
    assert "probe" in registry.installed_backends()
    assert "tm_probe_backend" not in sys.modules  # listing imports nothing
    backend = registry.make_backend("probe", BackendOptions(cpus=3))
    try:
        assert backend.name == "probe" and backend.capacity() == Resources(cpu=3)
    finally:
        backend.close()


def test_one_phase_vocabulary_maps_onto_the_instance_states_in_one_place() -> None:
    assert observed_state(InstancePhase.STARTING) == InstanceState.STARTING
    assert observed_state(InstancePhase.RUNNING) == InstanceState.RUNNING
    assert observed_state(InstancePhase.UNREACHABLE) == InstanceState.UNKNOWN
    assert observed_state(InstancePhase.EXITED, 0) == InstanceState.SUCCEEDED
    assert observed_state(InstancePhase.EXITED, 127) == InstanceState.FAILED  # a refused start too
    assert observed_state(InstancePhase.LOST) == InstanceState.FAILED
    # journals written before the vocabulary was one still read
    status = InstanceStatus.from_dict(
        {"handle": {"node": "local", "instance_id": "u/r-0/1"}, "phase": "start_failed", "exit_code": 127}
    )
    assert status.phase == InstancePhase.EXITED
    assert InstancePhase("waiting") == InstancePhase.STARTING


def test_the_handle_is_typed_and_becomes_json_only_in_its_column(tmp_path: Path) -> None:
    sessions = session_factory(make_engine(f"sqlite:///{tmp_path / 'store.db'}"))
    handle = InstanceHandle("h2", "u/server-0/1", 4242, [20001, 20002])
    with sessions() as session:
        job = JobRow(uid="u", name="j", spec={}, run_dir=str(tmp_path))
        session.add(job)
        session.flush()
        session.add_all(
            [
                InstanceRow(job_id=job.id, role="server", index=0, handle=handle),
                InstanceRow(job_id=job.id, role="server", index=1, handle=None),
            ]
        )
        session.commit()
    with sessions() as session:
        rows = session.query(InstanceRow).order_by(InstanceRow.index).all()
        assert rows[0].handle == handle and rows[1].handle is None
        # a row written before handles were typed (a Ray handle carried more keys; node unknown)
        legacy_json = {"backend": "ray", "instance_id": "u/server-1/1", "node": None, "bundle": 3, "pid": None}
        session.execute(
            text("UPDATE instances SET handle = :handle WHERE id = :id"),
            {"handle": json.dumps(legacy_json), "id": rows[1].id},
        )
        session.commit()
    with sessions() as session:
        legacy = session.query(InstanceRow).filter_by(index=1).one().handle
        assert legacy == InstanceHandle("", "u/server-1/1")

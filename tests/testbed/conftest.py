"""Testbed fixtures: a small testbed per test under a unique prefix, removed even when the test
fails, and a check after every test that no namespace of that prefix is left on the machine."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Callable, Iterator

import pytest

from trainmaster.testbed import Testbed, TestbedOptions, remove
from trainmaster.testbed.iproute import namespaces


def _namespaces_unavailable() -> str | None:
    """Why this machine cannot hold a testbed, or None when it can."""
    if os.geteuid() != 0:
        return "testbeds need root (network namespaces, veth links, tc qdiscs)"
    probe = f"tmprobe{secrets.token_hex(3)}"
    try:
        done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=20)
    except FileNotFoundError:
        return "iproute2's 'ip' is not installed (apt-get install -y iproute2)"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=20)
    if done.returncode != 0:
        return f"network namespaces cannot be created here: {done.stderr.strip()}"
    return None


_UNAVAILABLE = _namespaces_unavailable()


@pytest.fixture
def unique_prefix() -> Iterator[str]:
    """A prefix no other test or user holds; afterwards, nothing of it may remain."""
    if _UNAVAILABLE:
        pytest.skip(_UNAVAILABLE)
    prefix = f"t{secrets.token_hex(3)}"
    yield prefix
    remove(prefix)
    left = [ns for ns in namespaces() if ns.startswith(f"{prefix}-")]
    assert not left, f"namespaces left behind by the test: {left}"


@pytest.fixture
def make_testbed(unique_prefix: str) -> Iterator[Callable[..., Testbed]]:
    """``make_testbed(hosts=3, link_rate=...)`` -> a testbed that is up; removed after the test."""
    made: list[Testbed] = []

    def make(**options: object) -> Testbed:
        bed = Testbed.up(TestbedOptions(prefix=unique_prefix, **options))  # type: ignore[arg-type]
        made.append(bed)
        return bed

    try:
        yield make
    finally:
        for bed in made:
            bed.down()

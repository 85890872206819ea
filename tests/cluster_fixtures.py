"""One real Kubernetes cluster per test session, for every test marked ``kubernetes``.

A plain module (not conftest: several conftest.py files live in this tree); tests/conftest.py
imports the fixture and the ordering hook. The cluster is built from the binaries ``make
k8s-deps`` leaves in /var/cache/trainmaster; ``make test`` starts that build in the background
first, so these tests run last (:func:`pytest_collection_modifyitems`) and wait for the build
(at most ``$TM_K8S_BUILD_WAIT`` seconds, 1800 by default). They skip, saying why, where the
machine cannot have a cluster (not root, no build and none running, no containerd/etcd/podman).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BUILD_WAIT = float(os.environ.get("TM_K8S_BUILD_WAIT", "1800"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Kubernetes tests last: the build ``make test`` started meanwhile has the time it needs."""
    items.sort(key=lambda item: item.get_closest_marker("kubernetes") is not None)


def _build_running(cache: Path) -> bool:
    lock = cache / "kubernetes-build.lock"
    if not lock.exists():
        return False
    with open(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def wait_for_binaries() -> object:
    """The build's binaries, waiting for a build in progress; skips with the reason otherwise."""
    from trainmaster.cluster.binaries import cache_root, find_binaries
    from trainmaster.errors import UserError

    cache = cache_root()
    deadline = time.monotonic() + BUILD_WAIT
    while True:
        try:
            return find_binaries(cache)
        except UserError as exc:
            if not _build_running(cache) or time.monotonic() > deadline:
                log = cache / "kubernetes-build.log"
                why = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
                pytest.skip(f"{exc}" + (f" (the background build said: {' / '.join(why)})" if why else ""))
        time.sleep(5)


def cluster_unavailable() -> str:
    if os.geteuid() != 0:
        return "a Kubernetes cluster needs root (namespaces, veth links, cgroups, mounts)"
    for program in ("containerd", "ctr", "etcd", "nsenter", "unshare", "ip"):
        if shutil.which(program) is None:
            return f"{program} is not installed (make k8s-deps installs it)"
    from trainmaster.containers.runtime import unavailable

    why = unavailable()
    return f"the cluster's images are built with podman: {why}" if why else ""


@pytest.fixture(scope="session")
def k8s_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A 2-node cluster for the whole session, named ``t<hex>`` (nothing it makes can collide
    with another run's), removed at the end whether the tests passed or not."""
    why = cluster_unavailable()
    if why:
        pytest.skip(why)
    binaries = wait_for_binaries()
    from trainmaster.cluster import Cluster, ClusterOptions, remove

    root = tmp_path_factory.mktemp("k8s-cluster")
    name = f"t{secrets.token_hex(2)}"
    try:
        cluster = Cluster.up(ClusterOptions(name=name, nodes=2), binaries=binaries, root=root)  # type: ignore[arg-type]
    except BaseException:
        remove(name, root=root)
        raise
    try:
        yield cluster
    finally:
        remove(name, root=root)

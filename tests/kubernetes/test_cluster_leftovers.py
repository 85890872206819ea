"""Mechanism: `trainmaster cluster down --name N` removes what carries cluster N's names even
without the cluster's record (controller spec, 'Our product decisions': Kubernetes; a cluster
whose home was deleted, or an `up` killed before it wrote its record, left links and cgroups that
`down` reported as "0 item(s)" removed). Needs no Kubernetes binaries: the leftovers are made by
hand with the names `cluster up` gives them."""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

import pytest

from trainmaster.cluster import remove

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="links, namespaces and cgroups need root")


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def test_down_by_name_removes_links_namespaces_cgroups_and_processes_without_a_record(tmp_path: Path) -> None:
    name = f"z{secrets.token_hex(2)}"
    other = f"y{secrets.token_hex(2)}"  # another cluster's leftovers must stay
    pids = Path("/sys/fs/cgroup/pids")
    if not pids.is_dir():
        pytest.skip("no cgroup v1 pids hierarchy on this machine")
    sleeper = None
    try:
        assert ip("link", "add", f"tk{name}h2", "type", "veth", "peer", "name", f"tk{name}n2").returncode == 0
        assert ip("link", "add", f"tk{name}b1", "type", "bridge").returncode == 0
        assert ip("link", "add", f"tk{other}b1", "type", "bridge").returncode == 0
        assert ip("netns", "add", f"tmk-{name}-n2").returncode == 0
        (pids / f"tmk-{name}-n1" / "pod").mkdir(parents=True)
        sleeper = subprocess.Popen(["sleep", "300"])
        (pids / f"tmk-{name}-n1" / "pod" / "cgroup.procs").write_text(str(sleeper.pid))

        removed = remove(name, root=tmp_path)  # no record under this root

        assert sleeper.wait(timeout=20) != 0, "the process in the node's cgroup was not killed"
        assert f"cgroup /tmk-{name}-n1" in removed and f"netns tmk-{name}-n2" in removed
        assert {f"link tk{name}h2", f"link tk{name}b1"} <= set(removed)
        links = ip("-o", "link", "show").stdout
        assert f"tk{name}" not in links
        assert f"tk{other}b1" in links
        assert f"tmk-{name}-n2" not in ip("netns", "list").stdout
        assert not (pids / f"tmk-{name}-n1").exists()
    finally:
        if sleeper is not None and sleeper.poll() is None:
            sleeper.kill()
        for link in (f"tk{name}h2", f"tk{name}b1", f"tk{other}b1"):
            ip("link", "delete", link)
        ip("netns", "delete", f"tmk-{name}-n2")
        for folder in (pids / f"tmk-{name}-n1" / "pod", pids / f"tmk-{name}-n1"):
            if folder.is_dir():
                folder.rmdir()

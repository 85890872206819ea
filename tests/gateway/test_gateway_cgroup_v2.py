"""The sandbox's cgroup code on a cgroup v2 (unified) host, against a faked mount layout.

The sandbox tests in test_gateway_sandbox.py run on whatever hierarchy the host has (this one:
cgroup v1). These tests point the sandbox's cgroup root at a folder laid out like
``/sys/fs/cgroup`` on a v2-only host (and like a v1 and a hybrid host), so the v2 path is exercised
everywhere: detection, enabling the controllers down the tree, the limits each group gets, how a
process joins, how the kernel's counters are read, ``cgroup.kill``, and the sweep of stale groups.
A small fake kernel makes ``mkdir`` create a new group's interface files and ``rmdir`` remove
them with the group, as cgroupfs does; what a fake cannot show is the kernel enforcing the limits
(the sandbox tests do that on this host's hierarchy).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator

import pytest

from trainmaster.gateway.executors.sandbox import bubblewrap as sbx


KERNEL_FILES = {
    "cgroup.procs": "",
    "cgroup.subtree_control": "",
    "cgroup.kill": "",
    "memory.max": "max\n",
    "memory.swap.max": "max\n",
    "memory.oom.group": "0\n",
    "memory.current": "0\n",
    "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
    "pids.max": "max\n",
    "pids.events": "max 0\n",
}
"""What a v2 kernel puts in a new group with memory and pids enabled (the ones the sandbox touches)."""


@pytest.fixture
def fake_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "cgroup"
    root.mkdir()
    real_mkdir, real_rmdir = Path.mkdir, Path.rmdir
    files = KERNEL_FILES

    def kernel_mkdir(self: Path, mode: int = 0o777, parents: bool = False, exist_ok: bool = False) -> None:
        existed = self.is_dir()
        real_mkdir(self, mode, parents, exist_ok)
        if root in self.parents and not existed:
            for name, text in files.items():
                (self / name).write_text(text)

    def kernel_rmdir(self: Path) -> None:
        if root in self.parents and self.is_dir() and not any(p.is_dir() for p in self.iterdir()):
            for name in files:
                (self / name).unlink(missing_ok=True)
        real_rmdir(self)

    monkeypatch.setattr(Path, "mkdir", kernel_mkdir)
    monkeypatch.setattr(Path, "rmdir", kernel_rmdir)
    monkeypatch.setattr(sbx, "CGROUP_ROOT", root)
    sbx.cgroup_version.cache_clear()
    yield root
    sbx.cgroup_version.cache_clear()


def _v2_layout(root: Path, controllers: str = "cpuset cpu io memory hugetlb pids rdma misc") -> None:
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("\n")
    (root / "cgroup.procs").write_text("1\n")


def test_cgroup_v2_detected_on_unified_layout_and_v1_preferred_on_hybrid(fake_root: Path) -> None:
    """cgroup v2 detection: a unified root offering memory and pids is v2; one without pids is
    unusable (None); a hybrid host with v1 memory and pids hierarchies uses v1."""
    _v2_layout(fake_root)
    assert sbx.cgroup_version() == 2
    assert sbx.parent_dirs() == [fake_root / sbx.CGROUP_PARENT]
    assert sbx.group_dirs("g") == [fake_root / sbx.CGROUP_PARENT / "g"]

    (fake_root / "cgroup.controllers").write_text("cpu io memory\n")
    sbx.cgroup_version.cache_clear()
    assert sbx.cgroup_version() is None

    for ctl in sbx.CONTROLLERS:  # hybrid: v1 hierarchies next to the unified one
        (fake_root / ctl).mkdir()
        (fake_root / ctl / "cgroup.procs").write_text("")
    sbx.cgroup_version.cache_clear()
    assert sbx.cgroup_version() == 1
    assert sbx.parent_dirs() == [fake_root / ctl / sbx.CGROUP_PARENT for ctl in sbx.CONTROLLERS]


def test_cgroup_v2_group_gets_limits_joins_counts_kills_and_is_removed(fake_root: Path) -> None:
    """cgroup v2 group life cycle: memory and pids enabled for the children of the root and of
    trainmaster-gateway, one group holding both controllers with memory.max, memory.swap.max 0,
    memory.oom.group 1 and pids.max; joining writes the pid to its cgroup.procs; the OOM and
    fork-refusal counters are read from memory.events and pids.events; kill uses cgroup.kill."""
    _v2_layout(fake_root)
    parent = fake_root / sbx.CGROUP_PARENT
    leaf = parent / "tm-exec-t1.m_a.abc"
    limits = sbx.SandboxLimits(memory_mb=96, pids=17)
    group = sbx.SandboxCgroups.create(leaf.name, limits)
    assert group.version == 2
    assert group.paths == {"memory": leaf, "pids": leaf}
    assert (fake_root / "cgroup.subtree_control").read_text().split() == ["+memory", "+pids"]
    assert (parent / "cgroup.subtree_control").read_text().split() == ["+memory", "+pids"]
    assert (leaf / "memory.max").read_text() == str(96 << 20)
    assert (leaf / "memory.swap.max").read_text() == "0"  # no swapping past the limit
    assert (leaf / "memory.oom.group").read_text() == "1"
    assert (leaf / "pids.max").read_text() == "17"
    assert not (leaf / "memory.limit_in_bytes").exists()

    group.join_self()
    assert (leaf / "cgroup.procs").read_text() == str(os.getpid())

    (leaf / "memory.current").write_text("12345\n")
    assert group.memory_usage() == 12345
    group.set_memory_limit(1 << 30)
    assert (leaf / "memory.max").read_text() == str(1 << 30)
    (leaf / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 0\noom_group_kill 0\n")
    assert not group.memory_killed()
    (leaf / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\noom_group_kill 1\n")
    assert group.memory_killed()
    (leaf / "pids.events").write_text("max 4\n")
    assert group.pids_refused() == 4

    (leaf / "cgroup.procs").write_text("")  # (the fake kernel does not move processes: empty it by hand)
    assert group.kill_all(timeout_s=1.0)
    assert (leaf / "cgroup.kill").read_text() == "1"
    assert group.remove() and not leaf.exists() and group.paths == {}


def test_cgroup_v2_swap_limit_only_where_accounted_and_stale_groups_swept(
    fake_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cgroup v2 on a host without swap accounting (no memory.swap.max) still gets its memory
    limit; the sweep after a party was killed -9 removes an empty v2 group older than a minute and
    its host folder, and leaves a young one alone."""
    _v2_layout(fake_root)
    monkeypatch.delitem(KERNEL_FILES, "memory.swap.max")
    group = sbx.SandboxCgroups.create("tm-exec-t2.m_b.def", sbx.SandboxLimits(memory_mb=8))
    leaf = group.paths["memory"]
    assert (leaf / "memory.max").read_text() == str(8 << 20) and not (leaf / "memory.swap.max").exists()

    homes = tmp_path / "homes"
    (homes / leaf.name).mkdir(parents=True)
    young = fake_root / sbx.CGROUP_PARENT / "tm-exec-young"
    young.mkdir()
    old = time.time() - 2 * sbx.STALE_GROUP_AGE_S
    os.utime(leaf, (old, old))
    assert sbx.sweep_stale_groups(homes) == [leaf]
    assert not leaf.exists() and not (homes / leaf.name).exists() and young.is_dir()

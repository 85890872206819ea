"""Where the Kubernetes binaries are: built once by ``build-kubernetes.sh`` (``make k8s-deps`` or
``trainmaster cluster build``) into a cache outside any checkout, and found here by its stamp."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from trainmaster.errors import UserError

DEFAULT_CACHE = "/var/cache/trainmaster"
PROGRAMS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "pause")
BUILD_SCRIPT = Path(__file__).with_name("build-kubernetes.sh")
STAMP = ".built-r2"  # the build script's REVISION: earlier builds are not used


def cache_root() -> Path:
    return Path(os.environ.get("TM_K8S_CACHE") or DEFAULT_CACHE)


@dataclass(frozen=True)
class Binaries:
    folder: str
    version: str

    @property
    def pause(self) -> str:
        return os.path.join(self.folder, "pause")

    @property
    def kubectl(self) -> str:
        """The build's kubectl, else the one on PATH (the build skips it when one is there)."""
        built = os.path.join(self.folder, "kubectl")
        return built if os.path.exists(built) else (shutil.which("kubectl") or "kubectl")


def find_binaries(root: Path | None = None) -> Binaries:
    """The newest complete build in the cache, or a :class:`UserError` saying how to make one."""
    root = root or cache_root()
    builds = sorted(root.glob(f"kubernetes-*/{STAMP}")) if root.is_dir() else []
    for stamp in reversed(builds):
        folder = stamp.parent / "bin"
        if all((folder / p).is_file() for p in PROGRAMS):
            return Binaries(str(folder), stamp.parent.name.removeprefix("kubernetes-"))
    raise UserError(
        f"no Kubernetes build in {root} (kubernetes-<version>/{STAMP}); build it once with `make k8s-deps` "
        "or `trainmaster cluster build` (root, Debian with deb-src; about 8 minutes on 2 cores)"
    )


def build(root: Path | None = None) -> int:
    """Run the build script (prints its progress); returns its exit status (3: cannot build here)."""
    env = {**os.environ, "TM_K8S_CACHE": str(root or cache_root())}
    return subprocess.run(["bash", str(BUILD_SCRIPT)], env=env).returncode

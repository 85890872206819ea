"""Images built from this machine's own files, for machines without a registry (tests, benches,
air-gapped clusters).

- :func:`build_program_image`: a root filesystem holding a few of this machine's programs and
  the shared libraries they load (found with ``ldd``), imported with ``podman import``. A few
  megabytes; self-contained.
- :func:`build_python_image` + :func:`python_mounts`: an image whose Python (and torch, and every
  other package of the environment) is this machine's, bind-mounted read-only when the container
  runs: copying a multi-gigabyte environment into an image would take minutes, mounting it
  takes none. The image holds the mount points and the merged-``/usr`` links only.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import trainmaster
from trainmaster.containers.runtime import ContainerRuntime

MERGED_USR_LINKS = {"bin": "usr/bin", "sbin": "usr/sbin", "lib": "usr/lib", "lib64": "usr/lib64"}
SKELETON_DIRS = ("tmp", "etc", "proc", "sys", "dev", "root", "workspace")
PASSWD = "root:x:0:0:root:/root:/bin/sh\n"


def _libraries(program: str) -> list[str]:
    out = subprocess.run(["ldd", program], capture_output=True, text=True, timeout=30).stdout
    return sorted(set(re.findall(r"(/\S+)", out)))


def _add_file(tar: tarfile.TarFile, source: str, target: str) -> None:
    if target.lstrip("/") in tar.getnames():
        return
    tar.add(os.path.realpath(source), arcname=target.lstrip("/"), recursive=False)


def _add_dir(tar: tarfile.TarFile, name: str, mode: int = 0o755) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, mode
    tar.addfile(info)


def _add_text(tar: tarfile.TarFile, name: str, text: str) -> None:
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    tar.addfile(info, io.BytesIO(data))


def _import(runtime: ContainerRuntime, tarball: Path, tag: str, changes: list[str]) -> None:
    argv = [*runtime.base(), "import"]
    for change in changes:
        argv += ["--change", change]
    done = subprocess.run([*argv, str(tarball), tag], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"podman import of {tag} failed: {done.stderr.strip()}")


def _changes(entrypoint: list[str] | None, cmd: list[str] | None, workdir: str | None) -> list[str]:
    import json

    changes = []
    if entrypoint is not None:
        changes.append(f"ENTRYPOINT {json.dumps(entrypoint)}")
    if cmd is not None:
        changes.append(f"CMD {json.dumps(cmd)}")
    if workdir is not None:
        changes.append(f"WORKDIR {workdir}")
    return changes


def build_program_image(
    runtime: ContainerRuntime,
    tag: str,
    programs: list[str],
    *,
    entrypoint: list[str] | None = None,
    cmd: list[str] | None = None,
    workdir: str | None = None,
) -> None:
    """Import ``tag`` holding ``programs`` (names on PATH or paths; each lands at its path
    under ``/usr/bin``) with their libraries, ``/bin/sh`` included."""
    with tempfile.TemporaryDirectory(prefix="tm-image-") as folder:
        tarball = Path(folder) / "rootfs.tar"
        with tarfile.open(tarball, "w") as tar:
            for name in ("usr", "usr/bin", *SKELETON_DIRS):
                _add_dir(tar, name)
            _add_text(tar, "etc/passwd", PASSWD)
            for link, target in (("bin", "usr/bin"),):
                info = tarfile.TarInfo(link)
                info.type, info.linkname = tarfile.SYMTYPE, target
                tar.addfile(info)
            for program in ["sh", *programs]:
                path = shutil.which(program)
                if path is None:
                    raise FileNotFoundError(f"program '{program}' not found on this machine")
                _add_file(tar, path, f"usr/bin/{Path(program).name}")
                for library in _libraries(path):
                    for parent in Path(library).parents[::-1][1:]:
                        if str(parent).lstrip("/") not in tar.getnames():
                            _add_dir(tar, str(parent).lstrip("/"))
                    _add_file(tar, library, library)
        _import(runtime, tarball, tag, _changes(entrypoint, cmd, workdir))


def python_mounts(extra: list[str] | None = None) -> list[dict[str, object]]:
    """The read-only bind mounts that give a :func:`build_python_image` container this
    machine's Python: ``/usr``, the interpreter's installation, the virtual environment, the
    checkout Trainmaster runs from when it is installed in editable mode (a clone's ``make``
    install: the venv only points at it) and ``extra`` paths, each at its own path."""
    checkout = str(Path(trainmaster.__file__).resolve().parents[1])
    paths = ["/usr", os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), checkout, *(extra or [])]
    seen: list[str] = []
    for path in paths:
        if path not in seen and not any(path.startswith(p.rstrip("/") + "/") for p in seen):
            seen.append(path)
    return [{"source": p, "target": p, "read_only": True} for p in seen]


def build_python_image(
    runtime: ContainerRuntime,
    tag: str,
    *,
    entrypoint: list[str] | None = None,
    cmd: list[str] | None = None,
    workdir: str | None = None,
) -> None:
    """Import ``tag``: the merged-``/usr`` links and the mount points of :func:`python_mounts`
    (run it with those mounts; its ``python``, first on its PATH, is this process' interpreter
    with its virtual environment)."""
    with tempfile.TemporaryDirectory(prefix="tm-image-") as folder:
        tarball = Path(folder) / "rootfs.tar"
        with tarfile.open(tarball, "w") as tar:
            for name in ("usr", *SKELETON_DIRS):
                _add_dir(tar, name)
            _add_text(tar, "etc/passwd", PASSWD)
            for link, target in MERGED_USR_LINKS.items():
                info = tarfile.TarInfo(link)
                info.type, info.linkname = tarfile.SYMTYPE, target
                tar.addfile(info)
            for mount in python_mounts():
                parts = Path(str(mount["target"])).parts[1:]
                for i in range(1, len(parts) + 1):
                    name = "/".join(parts[:i])
                    if name not in tar.getnames() and name not in MERGED_USR_LINKS:
                        _add_dir(tar, name)
        path = os.pathsep.join(
            [os.path.join(os.path.realpath(sys.prefix), "bin"), "/usr/local/bin", "/usr/bin", "/bin"]
        )
        _import(runtime, tarball, tag, [*_changes(entrypoint, cmd, workdir), f"ENV PATH={path}"])


def python_executable() -> str:
    """The interpreter path to give such a container (the venv's, so its packages are found)."""
    return os.path.join(os.path.realpath(sys.prefix), "bin", "python")


def remove_images(runtime: ContainerRuntime, tags: list[str]) -> None:
    if tags:
        subprocess.run([*runtime.base(), "rmi", "--force", "--ignore", *tags], capture_output=True, timeout=120)

"""Images for the cluster's nodes, built from this machine's files (no registry is reachable):

- ``pause``: the pod sandbox, compiled from the Kubernetes tree by ``make k8s-deps``;
- ``busybox``: Debian's static busybox;
- ``python``: this machine's Python, its virtual environment (torch, mpi4py...) and ``/usr``
  (OpenMPI's ``mpirun``, every shared library) are mounted read-only into the pod with
  ``hostPath`` volumes (:func:`python_volumes`); the image holds their mount points only. An
  image *holding* torch would be a multi-gigabyte tar imported into every node at every ``up``;
  mounting costs nothing (see docs/kubernetes.md for the measured sizes).

Each is made with the containers module's builders (``podman import`` of a root filesystem made
of this machine's files), saved as a docker-archive tar once (cached by content), and imported
into each node's containerd with ``ctr images import``. Pods use them with
``imagePullPolicy: Never``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from trainmaster.containers import images as container_images
from trainmaster.containers.images import build_program_image, build_python_image, python_mounts, remove_images
from trainmaster.containers.runtime import detect

REGISTRY = "trainmaster.local"
PAUSE = f"{REGISTRY}/pause:3.2"
BUSYBOX = f"{REGISTRY}/busybox:1"
PYTHON = f"{REGISTRY}/python:3.11"
IMPORT_TIMEOUT = 300.0


def python_mount_paths() -> list[str]:
    """The host folders a ``python`` pod mounts read-only (the containers module's choice)."""
    return [str(m["source"]) for m in python_mounts()]


#: what else of the machine's /etc its software needs, where present: Debian's alternatives
#: (/usr/bin/mpirun is a link through them) and OpenMPI's own defaults
ETC_MOUNTS = ("/etc/alternatives", "/etc/openmpi")


def host_runtime_mounts() -> list[str]:
    """Every host folder a pod running this machine's software mounts read-only."""
    return [*python_mount_paths(), *(p for p in ETC_MOUNTS if os.path.isdir(p))]


def _content_key(tag: str, parts: list[str]) -> str:
    """A file name for ``tag`` built from ``parts`` (the python image's mount points differ
    between installations: each gets its own tar)."""
    digest = hashlib.sha256(json.dumps([tag, *parts]).encode()).hexdigest()[:12]
    return f"{tag.rsplit('/', 1)[-1].replace(':', '-')}-{digest}.tar"


def python_executable() -> str:
    """The interpreter a ``python`` pod runs: this process' virtual environment's."""
    return container_images.python_executable()


@dataclass(frozen=True)
class ImageTar:
    """A docker-archive tar whose image is named ``built_as`` inside (podman's store is shared
    by everyone on the machine: each build uses a name of its own), imported as ``tag``."""

    tag: str
    path: Path
    built_as: str


def build_image_tars(folder: Path, pause_binary: str) -> list[ImageTar]:
    """The docker-archive tars of every image, built once into ``folder`` (reused by tag)."""
    folder.mkdir(parents=True, exist_ok=True)
    wanted = [
        (
            PAUSE,
            [pause_binary],
            lambda rt, tag: build_program_image(rt, tag, [pause_binary], entrypoint=["/usr/bin/pause"]),
        ),
        (BUSYBOX, [], lambda rt, tag: build_program_image(rt, tag, ["busybox"], entrypoint=["/usr/bin/busybox"])),
        (PYTHON, [*python_mount_paths(), sys.prefix], lambda rt, tag: build_python_image(rt, tag)),
    ]
    tars = []
    runtime = None
    for tag, parts, build in wanted:
        path = folder / _content_key(tag, parts)
        built_as = f"{REGISTRY}/build-{path.stem}:latest"
        if not path.exists():
            runtime = runtime or detect()
            build(runtime, built_as)
            try:
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                done = subprocess.run(
                    [*runtime.base(), "save", "--format", "docker-archive", "-o", str(tmp), built_as],
                    capture_output=True,
                    text=True,
                    timeout=IMPORT_TIMEOUT,
                )
                if done.returncode != 0:
                    raise RuntimeError(f"podman save of {tag} failed: {done.stderr.strip()}")
                os.replace(tmp, path)
            finally:
                remove_images(runtime, [built_as])  # podman's store is shared: leave nothing there
        tars.append(ImageTar(tag, path, built_as))
    return tars


def import_images(containerd_socket: str, tars: list[ImageTar]) -> None:
    """Import every tar into a node's containerd (the ``k8s.io`` namespace the CRI reads),
    named as pods ask for it."""
    ctr = ["ctr", "--address", containerd_socket, "-n", "k8s.io", "images"]
    for image in tars:
        for argv in (
            [*ctr, "import", str(image.path)],
            [*ctr, "tag", "--force", image.built_as, image.tag],
            [*ctr, "rm", image.built_as],
        ):
            done = subprocess.run(argv, capture_output=True, text=True, timeout=IMPORT_TIMEOUT)
            if done.returncode != 0:
                raise RuntimeError(
                    f"{' '.join(argv[4:6])} of {image.tag} into {containerd_socket}: {done.stderr.strip()}"
                )

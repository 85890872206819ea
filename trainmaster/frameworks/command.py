"""``command``: every role is an arbitrary command; the controller adds only the TM_* variables.

``frameworkParams.indexVariables`` (a list of variable names) also sets each of them to the
instance's index in its role: how a Volcano Job's ``env`` plugin (``VK_TASK_INDEX``,
``VC_TASK_INDEX``) is honoured.

``frameworkParams.volcanoSvc: true`` is Volcano's ``svc`` plugin: for every role the instance
depends on (a converted Volcano job depends on every task with condition ``Placed``),
``VC_<ROLE>_HOSTS`` (its instances' addresses, comma-separated, in index order) and
``VC_<ROLE>_NUM``, the role name upper-cased with ``-`` as ``_``; and the files the plugin mounts
at ``/etc/volcano`` (``<role>.host``, one address a line, and one file per variable) in the job's
``volcano`` folder, named by ``VC_HOSTS_DIR``. Upstream lists DNS names (``<job>-<task>-<i>.<job>``)
that all answer on the same port; here every instance has its own port, so the entries are
``host:port``. In a container that folder is mounted (read-only) at ``/etc/volcano``, as Volcano
mounts it, so upstream commands that read ``/etc/volcano/<task>.host`` run unchanged; on the host
such a command is refused when the job is loaded (:func:`trainmaster.containers.policy.host_file_reads`).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

from trainmaster.frameworks.base import Framework, InstanceContext

_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
VOLCANO_HOSTS_DIR = "/etc/volcano"  # where Volcano's svc plugin mounts the host files in a pod


def volcano_folder(run_dir: str) -> Path:
    """The job's copy of the svc plugin's files (``<run dir>/volcano``)."""
    return Path(run_dir) / "volcano"


class CommandFramework(Framework):
    name = "command"

    def validate(self, spec: dict[str, Any], roles: list[dict[str, Any]]) -> list[str]:
        errors = super().validate(spec, roles)
        params = spec.get("frameworkParams")
        names = params.get("indexVariables", []) if isinstance(params, dict) else []
        if not isinstance(names, list) or not all(isinstance(n, str) and _VARIABLE.fullmatch(n) for n in names):
            errors.append(
                "spec.frameworkParams.indexVariables: must be a list of environment "
                "variable names (letters, digits, '_')"
            )
        svc = params.get("volcanoSvc", False) if isinstance(params, dict) else False
        if not isinstance(svc, bool):
            errors.append("spec.frameworkParams.volcanoSvc: must be true or false")
        return errors

    def container_mounts(self, params: dict[str, Any], run_dir: str) -> list[dict[str, Any]]:
        if not params.get("volcanoSvc"):
            return []
        folder = volcano_folder(run_dir)
        folder.mkdir(parents=True, exist_ok=True)  # a bind mount's source must exist; the wait step fills it
        return [{"source": str(folder), "target": VOLCANO_HOSTS_DIR, "read_only": True}]

    def environment(self, ctx: InstanceContext) -> dict[str, str]:
        env = {name: str(ctx.index) for name in ctx.params.get("indexVariables", [])}
        if ctx.params.get("volcanoSvc"):
            env.update(volcano_svc(ctx))
        return env


def volcano_svc(ctx: InstanceContext) -> dict[str, str]:
    """The svc plugin's variables, and its files written to the job's ``volcano`` folder."""
    env: dict[str, str] = {}
    files: dict[str, str] = {}
    for role in ctx.role_replicas:
        addresses = ctx.services.get(role, [])
        key = role.replace("-", "_")
        files[f"{key}.host"] = "\n".join(addresses)
        env[f"VC_{key.upper()}_HOSTS"] = ",".join(addresses)
        env[f"VC_{key.upper()}_NUM"] = str(len(addresses))
    folder = volcano_folder(str(Path(ctx.output_dir or ".").parent))
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in {**files, **env}.items():  # every instance writes the same: atomically
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, folder / name)
    env["VC_HOSTS_DIR"] = str(folder)
    return env

"""The instance runtime: ``python -m trainmaster.runtime.launch SPEC_JSON``.

Started by the node agent for an instance with dependencies (an instance without any is
spawned by the agent directly):

1. The wait step (like a Kubernetes init container): watch the address registry until every
   instance of each role it depends on has an address (``Running``) or has succeeded
   (``Succeeded``); give up after the dependency's timeout with a clear reason.
2. Resolve the environment (one resolver: :func:`trainmaster.runtime.environment.instance_environment`).
3. ``os.execve`` the role command: the same process becomes it, so no wrapper is left that could
   be killed on its own, and the agent reaps the command's own exit status. Just before, it
   writes ``exec <time>`` to the agent's notify pipe (closed on exec); when it gives up instead
   it writes ``reason <Reason> <message>`` and exits.

"""

from __future__ import annotations

import json
import os
import sys
import time

from trainmaster.contract import LaunchSpec

DEPENDENCY_TIMEOUT_EXIT = 124


class DependencyTimeout(Exception):
    pass


def wait_for_dependencies(launch: LaunchSpec) -> dict[str, list[str]]:
    """Block until every dependency of ``launch`` holds (read from the registry of the store at
    ``launch.db_url``); return role -> addresses of its instances."""
    import site

    site.main()  # the runtime starts with -S; the wait step needs the installed packages
    from sqlalchemy import select

    from trainmaster.store.db import make_engine, session_factory
    from trainmaster.store.models import InstanceRow, RegistryRow

    sessions = session_factory(make_engine(launch.db_url, create=False))
    job_id = launch.job_id
    services: dict[str, list[str]] = {}
    for dep in launch.depends:
        deadline = time.monotonic() + dep.timeout
        delay = 0.05
        while True:
            with sessions() as session:
                if dep.condition == "Placed":  # an address, whatever the instance waits for
                    placed = session.scalars(
                        select(InstanceRow).where(
                            InstanceRow.job_id == job_id,
                            InstanceRow.role == dep.role,
                            InstanceRow.state.in_(("starting", "running", "unknown", "succeeded")),
                            InstanceRow.address.is_not(None),
                            InstanceRow.address != "",
                        )
                    ).all()
                    addresses = {r.index: r.address or "" for r in placed}
                else:
                    rows = session.scalars(
                        select(RegistryRow).where(RegistryRow.job_id == job_id, RegistryRow.role == dep.role)
                    ).all()
                    addresses = {r.index: r.address for r in rows}
                done = len(addresses)
                if dep.condition == "Succeeded":
                    done = len(
                        session.scalars(
                            select(InstanceRow).where(
                                InstanceRow.job_id == job_id,
                                InstanceRow.role == dep.role,
                                InstanceRow.state == "succeeded",
                            )
                        ).all()
                    )
            if done >= dep.replicas:
                services[dep.role] = [addresses[i] for i in sorted(addresses)]
                break
            if time.monotonic() >= deadline:
                what = {"Running": "have an address", "Placed": "are placed"}.get(dep.condition, "have succeeded")
                raise DependencyTimeout(
                    f"waited {dep.timeout:g}s for role '{dep.role}' ({dep.condition}): "
                    f"{done} of {dep.replicas} instances {what}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
    return services


def exec_role(spec_file: str) -> int:
    """The agent's wait step: wait, resolve the environment, become the role command."""
    notify_fd = int(os.environ.get("TM_AGENT_NOTIFY_FD", "-1"))

    def tell(line: str) -> None:
        if notify_fd >= 0:
            os.write(notify_fd, (line.replace("\n", " ") + "\n").encode())

    with open(spec_file) as f:
        spec = LaunchSpec.from_dict(json.load(f))
    print(f"[trainmaster] waiting for {', '.join(d.role for d in spec.depends)}", flush=True)
    try:
        services = wait_for_dependencies(spec)
    except DependencyTimeout as exc:
        print(f"[trainmaster] {exc}", flush=True)
        tell(f"reason DependencyTimeout {exc}")
        return DEPENDENCY_TIMEOUT_EXIT
    from trainmaster.runtime.environment import instance_environment

    env = instance_environment({**spec.env_inputs, "env": spec.env}, services)
    if spec.container is not None:  # argv is ``podman run``: the environment goes to the container
        from trainmaster.containers.runtime import ENV_FILE, write_env_file

        write_env_file(os.path.join(spec.instance_dir, ENV_FILE), env)
        env = {k: v for k, v in os.environ.items() if k not in ("TM_AGENT_NOTIFY_FD", "PYTHONPATH")}
    env.update({k: v for k, v in os.environ.items() if k in ("TM_INSTANCE_ID", "TM_AGENT_KEY")})
    program = spec.argv[0] if spec.argv else "<empty command>"
    if notify_fd >= 0:
        os.set_inheritable(notify_fd, False)  # closed by exec: the agent sees EOF once we are the command
    try:
        if spec.cwd:
            os.chdir(spec.cwd)
        tell(f"exec {time.time()}")
        os.execvpe(program, spec.argv, env)
    except OSError as exc:
        where = f"working directory '{spec.cwd}'" if exc.filename == spec.cwd else "exec"
        message = (
            f"program '{program}' not found ({exc.strerror})"
            if isinstance(exc, FileNotFoundError) and where == "exec"
            else f"program '{program}' could not start: {where}: {exc.strerror or exc}"
        )
        print(f"[trainmaster] {message}", flush=True)
        tell(f"reason StartFailed {message}")
        return 127
    return 127  # not reached: execve replaced this process


if __name__ == "__main__":
    sys.exit(exec_role(sys.argv[1]))

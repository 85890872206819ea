"""The instance runtime: ``python -m trainmaster.runtime.launch LAUNCH_JSON``.

1. The wait step (like a Kubernetes init container): when the role depends on other roles,
   watch the address registry until every instance of each has an address (``Running``) or has
   succeeded (``Succeeded``); give up after the dependency's timeout with a clear reason.
2. Build the environment (service addresses, framework variables) and mark the instance ready.
3. Run the role's command as a child, forward SIGTERM/SIGINT to it, and record its exit code in
   the instance folder, so any controller, even one restarted after a crash, learns how it ended.

An instance without dependencies has nothing to wait for; the local backend then runs its
command under a few lines of POSIX shell that do step 3 (see ``backends/local.py``), because
64 Python runtimes starting at once cost seconds of CPU on a small machine.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Any

from trainmaster.runtime.files import InstanceFiles

DEPENDENCY_TIMEOUT_EXIT = 124


class DependencyTimeout(Exception):
    pass


def wait_for_dependencies(launch: dict[str, Any]) -> dict[str, list[str]]:
    """Block until every dependency holds; return role -> addresses of its instances."""
    import site

    site.main()  # the runtime starts with -S; the wait step needs the installed packages
    from sqlalchemy import select

    from trainmaster.store.db import make_engine, session_factory
    from trainmaster.store.models import InstanceRow, RegistryRow

    sessions = session_factory(make_engine(launch["db_url"], create=False))
    job_id = launch["job_id"]
    services: dict[str, list[str]] = {}
    for dep in launch["depends"]:
        deadline = time.monotonic() + dep["timeout"]
        delay = 0.05
        while True:
            with sessions() as session:
                rows = session.scalars(select(RegistryRow).where(
                    RegistryRow.job_id == job_id, RegistryRow.role == dep["role"])).all()
                done = len(rows)
                if dep["condition"] == "Succeeded":
                    done = len(session.scalars(select(InstanceRow).where(
                        InstanceRow.job_id == job_id, InstanceRow.role == dep["role"],
                        InstanceRow.state == "succeeded")).all())
            if done >= dep["replicas"]:
                services[dep["role"]] = [r.address for r in sorted(rows, key=lambda r: r.index)]
                break
            if time.monotonic() >= deadline:
                what = "have an address" if dep["condition"] == "Running" else "have succeeded"
                raise DependencyTimeout(
                    f"waited {dep['timeout']:g}s for role '{dep['role']}' ({dep['condition']}): "
                    f"{done} of {dep['replicas']} instances {what}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
    return services


def run(launch_file: str) -> int:
    files = InstanceFiles(launch_file.rsplit("/", 1)[0])
    launch = files.read_launch()
    if launch["depends"]:
        print(f"[trainmaster] waiting for {', '.join(d['role'] for d in launch['depends'])}", flush=True)
        try:
            services = wait_for_dependencies(launch)
        except DependencyTimeout as exc:
            print(f"[trainmaster] {exc}", flush=True)
            files.write_reason("DependencyTimeout", str(exc))
            files.write_exit_code(DEPENDENCY_TIMEOUT_EXIT)
            return DEPENDENCY_TIMEOUT_EXIT
        from trainmaster.runtime.environment import instance_environment

        env = instance_environment(launch, services)
    else:
        env = launch["env"]  # computed in full by the controller
    try:
        child = subprocess.Popen(launch["argv"], env=env, cwd=launch.get("cwd"))
    except OSError as exc:
        print(f"[trainmaster] cannot start {launch['argv'][0]!r}: {exc}", flush=True)
        files.write_reason("StartError", f"cannot start {launch['argv'][0]!r}: {exc.strerror or exc}")
        files.write_exit_code(127)
        return 127
    files.mark_ready()

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = child.wait()
    files.write_exit_code(code if code >= 0 else 128 - code)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(run(sys.argv[1]))

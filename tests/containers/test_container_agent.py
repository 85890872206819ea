"""Container instances owned by the node agent (issue #22), with images built here from this
machine's files: the image's own entry point, Kubernetes ``command``/``args`` overrides, env and
workingDir, exit codes, logs, the memory limit (OOMKilled), stop and cancel leave no container,
kill -9 of the agent leaves no duplicate, and the podman runtime detected once (runc, rlimits)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from container_fixtures import AgentUnderTest, labelled
from helpers import wait_until
from trainmaster.agent.client import agent_pid
from trainmaster.contract import ContainerLaunch, InstancePhase
from trainmaster.containers import runtime
from trainmaster.containers.runtime import ContainerRuntime

pytestmark = pytest.mark.timeout(240)


def test_runtime_is_detected_once_with_runc_and_a_working_rlimit_setting(podman: ContainerRuntime) -> None:
    """Detection: podman is called with runc (crun fails on hybrid cgroups), and through the
    rlimit-dropping shim exactly where the probe saw runc refuse to set rlimits."""
    assert runtime.detect() is podman  # probed once per process
    assert "runc" in os.path.basename(podman.oci_runtime)
    plain = runtime._probe(podman.podman, runtime._runc() or "runc")
    assert (podman.oci_runtime != runtime._runc()) == ("rlimit" in plain)
    assert runtime._probe(podman.podman, podman.oci_runtime) == ""


def test_image_entrypoint_command_and_args_follow_kubernetes(agent: AgentUnderTest, small_image: str) -> None:
    """Neither command nor args: the image's ENTRYPOINT + CMD. args only: replaces CMD. command
    only: replaces ENTRYPOINT and drops CMD. Both: command + args. Output lands in the log."""
    specs = [
        agent.spec("own", ContainerLaunch(small_image)),
        agent.spec("args", ContainerLaunch(small_image, args=["echo args replaced CMD"])),
        agent.spec("command", ContainerLaunch(small_image, command=["/bin/echo", "command", "alone"])),
        agent.spec("both", ContainerLaunch(small_image, command=["/bin/echo"], args=["both", "given"])),
    ]
    statuses = agent.run(specs)
    assert [s.exit_code for s in statuses] == [0, 0, 0, 0], [s.message for s in statuses]
    assert all(s.reason == "Completed" for s in statuses)
    assert "image entrypoint ran in /tmp" in agent.log("own")
    assert "args replaced CMD" in agent.log("args")
    assert "command alone" in agent.log("command") and "entrypoint ran" not in agent.log("command")
    assert "both given" in agent.log("both")
    assert labelled(agent.client and runtime.detect(), agent.key) == []  # removed once ended


def test_env_working_dir_exit_codes_and_mounts(agent: AgentUnderTest, small_image: str, tmp_path: Path) -> None:
    """The environment is the container's own (not the host's), workingDir is a path in the
    container, a bind mount is writable where asked, and exit codes pass through unchanged."""
    shared = tmp_path / "shared"
    shared.mkdir()
    script = 'echo "greeting=$GREETING home=${TRAINMASTER_HOME:-unset}"; pwd; echo out > /data/written; exit 7'
    spec = agent.spec(
        "env",
        ContainerLaunch(
            small_image,
            args=[script],
            working_dir="/workspace",
            mounts=[{"source": str(shared), "target": "/data", "read_only": False}],
        ),
        env={"GREETING": "hello container"},
    )
    (status,) = agent.run([spec])
    assert status.exit_code == 7 and status.reason == "Error"
    log = agent.log("env")
    assert "greeting=hello container home=unset" in log and "/workspace" in log
    assert (shared / "written").read_text() == "out\n"


def test_memory_limit_is_enforced_and_reported_as_oom_killed(agent: AgentUnderTest, small_image: str) -> None:
    """resources.limits.memory -> --memory: ``tail /dev/zero`` holds one endless line in memory
    and is killed by the kernel: exit 137, reason OOMKilled; its peak memory is the container's."""
    spec = agent.spec("oom", ContainerLaunch(small_image, command=["/bin/tail", "/dev/zero"]), memory=32 << 20)
    (status,) = agent.run([spec])
    assert status.exit_code == 137 and status.reason == "OOMKilled", (status, agent.log("oom"))


def test_never_pull_policy_refuses_a_missing_image(agent: AgentUnderTest) -> None:
    """imagePullPolicy Never with an image that is not here: a clear reason, no container."""
    spec = agent.spec("never", ContainerLaunch("localhost/tm-no-such-image:1", pull_policy="Never"))
    (status,) = agent.run([spec])
    assert status.exit_code != 0 and status.reason == "ErrImageNeverPull", status
    assert "tm-no-such-image" in status.message


def test_stop_removes_the_container(agent: AgentUnderTest, small_image: str) -> None:
    """Stop (what cancel does): TERM proxied to the container, KILL after the grace, then
    ``rm -f``: when stop returns, no container of the agent is left, running or not."""
    spec = agent.spec("sleeper", ContainerLaunch(small_image, command=["/bin/sleep", "300"]))
    assert agent.client.start([spec])[0].handle
    podman = runtime.detect()
    wait_until(lambda: labelled(podman, agent.key, running_only=True), 60, "the container to run")
    running = agent.client.observe(["job/sleeper/1"])[0]
    assert running.phase == InstancePhase.RUNNING
    (status,) = agent.client.stop(["job/sleeper/1"], grace=2)
    assert status.phase == InstancePhase.EXITED and status.reason == "Stopped"
    assert labelled(podman, agent.key) == []


def test_kill9_of_the_agent_leaves_no_container_and_no_duplicate(agent: AgentUnderTest, small_image: str) -> None:
    """kill -9 of the agent: its restart removes the container of the attempt it journaled as
    started and not ended (AgentRestarted, 137) before it accepts a start; the next attempt is
    then the only container; a repeated start of an attempt starts nothing."""
    podman = runtime.detect()
    first = agent.spec("r", ContainerLaunch(small_image, command=["/bin/sleep", "300"]))
    agent.client.start([first])
    wait_until(lambda: labelled(podman, agent.key, running_only=True), 60, "the container to run")
    old = agent_pid(agent.state_dir)
    assert old is not None
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: not Path(f"/proc/{old}").exists() or _zombie(old), what="the agent to die")
    assert len(labelled(podman, agent.key, running_only=True)) == 1  # podman kept it running
    agent.start_daemon()
    (lost,) = agent.client.observe(["job/r/1"])
    assert lost.reason == "AgentRestarted" and lost.exit_code == 137
    assert labelled(podman, agent.key) == []
    second = agent.spec("r", ContainerLaunch(small_image, command=["/bin/sleep", "300"]), attempt=2)
    agent.client.start([second])
    agent.client.start([second])  # idempotent: the same attempt twice is one container
    wait_until(lambda: labelled(podman, agent.key, running_only=True), 60, "the second attempt to run")
    assert len(labelled(podman, agent.key)) == 1
    agent.client.stop(["job/r/2"], grace=1)
    assert labelled(podman, agent.key) == []


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_without_podman_a_container_role_is_refused_with_what_to_do(tmp_path: Path) -> None:
    """Without a runtime (podman not on PATH here), the start fails and says how to install one
    or how to run on the host."""
    code = "from trainmaster.containers.runtime import unavailable; print(unavailable())"
    env = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    said = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60).stdout
    assert "podman is not installed" in said and "apt-get install -y podman runc" in said
    assert "runtime: host" in said

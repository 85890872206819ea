"""Every remote CLI verb against a server that requires a token (issue 39, item 8): the token comes
from TRAINMASTER_TOKEN, a token file or a named context (server + token, as kubeconfig), never
from the command line; without one a verb says how to give it.

Mechanism: status you can query at any time, and the job verbs (submit, scale, cancel...) of the
controller service, over its protected API."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from server_process import ServerProcess

pytestmark = pytest.mark.timeout(300)

TOKEN = "cli-token-9f8e7d6c5b4a"


def job_file(tmp_path: Path) -> Path:
    # long enough to outlast every verb below on a loaded machine; cancelled at the end
    code = "import time\nfor i in range(3000):\n    print('line', i, flush=True)\n    time.sleep(0.1)\n"
    doc = {
        "apiVersion": "trainmaster/v1",
        "kind": "Job",
        "metadata": {"name": "guarded"},
        "spec": {"roles": [{"name": "main", "command": [sys.executable, "-c", code]}]},
    }
    path = tmp_path / "guarded.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run(env: dict[str, str], *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainmaster", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_every_remote_verb_sends_the_token(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path, token=TOKEN)
    try:
        base = {k: v for k, v in server.env.items() if not k.startswith("TRAINMASTER_TOKEN")}
        base.pop("TRAINMASTER_DB")
        base["TRAINMASTER_HOME"] = str(tmp_path / "client-home")  # the user's own home, not the server's
        by_env = {**base, "TRAINMASTER_SERVER": server.url, "TRAINMASTER_TOKEN": TOKEN}
        token_file = tmp_path / "my.token"
        token_file.write_text(TOKEN + "\n")
        token_file.chmod(0o600)
        by_file = {**base, "TRAINMASTER_SERVER": server.url, "TRAINMASTER_TOKEN_FILE": str(token_file)}

        missing = run({**base, "TRAINMASTER_SERVER": server.url}, "job", "list")
        assert missing.returncode == 2 and "TRAINMASTER_TOKEN" in missing.stderr, missing.stderr
        assert "Traceback" not in missing.stderr

        submitted = run(by_env, "job", "submit", str(job_file(tmp_path)))
        assert submitted.returncode == 0, submitted.stderr
        verbs: list[tuple[dict[str, str], tuple[str, ...], str]] = [
            (by_file, ("job", "wait", "guarded", "--for", "running", "--timeout", "60"), "running"),
            (by_env, ("job", "list"), "guarded"),
            (by_file, ("job", "status", "guarded", "--json"), '"name": "guarded"'),
            (by_env, ("job", "logs", "guarded", "--tail", "1"), "line"),
            (by_file, ("job", "logs", "guarded"), "line 0"),
            (by_env, ("job", "scale", "guarded", "main", "1"), "scaled to 1"),
            (by_env, ("job", "suspend", "guarded"), "suspended"),
            (by_file, ("job", "unsuspend", "guarded"), "resumed"),
            (by_env, ("job", "cancel", "guarded"), "cancellation requested"),
            (by_file, ("job", "wait", "guarded", "--timeout", "60"), "cancelled"),
            (by_env, ("job", "logs", "guarded", "--follow"), "line"),
            (by_file, ("job", "delete", "guarded"), "deleted"),
        ]
        for env, args, expected in verbs:
            done = run(env, *args)
            assert expected in done.stdout, (args, done.returncode, done.stdout[-500:], done.stderr[-500:])
            assert "Traceback" not in done.stderr

        # a named context: server and token saved once (the token read from a file, never argv)
        context_env = {k: v for k, v in base.items() if k != "TRAINMASTER_SERVER"}
        added = run(context_env, "context", "add", "lab", "--server", server.url, "--token-file", str(token_file))
        assert added.returncode == 0 and "current" in added.stdout, added.stderr
        saved = Path(context_env["TRAINMASTER_HOME"]) / "contexts.yaml"
        assert stat.S_IMODE(saved.stat().st_mode) == 0o600
        assert stat.S_IMODE(saved.parent.stat().st_mode) == 0o700
        listed = run(context_env, "context", "list")
        assert "lab" in listed.stdout and TOKEN not in listed.stdout
        assert run(context_env, "job", "submit", str(job_file(tmp_path))).returncode == 0
        for args, expected in (
            (("job", "list"), "guarded"),
            (("job", "status", "guarded"), "guarded"),
            (("job", "cancel", "guarded"), "cancellation requested"),
        ):
            done = run(context_env, *args)
            assert done.returncode == 0 and expected in done.stdout, (args, done.stderr[-500:])
        by_name = run({**context_env, "TRAINMASTER_CONTEXT": "lab"}, "job", "list", "--json")
        assert by_name.returncode == 0 and '"guarded"' in by_name.stdout
        stdin_add = subprocess.run(
            [sys.executable, "-m", "trainmaster", "context", "add", "piped", "--server", server.url, "--no-use"],
            input=TOKEN + "\n",
            capture_output=True,
            text=True,
            env=context_env,
            timeout=60,
        )
        assert stdin_add.returncode == 0
        assert run(context_env, "job", "list", "--context", "piped").returncode == 0
        assert run(context_env, "context", "remove", "lab").returncode == 0
        assert TOKEN not in " ".join(str(a) for a in os.environ.values())
    finally:
        server.stop()

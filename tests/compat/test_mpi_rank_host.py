"""Mechanism: the MPIJob rank host (mpirun's remote shell into a worker instance): it runs a
command given with the job's key and relays its output and exit status; a request without the
key is refused; the agent names an unknown host clearly."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

AGENT = [sys.executable, "-m", "trainmaster.frameworks.mpi_rsh"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def rank_host(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "TM_HOST": "127.0.0.1", "TM_PORT": str(port), "TM_MPI_KEY": "right-key"}
    proc = subprocess.Popen([*AGENT, "serve"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert "listening" in (proc.stdout.readline() if proc.stdout else "")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def agent(address: str, key: str, *command: str, host: str = "w-0") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TM_MPI_HOSTS": f"w-0={address}", "TM_MPI_KEY": key, "TM_MPI_CONNECT_TIMEOUT": "5"}
    return subprocess.run([*AGENT, host, *command], env=env, capture_output=True, text=True, timeout=30)


def test_runs_the_command_and_relays_output_and_status(rank_host: str) -> None:
    done = agent(rank_host, "right-key", "echo", "out;", "echo", "err", ">&2;", "exit", "7")
    assert done.returncode == 7 and done.stdout == "out\n" and done.stderr == "err\n"


def test_refuses_a_request_without_the_jobs_key(rank_host: str) -> None:
    done = agent(rank_host, "wrong-key", "echo", "should-not-run")
    assert done.returncode == 255 and "not this job's key" in done.stderr and "should-not-run" not in done.stdout


def test_unknown_host_is_named(rank_host: str) -> None:
    done = agent(rank_host, "right-key", "true", host="w-9")
    assert done.returncode == 255 and "unknown host 'w-9'" in done.stderr and "w-0" in done.stderr

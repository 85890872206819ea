"""Benchmark: a model-sized payload each way through the gateway, against a direct TLS stream.

One leg of the ``scale_params`` rule (a stand-in for local training over a large model: it reads
every parameter of its input once and writes each one once) with an input of SIZE MB:

* **upload** (initiator -> gateway -> party): ``Initiator.send_input`` of the input file, timed
  from the first byte sent to the party's answer that the input is whole, checked against the
  initiator's signed SHA-256 and fsynced;
* **download** (party -> gateway -> initiator): ``Initiator.fetch_result`` of the rule's result
  (the same size), timed until the initiator holds the checked, fsynced file.

Each against the same bytes moved by one direct mutual-TLS stream (two processes: the file read
and sent, received and written, fsynced; the same certificates), in the same run, with the page
cache's dirty pages written back (``sync``) before every timed transfer so no transfer pays for
another's writes. The SHA-256 of the input is computed before the upload is timed (a model's
digest is known before it is sent; it is reported apart). During each transfer the RSS of the
gateway, the party and the initiator (this process) is sampled every 10 ms (growth = peak minus the
value before), and each process's CPU time is taken.

    .venv/bin/python bench/gateway.py --parties none --front 0 --executors 0 --transfer-mb 4096
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from trainmaster.gateway.initiator.taskfile import LegSpec
from trainmaster.gateway.localdeploy import Deployment
from trainmaster.gateway.net.tls import client_ssl_context, expect

MB = 1 << 20


class Sampler:
    """Peak RSS and CPU seconds of processes over a window, sampled in a thread."""

    def __init__(self, pids: dict[str, int], every_s: float = 0.01):
        import psutil

        self._procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.baseline = {name: p.memory_info().rss for name, p in self._procs.items()}
        self.peak = dict(self.baseline)
        self._cpu0 = {name: self._cpu(p) for name, p in self._procs.items()}
        self.cpu: dict[str, float] = {}
        self._stop = threading.Event()
        self._every = every_s
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _cpu(p: Any) -> float:
        t = p.cpu_times()
        return float(t.user + t.system)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            for name, p in self._procs.items():
                self.peak[name] = max(self.peak[name], p.memory_info().rss)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.cpu = {name: self._cpu(p) - self._cpu0[name] for name, p in self._procs.items()}

    def growth_mb(self) -> dict[str, float]:
        return {name: (self.peak[name] - self.baseline[name]) / 1e6 for name in self.peak}


def _write_input(path: Path, size_mb: int) -> None:
    """``size_mb`` MB of float32 parameters (a 64 MB random block repeated: content does not matter
    to the transfer, and nothing on the path compresses)."""
    block = np.random.default_rng(0).standard_normal(16 * MB, dtype=np.float32).tobytes()
    left = size_mb * MB
    with path.open("wb") as fh:
        while left:
            n = min(left, len(block))
            fh.write(block[:n])
            left -= n


def _cache_state(path: Path, state: str) -> None:
    """Put ``path`` in the page cache (``cached``: read once) or out of it (``cold``: written back,
    then dropped), so that both timed downloads of a stored result start from the same state."""
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        if state == "cold":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        else:
            buf = bytearray(MB)
            while os.readv(fd, [buf]):
                pass
    finally:
        os.close(fd)


def direct_tls(dep: Deployment, source: Path, dest: Path) -> float:
    """Seconds to move ``source`` over one mutual-TLS connection into ``dest`` (fsynced): the party's
    certificate serves in a subprocess that reads and sends the file, this process (the initiator's
    certificate) receives and writes it."""
    import socket

    party, ini = dep.cfg(dep.parties[0]), dep.cfg(dep.initiators[0])
    server = (
        "import socket, ssl, sys\n"
        "ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=sys.argv[1])\n"
        "ctx.load_cert_chain(sys.argv[2], sys.argv[3]); ctx.verify_mode = ssl.CERT_REQUIRED\n"
        "srv = socket.create_server(('127.0.0.1', 0)); print(srv.getsockname()[1], flush=True)\n"
        "conn, _ = srv.accept(); tls = ctx.wrap_socket(conn, server_side=True)\n"
        "buf = bytearray(1 << 20)\n"
        "with open(sys.argv[4], 'rb', buffering=0) as fh:\n"
        "    while n := fh.readinto(buf): tls.sendall(memoryview(buf)[:n])\n"
        "tls.close()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", server, party.ca, party.cert, party.key, str(source)], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(proc.stdout.readline())  # type: ignore[union-attr]
        ctx = client_ssl_context(ini)
        buf = bytearray(MB)
        t0 = time.perf_counter()
        with (
            socket.create_connection(("127.0.0.1", port)) as raw,
            ctx.wrap_socket(raw, server_hostname=expect(dep.parties[0], "party")["sni_hostname"]) as tls,
            dest.open("wb", buffering=0) as fh,
        ):
            while n := tls.recv_into(buf):
                fh.write(memoryview(buf)[:n])
            os.fsync(fh.fileno())
        return time.perf_counter() - t0
    finally:
        proc.wait(timeout=120)
        dest.unlink(missing_ok=True)


def one_run(size_mb: int, root: Path, run: int) -> dict[str, Any]:
    cap = (size_mb + 64) * MB
    party = {
        "allowed_rules": ["scale_params"],
        "max_input_bytes": cap,
        "max_result_bytes": cap,
        "executor_memory_mb": 1024,
        "executor_start_timeout_s": 120,
    }
    gateway = {"max_input_bytes": cap, "max_result_bytes": cap}
    dep = Deployment(root, ["p0"], overrides={"p0": party, "gateway": gateway}).start_all()
    try:
        source = root / "model.bin"
        _write_input(source, size_mb)
        ini = dep.initiator(timeout_s=600)
        pids = {"gateway": dep.procs["gateway"].pid, "party": dep.procs["p0"].pid, "initiator": os.getpid()}
        task = f"xfer{run}"
        leg = LegSpec(data_id="m_p0", party="p0", rule="scale_params", params={"factor": 0.5}, input=source)
        t0 = time.perf_counter()
        ini.input_ref(source)
        prehash_s = time.perf_counter() - t0
        created = ini.create_task(task, [leg], deadline_s=3600)["m_p0"]
        assert created["ok"], created
        os.sync()
        with Sampler(pids) as up:
            t0 = time.perf_counter()
            sent = ini.send_input(task, "m_p0", source, deadline=time.time() + 3600)
            upload_s = time.perf_counter() - t0
        assert sent["resumed_from"] == 0, sent
        t0 = time.perf_counter()
        got = ini.receive(task, ["m_p0"], leg_timeout_s=600, deadline=time.time() + 3600, fetch=False)["m_p0"]
        rule_s = time.perf_counter() - t0
        assert got["outcome"] == "result" and got.get("stored"), got
        stored = Path(dep.cfg("p0").state_dir) / "legs" / task / "m_p0" / "result"
        nbytes = size_mb * MB
        down: dict[str, Sampler] = {}
        times: dict[str, float] = {}
        for state in ("cold", "cached"):  # the stored result's state at the party, the same for both paths
            _cache_state(stored, state)
            with Sampler(pids) as down[state]:
                t0 = time.perf_counter()
                result = ini.fetch_result(task, "m_p0", ini.stored[(task, "m_p0")])
                times[state] = time.perf_counter() - t0
            assert result.stat().st_size == nbytes
            result.unlink()
            _cache_state(stored, state)
            times[f"direct_{state}"] = direct_tls(dep, stored, root / "direct-down.bin")
        ini.close()
        os.sync()
        direct_up_s = direct_tls(dep, source, root / "direct-up.bin")
        return {
            "bytes": nbytes,
            "prehash_s": prehash_s,
            "rule_s": rule_s,
            "upload_s": upload_s,
            "download_s": times["cold"],
            "direct_upload_s": direct_up_s,
            "direct_download_s": times["direct_cold"],
            "download_cached_s": times["cached"],
            "direct_download_cached_s": times["direct_cached"],
            **{f"upload_{k}_rss_growth_mb": v for k, v in up.growth_mb().items()},
            **{f"upload_{k}_cpu_ms_per_mb": v * 1e3 / size_mb for k, v in up.cpu.items()},
            **{
                f"{way}_{k}_rss_growth_mb": v
                for way, state in (("download", "cold"), ("download_cached", "cached"))
                for k, v in down[state].growth_mb().items()
            },
            **{
                f"{way}_{k}_cpu_ms_per_mb": v * 1e3 / size_mb
                for way, state in (("download", "cold"), ("download_cached", "cached"))
                for k, v in down[state].cpu.items()
            },
            **{f"{k}_baseline_rss_mb": v / 1e6 for k, v in up.baseline.items()},
        }
    finally:
        dep.stop_all()


def bench_transfer(size_mb: int, runs: int, workdir: str | None = None) -> dict[str, Any]:
    """Median figures over ``runs`` runs (each a fresh deployment; its files removed after)."""
    per_run = []
    for run in range(runs):
        with tempfile.TemporaryDirectory(prefix="tm-gw-xfer-", dir=workdir) as root:
            per_run.append(one_run(size_mb, Path(root), run))
            print({k: round(v, 3) for k, v in per_run[-1].items()}, flush=True)
    med = lambda key: statistics.median(r[key] for r in per_run)  # noqa: E731
    out: dict[str, Any] = {"size_mb": size_mb, "runs": runs, "prehash_s": med("prehash_s"), "rule_s": med("rule_s")}
    mb = size_mb * MB / 1e6
    for way in ("upload", "download", "download_cached"):
        gw, direct = med(f"{way}_s"), med(f"direct_{way}_s")
        row = {
            "gateway_s": gw,
            "direct_s": direct,
            "gateway_mb_per_s": mb / gw,
            "direct_mb_per_s": mb / direct,
            "ratio": direct / gw,
            "ratios": [r[f"direct_{way}_s"] / r[f"{way}_s"] for r in per_run],
        }
        for who in ("gateway", "party", "initiator"):
            row[f"{who}_rss_growth_mb"] = med(f"{way}_{who}_rss_growth_mb")
            row[f"{who}_cpu_ms_per_mb"] = med(f"{way}_{who}_cpu_ms_per_mb")
        out[way] = row
    for who in ("gateway", "party", "initiator"):
        out[f"{who}_baseline_rss_mb"] = med(f"{who}_baseline_rss_mb")
    return out

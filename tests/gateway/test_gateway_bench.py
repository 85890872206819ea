"""The gateway benchmark's own behaviour (its figures live in bench/results, not in tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gateway_bench_without_matplotlib_says_so_in_one_line_and_finishes(tmp_path: Path) -> None:
    """Issue 38 item 10: where matplotlib (the bench extra) is missing, bench/gateway.py writes its
    results, says in one line that there is no plot, and exits 0: no traceback."""
    code = (
        "import pathlib, sys\n"
        "sys.modules['matplotlib'] = None  # as where the bench extra is not installed: import fails\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "import gateway\n"
        "gateway.RESULTS = pathlib.Path(sys.argv[1])\n"
        "gateway.write_results([], {'small_load': [0.5, 0.7], 'load_min': 0.5, 'load_max': 0.7})\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), str(ROOT / "bench")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    missing = [line for line in out.stdout.splitlines() if "matplotlib" in line]
    assert len(missing) == 1 and "no plot" in missing[0], out.stdout
    assert json.loads((tmp_path / "gateway.json").read_text())["rows"] == []


def test_transfer_bench_moves_a_payload_each_way_and_reports_every_process(tmp_path: Path) -> None:
    """Issue 36 (streaming both ways, bounded memory): bench/gateway_transfer.py at a small size
    moves a leg's input initiator -> gateway -> party and the rule's result back (each checked
    end to end by the initiator and the party), times the same bytes over a direct TLS stream, and
    reports throughput, RSS growth and CPU per MB for the gateway, the party and the initiator."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gateway_transfer
    finally:
        sys.path.remove(str(ROOT / "bench"))
    out = gateway_transfer.bench_transfer(4, 1, workdir=str(tmp_path))
    assert out["size_mb"] == 4 and out["runs"] == 1
    for way in ("upload", "download", "download_cached"):
        row = out[way]
        assert row["gateway_s"] > 0 and row["direct_s"] > 0 and row["ratio"] > 0, row
        for who in ("gateway", "party", "initiator"):
            assert f"{who}_rss_growth_mb" in row and row[f"{who}_cpu_ms_per_mb"] >= 0, row
    assert list(tmp_path.iterdir()) == []  # each run's deployment and files are removed after it

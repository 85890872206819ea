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

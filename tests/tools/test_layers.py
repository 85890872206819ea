"""The import-layer check (``tools/layers.py``, run by ``make lint``): the package as it is passes,
and a package with an import up a layer, a cycle or an unexplained in-function import fails,
naming each (so the check cannot pass by accident)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "layers.py"


def layers(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120)


def test_the_package_imports_only_downhill_without_cycles() -> None:
    done = layers()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "back-arrows: 0, cycles: 0 of units + 0 of modules" in done.stdout
    assert "layer 0: ground" in done.stdout and "layer 9: cli" in done.stdout


def test_a_back_arrow_a_cycle_and_an_unexplained_deferred_import_fail(tmp_path: Path) -> None:
    package = tmp_path / "trainmaster"
    files = {
        "__init__.py": "",
        "spec/__init__.py": "",
        "spec/model.py": "from trainmaster.api import Trainmaster\n",  # ground floor -> api: up
        "store/__init__.py": "",
        "store/a.py": "from trainmaster.store import b\n",
        "store/b.py": "from trainmaster.store import a\n",  # a <-> b
        "api.py": "class Trainmaster:\n    def f(self):\n        from trainmaster.store import a\n",
    }
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    done = layers("--quiet", "--root", str(tmp_path))
    assert done.returncode == 1
    assert "back-arrow: trainmaster.spec.model (spec, layer 0) imports trainmaster.api (api, layer 7)" in done.stdout
    assert "cycle of modules: trainmaster.store.a <-> trainmaster.store.b" in done.stdout
    assert "in-function import: trainmaster/api.py:3 imports trainmaster.store.a" in done.stdout

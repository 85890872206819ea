"""Install as a user would: the wheel and sdist build, and the core (controller, CLI, server)
installs into a clean virtualenv without torch, ONNX, METIS, KaHIP, scikit-learn or pyarrow, runs a
job, and names the extra a command needs when its optional package is missing."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
HEAVY = ("torch", "onnx", "pymetis", "kahip", "sklearn", "pyarrow")


CLEAN = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def run(argv: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    """A command that sees none of this test run's packages (no PYTHONPATH)."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=540, env=env or CLEAN, **kwargs)


def test_core_install_in_a_clean_venv(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(ROOT)])
    if built.returncode != 0 and "No module named" in built.stderr:
        pytest.skip(f"cannot build a wheel here: {built.stderr.strip().splitlines()[-1]}")
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next(dist.glob("trainmaster-*.whl"))
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    installed = run([str(python), "-m", "pip", "install", "--quiet", str(wheel)])
    if installed.returncode != 0 and (
        "Could not find a version" in installed.stderr or "Failed to establish" in installed.stderr
    ):
        pytest.skip("the package index is not reachable to install the core's dependencies")
    assert installed.returncode == 0, installed.stderr[-2000:]
    have = run(
        [
            str(python),
            "-c",
            "import importlib.util, sys; print([m for m in sys.argv[1:] if importlib.util.find_spec(m)])",
            *HEAVY,
        ]
    )
    assert have.stdout.strip() == "[]", f"the core install pulled in {have.stdout}"

    trainmaster = str(env_dir / "bin" / "trainmaster")
    env = {**CLEAN, "TRAINMASTER_HOME": str(tmp_path / "home")}
    assert run([trainmaster, "version"], env=env).stdout.strip()
    job = tmp_path / "job.yaml"
    job.write_text(
        "apiVersion: trainmaster/v1\nkind: Job\nmetadata: {name: core}\nspec:\n  framework: command\n"
        "  roles:\n    - {name: main, replicas: 2, command: [sh, -c, 'echo hello from $TM_ROLE']}\n"
    )
    ran = run([trainmaster, "run", str(job)], env=env, cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    graph = tmp_path / "graph.json"
    graph.write_text(
        '{"nodes": [{"id": "a", "cost": 1}, {"id": "b", "cost": 1}, {"id": "c", "cost": 1}], '
        '"edges": [{"src": "a", "dst": "b", "cost": 1}, {"src": "b", "dst": "c", "cost": 1}]}'
    )
    needs = run([trainmaster, "partition", str(graph), "-k", "2", "--method", "metis"], env=env, cwd=tmp_path)
    assert needs.returncode == 2 and "trainmaster[partition]" in needs.stderr, needs.stderr
    assert "Traceback" not in needs.stderr


def test_sdist_and_wheel_build_with_pypa_build(tmp_path: Path) -> None:
    """`python -m build` (what a release runs) makes both; the sdist carries what the wheel is built
    from: the dashboard's templates and assets, the store's migrations, the README it describes."""
    import tarfile
    import zipfile

    pytest.importorskip("build", reason="pypa's build is in the test extra: pip install -e '.[test]'")
    out = tmp_path / "dist"
    built = run(
        [sys.executable, "-m", "build", "--sdist", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)]
    )
    assert built.returncode == 0, (built.stdout + built.stderr)[-3000:]
    sdist = next(out.glob("trainmaster-*.tar.gz"))
    wheel = next(out.glob("trainmaster-*.whl"))
    with tarfile.open(sdist) as archive:
        in_sdist = archive.getnames()
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = archive.namelist()
    for part in (
        "README.md",
        "pyproject.toml",
        "trainmaster/store/migrations/versions/",
        "trainmaster/service/dashboard/templates/",
        "trainmaster/service/dashboard/static/",
    ):
        assert any(part in name for name in in_sdist), f"{part} missing from the sdist"
    for part in (
        "trainmaster/store/migrations/versions/",
        "trainmaster/service/dashboard/templates/",
        "trainmaster/service/dashboard/static/",
    ):
        assert any(name.startswith(part) for name in in_wheel), f"{part} missing from the wheel"
    assert "SetuptoolsDeprecationWarning" not in built.stdout + built.stderr  # e.g. the old license table


def test_make_install_shows_progress_not_pips_warnings(tmp_path: Path) -> None:
    """`make install` prints what it collects and installs, and keeps the rest of pip's output
    (setuptools' editable-install BuildBackendWarning, on stderr, passed its filter: issue 38)
    in the venv's install.log, where its error message points. Run with a stand-in pip."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    pip = venv / "bin" / "pip"
    pip.write_text(
        "#!/bin/sh\n"
        "echo 'Collecting fastapi'\n"
        "echo '  /tmp/pip-build-env/setuptools/command/editable_wheel.py:354: BuildBackendWarning: "
        "Editable installation.' >&2\n"
        "echo '  !!' >&2\n"
        "echo 'Successfully installed trainmaster-0.1.0'\n"
    )
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\nexit 0\n")
    for program in (pip, python):
        program.chmod(0o755)
    out = run(["make", "--no-print-directory", "-C", str(ROOT), f"VENV={venv}", "install"])
    assert out.returncode == 0, out.stdout + out.stderr
    shown = out.stdout + out.stderr
    assert "Collecting fastapi" in shown and "Successfully installed trainmaster-0.1.0" in shown
    assert "BuildBackendWarning" not in shown and "!!" not in shown, shown
    assert "BuildBackendWarning" in (venv / "install.log").read_text()

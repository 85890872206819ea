"""Mechanism: validation and defaulting of the job description (controller spec, 'Validation').

Every problem is reported at once with its field path; the CLI exits 2 without a traceback;
``run --dry-run`` prints the defaulted job.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainmaster.errors import UserError
from trainmaster.spec import load_document

BASE = {"apiVersion": "trainmaster/v1", "kind": "Job", "metadata": {"name": "bad"}}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainmaster", *args], capture_output=True, text=True, timeout=60)


def errors_of(spec: dict) -> list[str]:
    with pytest.raises(UserError) as info:
        load_document({**BASE, "spec": spec})
    return info.value.details


@pytest.mark.parametrize(
    "spec,expected",
    [
        (
            {"roles": [{"name": "a", "command": ["x"]}, {"name": "b", "replicas": 0, "command": ["x"]}]},
            "spec.roles[1].replicas: must be an integer > 0",
        ),
        (
            {"roles": [{"name": "a", "command": ["x"], "dependsOn": [{"role": "ghost"}]}]},
            "spec.roles[0].dependsOn[0].role: unknown role 'ghost'",
        ),
        (
            {
                "roles": [
                    {"name": "a", "command": ["x"], "dependsOn": [{"role": "b"}]},
                    {"name": "b", "command": ["x"], "dependsOn": [{"role": "a"}]},
                ]
            },
            "spec.roles: dependency cycle a -> b -> a",
        ),
        (
            {"roles": [{"name": "a", "replicas": 2, "command": ["x"]}], "scheduling": {"minAvailable": 5}},
            "spec.scheduling.minAvailable: 5 is larger than the job's 2 replicas",
        ),
        (
            {"framework": "no-such-framework", "roles": [{"name": "a", "command": ["x"]}]},
            "spec.framework: unknown framework 'no-such-framework'",
        ),
        ({"roles": [{"name": "a", "command": ["x"], "ports": 100}]}, "spec.roles[0].ports: must be <= 64"),
        ({"roles": [{"name": "a", "command": ["x"], "replicaz": 2}]}, "spec.roles[0].replicaz: unknown field"),
        ({"roles": [{"name": "a"}]}, "spec.roles[0].command: required"),
        ({"roles": [{"name": "A_b", "command": ["x"]}]}, "spec.roles[0].name: must be lower-case"),
        (
            {"roles": [{"name": "a", "command": ["x"]}, {"name": "a", "command": ["y"]}]},
            "spec.roles[1].name: duplicate role name 'a'",
        ),
        (
            {"roles": [{"name": "a", "command": ["x"], "resources": {"memory": "lots"}}]},
            "spec.roles[0].resources.memory: 'lots' is not a memory quantity",
        ),
        (
            {"framework": "pytorch", "roles": [{"name": "chief", "command": ["x"]}]},
            "framework 'pytorch' has no role 'chief'",
        ),
    ],
)
def test_each_problem_is_named_with_its_path(spec: dict, expected: str) -> None:
    assert any(expected in e for e in errors_of(spec)), errors_of(spec)


def test_every_error_is_reported_at_once() -> None:
    errs = errors_of(
        {
            "framework": "nope",
            "roles": [
                {"name": "a", "replicas": 0, "command": ["x"]},
                {"name": "b", "command": ["x"], "dependsOn": [{"role": "zz"}]},
                {"name": "c", "command": ["x"], "dependsOn": [{"role": "d"}]},
                {"name": "d", "command": ["x"], "dependsOn": [{"role": "c"}]},
            ],
        }
    )
    assert len(errs) == 4, errs


BAD_FILES = {
    "replicas0.yaml": {"roles": [{"name": "a", "replicas": 0, "command": ["true"]}]},
    "unknown-dep.yaml": {"roles": [{"name": "a", "command": ["true"], "dependsOn": [{"role": "b"}]}]},
    "cycle.yaml": {
        "roles": [
            {"name": "a", "command": ["true"], "dependsOn": [{"role": "b"}]},
            {"name": "b", "command": ["true"], "dependsOn": [{"role": "a"}]},
        ]
    },
    "gang.yaml": {"roles": [{"name": "a", "command": ["true"]}], "scheduling": {"minAvailable": 2}},
    "framework.yaml": {"framework": "tensorflow-9", "roles": [{"name": "a", "command": ["true"]}]},
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
@pytest.mark.parametrize("verb", ["validate", "run"])
def test_cli_rejects_invalid_files_with_exit_2(tmp_path: Path, name: str, verb: str) -> None:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({**BASE, "spec": BAD_FILES[name]}))
    out = cli(verb, str(path))
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr
    assert "spec." in out.stderr and "error:" in out.stderr


def test_unreadable_documents_are_user_errors(tmp_path: Path) -> None:
    (tmp_path / "broken.yaml").write_text("spec: [unclosed")
    for path in (tmp_path / "broken.yaml", tmp_path / "missing.yaml"):
        out = cli("validate", str(path))
        assert out.returncode == 2 and "Traceback" not in out.stderr and "error:" in out.stderr


def test_dry_run_prints_the_defaulted_job(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                **BASE,
                "spec": {
                    "framework": "pytorch",
                    "roles": [
                        {"name": "master", "command": ["python", "train.py"]},
                        {"name": "worker", "replicas": 2, "command": ["python", "train.py"]},
                    ],
                },
            }
        )
    )
    out = cli("run", "--dry-run", str(path))
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    worker = printed["spec"]["roles"][1]
    assert worker["dependsOn"] == [{"role": "master", "condition": "Running", "timeoutSeconds": 600.0}]
    assert worker["restartPolicy"]["policy"] == "Never"
    # every default filled in: presets expanded, empty policies as the controller applies them
    # (issue 38: `statusPolicy: {}` on each role and an unexpanded preset were printed)
    assert printed["spec"]["statusPolicy"] == {"failed": "any", "succeeded": {"roles": ["master"]}}
    assert all(r["statusPolicy"] == {"failed": "any", "succeeded": "all"} for r in printed["spec"]["roles"])
    assert load_document(printed).job.spec.roles[1].status_policy.succeeded == "all"  # it reads back


def test_unknown_fields_of_our_own_kind_get_a_did_you_mean() -> None:
    """A misspelt field anywhere in a trainmaster/v1 Job is refused by its path with the closest
    field of that object, as Kubeflow and Volcano files' are (issue 38)."""
    details = errors_of(
        {
            "framwork": "command",
            "roles": [{"name": "a", "replcas": 2, "command": ["x"], "restartPolicy": {"polcy": "Never"}}],
        }
    )
    for wrong, right in (
        ("spec.framwork", "framework"),
        ("spec.roles[0].replcas", "replicas"),
        ("spec.roles[0].restartPolicy.polcy", "policy"),
    ):
        assert any(d.startswith(f"{wrong}: unknown field (did you mean '{right}'?)") for d in details), details
    assert any(
        d.startswith("spec.roles[0].zzzz: unknown field; check")
        for d in errors_of({"roles": [{"name": "a", "command": ["x"], "zzzz": 1}]})
    )


def test_user_framework_from_a_python_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Framework loading by address (spec: "a user's own framework must be loadable this way"),
    once the operator allowed that address."""
    from trainmaster.frameworks import ALLOW_LIST_VARIABLE, get_framework

    fw = tmp_path / "myfw.py"
    fw.write_text(
        "from trainmaster.frameworks.base import Framework\n"
        "class Echo(Framework):\n"
        "    name = 'echo'\n"
        "    role_names = ('speaker',)\n"
        "    def role_command(self, job, role):\n"
        "        return ['python', '-c', 'print(1)']\n"
        "    def environment(self, ctx):\n"
        "        return {'ECHO_INDEX': str(ctx.index)}\n"
    )
    monkeypatch.setenv(ALLOW_LIST_VARIABLE, f"{fw},echo={fw}")
    get_framework.cache_clear()
    try:
        loaded = load_document({**BASE, "spec": {"framework": str(fw), "roles": [{"name": "speaker"}]}})
        assert loaded.job.spec.roles[0].command == ["python", "-c", "print(1)"]
        assert load_document({**BASE, "spec": {"framework": "echo", "roles": [{"name": "speaker"}]}})
        assert any("has no role 'other'" in e for e in errors_of({"framework": str(fw), "roles": [{"name": "other"}]}))
    finally:
        get_framework.cache_clear()


@pytest.mark.parametrize("address", ["{file}", "{file}:Boom", "os.path:join", "tm_probe_module:X"])
def test_a_job_never_makes_the_server_import_code(
    tmp_path: Path, address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Framework registry: a job naming a file or module path that the operator did not allow is
    refused (listing the installed frameworks) and nothing is imported or executed."""
    from trainmaster.frameworks import get_framework

    marker = tmp_path / "imported"
    module = tmp_path / "evil.py"
    module.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (tmp_path / "tm_probe_module.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    get_framework.cache_clear()
    errors = errors_of({"framework": address.format(file=module), "roles": [{"name": "a", "command": ["true"]}]})
    assert not marker.exists()
    assert any(e.startswith("spec.framework: unknown framework") and "installed: command" in e for e in errors), errors


def test_run_refuses_a_backend_conflict_and_paths_outside_its_directory(tmp_path: Path) -> None:
    """`run`: --backend against the job's spec.scheduling.backend is an error, not a silent
    override; an absolute output.path outside the current directory is refused unless allowed."""
    path = tmp_path / "job.yaml"
    path.write_text(
        yaml.safe_dump(
            {**BASE, "spec": {"scheduling": {"backend": "local"}, "roles": [{"name": "a", "command": ["true"]}]}}
        )
    )
    out = cli("run", str(path), "--backend", "ray", "--dry-run")
    assert out.returncode == 2 and "conflicts with the job's spec.scheduling.backend" in out.stderr
    outside = tmp_path / "elsewhere"
    path.write_text(
        yaml.safe_dump(
            {**BASE, "spec": {"output": {"path": str(outside)}, "roles": [{"name": "a", "command": ["true"]}]}}
        )
    )
    out = cli("validate", str(path))
    assert out.returncode == 2 and "spec.output.path" in out.stderr and "Traceback" not in out.stderr
    assert cli("validate", str(path), "--allow-path", str(tmp_path)).returncode == 0


def test_validate_lenient_and_allow_framework_flags(tmp_path: Path) -> None:
    """`validate --lenient` lists a typo instead of refusing it; `--allow-framework ID=FILE` makes
    an operator-approved framework file loadable (and only then)."""
    typo = tmp_path / "typo.yaml"
    typo.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "batch.volcano.sh/v1alpha1",
                "kind": "Job",
                "metadata": {"name": "vc"},
                "spec": {
                    "queu": "default",
                    "tasks": [
                        {"name": "a", "template": {"spec": {"containers": [{"name": "a", "command": ["true"]}]}}}
                    ],
                },
            }
        )
    )
    strict = cli("validate", str(typo))
    assert strict.returncode == 2 and "did you mean 'queue'" in strict.stderr
    lenient = cli("validate", str(typo), "--lenient")
    assert lenient.returncode == 0 and "spec.queu: unknown field, ignored" in lenient.stderr
    fw = tmp_path / "echo_fw.py"
    fw.write_text("from trainmaster.frameworks.base import Framework\nclass Echo(Framework):\n    name = 'echo'\n")
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump({**BASE, "spec": {"framework": "echo", "roles": [{"name": "a", "command": ["true"]}]}})
    )
    assert cli("validate", str(job)).returncode == 2
    assert cli("validate", str(job), "--allow-framework", f"echo={fw}").returncode == 0

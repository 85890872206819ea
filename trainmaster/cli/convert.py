"""``trainmaster convert FILE``: show what a Kubeflow or Volcano job file becomes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from trainmaster.cli.jobs import AllowFrameworkOpt, AllowPathOpt, LenientOpt, RuntimeFilesArg, RuntimeOpt
from trainmaster.errors import UserError


def convert_command(
    file: Annotated[
        Path, typer.Argument(help="A Kubeflow PyTorchJob/TFJob/MPIJob or TrainJob, or Volcano Job YAML/JSON file.")
    ],
    runtime_files: RuntimeFilesArg = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of YAML.")] = False,
    check: Annotated[
        bool,
        typer.Option(
            "--check/--no-check",
            help="Refuse (exit 2, nothing printed) what `validate` and `run` refuse: the converted job's "
            "fields, its paths under the path rule, its framework.",
        ),
    ] = True,
    lenient: LenientOpt = False,
    allow_path: AllowPathOpt = None,
    allow_framework: AllowFrameworkOpt = None,
    runtime: RuntimeOpt = None,
) -> None:
    """Print FILE converted to a trainmaster/v1 Job; list the source fields it ignores on stderr.

    The printed job is what `trainmaster run FILE` and `trainmaster submit FILE` run, and it is
    checked by the same rules as `trainmaster validate FILE` (the same options): a file one
    refuses, the other refuses too. Fields with no local meaning (images, volumes, node
    selectors...) are listed with the reason.
    """
    import yaml
    from rich.markup import escape

    from trainmaster.cli.jobs import load_options
    from trainmaster.cli.output import console
    from trainmaster.spec.compat import convert
    from trainmaster.loading import load_document, runtimes_for, with_runtimes
    from trainmaster.spec.load import read_documents

    raw, options = with_runtimes(
        read_documents(file),
        str(file),
        load_options(lenient, allow_path, allow_framework, runtime),
        runtime_files or (),
    )
    converted = convert(raw, lenient=lenient, runtimes=runtimes_for(raw, options))
    if converted is None:
        raise UserError(
            f"{file}: apiVersion={raw.get('apiVersion')!r} kind={raw.get('kind')!r} is not a Kubeflow or Volcano job",
            [
                "convert reads Kubeflow PyTorchJob/TFJob (kubeflow.org/v1), MPIJob (kubeflow.org/v1, "
                "v2beta1) and Volcano Job (batch.volcano.sh/v1alpha1); a trainmaster/v1 Job needs no "
                "conversion"
            ],
        )
    if check:  # validate's own way through the file: one set of rules, before anything is printed
        load_document(raw, source=str(file), options=options)
    document = converted.document
    if as_json:
        typer.echo(json.dumps(document, indent=2))
    else:
        typer.echo(yaml.dump(document, Dumper=_block_dumper(), sort_keys=False), nl=False)
    err = console(stderr=True, highlight=False, soft_wrap=True)
    for line in converted.ignored:
        err.print(f"[yellow]ignored:[/] {escape(line)}")


def _block_dumper() -> type:
    """A safe YAML dumper that prints multi-line strings (inline scripts) as ``|`` blocks."""
    import yaml

    class BlockDumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
        style = "|" if "\n" in data else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    BlockDumper.add_representer(str, text)
    return BlockDumper


def register(app: typer.Typer) -> None:
    """Add ``convert`` to the top-level app."""
    app.command(name="convert")(convert_command)

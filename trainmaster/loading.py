"""Loading a job: the one chain every job takes in, run once, in this order.

1. read the YAML/JSON document (bounded: :mod:`trainmaster.spec.load`) and convert a
   Kubeflow/Volcano one (:mod:`trainmaster.spec.compat`), listing the fields it cannot carry;
2. validate it: the spec's checks and the framework's (:func:`trainmaster.frameworks.framework_errors`)
   over the raw document, so every problem is listed at once with its field path (a framework
   checking the typed job could only speak once the structure is sound);
3. settle where each role runs (:func:`trainmaster.containers.policy.settle_runtimes`) for the
   backend the job will run on, and refuse (unless lenient) a command on the host that reads
   files only its container would have;
4. fill the framework's defaults;
5. anchor relative paths to the operator's base directory.

The CLI's ``validate``/``run``, the server's submit and the facade all come here; the spec
below knows nothing of frameworks or containers, the controller above reads the loaded job.
This module is the one place the container policy is consulted: :func:`check_runnable` is the
refusal ``run`` applies before it stores anything (a role that this machine and backend cannot
run as the job says), from the same rule.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from trainmaster.containers.policy import container_problems, host_file_reads, settle_runtimes
from trainmaster.errors import UserError
from trainmaster.frameworks import apply_defaults, framework_errors
from trainmaster.spec.compat import RuntimeDoc
from trainmaster.spec.compat.trainer import is_runtime, is_trainer, runtime_doc
from trainmaster.spec.load import LoadedJob, LoadOptions, plain_document, read_documents
from trainmaster.spec.model import Job
from trainmaster.spec.paths import PathPolicy, anchored
from trainmaster.spec.validate import validate

__all__ = ["LoadOptions", "LoadedJob", "check_runnable", "load_document", "load_job", "validate_document"]


def load_job(
    path: str | Path, options: LoadOptions | None = None, runtime_files: Sequence[str | Path] = ()
) -> LoadedJob:
    """Load a job file (see the module's chain). The file holds one job document; a Kubeflow
    Trainer ``TrainJob`` may come with its runtimes, in the same file (several YAML documents)
    or in ``runtime_files``, which are read strictly and tried before the installed ones."""
    raw, options = with_runtimes(read_documents(path), str(path), options or LoadOptions(), runtime_files)
    return load_document(raw, source=str(path), options=options)


def with_runtimes(
    docs: list[dict[str, Any]], source: str, options: LoadOptions, runtime_files: Sequence[str | Path] = ()
) -> tuple[dict[str, Any], LoadOptions]:
    """The one job document among ``docs`` (a file's), and ``options`` with the Trainer runtimes
    given beside it (in that file, then in ``runtime_files``) first among those a TrainJob may name."""
    given = [runtime_doc(d, source, options.lenient) for d in docs if is_runtime(d)]
    for extra in runtime_files:
        for doc in read_documents(extra):
            if not is_runtime(doc):
                raise UserError(
                    f"{extra}: holds a {doc.get('kind')!r}; the files after the job's are Kubeflow Trainer "
                    "runtimes (TrainingRuntime, ClusterTrainingRuntime) the TrainJob names"
                )
            given.append(runtime_doc(doc, str(extra), options.lenient))
    jobs = [d for d in docs if not is_runtime(d)]
    if len(jobs) != 1:
        raise UserError(
            f"{source}: expected exactly one job document, found {len(jobs)}"
            + (f" (and {len(given)} runtime(s))" if given else "")
        )
    if given:
        options = replace(options, runtimes=(*given, *options.runtimes))
    return jobs[0], options


def runtimes_for(raw: dict[str, Any], options: LoadOptions) -> tuple[RuntimeDoc, ...]:
    """The runtimes a TrainJob ``raw`` may name: those given, then the installed ones (read only
    when the job is a TrainJob, so other jobs never open the store)."""
    if not is_trainer(raw) or options.installed_runtimes is None:
        return options.runtimes
    return (*options.runtimes, *options.installed_runtimes())


def load_document(raw: dict[str, Any], source: str = "job", options: LoadOptions | None = None) -> LoadedJob:
    """Convert, validate, settle, default and anchor one job document (see the module's chain)."""
    options = options or LoadOptions()
    document, ignored = plain_document(raw, source, options.lenient, runtimes_for(raw, options))
    job = validate_document(document, source, options.paths)
    backend = options.backend or (job.spec.scheduling.backend.value if job.spec.scheduling.backend else "local")
    job = settle_runtimes(job, options.runtime, backend)
    host_files = host_file_reads(job)  # a container's fixed files, read on the host
    if host_files and not options.lenient:
        raise UserError(
            f"{source}: a command reads files that exist only in its container; run it in one (--runtime "
            "container), read $VC_HOSTS_DIR instead, or pass --lenient to run it as it is",
            host_files,
        )
    ignored = [*ignored, *(f"{line} (--lenient: run as it is)" for line in host_files)]
    job = apply_defaults(job)
    if options.paths is not None:
        job = anchored(job, options.paths)
    return LoadedJob(job=job, source=source, ignored=ignored)


def check_runnable(loaded: LoadedJob, backend: str) -> None:
    """Refuse, listing each, the roles this machine and ``backend`` cannot run as the loaded job
    says (a container where no runtime is, or on a backend that runs none; an image's entry point
    on the host): what ``run`` checks before anything is stored."""
    problems = container_problems(loaded.job, backend)
    if problems:
        raise UserError(f"{loaded.source}: {len(problems)} role(s) cannot run on this machine", problems)


def validate_document(raw: dict[str, Any], source: str = "job", paths: PathPolicy | None = None) -> Job:
    """A ``trainmaster/v1 Job`` document checked by the spec and its framework (every problem at
    once, with field paths): a submitted one, or a stored one changed (a role scaled)."""
    return validate(raw, source, paths, checks=(framework_errors,))

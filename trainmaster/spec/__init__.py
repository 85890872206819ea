"""Job descriptions: typed models, loading (YAML/JSON, Kubeflow/Volcano), validation, status policies."""

from trainmaster.spec.load import LoadedJob, load_document, load_job
from trainmaster.spec.model import Job, JobSpec, Role

__all__ = ["Job", "JobSpec", "LoadedJob", "Role", "load_document", "load_job"]

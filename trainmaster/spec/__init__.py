"""Job descriptions: typed models, reading (YAML/JSON, Kubeflow/Volcano), validation, status
policies. The ground floor: it imports nothing of ours above it (loading a job with its
framework's checks and defaults is :mod:`trainmaster.loading`)."""

from trainmaster.spec.load import LoadedJob, LoadOptions
from trainmaster.spec.model import Job, JobSpec, Role

__all__ = ["Job", "JobSpec", "LoadOptions", "LoadedJob", "Role"]

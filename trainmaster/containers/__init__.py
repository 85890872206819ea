"""Instances in OCI containers (podman): see :mod:`trainmaster.containers.runtime`."""

"""Test-side name for the loopback deployment launcher (kept in the package for the benchmark too)."""

from trainmaster.gateway.localdeploy import Deployment, breast_cancer_split, free_port_block, write_csv

__all__ = ["Deployment", "breast_cancer_split", "free_port_block", "write_csv"]

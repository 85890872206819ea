"""Operator mode: Trainmaster's controller on Kubernetes, its jobs custom resources
(``trainmaster operator``; see docs/kubernetes.md)."""

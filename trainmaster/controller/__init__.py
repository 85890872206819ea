"""The controller: queue and admission, reconcile, dependencies, restarts, status policies."""

from trainmaster.controller.controller import Controller

__all__ = ["Controller"]

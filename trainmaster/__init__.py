"""Trainmaster: one controller for every distributed and federated ML training framework."""

__version__ = "0.1.0"

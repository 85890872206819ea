"""Command-line interface: one module per verb group, assembled in :mod:`trainmaster.cli.main`."""

"""The controller as a long-running service: a REST API over the store plus a reconcile thread."""

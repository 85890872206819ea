"""Per-task isolated executors: the interface, the process inside, a subprocess (sandboxed or
not) and a Ray actor."""

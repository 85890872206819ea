"""The party agent: holds data files that never leave it, runs rules in per-task executors."""

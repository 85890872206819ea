"""The bubblewrap sandbox of an executor: namespaces, cgroups and the seccomp filter."""

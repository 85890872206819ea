"""The audit log: append-only, hash-chained, signed lines of who asked for what, and when."""

"""The gateway's HTTP routes, one module per concern: tasks (creation, cancel, executor reports),
results (data receive and streamed result fetch), health."""

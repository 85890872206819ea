"""The party's HTTP routes, one module per concern: task creation, data transfer, health."""

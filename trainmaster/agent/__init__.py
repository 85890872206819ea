"""The node agent: the only owner of instance processes on a node (see ``core``), its journal,
its process trees, and the daemon + client through which a local controller reaches it."""

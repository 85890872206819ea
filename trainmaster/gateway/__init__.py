"""Cross-silo task gateway: one mutual-TLS door between a task initiator and data-holding parties.

Sub-packages, lowest first; a module imports only from its own layer or below:

0. ``models`` (the wire models);
1. ``config`` (a service's ``config.yaml``), ``store`` (database engines);
2. ``crypto`` (envelopes, chunk streams, TLS identities, provisioning, replay table, the gate) and
   ``rules`` (the processing-rule registry, disclosure limits);
3. ``executors`` (per-task executors: the process inside, subprocess with its bubblewrap
   ``sandbox``, Ray actor), ``net`` (mutual TLS for clients, the services' shared plumbing, the
   stream port) and ``audit`` (the hash-chained, signed audit log);
4. ``party`` (the party agent), ``relay`` (the gateway service) and ``initiator`` (the client);
5. ``localdeploy`` (a whole deployment on loopback, for tests and benchmarks).

The gateway never imports the controller; the controller runs it as the ``crosssilo`` framework.
"""

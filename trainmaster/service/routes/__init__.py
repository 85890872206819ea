"""The controller service's routes, one module per concern: :mod:`.jobs` (the REST job verbs),
:mod:`.logs` (instance log streams), :mod:`.metrics` (Prometheus), :mod:`.health` and
:mod:`.errors` (how every failure is answered). The dashboard's routes are
:mod:`trainmaster.service.dashboard`'s. Each reads the service's parts with
:func:`trainmaster.service.state.service_of`."""

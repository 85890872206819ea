"""The web dashboard the controller service serves at ``/``.

Server-rendered pages (Jinja2) with htmx for partial updates and Chart.js for metric curves,
both shipped in ``static/`` so the dashboard works offline with no build step. Pages refresh
when the store changes: one :class:`~trainmaster.service.dashboard.watch.StoreWatcher` per
server reads the store's change marks and pushes a server-sent event to every open tab, so a
thousand idle tabs cost one query per tick, not a thousand.
"""

from trainmaster.service.dashboard.access import AccessOptions
from trainmaster.service.dashboard.mount import mount_dashboard

__all__ = ["AccessOptions", "mount_dashboard"]

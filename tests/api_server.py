"""A real controller service on a free loopback port, in a thread of the test process (uvicorn),
for the API tests: requests cross a real socket and the real ASGI stack."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import uvicorn
from helpers import free_port

from trainmaster.backends.local import LocalBackend
from trainmaster.controller import Controller
from trainmaster.service.app import ServiceOptions, create_app
from trainmaster.service.draining import DrainingServer
from trainmaster.store.db import make_engine, session_factory


class ThreadedServer:
    """``with ThreadedServer(tmp, reconcile=...) as url:`` serves until the block ends."""

    def __init__(
        self, root: Path, reconcile: bool = False, options: ServiceOptions | None = None, interval: float = 0.1
    ):
        url = f"sqlite:///{root / 'store.db'}"
        self.controller = Controller(
            session_factory(make_engine(url)), LocalBackend(), url, interval=interval, grace=2, runs_dir=root / "runs"
        )
        self.app = create_app(self.controller, reconcile=reconcile, options=options)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = DrainingServer(  # as `trainmaster server` runs it: live streams end at shutdown
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"),
            self.app.state.draining,
        )
        self.thread = threading.Thread(target=self.server.run, name="api-server", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise AssertionError(f"the API server on port {self.port} did not start within 30 s")
            time.sleep(0.05)
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        assert not self.thread.is_alive(), "the API server did not stop within 20 s"

"""Run a server app on a background thread of this process (tests, notebooks, benchmarks):

with ServerThread(create_app(config, factory)) as server:
    httpx.get(server.url + "/health")
"""

from __future__ import annotations

import socket
import threading
import time

import httpx

from .graceful import make_server


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning") -> None:
        self.host, self.port = host, port or free_port(host)
        self.server = make_server(app, self.host, self.port, log_level)
        self._thread = threading.Thread(target=self.server.run, name="nanocp-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, ready_timeout_s: float = 120.0, wait_healthy: bool = True) -> ServerThread:
        """Start serving; with wait_healthy, return once /health answers 200 (the cluster is up)."""
        self._thread.start()
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited during startup")
            try:
                status = httpx.get(self.url + "/health", timeout=5).status_code
            except httpx.TransportError:
                status = None
            if status == 200 or (status is not None and not wait_healthy):
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"server at {self.url} not {'healthy' if wait_healthy else 'up'} in {ready_timeout_s} s")

    def stop(self, timeout_s: float = 60.0) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

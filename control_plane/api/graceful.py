"""A uvicorn server that ends every in-flight request with an answer when it shuts down.

Plain uvicorn, on SIGINT / SIGTERM, stops accepting connections and then waits (up to its graceful timeout) for the
responses in flight before it cancels them and only then runs the app's lifespan shutdown: a long SSE stream would
just be cut, with no error event. `GracefulServer` stops the engine loop first (once the listening sockets are
closed), which answers every in-flight request: a stream gets an SSE error event and `[DONE]`, a non-streamed
request a 503; the connections then drain at once.
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn


class GracefulServer(uvicorn.Server):
    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # no new connections while in-flight requests are being answered
        openai_server = getattr(getattr(self.config.app, "state", None), "server", None)
        if openai_server is not None:
            await asyncio.to_thread(openai_server.loop.stop)
        await super().shutdown(sockets)


def make_server(app, host: str, port: int, log_level: str = "info", graceful_timeout_s: int = 5) -> GracefulServer:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level)
    config.timeout_graceful_shutdown = graceful_timeout_s
    return GracefulServer(config)

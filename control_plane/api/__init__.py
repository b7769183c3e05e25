"""The router / API front door: an OpenAI-compatible HTTP server in front of the engine.

server.py (FastAPI app), protocol.py (request/response bodies), errors.py (OpenAI-style errors), engine_loop.py
(the thread that owns the Engine), chat_template.py (sandboxed Jinja), metrics.py (Prometheus), admission.py
(bounded admission, 429), launch.py (serve / Ray deploy).
"""

from .server import OpenAIServer, ServerConfig, create_app

__all__ = ["OpenAIServer", "ServerConfig", "create_app"]

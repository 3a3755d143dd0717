"""Stand-ins for an engine that the publisher and the run's engine backend talk to."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def healthy_server() -> ThreadingHTTPServer:
    """A server on a free loopback port that answers every GET with 200 (an engine that is up); the caller shuts
    it down."""

    class Healthy(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the handler's protocol
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server

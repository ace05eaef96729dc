"""uvicorn serving an app in a background thread on a free loopback port, for the server and bench tests.
Importable from tests (pyproject sets pytest's pythonpath to tests/)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import uvicorn


def serve_in_thread(app) -> tuple[str, Callable[[], None]]:
    """(URL, stop) of uvicorn serving `app` on 127.0.0.1 and a free port."""
    # proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets; without it every response waits
    # ~40 ms for a delayed ACK (uvicorn binding host:port itself gets this right)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)

    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop
